"""Worker of tests/test_checkpoint_resharding.py: 2 trainer ranks over gloo (spawned by the test), each a
MegatronTrainRayActor driven in-process (no Ray) by a small copy of the driver's iteration: prompts from the
real data source, fixed seeded responses with the synthetic copy reward, old / reference log-probs from the
trainer, the driver's advantages, one train step.

Per layout pair (A -> B): a run at A does rollouts 0 and 1 without stopping and saves after rollout 0; a run at
B resumes from that torch_dist checkpoint and does rollout 1. Rollout 1 must give the same rewards, the same
per-token old and reference log-probs, the same train metrics, and after its step both runs save: the two
checkpoints' tensors (weights and Adam moments, read whole) must be equal. A resume without the optimizer
state (--no-load-optim) must not give the same moments."""

from __future__ import annotations

import logging
import os
import random

import torch
import torch.distributed as dist

METRIC_KEYS = ("rollout/reward_mean", "rollout/reward_std", "train/advantage_abs_mean", "train/loss", "train/pg_loss",
               "train/kl", "train/entropy", "train/ppo_kl", "train/clip_frac", "train/grad_norm")
REL = 1e-5  # float32: other reduction orders at another layout, nothing else
# (tp, ep, pp, cp), world size 2
LAYOUTS = {"dp2": (1, 1, 1, 1), "tp2": (2, 1, 1, 1), "ep2": (1, 2, 1, 1), "pp2": (1, 1, 2, 1), "cp2": (1, 1, 1, 2)}
PAIRS = (("dp2", "tp2"), ("tp2", "ep2"), ("pp2", "tp2"))


def _args(ckpt: str, layout: str, save: str, load: str | None = None, *extra: str):
    from slime.config.arguments import parse_args

    tp, ep, pp, cp = LAYOUTS[layout]
    argv = ["--hf-checkpoint", ckpt, "--num-rollout", "2", "--actor-num-gpus-per-node", "2",
            "--tensor-model-parallel-size", str(tp), "--expert-model-parallel-size", str(ep),
            "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64", "--lr", "3e-3",
            "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "k3", "--seed", "5", "--save", save, *extra]
    return parse_args(argv + (["--load", load] if load else []))


def _rollout(source, tok, rollout_id: int, n_prompts: int = 2, n_samples: int = 4):
    """Seeded copy-task responses (each symbol right with p=0.6): rewards depend on the data-source position."""
    from slime.backends.megatron.data import RolloutBatch
    from slime.rollout.synthetic import ALPHABET, score

    tokens, lengths, rewards = [], [], []
    for item in source.next_batch(n_prompts):
        for j in range(n_samples):
            rng = random.Random(rollout_id * 1000 + item.group_index * 10 + j)
            words = [s if rng.random() < 0.6 else rng.choice(ALPHABET) for s in item.label.split()]
            ids = tok(" ".join(words), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            tokens.append(item.prompt_ids + ids)
            lengths.append(len(ids))
            rewards.append(score(" ".join(words), item.label))
    return RolloutBatch(tokens=tokens, response_lengths=lengths, rewards=rewards, loss_masks=[[1] * n for n in lengths])


def _iteration(actor, args, source, tok, rollout_id: int) -> dict:
    """Rollout, log-probs merged over ranks (as RayTrainGroup merges them), advantages, train step."""
    import numpy as np

    from slime.backends.megatron.rollout_data import payload_summary
    from slime.backends.megatron.rollout_data import share_advantages

    batch = _rollout(source, tok, rollout_id)
    metrics = payload_summary({"rewards": np.asarray(batch.rewards, dtype=np.float64),
                               "response_lengths": np.asarray(batch.response_lengths)})
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, actor.compute_log_probs(batch)["log_probs"])
    merged = {}
    for part in parts:
        for key, by_index in part.items():
            merged.setdefault(key, {}).update(by_index)
    batch.old_log_probs = [merged["old_log_probs"][i] for i in range(len(batch))]
    batch.ref_log_probs = [merged["ref_log_probs"][i] for i in range(len(batch))]
    metrics.update(share_advantages(args, batch, range(len(batch))))  # the whole rollout in this process
    metrics.update(actor.train(rollout_id, batch))
    metrics["old_log_probs"], metrics["ref_log_probs"] = torch.cat(batch.old_log_probs), torch.cat(batch.ref_log_probs)
    return metrics


def _saved_tensors(actor, source, rollout_id: int) -> dict[str, torch.Tensor]:
    """Save, then read back every tensor of the checkpoint whole (model weights and Adam moments, each as
    its global tensor: comparable across layouts)."""
    from megatron.core import dist_checkpointing

    from slime.backends.megatron.checkpoint.layout import iter_dir

    actor.save(rollout_id, {"data_source": source.state_dict(), "rollout_id": rollout_id})
    flat = {}

    def walk(prefix, value):
        if isinstance(value, (dict, list)):
            for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):  # (the load also hands back common non-tensor values)
            flat[prefix[:-1]] = value

    walk("", dist_checkpointing.load_plain_tensors(iter_dir(actor.args.save, rollout_id)))
    return flat


