"""Weight updates by HF checkpoint name: name resolution, all-or-nothing checks, safetensors loading.

transformers keeps some weights in a fused runtime layout (MoE experts as one 3-D
`experts.gate_up_proj` parameter) while checkpoints and trainers name them per expert
(`experts.7.gate_proj.weight`). `WeightNameMap` accepts both: every runtime parameter/persistent
buffer name, and every checkpoint name that transformers' own conversion table maps into a slice
of a fused parameter (stack over experts, then concatenate). Conversions with other operations
(transposes, splits of unknown size) are not mapped; their weights are updated by runtime name.

An update is a list of (name, shape, dtype) checked completely (unknown name, duplicate, shape,
dtype) before anything is copied, so a bad update changes nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

from slime.backends.embedded.errors import BadRequest
from slime.utils.fp8_pairs import STORED_DTYPES

if TYPE_CHECKING:
    from slime.backends.embedded.fp8_checkpoint import Fp8Layout

_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n)
    for n in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
              "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, n)
}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    key = str(name).removeprefix("torch.")
    if key not in _DTYPES:
        raise BadRequest(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True)
class _Slot:
    runtime_name: str
    index: tuple  # applied to the runtime tensor; () = whole tensor


def _simple_pattern(p: str) -> bool:
    return isinstance(p, str) and not re.search(r"[\^$()\[\]\\|+?{}]", p)


def _module_path(pattern: Any) -> str | None:
    """A rename pattern as the literal module path it matches (escaped dots read as dots, surrounding dots
    dropped), or None for a real regex."""
    if not isinstance(pattern, str):
        return None
    literal = pattern.replace("\\.", ".")
    return literal.strip(".") or None if _simple_pattern(literal) and "*" not in literal else None


class WeightNameMap:
    """Resolves external weight names to live tensors (views) of `model`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._slots: dict[str, _Slot] = {}
        runtime: list[str] = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        for mod_name, mod in model.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for b_name, _ in mod.named_buffers(recurse=False):
                if b_name not in skip:
                    runtime.append(f"{mod_name}.{b_name}" if mod_name else b_name)
        for n in runtime:
            self._slots[n] = _Slot(n, ())
        self._fused: set[str] = set()
        self._renamed: set[str] = set()  # names that a checkpoint stores under another module path
        self._add_conversions()
        self._add_renamings()
        self._add_prefix_changes()
        # Tied weights (lm_head <- embed_tokens) are one tensor; a checkpoint stores only one name.
        tied = getattr(model, "_tied_weights_keys", None) or {}
        tie = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        self._aliases = {k for k in (tied if isinstance(tied, dict) else {})} if tie else set()

    def _add_conversions(self) -> None:
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
        except Exception:  # older/newer transformers without this table: runtime names only
            return
        try:
            conversions = get_model_conversion_mapping(self.model)
        except Exception:
            return
        shapes = {n: tuple(self._tensor(n).shape) for n in list(self._slots)}
        for conv in conversions:
            if not isinstance(conv, WeightConverter) or getattr(conv, "scope_prefix", None):
                continue
            ops = list(getattr(conv, "operations", []) or [])
            if not ops or not all(isinstance(o, (MergeModulelist, Concatenate)) for o in ops):
                continue
            merge = [o for o in ops if isinstance(o, MergeModulelist)]
            concat = [o for o in ops if isinstance(o, Concatenate)]
            if len(merge) > 1 or len(concat) > 1 or (merge and merge[0].dim != 0):
                continue
            sources, targets = list(conv.source_patterns), list(conv.target_patterns)
            if len(targets) != 1 or not all(_simple_pattern(p) for p in sources + targets):
                continue
            if any(p.count("*") != (1 if merge else 0) for p in sources):
                continue
            target = targets[0]
            for rt_name, shape in shapes.items():
                # patterns name a module path relative to any prefix, with (Mixtral's) or without a leading dot
                if not (rt_name == target or rt_name.endswith(target if target.startswith(".") else "." + target)):
                    continue
                prefix = rt_name[: len(rt_name) - len(target)]
                cat_dim = concat[0].dim if concat else None
                if cat_dim is not None and (cat_dim >= len(shape) or shape[cat_dim] % len(sources)):
                    continue
                chunk = shape[cat_dim] // len(sources) if cat_dim is not None else None
                experts = range(shape[0]) if merge else [None]
                for si, src in enumerate(sources):
                    for e in experts:
                        idx: list[Any] = [] if e is None else [e]
                        if cat_dim is not None:
                            local = cat_dim - (1 if merge else 0)  # dim inside one expert's tensor
                            idx += [slice(None)] * local + [slice(si * chunk, (si + 1) * chunk)]
                        name = prefix + (src.replace("*", str(e)) if e is not None else src)
                        self._slots[name] = _Slot(rt_name, tuple(idx))
                self._fused.add(rt_name)

    def _add_renamings(self) -> None:
        """Checkpoint names of modules transformers renames on load (MiniMax-M2: `.block_sparse_moe.` -> `.mlp.`):
        each name holding the rename's target gets the checkpoint's name too (what save_pretrained writes). Only
        literal module-path renames (".a." -> ".b.") are reversed; the runtime name then stays resolvable but is
        not listed as a checkpoint name."""
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightRenaming

            renames = [c for c in get_model_conversion_mapping(self.model) if isinstance(c, WeightRenaming)]
        except Exception:
            return
        for conv in renames:
            sources, targets = list(conv.source_patterns), list(conv.target_patterns)
            if len(sources) != 1 or len(targets) != 1:
                continue
            src, tgt = _module_path(sources[0]), _module_path(targets[0])
            if src is None or tgt is None:
                continue
            # whole name components only (GLM-5.3-Flash: "hc_attn_fn" -> "attn_hc.fn", "self_attn\.A_log" ->
            # "self_attn.forget_gate.A_log")
            at_tgt, at_src = (re.compile(rf"(?:^|(?<=\.)){re.escape(p)}(?=\.|$)") for p in (tgt, src))
            for name, slot in list(self._slots.items()):
                if at_tgt.search(name) and not at_src.search(name):
                    alias = at_tgt.sub(src, name)
                    self._slots.setdefault(alias, slot)
                    self._renamed.add(name)
                    if name in self._fused:  # a fused runtime tensor is listed by its parts only
                        self._fused.add(alias)

    def _add_prefix_changes(self) -> None:
        """A text model that transformers loaded from a vision-language checkpoint (Qwen3.5 through
        AutoModelForCausalLM: `model.language_model.X` read as `model.X`, transformers' PrefixChange): each runtime
        name under the prefix gets the checkpoint's name, which replaces it among the checkpoint names. Only for
        a model read from such a checkpoint (its config.json holds a text_config); a text-only checkpoint of the
        same class keeps the runtime names."""
        if not _from_wrapper_checkpoint(self.model):
            return
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import PrefixChange

            changes = [c for c in get_model_conversion_mapping(self.model)
                       if isinstance(c, PrefixChange) and c.prefix_to_remove]
        except Exception:
            return
        for change in changes:
            head = f"{change.model_prefix}." if change.model_prefix else ""
            inserted = f"{head}{change.prefix_to_remove}."
            for name, slot in list(self._slots.items()):
                if name.startswith(head) and not name.startswith(inserted):
                    alias = inserted + name[len(head):]
                    self._slots.setdefault(alias, slot)
                    self._renamed.add(name)
                    if name in self._fused:  # a fused runtime tensor is listed by its parts only
                        self._fused.add(alias)

    def _tensor(self, runtime_name: str) -> torch.Tensor:
        # The owning module is looked up once per name (a walk down the module path costs ~15 us, paid for
        # every weight of every update and checksum); the attribute is read each time, so a parameter whose
        # .data was swapped (release/resume memory) or a re-registered buffer is seen as it is now.
        owners = self.__dict__.setdefault("_owners", {})
        owner = owners.get(runtime_name)
        if owner is None:
            module_path, _, attr = runtime_name.rpartition(".")
            module = self.model.get_submodule(module_path)
            if attr not in module._parameters and attr not in module._buffers:
                raise AttributeError(f"{runtime_name} is neither a parameter nor a buffer")
            owner = owners[runtime_name] = (module, attr)
        return getattr(owner[0], owner[1])

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def resolve(self, name: str) -> torch.Tensor:
        """A view of the live tensor that `name` denotes (writes through)."""
        slot = self._slots[name]
        t = self._tensor(slot.runtime_name)
        return t.data[slot.index] if slot.index else t.data

    def checkpoint_names(self) -> list[str]:
        """Names a complete HF checkpoint provides: fused runtime names replaced by their parts, tied aliases dropped."""
        out = []
        for name, slot in self._slots.items():
            if name in self._aliases or name in self._renamed or (name in self._fused and not slot.index):
                continue
            out.append(name)
        return out

    def dtype_overrides(self, default: torch.dtype) -> dict[str, str]:
        """{checkpoint name: dtype} for weights whose dtype differs from the model's main dtype."""
        return {n: dtype_name(self.resolve(n).dtype) for n in self.checkpoint_names()
                if self.resolve(n).dtype != default}


