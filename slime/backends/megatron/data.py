"""Training data layout: rollout batch -> per-rank steps -> packed micro-batches (THD, B=1).

A packed micro-batch concatenates its samples into one row of T tokens; `cu_seqlens` ([0, l0,
l0+l1, ...], int32) tells attention where sequences start so no token attends across samples,
and positions restart at 0 per sample. Response tokens are the loss positions: the logit at row
t predicts token t+1, so the log-prob of response token j of sample i comes from logit row
offset_i + prompt_len_i - 1 + j. `response_logit_rows` lists those rows in sample order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from slime_plugins.models.common.context_parallel import ContextParallelLayout, build_layout, combine_rows


@dataclass
class RolloutBatch:
    """One rollout's training data, one entry per sample (order = data order; groups contiguous)."""

    tokens: list[list[int]]  # prompt + response token ids
    response_lengths: list[int]
    rewards: list[float]
    loss_masks: list[list[int]]  # per response token: 1 = trained on
    rollout_log_probs: list[list[float]] | None = None  # engine's log-probs of the response tokens
    # --use-rollout-routing-replay: the engine's experts per token but the last, int32 [len - 1, layers, top-k]
    rollout_routed_experts: list[torch.Tensor] | None = None
    # --use-rollout-indexer-replay: the engine's DSA key selections per token but the last, int32
    # [len - 1, layers, width] (slime.utils.indexer_replay)
    rollout_indexer_topk: list[torch.Tensor] | None = None
    # Filled by the trainer/driver (one flat tensor per sample, over response tokens):
    old_log_probs: list[torch.Tensor] | None = None
    ref_log_probs: list[torch.Tensor] | None = None
    advantages: list[torch.Tensor] | None = None
    # --advantage-estimator ppo: the critic's values of each response token before its update (its old values)
    values: list[torch.Tensor] | None = None
    # --use-opd: the teacher's log-probs of the response tokens (from the rollout, or the trainer's teacher)
    teacher_log_probs: list | None = None
    # --use-rollout-entropy: the old policy's entropy of each response token, from its log-prob pass
    entropy: list[torch.Tensor] | None = None
    # the rollout each sample came from (upstream's train_data["rollout_ids"]): a forked agent session gives several
    # samples of one rollout, which stay in one optimizer step (see `batch_steps`); None: one rollout per sample
    rollout_ids: list[int] | None = None
    # Set by the driver when the first training forward's detached log-probs serve as the old log-probs
    # (one optimizer step per rollout, nothing needs them before training): no separate old forward.
    reuse_train_log_probs: bool = False

    def __post_init__(self) -> None:
        n = len(self.tokens)
        for name in ("response_lengths", "rewards", "loss_masks"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"RolloutBatch.{name} has {len(getattr(self, name))} entries for {n} samples")
        for i, (t, r, m) in enumerate(zip(self.tokens, self.response_lengths, self.loss_masks)):
            if not 0 < r < len(t):
                raise ValueError(f"sample {i}: response_length {r} must be in [1, {len(t) - 1}] (prompt needs >= 1 token)")
            if len(m) != r:
                raise ValueError(f"sample {i}: loss_mask has {len(m)} entries for a response of {r} tokens")
        if self.rollout_log_probs is not None:
            for i, (lp, r) in enumerate(zip(self.rollout_log_probs, self.response_lengths)):
                if len(lp) != r:
                    raise ValueError(f"sample {i}: {len(lp)} rollout log-probs for a response of {r} tokens")

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: Sequence[int]) -> "RolloutBatch":
        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return RolloutBatch(
            tokens=pick(self.tokens), response_lengths=pick(self.response_lengths), rewards=pick(self.rewards),
            loss_masks=pick(self.loss_masks), rollout_log_probs=pick(self.rollout_log_probs),
            rollout_routed_experts=pick(self.rollout_routed_experts),
            rollout_indexer_topk=pick(self.rollout_indexer_topk),
            old_log_probs=pick(self.old_log_probs), ref_log_probs=pick(self.ref_log_probs),
            advantages=pick(self.advantages), values=pick(self.values), teacher_log_probs=pick(self.teacher_log_probs),
            rollout_ids=pick(self.rollout_ids),
        )


def step_indices(num_samples: int, global_batch_size: int) -> list[list[int]]:
    """Sample indices of each optimizer step of a rollout (consecutive slices of the global batch)."""
    if num_samples % global_batch_size:
        raise ValueError(f"{num_samples} rollout samples do not split into global batches of {global_batch_size}")
    return [list(range(s, s + global_batch_size)) for s in range(0, num_samples, global_batch_size)]


