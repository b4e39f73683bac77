"""SGLang-compatible sampling parameters, and the sampler that turns a batch of logits into tokens.

Log-probabilities follow SGLang's default: the returned logprob of a sampled token is taken from
the distribution the token was sampled from *before* top-k/top-p truncation, i.e.
`log_softmax(penalized_logits / temperature)`. Greedy requests (temperature 0) use temperature 1.
With `original_logprobs=True` (SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB) they are the raw
`log_softmax(logits)` instead. At temperature 1 without penalties both agree, and equal a
teacher-forced forward pass of the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.backends.embedded.errors import BadRequest

# Keys SGLang clients send that have no effect on token ids here (text formatting knobs).
_ACCEPTED_NOOP_KEYS = {"spaces_between_special_tokens", "stream_interval"}


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_new_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_json(cls, obj: Any, vocab_size: int) -> "SamplingParams":
        if obj is None:
            obj = {}
        if not isinstance(obj, dict):
            raise BadRequest(f"sampling_params must be a JSON object, got {type(obj).__name__}")
        d = dict(obj)
        if "seed" in d:  # accepted alias
            if d.get("sampling_seed") is not None and d["sampling_seed"] != d["seed"]:
                raise BadRequest("sampling_params has both seed and sampling_seed with different values; send one")
            d["sampling_seed"] = d.pop("seed")
        # SGLang's per-request parameters of a custom logit processor: without a processor (this engine runs
        # none; /generate refuses `custom_logit_processor`) SGLang ignores them too.
        custom = d.pop("custom_params", None)
        if custom is not None and not isinstance(custom, dict):
            raise BadRequest(f"sampling_params.custom_params must be a JSON object, got {type(custom).__name__}")
        known = set(cls.__dataclass_fields__) | _ACCEPTED_NOOP_KEYS
        unknown = sorted(set(d) - known)
        if unknown:
            raise BadRequest(f"unsupported sampling_params {unknown}; supported: {sorted(known)}")
        for k in _ACCEPTED_NOOP_KEYS:
            d.pop(k, None)
        p = cls()
        p.max_new_tokens = _int(d, "max_new_tokens", p.max_new_tokens, lo=0)
        p.min_new_tokens = _int(d, "min_new_tokens", p.min_new_tokens, lo=0)
        p.temperature = _float(d, "temperature", p.temperature, lo=0.0)
        p.top_p = _float(d, "top_p", p.top_p, lo=0.0)
        if not 0.0 < p.top_p <= 1.0:
            raise BadRequest(f"sampling_params.top_p must be in (0, 1], got {p.top_p}")
        p.top_k = _int(d, "top_k", p.top_k)
        if p.top_k == 0 or p.top_k < -1:
            raise BadRequest(f"sampling_params.top_k must be -1 (off) or >= 1, got {p.top_k}")
        p.repetition_penalty = _float(d, "repetition_penalty", p.repetition_penalty, lo=0.0)
        if p.repetition_penalty == 0.0:
            raise BadRequest("sampling_params.repetition_penalty must be > 0 (1.0 = off)")
        p.frequency_penalty = _float(d, "frequency_penalty", p.frequency_penalty)
        p.presence_penalty = _float(d, "presence_penalty", p.presence_penalty)
        p.n = _int(d, "n", 1, lo=1)
        if p.n != 1:
            raise BadRequest("sampling_params.n > 1 is not supported; send the prompt n times (batch input_ids)")
        for k in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            v = d.get(k, getattr(p, k))
            if not isinstance(v, bool):
                raise BadRequest(f"sampling_params.{k} must be true/false, got {v!r}")
            setattr(p, k, v)
        ids = d.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequest("sampling_params.stop_token_ids must be a list of ints")
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise BadRequest(f"sampling_params.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        p.stop_token_ids = list(ids)
        stop = d.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("sampling_params.stop must be a non-empty string or a list of them")
        p.stop = stop
        seed = d.get("sampling_seed")
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
                raise BadRequest(f"sampling_params.sampling_seed must be a non-negative int, got {seed!r}")
            p.sampling_seed = seed
        if p.min_new_tokens > p.max_new_tokens:
            raise BadRequest(f"min_new_tokens {p.min_new_tokens} exceeds max_new_tokens {p.max_new_tokens}")
        return p


def _num(d: dict, key: str, default: Any, kind: type) -> Any:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(f"sampling_params.{key} must be a{'n integer' if kind is int else ' number'}, got {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise BadRequest(f"sampling_params.{key} must be finite, got {v!r}")
    return kind(v)


def _int(d: dict, key: str, default: int, lo: int | None = None) -> int:
    v = _num(d, key, default, int)
    if lo is not None and v < lo:
        raise BadRequest(f"sampling_params.{key} must be >= {lo}, got {v}")
    return v


def _float(d: dict, key: str, default: float, lo: float | None = None) -> float:
    v = _num(d, key, default, float)
    if lo is not None and v < lo:
        raise BadRequest(f"sampling_params.{key} must be >= {lo}, got {v}")
    return v


def apply_penalties(logits: torch.Tensor, params: SamplingParams, seen: list[int], generated: list[int]) -> None:
    """In place on one row. Repetition penalty over prompt+output (CTRL style); frequency/presence over output."""
    if params.repetition_penalty != 1.0 and seen:
        idx = torch.tensor(sorted(set(seen)), device=logits.device)
        vals = logits[idx]
        logits[idx] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and generated:
        ids, counts = torch.tensor(generated, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty


def truncate_top_k_top_p(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities [R, V] with tokens outside the top-k / top-p nucleus set to -inf (row-wise)."""
    out = logprobs
    if 0 < top_k < out.shape[-1]:
        kth = torch.topk(out, top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, dim=-1, descending=True)
        probs = sorted_lp.exp()
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        out = torch.full_like(out, float("-inf")).scatter(-1, order, sorted_lp)
    return out


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
    original_logprobs: bool = False,
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [B, V] (already penalized/masked) and return (tokens, logprobs).

    Rows with the same (temperature, top_k, top_p) are processed together; each seeded row draws from
    its own generator, so its tokens do not depend on the rest of the batch.
    """
    logits = logits.float()
    raw_lp = torch.log_softmax(logits, dim=-1)
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    lps = torch.empty(len(params), dtype=torch.float32, device=logits.device)
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((0.0, -1, 1.0) if p.greedy else (p.temperature, p.top_k, p.top_p), []).append(i)
    for (temperature, top_k, top_p), rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        if temperature == 0.0:
            tok = logits.index_select(0, idx).argmax(-1)
            lp = raw_lp.index_select(0, idx)
        else:
            lp = raw_lp.index_select(0, idx) if temperature == 1.0 else \
                torch.log_softmax(logits.index_select(0, idx) / temperature, dim=-1)
            # Generators live on the host so a seed gives the same tokens on every device.
            probs = torch.softmax(truncate_top_k_top_p(lp, top_k, top_p), dim=-1).cpu()
            seeded = [generators[r] for r in rows]
            if all(g is None for g in seeded):
                tok = torch.multinomial(probs, 1, generator=default_generator)[:, 0]
            else:
                tok = torch.stack([torch.multinomial(probs[j], 1, generator=g if g is not None else default_generator)[0]
                                   for j, g in enumerate(seeded)])
            tok = tok.to(logits.device)
        chosen = (raw_lp.index_select(0, idx) if original_logprobs else lp).gather(-1, tok[:, None])[:, 0]
        tokens[idx] = tok
        lps[idx] = chosen
    return tokens.tolist(), lps.tolist()
