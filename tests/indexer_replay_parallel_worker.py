"""Worker of tests/test_glm5_next_indexer_replay.py: one spawned trainer rank (gloo) with
--use-rollout-indexer-replay at TP2 (sequence parallel: the DSA layers gather the sequence before the indexer),
CP2 (each rank's chunks attend over their sequences' prefixes), PP2 (the DSA layers on the second stage read
the payload by global layer index) or EP2; with the trainer's indexer weights changed it
computes the rollout's log-probs replayed and selected by itself, and rank 0 writes both."""

from __future__ import annotations

import torch

CONFIGS = {"tp2": ["--tensor-model-parallel-size", "2"], "cp2": ["--context-parallel-size", "2"],
           # PP2 splits the 5 layers 2 + 3: both DSA layers (global indices 2 and 3) sit on the second stage
           "pp2": ["--pipeline-model-parallel-size", "2"], "ep2": ["--expert-model-parallel-size", "2"],
           # DP2, full activation recompute: the training forward (with grad) recomputes each layer in backward
           "recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1"]}


def run(rank: int, world: int, port: int, ckpt: str, rollout_path: str, out_dir: str, names: list[str]) -> None:
    from replay_helpers import run_layouts

    run_layouts(rank, world, port, ckpt, rollout_path, out_dir, names, "--use-rollout-indexer-replay", CONFIGS,
                _perturbed_indexers_measure)


def _perturbed_indexers_measure(name: str, actor, payload) -> dict:
    """With the trainer's indexer weights changed: the log-prob passes (the training forward's gaps under recompute)
    and, gathered from every rank, the global indices of its DSA layers."""
    import torch.distributed as dist
    from test_glm5_next_indexer_replay import _perturb_indexers

    from slime.backends.megatron.hf_export import unwrap
    from slime_plugins.models.glm5_next.attention import NopeMlaDsaAttention

    _perturb_indexers(unwrap(actor.model))  # the same seed on every rank: replicated indexer weights
    out = _train_forward_gaps(actor, payload) if name == "recompute" else _log_prob_passes(actor, payload)
    out["dsa_layers"] = [None] * dist.get_world_size()  # each rank's DSA layers, by global index
    dist.all_gather_object(out["dsa_layers"], sorted(
        m.layer_index for m in unwrap(actor.model).modules() if isinstance(m, NopeMlaDsaAttention)))
    return out


def _log_prob_passes(actor, payload) -> dict:
    """The old-policy log-prob pass (no grad), replayed and selecting by itself."""
    from replay_helpers import replayed_and_own

    from slime.backends.megatron.rollout_data import batch_from_payload
    from slime.utils.indexer_replay import INDEXER_REPLAY

    return replayed_and_own(actor, batch_from_payload(payload), INDEXER_REPLAY.replaying)


def _train_forward_gaps(actor, payload) -> dict:
    """train_rollout with the training forward's own log-probs as the old ones (reuse_train_log_probs): the
    train/rollout gap of the forward that runs with grad under recompute, with the flag and without."""
    weights = {k: v.detach().clone() for k, v in actor.model.state_dict().items() if torch.is_tensor(v)}
    out = {}
    for flag in (True, False):
        actor.args.use_rollout_indexer_replay = flag
        out[flag] = actor.train_rollout(0, payload, reuse_train_log_probs=True)["train_rollout_logprob_abs_diff_max"]
        actor.model.load_state_dict(weights, strict=False)
    return out