def rollout_steps(rollout_ids: Sequence[int], global_batch_size: int) -> list[list[int]]:
    """Upstream's step split (slime.utils.dp_schedule.build_dp_schedule): the samples grouped by rollout id in
    order of first appearance, each step the samples of --global-batch-size rollouts (a rollout's samples in
    their order), as many steps as whole sets of rollouts; the samples of the rollouts after the last whole set
    are not trained. With one sample per rollout and a divisible count: `step_indices`."""
    members: dict[int, list[int]] = {}
    for i, rid in enumerate(rollout_ids):
        members.setdefault(int(rid), []).append(i)
    rollouts = list(members.values())
    if len(rollouts) < global_batch_size:
        raise ValueError(f"{len(rollout_ids)} rollout samples come from {len(rollouts)} rollouts, fewer than one "
                         f"optimizer step of --global-batch-size {global_batch_size} rollouts")
    return [[i for rollout in rollouts[s:s + global_batch_size] for i in rollout]
            for s in range(0, len(rollouts) - global_batch_size + 1, global_batch_size)]


def batch_steps(batch: RolloutBatch, global_batch_size: int) -> list[list[int]]:
    """Sample indices of each optimizer step of the batch: by rollout id when the batch has them (the trainer's
    payload always does), else consecutive slices that must divide the batch."""
    if batch.rollout_ids is None:
        return step_indices(len(batch), global_batch_size)
    return rollout_steps(batch.rollout_ids, global_batch_size)


def _rollout_sizes(batch: RolloutBatch) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for rid in batch.rollout_ids or ():
        sizes[int(rid)] = sizes.get(int(rid), 0) + 1
    return sizes


def rollout_denominators(batch: RolloutBatch) -> list[float | None]:
    """Per sample, the divisor of its masked token sums in a per-sample-mean loss: None (its own loss-mask total)
    when its rollout is that sample alone, else the loss-mask total over all its rollout's samples (upstream's
    rollout_mask_sums), so a forked rollout adds up to one token mean wherever packing puts its samples."""
    if batch.rollout_ids is None:
        return [None] * len(batch)
    sizes, totals = _rollout_sizes(batch), {}
    for rid, mask in zip(batch.rollout_ids, batch.loss_masks):
        totals[int(rid)] = totals.get(int(rid), 0) + int(sum(mask))
    return [float(totals[int(rid)]) if sizes[int(rid)] > 1 else None for rid in batch.rollout_ids]


def rollout_shares(batch: RolloutBatch) -> list[float]:
    """Per sample, its share of its rollout (1 / the rollout's samples): the shares of a step's samples add up
    to its rollout count, the count its per-sample-mean metrics are averaged over."""
    if batch.rollout_ids is None:
        return [1.0] * len(batch)
    sizes = _rollout_sizes(batch)
    return [1.0 / sizes[int(rid)] for rid in batch.rollout_ids]


def sample_mean_normalizer(batch: RolloutBatch, step: Sequence[int], shard: Sequence[int], dp_size: int) -> float:
    """This rank's divisor of a step's per-sample-mean loss: upstream divides the step's sum by its rollout
    count, which the data-parallel gradient mean spreads over the ranks; with one sample per rollout that is
    the rank's sample count, as always."""
    rollouts = len(step) if batch.rollout_ids is None else len({int(batch.rollout_ids[i]) for i in step})
    if rollouts == len(step):
        return float(len(shard))
    return rollouts / dp_size


def _uneven_step(num_samples: int, dp_size: int) -> str:
    return (f"{num_samples} samples of an optimizer step do not split over {dp_size} data-parallel ranks (a step "
            "takes whole rollouts, and a forked agent session gives its rollout several samples); train such "
            "rollouts with one data-parallel rank")


def dp_shard(indices: Sequence[int], dp_rank: int, dp_size: int) -> list[int]:
    """This data-parallel rank's samples of a step: strided, so each rank sees every group position."""
    if len(indices) % dp_size:
        raise ValueError(_uneven_step(len(indices), dp_size))
    return list(indices[dp_rank::dp_size])


def balanced_dp_shard(indices: Sequence[int], token_counts: Sequence[int], dp_rank: int, dp_size: int) -> list[int]:
    """--balance-data: this rank's samples of a step when the step is split into dp_size equal-count sets of
    nearly equal token totals (longest first, each to the lightest set that still has room). Every rank
    computes the same split from the same counts."""
    if len(indices) % dp_size:
        raise ValueError(_uneven_step(len(indices), dp_size))
    cap = len(indices) // dp_size
    loads, members = [0] * dp_size, [[] for _ in range(dp_size)]
    for i in sorted(range(len(indices)), key=lambda i: (-token_counts[i], i)):
        rank = min((r for r in range(dp_size) if len(members[r]) < cap), key=lambda r: (loads[r], r))
        loads[rank] += token_counts[i]
        members[rank].append(indices[i])
    return sorted(members[dp_rank])


