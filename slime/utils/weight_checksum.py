"""Exact weight checksums, computed the same way by the trainer (on exported HF tensors) and by a rollout
engine (on its loaded weights), to verify a weight sync.

Per tensor, on its raw bytes (so any dtype, bit-exact): the bytes are read as little 64-bit integer words
w_0, w_1, ... (the last one zero-padded) and summed with wrap-around (mod 2**64, so the reduction order
does not matter) as

    [number of bytes, sum of w_i, sum of w_i * (1 + i mod 251)]

Any change of a single element changes its word and so the plain sum; the position weights make swapped,
shifted or transposed words change the weighted sum. Both sides must hold the same dtype (a weight update
never casts), and the two checksums are compared for equality.

Cost: one read of each large tensor (a column sum over rows of 251 words, no conversion, no temporary
the size of the tensor; small tensors are copied into one padded buffer and summed together), on the
tensors' own device, with one device-to-host transfer per call of `named_checksums`.
"""

from __future__ import annotations

from typing import Iterable

import torch

_PERIOD = 251  # prime, so the weight pattern does not align with power-of-two row lengths
_WORD = 8  # bytes per word
_ROW_BYTES = _PERIOD * _WORD
_SMALL_BYTES = 1 << 20  # tensors below this are checksummed together (per-op overhead dominates them)


def _raw(t: torch.Tensor) -> torch.Tensor:
    data = t.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    return data.reshape(-1).view(torch.uint8)


def _weighted(cols: torch.Tensor) -> torch.Tensor:
    """[..., 2] = (sum, position-weighted sum) of column sums cols[..., PERIOD]."""
    weights = torch.arange(1, _PERIOD + 1, dtype=torch.int64, device=cols.device)
    return torch.stack([cols.sum(-1), (cols * weights).sum(-1)], dim=-1)


def _one(raw: torch.Tensor) -> torch.Tensor:
    """Checksum sums of one (large) tensor's bytes, read in place."""
    if raw.storage_offset() % _WORD:  # a slice of a larger tensor: words must start on a word boundary
        raw = raw.clone()
    nbytes = raw.numel()
    n_words = nbytes // _WORD
    words = raw[: n_words * _WORD].view(torch.int64)
    rows = n_words // _PERIOD
    cols = words[: rows * _PERIOD].view(rows, _PERIOD).sum(0)
    rest = words[rows * _PERIOD:]
    cols[: rest.numel()] += rest
    if nbytes % _WORD:  # the last bytes, zero-padded to one word at position n_words
        pad = torch.zeros(_WORD, dtype=torch.uint8, device=raw.device)
        pad[: nbytes % _WORD] = raw[n_words * _WORD:]
        cols[n_words % _PERIOD] += pad.view(torch.int64)[0]
    return _weighted(cols)


def _many(raws: list[torch.Tensor]) -> torch.Tensor:
    """Checksum sums of many small tensors at once: each copied into whole zero-padded rows of one buffer
    (so its words keep their positions); per-row sums, then per-tensor differences of their running sum."""
    device = raws[0].device
    rows = [max(1, -(-r.numel() // _ROW_BYTES)) for r in raws]
    buf = torch.zeros(sum(rows) * _ROW_BYTES, dtype=torch.uint8, device=device)
    bounds, off = [0], 0
    for r, n in zip(raws, rows):
        buf[off * _ROW_BYTES: off * _ROW_BYTES + r.numel()].copy_(r)
        off += n
        bounds.append(off)
    per_row = _weighted(buf.view(torch.int64).view(-1, _PERIOD))
    running = torch.cat([torch.zeros(1, 2, dtype=torch.int64, device=device), per_row.cumsum(0)])
    bounds_t = torch.tensor(bounds, device=device)
    return running[bounds_t[1:]] - running[bounds_t[:-1]]


def named_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
    """{name: [nbytes, sum, weighted sum]}; one device-to-host transfer per device."""
    raws = [(name, _raw(t)) for name, t in named]
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, r in raws:
        by_device.setdefault(r.device, []).append((name, r))
    out: dict[str, list[int]] = {}
    for items in by_device.values():
        small = [(n, r) for n, r in items if r.numel() < _SMALL_BYTES]
        large = [(n, r) for n, r in items if r.numel() >= _SMALL_BYTES]
        parts = ([_many([r for _, r in small])] if small else []) + [_one(r).unsqueeze(0) for _, r in large]
        values = torch.cat(parts).tolist()
        for (name, r), v in zip(small + large, values):
            out[name] = [r.numel(), *v]
    return {name: out[name] for name, _ in raws}


def tensor_checksum(t: torch.Tensor) -> list[int]:
    return named_checksums([("", t)])[""]


def mismatches(expected: dict[str, list[int]], actual: dict[str, list[int]]) -> list[str]:
    """Names whose checksums differ (or that one side lacks), sorted; empty when the weights agree."""
    bad = [n for n in expected if n not in actual] + [n for n in actual if n not in expected]
    bad += [n for n in expected.keys() & actual.keys() if list(expected[n]) != list(actual[n])]
    return sorted(bad)