def _actor(args):
    from slime.backends.megatron.actor import MegatronTrainRayActor

    actor = MegatronTrainRayActor(dist.get_world_size(), dist.get_rank())
    return actor, actor.init(args, with_ref=args.use_ref_model)


def _source(data: str, tok):
    from slime.rollout.data_source import JsonlDataSource

    return JsonlDataSource(data, tok, shuffle=True, seed=3)


def continuous(ckpt, data, tok, layout, save, *extra):
    """Rollouts 0 and 1 at `layout` without stopping; a checkpoint after rollout 0."""
    args = _args(ckpt, layout, save, None, *extra)
    actor, start = _actor(args)
    assert start == 0
    source = _source(data, tok)
    _iteration(actor, args, source, tok, 0)
    actor.save(0, {"data_source": source.state_dict(), "rollout_id": 0})
    metrics = _iteration(actor, args, source, tok, 1)
    assert metrics["train/advantage_abs_mean"] > 0 and metrics["train/grad_norm"] > 0  # a step with signal
    return metrics, _saved_tensors(actor, source, 1)


def resumed(ckpt, data, tok, layout, save, *extra):
    args = _args(ckpt, layout, save + "_resumed", os.path.join(save, "iter_0000000"), *extra)  # the rollout-0 save
    actor, start = _actor(args)
    assert start == 1
    source = _source(data, tok)
    source.load_state_dict(actor.loaded_extra_state()["data_source"])
    metrics = _iteration(actor, args, source, tok, 1)
    return metrics, _saved_tensors(actor, source, 1)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def compare(name, got, want) -> None:
    (m_got, t_got), (m_want, t_want) = got, want
    for key in METRIC_KEYS:
        a, b = m_got[key], m_want[key]
        assert abs(a - b) <= REL * abs(b) + 1e-7, f"{name}: {key} {a} != {b} (rel {REL})"
    for key in ("old_log_probs", "ref_log_probs"):
        torch.testing.assert_close(m_got[key], m_want[key], rtol=0, atol=1e-5, msg=f"{name}: per-token {key}")
    assert t_got.keys() == t_want.keys() and any(k.startswith("optimizer.state.exp_avg_sq.") for k in t_want)
    worst = max(t_want, key=lambda k: _max_rel(t_got[k], t_want[k]))
    err = _max_rel(t_got[worst], t_want[worst])
    assert err <= REL, f"{name}: after the step, the checkpoint's {worst} differs (max rel {err:.3g} > {REL})"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _watch_validation() -> _Warnings:
    """The warnings of dist_checkpointing's save-time validation, from now on in this process."""
    warnings = _Warnings()
    validation = logging.getLogger("megatron.core.dist_checkpointing.validation")
    validation.addHandler(warnings)
    validation.setLevel(logging.WARNING)
    return warnings


def _assert_common_state_equal(warnings: _Warnings, name: str) -> None:
    """dist_checkpointing's save compares every rank's common (non-tensor) state with rank 0's and logs a
    warning on the ranks that differ; none may have differed (checked on both ranks)."""
    differs = [None] * dist.get_world_size()
    dist.all_gather_object(differs, [m for m in warnings.messages if "common state dict differs" in m])
    differs = [m for ms in differs for m in ms]
    assert not differs, f"{name}: the ranks' common checkpoint state differs: {differs[0]}"


