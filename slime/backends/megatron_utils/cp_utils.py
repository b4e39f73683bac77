"""Upstream slime's context-parallel helpers (`slime.backends.megatron_utils.cp_utils`), as its TIS and loss
examples import them.

Upstream's layout: a sequence of length L is cut into 2 * cp_size chunks of ceil(L / (2 * cp_size)) tokens and
rank r holds chunks r and 2 * cp_size - 1 - r (load-balanced causal attention). The rank and size are megatron's
context-parallel group's (size 1 when megatron's groups are not set up). The per-sample tensors this project
hands plugin hooks are whole responses (docs/plugins.md); these helpers are for code holding a rank's pieces.
`prepare_routed_experts_for_routing_replay` lays the engine's routed experts out as upstream's trainer does (this
project's trainer replays routes through slime.utils.routing_replay, which does its own layout).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def _cp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_context_parallel_rank(), max(1, parallel_state.get_context_parallel_world_size())


def _tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def get_logits_and_tokens_offset_with_cp(total_length: int, response_length: int):
    """This rank's (chunk_size, its two chunks' [start, end), the logits rows of response tokens in them, those
    tokens' positions); offsets from the prompt's start, empty pieces as (0, 0)."""
    rank, size = _cp_rank_size()
    if size <= 1:
        raise ValueError("get_logits_and_tokens_offset_with_cp needs a context-parallel size > 1")
    prompt_length = total_length - response_length
    chunk = (total_length + 2 * size - 1) // (2 * size)
    chunks = ((rank * chunk, (rank + 1) * chunk), ((2 * size - rank - 1) * chunk, (2 * size - rank) * chunk))
    logits, tokens = [], []
    for start, end in chunks:
        lo, hi = max(start, prompt_length - 1), min(end, total_length - 1)
        logits.append((lo, hi) if lo < hi else (0, 0))
        tokens.append((lo + 1, hi + 1) if lo < hi else (0, 0))
    return chunk, chunks, tuple(logits), tuple(tokens)


def get_sum_of_sample_mean(total_lengths: list[int], response_lengths: list[int], loss_masks: list[torch.Tensor],
                           sample_denoms=None, calculate_per_token_loss: bool = False) -> Callable:
    """A reducer of per-token values (this rank's pieces, back to back): the sum over samples of the masked sum
    divided by the sample's denominator (its mask's sum unless sample_denoms), or of the masked sums."""
    if sample_denoms is None:
        sample_denoms = [m.sum() for m in loss_masks]
    _, size = _cp_rank_size()
    masks, lengths = list(loss_masks), list(response_lengths)
    if size > 1:
        masks = []
        for total, response, mask in zip(total_lengths, response_lengths, loss_masks):
            prompt = total - response
            _, _, _, tokens = get_logits_and_tokens_offset_with_cp(total, response)
            masks.append(torch.cat([mask[a - prompt:b - prompt] for a, b in tokens]))
        lengths = [m.size(0) for m in masks]

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return sum((xi * m).sum() / torch.clamp_min(d, 1) for xi, m, d in zip(x.split(lengths), masks, sample_denoms))

    def sum_of_token(x: torch.Tensor) -> torch.Tensor:
        return sum((xi * m).sum() for xi, m in zip(x.split(lengths), masks))

    return sum_of_token if calculate_per_token_loss else sum_of_sample_mean


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """This rank's response pieces placed in a zero tensor of response_length rows and summed over the
    context-parallel group: the whole response on every rank (with gradient)."""
    _, size = _cp_rank_size()
    if size == 1:
        return tensor
    from megatron.core import parallel_state

    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total_length, response_length)
    first = logits[0][1] - logits[0][0]
    full = tensor.new_zeros((response_length, *tensor.shape[1:]))
    offset = total_length - response_length - 1  # the logits row of the first response token
    for (lo, hi), piece in zip(logits, (tensor[:first], tensor[first:])):
        if hi > lo:
            full = full.index_add(0, torch.arange(lo - offset, hi - offset, device=tensor.device), piece)
    return torch.distributed.nn.all_reduce(full, group=parallel_state.get_context_parallel_group())


def slice_with_cp(tokens: torch.Tensor, pad_value) -> torch.Tensor:
    """This rank's two chunks of a whole sequence, padded (pad_value, or pad_value(tokens, pad)) to 2 * size
    chunks first."""
    rank, size = _cp_rank_size()
    if size == 1:
        return tokens
    chunk = (len(tokens) + 2 * size - 1) // (2 * size)
    pad = 2 * size * chunk - len(tokens)
    if callable(pad_value):
        tokens = pad_value(tokens, pad)
    else:
        tokens = F.pad(tokens, (0, 0) * (tokens.dim() - 1) + (0, pad), value=pad_value)
    return torch.cat([tokens[chunk * rank:chunk * (rank + 1)], tokens[chunk * (2 * size - rank - 1):chunk * (2 * size - rank)]])


def slice_log_prob_with_cp(log_prob, total_length: int, response_length: int):
    """This rank's pieces of a whole response's per-token values (a list stays a list)."""
    if len(log_prob) != response_length:
        raise ValueError(f"log_prob length mismatch: len(log_prob)={len(log_prob)}, "
                         f"response_length={response_length}, total_length={total_length}")
    _, size = _cp_rank_size()
    if size == 1:
        return log_prob
    offset = total_length - response_length - 1
    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total_length, response_length)
    pieces = [log_prob[lo - offset:hi - offset] for lo, hi in logits]
    return pieces[0] + pieces[1] if isinstance(log_prob, list) else torch.cat(pieces)


def _pad_experts(experts: torch.Tensor, pad: int, num_experts: int) -> torch.Tensor:
    """`pad` rows of valid expert ids (0, 1, 2, ... modulo num_experts over [rows, layers, top-k]) appended, so a
    padding token's replayed route is still a real expert."""
    if pad == 0:
        return experts
    _, layers, topk = experts.shape
    filler = torch.arange(pad * layers * topk, device=experts.device, dtype=experts.dtype) % num_experts
    return torch.cat([experts, filler.reshape(pad, layers, topk)])


