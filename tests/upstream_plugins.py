"""Plugins written only against upstream slime's documented contracts (its customization guide and the
modules it names: slime.utils.types.Sample, slime.utils.http_utils.post, slime.rollout.sglang_rollout,
slime.rollout.rm_hub), for tests/test_plugins.py. They record what they saw in $SLIME_PLUGIN_LOG (JSONL)."""

from __future__ import annotations

import asyncio
import json
import os

from slime.rollout.sglang_rollout import GenerateState, generate_rollout
from slime.rollout.synthetic import score
from slime.utils.http_utils import post
from slime.utils.types import Sample


def _log(kind: str, **record) -> None:
    with open(os.environ["SLIME_PLUGIN_LOG"], "a") as f:
        f.write(json.dumps({"kind": kind, **record}) + "\n")


# --custom-generate-function-path: two model turns around one tool call
async def tool_calling_generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    if not sample.tokens:
        sample.tokens = state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    prompt_len, tool_tokens = len(sample.tokens), 0
    for turn in range(2):
        params = dict(sampling_params, max_new_tokens=3)
        out = await post(url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
        pairs = out["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                      trainable=True, meta_info=out["meta_info"], text=out["text"])
        if turn == 0:
            result = await post(os.environ["SLIME_TOOL_URL"], {"query": out["text"]})
            ids = state.tokenizer.encode(result["text"], add_special_tokens=False)
            tool_tokens = len(ids)
            sample.append_response_tokens(args, tokens=ids, trainable=False, text=result["text"])
    _log("generate", index=sample.index, prompt_len=prompt_len, tokens=len(sample.tokens),
         response_length=sample.response_length, loss_mask=sample.loss_mask, tool_tokens=tool_tokens,
         status=sample.status.value, log_probs=len(sample.rollout_log_probs), evaluation=evaluation)
    return sample


# --custom-rm-path: async, one sample
async def async_reward(args, sample: Sample, **kwargs) -> float:
    await asyncio.sleep(0)
    _log("reward", index=sample.index)
    return score(sample.response, sample.label)


# --custom-rm-path with --group-rm: a prompt's samples at once
async def batched_reward(args, samples: list[Sample], **kwargs) -> list[float]:
    _log("batched_reward", indices=[s.index for s in samples])
    return [score(s.response, s.label) + 0.01 * (s.index % 2) for s in samples]  # never an all-equal group


# --rollout-function-path: the default rollout, plus a metric of its own
def custom_rollout(args, rollout_id, data_source, evaluation=False):
    out = generate_rollout(args, rollout_id, data_source, evaluation)
    _log("rollout", rollout_id=rollout_id, groups=len(out.samples), sizes=[len(g) for g in out.samples])
    out.metrics = dict(out.metrics or {}, **{"rollout/custom_fn_rollout_id": float(rollout_id)})
    return out


# --data-source-path: prompts from the JSONL file, served in file order, groups given back served first
class FileOrderDataSource:
    def __init__(self, args):
        from transformers import AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        with open(args.prompt_data) as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        self.position, self.next_index, self.buffer = 0, 0, []

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        groups = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        while len(groups) < num_samples:
            row = self.rows[self.position % len(self.rows)]
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": row[self.args.input_key]}],
                                                      tokenize=False, add_generation_prompt=True)
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                group.append(Sample(group_index=self.position, index=self.next_index, prompt=text,
                                    label=row[self.args.label_key]))
                self.next_index += 1
            groups.append(group)
            self.position += 1
        _log("get_samples", n=num_samples, first_group=groups[0][0].group_index)
        return groups

    def add_samples(self, samples: list[list[Sample]]):
        self.buffer.extend(samples)

    def save(self, rollout_id):
        pass  # nothing to persist: the position restarts with the run

    def load(self, rollout_id=None):
        pass

    def __len__(self):
        return len(self.rows)


# --loss-type custom_loss --custom-loss-function-path: a PPO-clip policy loss written the upstream way
def custom_pg_loss(args, batch, logits, sum_of_sample_mean):
    import torch

    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy

    _, out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"], with_entropy=True)
    log_probs = torch.cat(out["log_probs"])
    old = torch.cat(batch["log_probs"])
    advantages = torch.cat(batch["advantages"])
    ratio = (log_probs - old).exp()
    pg = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    loss = sum_of_sample_mean(pg)
    _log("loss", samples=len(batch["response_lengths"]), max_old_diff=float((log_probs - old).abs().max()),
         masks=[int(m.sum()) for m in batch["loss_masks"]], lengths=batch["response_lengths"])
    return loss, {"entropy": sum_of_sample_mean(torch.cat(out["entropy"])).detach()}


# the three Megatron hooks
def megatron_init(args):
    _log("megatron_init", lr=args.lr)


def before_log_prob(args, model, store_prefix):
    _log("before_log_prob", store_prefix=store_prefix, has_model=model is not None)


def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    _log("before_train_step", rollout_id=rollout_id, step_id=step_id,
         lr=float(optimizer.param_groups[0]["lr"]), has_model=model is not None,
         has_scheduler=opt_param_scheduler is not None)


# --use-tis --custom-tis-function-path: upstream's keyword contract, truncated IS weights in [0, 2]
def tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                 **kwargs):
    import torch

    weights = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).clamp(0.0, 2.0)
    _log("tis", samples=len(loss_masks), lengths=list(response_lengths), total=list(total_lengths),
         ok=all(m.numel() == n for m, n in zip(loss_masks, response_lengths)))
    return pg_loss * weights, loss_masks, {"tis": weights.detach()}