def run(rank: int, port: int, ckpt: str, data: str, out: str, pairs=PAIRS, extra=()) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from slime.utils.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(512)
    warnings = _watch_validation()
    for source_layout, target_layout in pairs:
        save = os.path.join(out, f"{source_layout}_to_{target_layout}")
        want = continuous(ckpt, data, tok, source_layout, save, *extra)
        _assert_common_state_equal(warnings, source_layout)
        compare(f"{source_layout} -> {target_layout}", resumed(ckpt, data, tok, target_layout, save, *extra), want)
        _assert_common_state_equal(warnings, target_layout)
        if source_layout == "dp2" and not extra:  # the state check can fail: without the loaded moments they differ
            _, t = resumed(ckpt, data, tok, target_layout, save, "--no-load-optim")
            moments = [k for k in t if k.startswith("optimizer.state.exp_avg.")]
            differ = [k for k in moments if _max_rel(t[k], want[1][k]) > 1e-2]
            assert len(differ) > len(moments) // 2, f"only {len(differ)} of {len(moments)} moments differ"
    dist.barrier()
    dist.destroy_process_group()


# --- state round trip through layouts (checkpoint level, no trainer) ------------------------------------

CHAIN = [  # (tp, ep, pp, distributed optimizer)
    (1, 1, 1, False), (1, 1, 2, False), (2, 1, 1, True), (1, 2, 1, True), (1, 1, 1, False)]


def _plain(path: str) -> dict[str, torch.Tensor]:
    from megatron.core import dist_checkpointing

    flat = {}

    def walk(prefix, value):
        if isinstance(value, (dict, list)):
            for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
                walk(f"{prefix}{k}.", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix[:-1]] = value

    walk("", dist_checkpointing.load_plain_tensors(path))
    return flat


def run_chain(rank: int, port: int, ckpt: str, out: str) -> None:
    """One Adam step at DP2, saved; then each layout of CHAIN loads the previous layout's checkpoint and
    saves it again. Every checkpoint's tensors (weights, Adam moments) must be bit-identical to the first:
    a load at any layout followed by a save writes back exactly what was read. Every other save is an async one
    (--async-save), finished on both ranks after every weight and Adam moment changed: it holds the state at the
    save. Every save must find the same common (non-tensor) state on both ranks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from slime.backends.megatron import build_optimizer, load_hf_model
    from slime.backends.megatron.checkpoint import torch_dist as checkpoint

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 512, (2, 12), generator=g)
    pos = torch.arange(12).expand(2, 12).contiguous()
    first = None
    warnings = _watch_validation()
    for i, (tp, ep, pp, distributed) in enumerate(CHAIN):
        layout = {"world_size": 2, "tp": tp, "ep": ep, "pp": pp}
        model = load_hf_model(ckpt, tp=tp, ep=ep, pp=pp)
        ddp, opt = build_optimizer(model, lr=1e-2, use_distributed_optimizer=distributed)
        if i == 0:
            ddp.zero_grad_buffer()
            (ddp(ids, pos).float().pow(2).mean()).backward()
            ddp.finish_grad_sync()
            assert opt.step()[0]
        else:
            resumed = checkpoint.load(os.path.join(out, f"chain{i - 1}"), ddp, opt, rank, layout)
            assert resumed.start_rollout_id == i and "optimizer" in resumed.restored
        pending = checkpoint.save(os.path.join(out, f"chain{i}"), i, ddp, opt, rank, layout, {}, async_save=i % 2 == 1)
        if i % 2 == 1:  # --async-save: training changes every weight and moment while the files are written
            with torch.no_grad():
                for t in [*ddp.parameters(), *(v for inner in checkpoint._inner_optimizers(opt)
                                               for st in inner.state.values() for v in st.values()
                                               if isinstance(v, torch.Tensor) and v.is_floating_point())]:
                    t.add_(1.0)
            assert not os.path.exists(checkpoint.iter_dir(os.path.join(out, f"chain{i}"), i))  # not yet published
            pending.finish()
        name = f"tp{tp} ep{ep} pp{pp}{' dist-opt' if distributed else ''}"
        _assert_common_state_equal(warnings, name)
        tensors = _plain(checkpoint.iter_dir(os.path.join(out, f"chain{i}"), i))
        if first is None:
            first = tensors
            assert any(k.startswith("optimizer.state.exp_avg.") and v.abs().sum() > 0 for k, v in first.items())
            continue
        missing = sorted(set(first) - set(tensors))
        assert not missing, f"{name}: checkpoint lacks {missing[:3]}"
        changed = [k for k in first if not torch.equal(first[k], tensors[k])]
        assert not changed, f"{name}: {len(changed)} tensors changed in the round trip, e.g. {changed[:3]}"
    dist.barrier()
    dist.destroy_process_group()