def _from_wrapper_checkpoint(model: torch.nn.Module) -> bool:
    """Whether `model` was read from a checkpoint directory whose config.json wraps a text_config."""
    import json
    import os

    path = os.path.join(str(getattr(model, "name_or_path", "") or ""), "config.json")
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return isinstance(json.load(f).get("text_config"), dict)
    except (OSError, ValueError):
        return False


@dataclass
class PlannedCopy:
    name: str
    target: torch.Tensor
    source: torch.Tensor | None  # None until received (distributed path)
    # (scale name, checksums of the e4m3 weight and of the scale as received) when `source` is their
    # dequantization (fp8_receipts.py)
    fp8_received: tuple[str, list[int], list[int]] | None = None


def plan_update(
    name_map: WeightNameMap,
    specs: Iterable[tuple[str, Any, Any]],
    allow_cast: bool = False,
) -> list[PlannedCopy]:
    """Check (name, shape, dtype) of every weight against the model; raise BadRequest listing the problems.

    `shape` is a list/tuple/torch.Size; `dtype` a torch.dtype or its name. Nothing is modified.
    """
    problems: list[str] = []
    plan: list[PlannedCopy] = []
    seen: set[str] = set()
    for name, shape, dtype in specs:
        if not isinstance(name, str):
            problems.append(f"weight name {name!r} is not a string")
            continue
        if name in seen:
            problems.append(f"{name} appears twice")
            continue
        seen.add(name)
        if name not in name_map:
            problems.append(f"unknown weight {name}")
            continue
        target = name_map.resolve(name)
        try:
            shape_t = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            problems.append(f"{name}: shape {shape!r} is not a list of ints")
            continue
        if shape_t != tuple(target.shape):
            problems.append(f"{name}: shape {list(shape_t)} != model {list(target.shape)}")
            continue
        try:
            dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
        except BadRequest as e:
            problems.append(f"{name}: {e}")
            continue
        if dt != target.dtype and not allow_cast:
            problems.append(f"{name}: dtype {dtype_name(dt)} != model {dtype_name(target.dtype)} (send it as "
                            f"{dtype_name(target.dtype)})")
            continue
        plan.append(PlannedCopy(name, target, None))
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise BadRequest(f"weight update rejected, nothing changed: {'; '.join(problems[:3])}{more}")
    return plan