def prepare_routed_experts_for_routing_replay(rollout_routed_experts, tokens, *, num_experts: int,
                                              data_pad_size_multiplier: int, sequence_parallel: bool,
                                              allgather_cp: bool) -> torch.Tensor:
    """The engine's routed experts of a packed micro-batch ([len(tokens) - 1, layers, top-k] per sample) as this
    rank's rows of the training layout: each sample padded by one row (its last token), then either all samples
    joined, padded to a multiple of cp * tp * multiplier and cut into CP-size contiguous pieces (`allgather_cp`), or
    each sample cut like its tokens (slice_with_cp) and the whole padded to tp * multiplier; with sequence
    parallelism this TP rank's share of the rows."""
    if len(rollout_routed_experts) != len(tokens):
        raise ValueError(f"{len(rollout_routed_experts)} routed-experts tensors for {len(tokens)} samples")
    for experts, ids in zip(rollout_routed_experts, tokens):
        if experts.shape[0] != ids.shape[0] - 1:
            raise ValueError(f"routed experts {tuple(experts.shape)} do not cover tokens {tuple(ids.shape)} but the last")
    padded = [_pad_experts(experts, 1, num_experts) for experts in rollout_routed_experts]
    tp_rank, tp_size = _tp_rank_size()
    cp_rank, cp_size = _cp_rank_size()
    multiple = tp_size * data_pad_size_multiplier
    if allgather_cp:
        rows = torch.cat(padded)
        rows = _pad_experts(rows, -rows.size(0) % (cp_size * multiple), num_experts).chunk(cp_size)[cp_rank]
    else:
        rows = torch.cat([slice_with_cp(e, lambda x, pad: _pad_experts(x, pad, num_experts)) for e in padded])
        rows = _pad_experts(rows, -rows.size(0) % multiple, num_experts)
    if sequence_parallel:
        if rows.size(0) % tp_size:
            raise ValueError(f"{rows.size(0)} rows do not split over tensor-parallel size {tp_size}")
        share = rows.size(0) // tp_size
        rows = rows[share * tp_rank:share * (tp_rank + 1)]
    return rows
