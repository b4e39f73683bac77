"""The embedded rollout engine: a transformers causal LM with batched, KV-cached generation.

Scheduling: requests that are waiting when the scheduler is free (plus those arriving in the same
burst: until `batch_wait_s` passes without a new one, at most `max_batch_wait_s`; not waited for when
the newest arrivals are one batched request, its caller's whole batch) form a wave of
up to `max_running_requests` rows. A wave is left-padded (padding masked, position ids counted
from each row's first real token), prefilled, then decoded one token per step for all rows;
finished rows are dropped from the batch and its KV cache. Requests arriving during a wave join it
at a step boundary once at least half as many wait as run: the running rows' tokens so far and the
newcomers' prompts are prefilled together into a fresh cache (continuous batching by recompute:
no surgery on model-specific cache layouts, and the re-prefill is paid a few times per wave).

Exactness: with float32 weights, greedy tokens equal `model.generate` on each prompt alone and the
returned logprobs equal a teacher-forced forward pass within float32 rounding (tests: 1e-4). DSA
(GLM-5) selects the top-k keys per query; exact score ties (keys whose ReLU terms are all 0) are
kept by lowest position in the cached decode path as in a full forward and in the trainer's
`ops.lightning_indexer` (the engine applies slime's "transformers" patch set before loading). Scores
that differ only by float rounding between the two paths can still pick different keys (rare).

Weights change only between forward steps (one lock), and only after a whole update has been
validated (see weights.py).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from slime.accelerator import get_accelerator
from slime.backends.embedded.errors import BadRequest
from slime.backends.embedded.sampling import SamplingParams, apply_penalties, choose_tokens
from slime.backends.embedded.engine_weights import WeightControl
from slime.backends.embedded.text_continuations import TextContinuations
from slime.backends.embedded.weights import WeightNameMap, parse_dtype

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    model_path: str
    dtype: str = "auto"  # auto: float32 on CPU, the checkpoint's dtype on a device
    max_running_requests: int = 64
    context_length: int | None = None  # default: the model's max_position_embeddings
    random_seed: int = 0
    original_logprobs: bool = False  # True: logprobs of the raw (temperature 1) distribution
    batch_wait_s: float = 0.01  # a wave starts after this long without a new arrival ...
    max_batch_wait_s: float = 0.1  # ... or this long after the first one
    tokenizer_path: str | None = None
    attn_implementation: str | None = None
    # tensor parallel over processes (tensor_parallel.py): this process's rank and rank 0's rendezvous host:port
    tp_size: int = 1
    tp_rank: int = 0
    dist_init_addr: str | None = None
    # SGLang's --enable-deterministic-inference: a request's tokens and log-probs must not depend on what else
    # is in flight. Here each request is computed alone (waves of one row), so no padding or batch shape
    # reaches its numbers; sampling is already seeded per request.
    deterministic: bool = False


@dataclass
class Request:
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    text: str = ""
    weight_version: str = ""
    created: float = field(default_factory=time.perf_counter)
    finished_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    routed: torch.Tensor | None = None  # int32 [tokens fed so far, num_layers, top_k]: the routers' choices
    return_indexer_topk: bool = False
    indexer: torch.Tensor | None = None  # int32 [tokens fed so far, num_layers, width]: the DSA layers' keys
    input_text: str | None = None  # a text request's text (text_continuations.py)


_ALIGN = 64  # bytes: torch's CPU allocator aligns every allocation to this


def _aligned(model: torch.nn.Module) -> torch.nn.Module:
    """Every host tensor of `model` at a 64-byte aligned address. from_pretrained can leave a weight where its
    safetensors file put it (an mmap at the header's offset, e.g. 24 bytes past a line): on some CPUs (AVX2)
    the matmul kernels then round differently than for the same values aligned, so an engine loaded from a
    checkpoint and one whose weights live in the trainer's aligned buffers (weight_sets.py) would not give
    bit-identical log-probs. Copies only the tensors that are off (a copy is allocated aligned)."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_cpu and t.numel() and t.data_ptr() % _ALIGN:
            t.data = t.data.clone()
    return model


class EmbeddedEngine(WeightControl):
    def __init__(self, cfg: EngineConfig, model: torch.nn.Module | None = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self.acc = get_accelerator()
        self.device = self.acc.device()
        # Before the model runs: the DSA indexer keeps tied keys by the trainer's rule (transformers_patches.py).
        self.acc.apply_patches("transformers")
        self.model = model if model is not None else self._load_model()
        self.model.eval()
        self.tokenizer = tokenizer if tokenizer is not None else self._load_tokenizer()
        self.continuations = TextContinuations()
        config = self.model.config
        self.vocab_size = int(getattr(config, "vocab_size", 0) or self.model.get_output_embeddings().weight.shape[0])
        self.context_length = int(cfg.context_length or getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()
        self.name_map = WeightNameMap(self.model)
        self.weight_version = "default"
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._keep_kw = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self._default_gen = torch.Generator().manual_seed(cfg.random_seed)
        self.tp_size, self.tp, self.tp_group = cfg.tp_size, None, None  # tp: rank 0's Lockstep
        if cfg.tp_size > 1:
            from slime.backends.embedded import tensor_parallel

            self.tp_group = tensor_parallel.attach(self, tensor_parallel.TensorParallelConfig(
                cfg.tp_size, cfg.tp_rank, cfg.dist_init_addr or ""))
        from slime.backends.embedded.indexer_topk import IndexerCapture
        from slime.backends.embedded.routed_experts import RouteCapture

        self._routes = RouteCapture(self.model)
        self._indexers = IndexerCapture(self.model)
        self._wave_rows = 1 if cfg.deterministic else cfg.max_running_requests  # rows computed together

        self._model_lock = threading.RLock()  # held per forward step and per weight change
        self._cond = threading.Condition()
        self._queue: deque[Request] = deque()
        self._whole_batch = False  # the newest arrivals were a caller's whole batch (submit_batch): no gather wait
        self._running: list[Request] = []
        self._paused = False
        self._abort_pending = False
        self._released_weights: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        self._stopped = False
        self._wave_idle = threading.Event()
        self._wave_idle.set()
        self._groups: dict[str, Any] = {}
        # Cumulative; /health reports them, a client takes differences (e.g. generate time per rollout).
        self.stats = {"waves": 0, "joins": 0, "forward_steps": 0, "generated_tokens": 0,
                      "wave_seconds": 0.0, "forward_seconds": 0.0}
        self._thread = threading.Thread(target=self._loop, name="embedded-engine-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loading
    def _torch_dtype(self) -> torch.dtype | str:
        if self.cfg.dtype == "auto":
            return self.acc.auto_model_dtype()
        return parse_dtype(self.cfg.dtype)

    def _load_model(self) -> torch.nn.Module:
        from slime.backends.embedded.model_loading import load_pretrained

        kwargs: dict[str, Any] = {"dtype": self._torch_dtype()}
        if self.cfg.attn_implementation:
            kwargs["attn_implementation"] = self.cfg.attn_implementation
        return _aligned(load_pretrained(self.cfg.model_path, **kwargs).to(self.device))

    def _load_tokenizer(self) -> Any:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.cfg.tokenizer_path or self.cfg.model_path)
        except Exception as e:  # token-id clients do not need one
            logger.warning("no tokenizer loaded (%s); text input/output disabled", e)
            return None

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            v = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        return ids

    # ------------------------------------------------------------------ requests
    def make_request(self, input_ids: Any, sampling_params: Any, return_logprob: bool = False,
                     rid: str | None = None, text: str | None = None, return_routed_experts: bool = False,
                     routed_experts_start_len: int = 0, return_indexer_topk: bool = False) -> Request:
        """Validate one request (BadRequest on any problem)."""
        text = text if input_ids is None else None  # input_ids win; text is then not the request's input
        if input_ids is None and text is not None:
            if self.tokenizer is None:
                raise BadRequest("text input needs a tokenizer, and none was loaded; send input_ids")
            if not isinstance(text, str):
                raise BadRequest("text must be a string")
            input_ids = self.continuations.tokenize(text, self.tokenizer)
        if not isinstance(input_ids, list) or not input_ids:
            raise BadRequest("input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise BadRequest("input_ids must contain only integers")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise BadRequest(f"prompt has {len(input_ids)} tokens but the context length is {self.context_length} "
                             "(it must leave room for one new token); shorten the prompt")
        params = SamplingParams.from_json(sampling_params, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise BadRequest("sampling_params.stop (strings) needs a tokenizer; use stop_token_ids")
        if not isinstance(return_logprob, bool):
            raise BadRequest("return_logprob must be true/false")
        if not isinstance(return_routed_experts, bool):
            raise BadRequest("return_routed_experts must be true/false")
        if return_routed_experts and not self._routes.available:
            raise BadRequest("return_routed_experts: this model has no MoE router to report; drop it (routing "
                             "replay is for MoE models)")
        if not isinstance(return_indexer_topk, bool):
            raise BadRequest("return_indexer_topk must be true/false")
        if return_indexer_topk and not self._indexers.available:
            raise BadRequest("return_indexer_topk: this model has no DSA indexer to report; drop it (indexer top-k "
                             "replay is for GLM-5.3-Flash, glm5_next)")
        start = routed_experts_start_len
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(input_ids):
            raise BadRequest(f"routed_experts_start_len must be an integer in [0, {len(input_ids)}] (the prompt "
                             f"length), got {start!r}")
        req = Request(list(input_ids), params, return_logprob, rid=str(rid) if rid is not None else uuid.uuid4().hex,
                      return_routed_experts=return_routed_experts, routed_experts_start_len=start,
                      input_text=text, return_indexer_topk=return_indexer_topk)
        if params.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(params.sampling_seed)
        return req

    def submit(self, req: Request) -> Request:
        self.submit_batch([req], whole=False)
        return req

    def submit_batch(self, reqs: list[Request], whole: bool = True) -> list[Request]:
        """Queue `reqs` together. whole: they are everything their caller sends now (one batched /generate),
        so the scheduler starts a wave on them without waiting `batch_wait_s` for more arrivals; a request
        queued after them (a concurrent client) makes it gather again."""
        queued = []
        for req in reqs:
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
            else:
                queued.append(req)
        with self._cond:
            if self._stopped:
                for req in queued:
                    self._finish(req, {"type": "abort", "message": "engine is shutting down"})
                return reqs
            if queued:
                self._queue.extend(queued)
                self._whole_batch = whole
                self._cond.notify_all()
        return reqs

    def generate(self, input_ids: list[int], sampling_params: dict | None = None, return_logprob: bool = False) -> Request:
        """Blocking convenience call (tests, benchmarks)."""
        req = self.submit(self.make_request(input_ids, sampling_params or {}, return_logprob))
        req.done.wait()
        return req

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req.done.is_set():
            return
        req.finish_reason = reason
        req.weight_version = self.weight_version
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)
            matched = reason.get("matched")
            if isinstance(matched, str) and not req.params.no_stop_trim:
                req.text = req.text[: req.text.find(matched)] if matched in req.text else req.text
            if req.input_text is not None:
                self.continuations.remember(req.input_text + req.text, req.input_ids + req.output_ids)
        req.finished_at = time.perf_counter()
        req.done.set()

    def response(self, req: Request) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "finish_reason": req.finish_reason,
            "weight_version": req.weight_version,
            "e2e_latency": max(0.0, req.finished_at - req.created),
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.logprobs, req.output_ids)]
        if req.return_routed_experts:
            from slime.backends.embedded.routed_experts import encode

            # SGLang's rows: tokens [start_len, len(prompt + response) - 1)
            end = len(req.input_ids) + len(req.output_ids) - 1
            rows = req.routed[req.routed_experts_start_len:end] if req.routed is not None else \
                torch.zeros(0, self._routes.num_layers, self._routes.top_k, dtype=torch.int32)
            meta["routed_experts"] = encode(rows)
        if req.return_indexer_topk:  # SGLang's rows: tokens [0, len(prompt + response) - 1)
            from slime.utils.indexer_replay import META_KEY, encode

            end = len(req.input_ids) + len(req.output_ids) - 1
            meta[META_KEY] = encode(req.indexer[:end] if req.indexer is not None else
                                    torch.zeros(0, self._indexers.num_layers, self._indexers.width, dtype=torch.int32))
        return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._queue or self._paused or self._released_weights is not None):
                    self._cond.wait()
                if self._stopped:
                    return
                # Gather: keep waiting while requests keep arriving (a burst of concurrent clients
                # lands over a few ms), so they share one wave instead of splitting into several.
                deadline = time.perf_counter() + self.cfg.max_batch_wait_s
                while (len(self._queue) < self._wave_rows and self.cfg.batch_wait_s > 0 and not self._whole_batch
                       and time.perf_counter() < deadline):
                    before = len(self._queue)
                    self._cond.wait(self.cfg.batch_wait_s)
                    if len(self._queue) == before:
                        break
                if self._paused or self._released_weights is not None or not self._queue:
                    continue
                wave = [self._queue.popleft() for _ in range(min(len(self._queue), self._wave_rows))]
                self._running = wave
                self._wave_idle.clear()
            t_wave = time.perf_counter()
            try:
                self._run_wave(wave)
            except Exception as e:  # a bug or device error must not hang clients
                logger.exception("generation wave failed")
                for r in self._running:
                    self._finish(r, {"type": "abort", "message": f"engine error: {type(e).__name__}: {e}"})
            finally:
                self.stats["wave_seconds"] += time.perf_counter() - t_wave
                with self._cond:
                    self._running = []
                    self._abort_pending = False
                    self._wave_idle.set()
                    self._cond.notify_all()

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any,
                 rows: list[Request] | None = None) -> torch.Tensor:
        """Next-token logits; rows that asked for routed experts get this forward's router choices (the
        positions each row feeds: its whole sequence in a prefill, its last token in a decode step)."""
        kwargs: dict[str, Any] = {self._cache_kw: cache, "use_cache": True}
        if self._keep_kw:
            kwargs["logits_to_keep"] = 1
        capture = rows is not None and any(r.return_routed_experts for r in rows)
        keys = rows is not None and any(r.return_indexer_topk for r in rows)
        with self._model_lock:
            t0 = time.perf_counter()
            self._routes.enabled, self._indexers.enabled = capture, keys
            try:
                out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs)
            finally:
                self._routes.enabled = self._indexers.enabled = False
            self.stats["forward_seconds"] += time.perf_counter() - t0
            routes = self._routes.take(*ids.shape) if capture else None
            selected = self._indexers.take(mask, ids.shape[1]) if keys else None
        self.stats["forward_steps"] += 1
        if selected is not None or routes is not None:  # each row's fed tokens: routers' experts, DSA layers' keys
            from slime.backends.embedded.indexer_topk import extend

            for i, r in enumerate(rows):
                length = len(r.input_ids) + len(r.output_ids)
                if r.return_indexer_topk:
                    r.indexer = extend(r.indexer, selected[i], ids.shape[1], length)
                if r.return_routed_experts:
                    r.routed = extend(r.routed, routes[i], ids.shape[1], length)
        return out.logits[:, -1, :]

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            cache = DynamicCache(config=self.model.config.get_text_config())
        except TypeError:
            return DynamicCache()
        for layer in cache.layers:
            # transformers 5.24's recurrent-state layers (KDA, Gated DeltaNet: LinearAttentionLayer) have no
            # batch_select_indices, which the scheduler calls when rows finish; their reorder_cache keeps the
            # same rows (index_select on the batch dim of the conv and recurrent states). Remove once they have it.
            if not hasattr(layer, "batch_select_indices") and hasattr(layer, "reorder_cache"):
                layer.batch_select_indices = layer.reorder_cache
        return cache

    def _check_interrupts(self) -> bool:
        """Between steps: honour abort and in-place pause. True = abort every row."""
        with self._cond:
            while self._paused and not self._abort_pending and not self._stopped:
                self._cond.wait()
            if self._abort_pending or self._stopped:
                return True
        return False

    def _prefill(self, rows: list[Request]) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """Left-padded forward over each row's prompt + tokens so far. Returns (next-token logits, cache,
        attention mask, position of each row's last token)."""
        seqs = [r.input_ids + r.output_ids for r in rows]
        width = max(map(len, seqs))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, width - len(seq):] = torch.tensor(seq)
            mask[i, width - len(seq):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._new_cache()
        logits = self._forward(ids, mask, pos, cache, rows)
        return logits, cache, mask, pos[:, -1]

    def _take_joiners(self, running: int) -> list[Request]:
        """Queued requests that join the running wave at this step boundary: when at least half as many wait
        as run (so the re-prefill this costs is paid at most a few times per wave) and there is room."""
        with self._cond:
            if (self._paused or self._abort_pending or self._stopped or self._released_weights is not None
                    or not self._queue or 2 * len(self._queue) < running):
                return []
            room = self._wave_rows - running
            joiners = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
            self._running = self._running + joiners
            return joiners

    @torch.inference_mode()
    def _run_wave(self, wave: list[Request]) -> None:
        self.stats["waves"] += 1
        dev = self.device
        rows = list(wave)
        logits, cache, mask, last_pos = self._prefill(rows)
        while rows:
            if self._check_interrupts():
                for r in rows:
                    self._finish(r, {"type": "abort", "message": "aborted by pause_generation/abort_request"})
                return
            logits = self._adjust_logits(logits, rows)
            tokens, lps = choose_tokens(logits, [r.params for r in rows], [r.generator for r in rows],
                                        self._default_gen, self.cfg.original_logprobs)
            keep: list[int] = []
            for i, (r, tok, lp) in enumerate(zip(rows, tokens, lps)):
                r.output_ids.append(tok)
                r.logprobs.append(lp)
                self.stats["generated_tokens"] += 1
                reason = self._finish_reason(r, tok)
                if reason is None:
                    keep.append(i)
                else:
                    self._finish(r, reason)
            joiners = self._take_joiners(len(keep))
            if joiners:
                # Continuous batching by recompute: one prefill over the running rows' tokens so far and
                # the newcomers' prompts gives every row its next-token logits, with no cache surgery.
                rows = [rows[i] for i in keep] + joiners
                self.stats["joins"] += 1
                logits, cache, mask, last_pos = self._prefill(rows)
                continue
            if not keep:
                return
            next_ids = torch.tensor([tokens[i] for i in keep], dtype=torch.long, device=dev)[:, None]
            if len(keep) != len(rows):
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(idx)
                mask, last_pos = mask[idx], last_pos[idx]
                rows = [rows[i] for i in keep]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
            last_pos = last_pos + 1
            logits = self._forward(next_ids, mask, last_pos[:, None], cache, rows)

    def _adjust_logits(self, logits: torch.Tensor, rows: list[Request]) -> torch.Tensor:
        """Penalties and min_new_tokens masking, only for rows that ask for them."""
        out = logits
        for i, r in enumerate(rows):
            p = r.params
            needs_min = len(r.output_ids) < p.min_new_tokens
            if not (p.penalized or needs_min):
                continue
            if out is logits:
                out = logits.float().clone()
            if p.penalized:
                apply_penalties(out[i], p, r.input_ids + r.output_ids, r.output_ids)
            if needs_min:
                stop = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
                if stop:
                    out[i, sorted(stop)] = float("-inf")
        return out

    def _finish_reason(self, r: Request, tok: int) -> dict[str, Any] | None:
        p = r.params
        n = len(r.output_ids)
        if n >= p.min_new_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                return {"type": "stop", "matched": tok}
            if p.stop:
                tail = self.tokenizer.decode(r.output_ids[-32:], skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    if s in tail:
                        return {"type": "stop", "matched": s}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": n}
        if len(r.input_ids) + n >= self.context_length:
            return {"type": "length", "length": n, "message": f"reached the context length {self.context_length}"}
        return None

    # ------------------------------------------------------------------ control
    def pause(self, mode: str = "abort") -> None:
        """Stop scheduling. mode "abort": running and queued requests finish now with finish_reason abort;
        "in_place": running requests freeze between steps and continue after `resume()`."""
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"pause_generation mode {mode!r} unknown; use abort or in_place")
        with self._cond:
            self._paused = True
            self._cond.notify_all()
        if mode in ("abort", "retract"):
            self.abort_all("aborted by pause_generation")

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def abort_all(self, message: str = "aborted") -> int:
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
            running = bool(self._running)
            if running:
                self._abort_pending = True  # the scheduler clears it when the wave ends
            self._cond.notify_all()
        for r in queued:
            self._finish(r, {"type": "abort", "message": message})
        if running:
            self._wave_idle.wait()
        return len(queued)

    def abort_request(self, rid: str) -> bool:
        with self._cond:
            for r in list(self._queue):
                if r.rid == rid:
                    self._queue.remove(r)
                    self._finish(r, {"type": "abort", "message": "aborted by abort_request"})
                    return True
        return False

    def is_idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._running

    def load(self) -> dict[str, int]:
        with self._cond:
            return {"num_queued_reqs": len(self._queue), "num_running_reqs": len(self._running)}

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self.abort_all("engine is shutting down")
        self._thread.join(timeout=10)
        if self.tp is not None:
            self.tp.stop()  # the followers leave their loop
        for name in list(self._groups):
            self.destroy_weights_update_group(name)