def apply_plan(plan: list[PlannedCopy]) -> None:
    """Copy every planned source into its target. Call with the engine's model lock held. Returns once
    the copies are complete: the sources may be shared buffers the sender refills after the reply."""
    with torch.no_grad():
        for p in plan:
            p.target.copy_(p.source)
    from slime.accelerator import get_accelerator

    get_accelerator().synchronize()  # device copies are asynchronous; a no-op on a synchronized device


def safetensors_files(model_path: str) -> list[str]:
    if not isinstance(model_path, str) or not os.path.isdir(model_path):
        raise BadRequest(f"model_path {model_path!r} is not a directory; pass an HF checkpoint directory")
    files = sorted(os.path.join(model_path, f) for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise BadRequest(f"no *.safetensors files in {model_path}; save the checkpoint with safe_serialization=True")
    return files


def plan_disk_update(name_map: WeightNameMap, model_path: str, fp8: "Fp8Layout | None" = None) -> list[PlannedCopy]:
    """Plan loading a full safetensors checkpoint: names/shapes checked from headers before reading data;
    dtypes are cast (as loading does). Every checkpoint weight of the model must be present. Block-FP8 weights
    (e4m3 + weight_scale_inv, fp8_checkpoint.py) are dequantized in `fp8`'s blocks (default: the layout
    model_path's config.json states, else 128 x 128)."""
    from safetensors import safe_open

    from slime.backends.embedded.fp8_checkpoint import Fp8Layout, dequantized, fold_scales, layout_of_dir
    from slime.backends.embedded.fp8_receipts import mark_received

    specs, where = [], {}
    for path in safetensors_files(model_path):
        _check_file(path)
        with _reading(path):
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    specs.append((key, sl.get_shape(), _safetensors_dtype(sl.get_dtype())))
                    where[key] = path
    fp8 = fp8 or layout_of_dir(model_path) or Fp8Layout()
    specs, scales = fold_scales(specs, fp8, f"weight update rejected, nothing changed: {model_path}")
    plan = plan_update(name_map, specs, allow_cast=True)
    missing = sorted(set(name_map.checkpoint_names()) - set(where))
    if missing:
        raise BadRequest(f"checkpoint {model_path} lacks {len(missing)} weights of this model (e.g. {missing[:3]}); "
                         "nothing changed")
    by_file: dict[str, list[PlannedCopy]] = {}
    for p in plan:
        by_file.setdefault(where[p.name], []).append(p)
    for path, items in by_file.items():
        with _reading(path):
            with safe_open(path, framework="pt", device="cpu") as f:
                for p in items:
                    p.source = f.get_tensor(p.name)
    by_scale_file: dict[str, list[PlannedCopy]] = {}  # a scale may sit in another shard than its weight
    for p in plan:
        if p.name in scales:
            by_scale_file.setdefault(where[scales[p.name]], []).append(p)
    for path, items in by_scale_file.items():
        with _reading(path):
            with safe_open(path, framework="pt", device="cpu") as f:
                pairs = {p.name: (scales[p.name], p.source, f.get_tensor(scales[p.name])) for p in items}
        mark_received(items, pairs)
        for p in items:
            p.source = dequantized(p.source, pairs[p.name][2], fp8, p.name)
    return plan


def _check_file(path: str) -> None:
    """A shard's header and byte ranges against its size (the preflight check of --hf-checkpoint), before
    any tensor is read: a truncated or foreign file is a 400 naming it, not safetensors' error as a 500."""
    from slime.utils import safetensors_header

    try:
        safetensors_header.check(path, flag="model_path")
    except safetensors_header.SafetensorsHeaderError as e:
        raise BadRequest(f"weight update rejected, nothing changed: {e}") from e
    except OSError as e:
        raise BadRequest(f"weight update rejected, nothing changed: model_path shard {path} cannot be read "
                         f"({e.strerror}); check the file") from e


@contextlib.contextmanager
def _reading(path: str):
    """Errors while reading a shard (it changed after the check, or safetensors refuses it) are the request's."""
    try:
        yield
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
        raise BadRequest(f"weight update rejected, nothing changed: model_path shard {path} is unreadable "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); re-export it") from e


def _safetensors_dtype(code: str) -> torch.dtype:
    if code not in STORED_DTYPES:
        raise BadRequest(f"safetensors dtype {code} is not supported")
    return STORED_DTYPES[code]