# --- micro-batching -----------------------------------------------------------------------
def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    return [list(range(s, min(s + micro_batch_size, num_samples))) for s in range(0, num_samples, micro_batch_size)]


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Bins of positions whose lengths sum to <= max_tokens (a longer sample gets a bin of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def dynamic_micro_batches(lengths: Sequence[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """The fewest micro-batches under the token budget, but at least `min_count` (all data-parallel
    ranks must run the same number, since MoE all-to-all and grad sync are collective). Bins are
    split, largest sample-count first, until there are enough; sample order is kept inside a bin."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_gpu must be > 0, got {max_tokens}")
    if min_count > len(lengths):
        raise ValueError(f"cannot make {min_count} micro-batches from {len(lengths)} samples")
    bins = first_fit_decreasing(lengths, max_tokens)
    while len(bins) < min_count:
        b = max(range(len(bins)), key=lambda k: (len(bins[k]), sum(lengths[i] for i in bins[k])))
        items = sorted(bins[b], key=lambda i: lengths[i])
        half = len(items) // 2
        bins[b] = items[half:]
        bins.append(items[:half])
    bins = [sorted(b) for b in bins]
    bins.sort(key=lambda b: b[0])
    return bins


# --- packing ------------------------------------------------------------------------------
@dataclass
class PackedMicroBatch:
    tokens: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 per sample
    cu_seqlens: torch.Tensor  # [n + 1] int32 (a trailing padding segment counts as a sequence)
    max_seqlen: int
    response_logit_rows: torch.Tensor  # [R] int64 rows of the [T, V] logits that score response tokens
    response_targets: torch.Tensor  # [R] int64 the response tokens themselves (= tokens[rows + 1])
    response_lengths: list[int]  # per real sample
    loss_mask: torch.Tensor  # [R] float32
    sample_indices: list[int] = field(default_factory=list)  # positions in the source batch
    num_tokens: int = 0  # real tokens (without padding)
    # Context parallel (split_for_context_parallel): this CP rank's share of the pack, and which response
    # rows it scores (local logit rows, and their slots among the R response rows).
    cp: ContextParallelLayout | None = None
    cp_logit_rows: torch.Tensor | None = None
    cp_response_slots: torch.Tensor | None = None


def pack(batch: RolloutBatch, indices: Sequence[int], pad_multiple: int = 1, pad_token_id: int = 0,
         cp_size: int = 1) -> PackedMicroBatch:
    """Pack samples `indices` of `batch` into one THD row, padded to a multiple of `pad_multiple`
    (TP/sequence-parallel needs T divisible by the TP size). With context parallel (cp_size > 1) every
    sample is first padded to a multiple of 2*cp_size (padding after its tokens, inside its segment: causal
    attention keeps it out of the real tokens), so its 2*CP chunks are equal."""
    if not indices:
        raise ValueError("cannot pack an empty micro-batch")
    tokens: list[int] = []
    positions: list[int] = []
    cu = [0]
    rows: list[int] = []
    masks: list[int] = []
    lengths: list[int] = []
    for i in indices:
        seq, r = batch.tokens[i], batch.response_lengths[i]
        offset = len(tokens)
        prompt_len = len(seq) - r
        rows.extend(range(offset + prompt_len - 1, offset + len(seq) - 1))
        tokens.extend(seq)
        cp_pad = (-len(seq)) % (2 * cp_size) if cp_size > 1 else 0
        tokens.extend([pad_token_id] * cp_pad)
        positions.extend(range(len(seq) + cp_pad))
        cu.append(len(tokens))
        masks.extend(batch.loss_masks[i])
        lengths.append(r)
    real = sum(len(batch.tokens[i]) for i in indices)
    pad = (-len(tokens)) % max(1, pad_multiple)
    if cp_size > 1 and max(1, pad_multiple) % (2 * cp_size):
        raise ValueError(f"pad_multiple {pad_multiple} must be a multiple of 2*cp_size={2 * cp_size}")
    if pad:
        tokens.extend([pad_token_id] * pad)
        positions.extend(range(pad))
        cu.append(len(tokens))
    t = torch.tensor(tokens, dtype=torch.long)
    rows_t = torch.tensor(rows, dtype=torch.long)
    return PackedMicroBatch(
        tokens=t.unsqueeze(0), position_ids=torch.tensor(positions, dtype=torch.long).unsqueeze(0),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(b - a for a, b in zip(cu, cu[1:])),
        response_logit_rows=rows_t, response_targets=t[rows_t + 1], response_lengths=lengths,
        loss_mask=torch.tensor(masks, dtype=torch.float32), sample_indices=list(indices), num_tokens=real,
    )


def split_for_context_parallel(mb: PackedMicroBatch, size: int, rank: int, group) -> PackedMicroBatch:
    """Attach CP rank `rank`'s share of `mb` (Megatron's causal load balancing: chunks r and 2*CP-1-r of every
    sequence) and the response rows its logits score. Every CP rank keeps the whole pack's tokens (the
    targets of a chunk's last row live in the next chunk)."""
    layout = build_layout(mb.cu_seqlens, size, rank, group)
    local_row = torch.full((int(mb.tokens.shape[-1]),), -1, dtype=torch.long)
    local_row[layout.local_index] = torch.arange(layout.local_index.numel())
    owned = local_row[mb.response_logit_rows]
    slots = torch.nonzero(owned >= 0).flatten()
    mb.cp, mb.cp_logit_rows, mb.cp_response_slots = layout, owned[slots], slots
    return mb


def response_log_probs(logits: torch.Tensor, mb: PackedMicroBatch, ops, chunk_size: int | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs, entropy) of the response tokens, flat in sample order, from [1, T, V] or [T, V]
    logits, via the accelerator's `ops.token_log_probs` (only response rows are processed). Under context
    parallel the logits are this CP rank's tokens: it scores the response rows it holds and the CP group
    sums them into the full vectors (every CP rank returns all of them; the grad reaches each rank's own)."""
    flat = logits.reshape(-1, logits.shape[-1])
    if mb.cp is None:
        rows = mb.response_logit_rows.to(flat.device)
        return ops.token_log_probs(flat.index_select(0, rows), mb.response_targets.to(flat.device),
                                   chunk_size=chunk_size)
    slots = mb.cp_response_slots.to(flat.device)
    lp, ent = ops.token_log_probs(flat.index_select(0, mb.cp_logit_rows.to(flat.device)),
                                  mb.response_targets.to(flat.device).index_select(0, slots), chunk_size=chunk_size)
    total = int(mb.response_logit_rows.numel())
    return combine_rows(lp, slots, total, mb.cp.group), combine_rows(ent, slots, total, mb.cp.group)


def mtp_targets(mb: PackedMicroBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [R], valid [R] float32) of MTP depth `depth` at the response rows: the depth-k head at row r
    predicts token r + k + 1 (the main head: r + 1), which exists for a sample's response position j only
    while j + k < its response length (targets past it are 0 and not valid)."""
    rows = mb.response_logit_rows
    j = torch.cat([torch.arange(n) for n in mb.response_lengths]) if mb.response_lengths else rows.new_zeros(0)
    lengths = torch.repeat_interleave(torch.tensor(mb.response_lengths, dtype=torch.long),
                                      torch.tensor(mb.response_lengths, dtype=torch.long))
    valid = (j + depth) < lengths
    ahead = (rows + 1 + depth).clamp(max=mb.tokens.shape[-1] - 1)
    return torch.where(valid, mb.tokens[0, ahead], 0), valid.to(torch.float32)


def tokens_ahead(mb: PackedMicroBatch, k: int, pad_id: int = 0) -> torch.Tensor:
    """[1, T] ids k positions ahead inside each packed sequence (pad_id past its end): the input of MTP depth k,
    over the whole pack (under context parallel a chunk's last rows need the next chunk's tokens)."""
    flat = mb.tokens.reshape(-1)
    t = torch.arange(flat.numel())
    cu = mb.cu_seqlens.long()
    end = cu[torch.searchsorted(cu, t, right=True)]
    ahead = t + k
    return torch.where(ahead < end, flat[ahead.clamp(max=flat.numel() - 1)], pad_id).view_as(mb.tokens)


def mtp_log_probs(logits: torch.Tensor, mb: PackedMicroBatch, depth: int, ops, chunk_size: int | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [R], valid [R]) of MTP depth `depth`'s targets at the response rows (mtp_targets), from its
    [1, T, V] logits; under context parallel from this rank's rows, summed over the CP group as
    response_log_probs does (every CP rank returns all R; the grad reaches each rank's own rows)."""
    targets, valid = mtp_targets(mb, depth)
    flat = logits.reshape(-1, logits.shape[-1])
    if mb.cp is None:
        lp, _ = ops.token_log_probs(flat.index_select(0, mb.response_logit_rows.to(flat.device)),
                                    targets.to(flat.device), chunk_size=chunk_size)
        return lp, valid
    slots = mb.cp_response_slots.to(flat.device)
    lp, _ = ops.token_log_probs(flat.index_select(0, mb.cp_logit_rows.to(flat.device)),
                                targets.to(flat.device).index_select(0, slots), chunk_size=chunk_size)
    return combine_rows(lp, slots, int(mb.response_logit_rows.numel()), mb.cp.group), valid


def split_per_sample(flat: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, list(lengths)))