# --custom-pg-loss-reducer-function-path: Dr.GRPO's constant denominator
def dr_grpo_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss=False):
    import torch

    _log("reducer", samples=len(loss_masks), per_token=calculate_per_token_loss)
    return lambda x: (x * torch.cat(loss_masks)).sum() / 8.0


# --rollout-data-postprocess-path: sees this rank's share after the advantages
def rollout_data_postprocess(args, rollout_id, rollout_data):
    _log("postprocess", rollout_id=rollout_id, keys=sorted(rollout_data), samples=len(rollout_data["tokens"]),
         masks_ok=all(m.numel() == n for m, n in zip(rollout_data["loss_masks"], rollout_data["response_lengths"])))


def rollout_log(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    _log("rollout_log", rollout_id=rollout_id, samples=len(samples), time=rollout_time,
         has_reward_mean="rollout/reward_mean" in rollout_extra_metrics)
    return False


def eval_rollout_log(rollout_id, args, data, extra_metrics):
    _log("eval_log", rollout_id=rollout_id, sets=sorted(data), rewards=len(next(iter(data.values()))["rewards"]))
    return False


# --custom-rm-path for the real-model tests: async, one sample; the addition task's 0/1 (slime/rollout/addition.py)
# plus a tie-break, so a group of equally wrong answers still has an advantage to train on
async def async_addition_reward(args, sample: Sample, **kwargs) -> float:
    from slime.rollout.addition import score as addition_score

    await asyncio.sleep(0)
    _log("reward", index=sample.index)
    return addition_score(sample.response, sample.label) + 0.01 * (sample.index % 2)


# --custom-generate-function-path: upstream's search-r1 / retool way: each turn posts the *text* so far, keeps the
# ids and log-probs of meta_info.output_token_logprobs, tokenizes each observation alone (loss mask 0, log-prob
# 0.0) and assembles the sample at the end
async def text_tool_calling_generate(args, sample: Sample, sampling_params: dict, evaluation: bool = False) -> Sample:
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt_ids = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    response, response_ids, loss_mask, log_probs, engine_lengths, differs = "", [], [], [], [], False
    for turn in range(2):
        # the text sent, tokenized afresh: where that differs from the assembled ids, an engine that re-tokenized
        # each turn's text would condition on other tokens than the trainer trains on
        differs = differs or state.tokenizer(sample.prompt + response, add_special_tokens=False)["input_ids"] != \
            prompt_ids + response_ids
        output = await post(url, {"text": sample.prompt + response, "return_logprob": True,
                                  "sampling_params": dict(sampling_params, max_new_tokens=3)})
        engine_lengths.append([output["meta_info"]["prompt_tokens"], len(prompt_ids) + len(response_ids)])
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        pairs = output["meta_info"]["output_token_logprobs"]
        response += output["text"]
        response_ids += [p[1] for p in pairs]
        log_probs += [p[0] for p in pairs]
        loss_mask += [1] * len(pairs)
        if turn == 0:
            result = await post(os.environ["SLIME_TOOL_URL"], {"query": output["text"]})
            observation = f".\n\n<information>{result['text']}</information>"
            ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
            response += observation
            response_ids += ids
            log_probs += [0.0] * len(ids)
            loss_mask += [0] * len(ids)
    sample.tokens = prompt_ids + response_ids
    sample.response_length, sample.response, sample.loss_mask = len(response_ids), response, loss_mask
    sample.rollout_log_probs = log_probs
    sample.status = {"length": Sample.Status.TRUNCATED, "stop": Sample.Status.COMPLETED}.get(
        output["meta_info"]["finish_reason"]["type"], sample.status)
    _log("text_generate", index=sample.index, evaluation=evaluation, engine_lengths=engine_lengths,
         retokenized_differs=differs, loss_mask=loss_mask, response_length=sample.response_length)
    return sample
