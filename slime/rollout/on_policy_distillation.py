"""On-policy distillation from a teacher served by SGLang (`--use-opd --opd-type sglang`), at upstream's import
path, as its example scripts name the two hooks:

    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards
    --rm-url http://TEACHER_HOST:PORT/generate

`reward_func` asks the teacher to score the sample's tokens (SGLang's `/generate` with `max_new_tokens` 0,
`return_logprob` and `logprob_start_len` 0: `meta_info.input_token_logprobs` holds log p(token_t | tokens_<t)
for t >= 1) and keeps the teacher's log-probs of the response tokens on the sample (`Sample.teacher_log_probs`);
the sample's task reward is 0 (pure distillation: the learning signal is the OPD term the trainer subtracts
from the advantages). `post_process_rewards` returns those rewards as they are. Upstream's reward_func
returns the teacher's reply as the reward and its post-process extracts the log-probs; here the
extraction happens as the reply arrives, so the rollout's rewards stay numbers.
"""

from __future__ import annotations

from typing import Any

from slime.utils.http_utils import post


def teacher_request(args: Any, sample: Any) -> dict:
    """SGLang's `/generate` body that scores `sample.tokens` without generating (upstream's request)."""
    return {"input_ids": list(sample.tokens),
            "sampling_params": {"temperature": args.rollout_temperature, "max_new_tokens": 0,
                                "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}


def response_log_probs(reply: dict, response_length: int) -> list[float]:
    """The teacher's log-probs of the last `response_length` tokens from SGLang's reply (input_token_logprobs:
    [[logprob, token_id, text], ...], the first entry, for the first token, has no log-prob)."""
    entries = (reply.get("meta_info") or {}).get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) - 1 < response_length:
        got = "none" if not isinstance(entries, list) else f"{len(entries)}"
        raise ValueError(f"--rm-url teacher reply has {got} input_token_logprobs for a response of {response_length} "
                         "tokens; the teacher must be an SGLang /generate endpoint (return_logprob, logprob_start_len 0)")
    values = [float(item[0]) for item in entries[1:]]
    return values[len(values) - response_length:] if response_length else []


async def reward_func(args: Any, sample: Any, **kwargs) -> float:
    if not args.rm_url:
        raise ValueError("slime.rollout.on_policy_distillation.reward_func needs --rm-url (the teacher's /generate)")
    reply = await post(args.rm_url, teacher_request(args, sample))
    sample.teacher_log_probs = response_log_probs(reply, int(sample.response_length))
    return 0.0


def post_process_rewards(args: Any, samples: list, **kwargs) -> tuple[list[float], list[float]]:
    """(raw rewards, rewards for training): the samples' rewards as they are (0 from reward_func)."""
    missing = [getattr(s, "index", i) for i, s in enumerate(samples) if getattr(s, "teacher_log_probs", None) is None]
    if missing:
        raise ValueError(f"samples {missing[:5]} have no teacher_log_probs; use "
                         "--custom-rm-path slime.rollout.on_policy_distillation.reward_func with --rm-url")
    rewards = [float(s.get_reward_value(args)) if hasattr(s, "get_reward_value") else float(s.reward) for s in samples]
    return rewards, list(rewards)
