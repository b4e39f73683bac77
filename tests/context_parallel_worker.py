"""Worker of tests/test_context_parallel.py: one spawned trainer rank (gloo) that runs, per named config, the
real trainer actor (load, DDP + optimizer from the train.py flags), the per-token log-probs of every sample
(no grad), then one RL train step on the fixed rollout batch. Every rank records the DSA indexer's top-k of
the log-prob forward by (sample, position, layer); rank 0 writes the loss, the log-probs and the exported HF
tensors."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# name -> (world size, train.py flags beyond the common ones)
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "single": (1, ["--no-use-distributed-optimizer"]),
    "cp2": (2, ["--context-parallel-size", "2"]),
    "cp2_tp2": (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    # MTP training (checkpoint with an MTP layer): depth 1's inputs are the tokens one ahead of each row
    "single_mtp": (1, ["--no-use-distributed-optimizer", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5"]),
    "cp2_mtp": (2, ["--context-parallel-size", "2", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5"]),
    # a batch with forked rollouts (rollout_ids): one step of 2 rollouts
    "single_forked": (1, ["--no-use-distributed-optimizer", "--global-batch-size", "2"]),
    "cp2_forked": (2, ["--context-parallel-size", "2", "--global-batch-size", "2"]),
}


def common_flags(ckpt: str, world: int) -> list[str]:
    # --adam-eps 1e-4: grads at rounding-noise level move weights by ~0 instead of +-lr (see trainer_parallel_worker).
    return ["--hf-checkpoint", ckpt, "--num-rollout", "1", "--global-batch-size", "4", "--use-dynamic-batch-size",
            "--max-tokens-per-gpu", "64", "--lr", "1e-2", "--clip-grad", "1.0", "--adam-eps", "1e-4",
            "--actor-num-gpus-per-node", str(world)]


def record_indexer_selections(records: list) -> None:
    """Patch the GLM attention so every no-grad forward of a DSA "full" layer appends
    (layer, sample, position, selected key positions) for each real token it holds."""
    from slime.backends.megatron import model_setup
    from slime_plugins.models.glm5 import attention

    current = {}
    forward = model_setup.forward

    def forward_recording(model, mb, device, **kw):
        current["mb"] = mb
        return forward(model, mb, device, **kw)

    attn_forward = attention.MLASelfAttention.forward

    def attn_recording(self, hidden_states, attention_mask=None, packed_seq_params=None, **kw):
        out = attn_forward(self, hidden_states, attention_mask, packed_seq_params, **kw)
        if self.indexer is not None and not torch.is_grad_enabled():
            ctx, mb = packed_seq_params, current["mb"]
            topk = ctx.topk[self.layer_index].cpu()
            rows = ctx.cp.local_index.cpu() if ctx.cp is not None else torch.arange(topk.shape[0])
            cu = mb.cu_seqlens.tolist()
            for row, sel in zip(rows.tolist(), topk.tolist()):
                b = max(i for i in range(len(cu) - 1) if cu[i] <= row)
                if b < len(mb.sample_indices) and row - cu[b] < mb.real_lengths[b]:
                    records.append((self.layer_index, mb.sample_indices[b], row - cu[b], sorted(s for s in sel if s >= 0)))
        return out

    model_setup.forward = forward_recording
    attention.MLASelfAttention.forward = attn_recording


def run(rank: int, world: int, port: int, ckpt: str, batch_path: str, out_dir: str, names: list[str]) -> None:
    from glm5_helpers import exported_weights, init_rank
    from slime.backends.megatron import data as D
    from slime.backends.megatron.actor import MegatronTrainRayActor
    from slime.config.arguments import parse_args

    init_rank(rank, world, port)
    fields = torch.load(batch_path)
    records: list = []
    record_indexer_selections(records)
    pack = D.pack

    def pack_with_lengths(batch, indices, *a, **kw):
        mb = pack(batch, indices, *a, **kw)
        mb.real_lengths = [len(batch.tokens[i]) for i in indices]
        return mb

    D.pack = pack_with_lengths
    for name in names:
        size, flags = CONFIGS[name]
        assert size == world, f"{name} runs at world {size}, not {world}"
        args = parse_args(common_flags(ckpt, world) + flags)
        actor = MegatronTrainRayActor(world, rank)
        actor.init(args)
        batch = D.RolloutBatch(**fields)
        records.clear()
        actor.model.eval()
        log_probs = actor._log_probs_of(batch, list(range(len(batch))))
        metrics = actor.train(0, batch)
        weights = exported_weights(actor.model)
        torch.save(list(records), os.path.join(out_dir, f"{name}.indexer.{rank}.pt"))
        if rank == 0:
            torch.save({"loss": metrics["train/loss"], "log_probs": log_probs, "weights": weights,
                        "entropy": metrics["train/entropy"], "mtp_loss": metrics.get("train/mtp_loss")},
                       os.path.join(out_dir, f"{name}.pt"))
        dist.barrier()
    dist.destroy_process_group()
