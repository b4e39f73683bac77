"""Reading HF safetensors checkpoints: single file, sharded with an index, or a directory of shards;
transformers 5.x fused expert tensors are exposed under the per-expert names; block-FP8 weights (e4m3 with a
`weight_scale_inv` per [128, 128] block, slime/utils/fp8_blocks.py) are read dequantized to float32 under their
own names, their scales hidden, after the pairs are checked as the embedded engine checks them
(slime/utils/fp8_pairs.py)."""

from __future__ import annotations

import glob
import json
import os
import re

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# transformers 5.x fused experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
_FUSED = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class HFCheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names every offending file or tensor."""


def name_list(names, limit: int = 12) -> str:
    names = sorted(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class HFCheckpoint:
    def __init__(self, hf_dir: str) -> None:
        self.dir = hf_dir
        if not os.path.isdir(hf_dir):
            raise HFCheckpointError(f"HF checkpoint directory {hf_dir!r} does not exist")
        config_path = os.path.join(hf_dir, "config.json")
        if not os.path.isfile(config_path):
            raise HFCheckpointError(f"{hf_dir}: missing config.json (not an HF model directory)")
        with open(config_path) as f:
            self.config = json.load(f)
        self._file_of = self._index()
        self._handles: dict[str, object] = {}
        self._virtual: dict[str, tuple[str, int, str]] = {}  # per-expert name -> (fused name, expert, part)
        self._fp8, self._fp8_block = self._fp8_weights()  # FP8 weight name -> its scale's name; block size
        for name in list(self._file_of):
            m = _FUSED.match(name)
            if m:
                self._add_fused(name, m["prefix"], m["kind"])

    def _index(self) -> dict[str, str]:
        index_path = os.path.join(self.dir, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map") or {}
            files = sorted(set(weight_map.values()))
            missing = [fn for fn in files if not os.path.isfile(os.path.join(self.dir, fn))]
            if missing:
                raise HFCheckpointError(f"{self.dir}: {INDEX_FILE} lists missing shard files: {name_list(missing)}")
            return dict(weight_map)
        files = [SINGLE_FILE] if os.path.isfile(os.path.join(self.dir, SINGLE_FILE)) else sorted(
            os.path.basename(p) for p in glob.glob(os.path.join(self.dir, "*.safetensors")))
        if not files:
            other = [os.path.basename(p) for p in glob.glob(os.path.join(self.dir, "*.bin"))]
            hint = " (found .bin files: convert them to safetensors)" if other else ""
            raise HFCheckpointError(f"{self.dir}: no safetensors weights ({SINGLE_FILE}, {INDEX_FILE} or *.safetensors){hint}")
        from safetensors import safe_open

        file_of = {}
        for fn in files:
            with safe_open(os.path.join(self.dir, fn), "pt") as f:
                for key in f.keys():
                    file_of[key] = fn
        return file_of

    def _fp8_weights(self) -> tuple[dict[str, str], tuple[int, int]]:
        """{e4m3 weight: its weight_scale_inv} and the block size (config.json quantization_config, else 128 x 128),
        paired and checked from the headers as the embedded engine pairs them (slime.utils.fp8_pairs)."""
        from slime.utils.fp8_blocks import Fp8FormatError
        from slime.utils.fp8_pairs import STORED_DTYPES, Fp8Layout, pair_scales

        try:
            layout = Fp8Layout.from_config(self.config) or Fp8Layout()
            specs = [(n, self._shape(n), STORED_DTYPES.get(self._stored_dtype(n), torch.uint8)) for n in self._file_of]
            return pair_scales(specs, layout), layout.fmt.block
        except Fp8FormatError as e:
            raise HFCheckpointError(f"{self.dir}: {e}") from e

    def _stored_dtype(self, name: str) -> str:
        return self._handle(self._file_of[name]).get_slice(name).get_dtype()

    def _dequantized(self, name: str, index: int | None = None) -> torch.Tensor:
        """An FP8 weight (or one expert of a fused one) dequantized to float32 with its block scales."""
        from slime.utils.fp8_blocks import Fp8FormatError, dequantize

        w, s = (self._handle(self._file_of[n]).get_slice(n) for n in (name, self._fp8[name]))
        w, s = (w[index], s[index]) if index is not None else (w[:], s[:])
        try:
            return dequantize(w, s, self._fp8_block, name=name)
        except Fp8FormatError as e:
            raise HFCheckpointError(f"{self.dir}: {e}") from e

    def fp8_weights(self) -> dict[str, tuple[int, int]]:
        """{name as the loader sees it: block size} of the weights stored in block FP8 (what an FP8 engine
        expects back in that format)."""
        out = {n: self._fp8_block for n in self._fp8}
        for virtual, (fused, _, _) in self._virtual.items():
            if fused in self._fp8:
                out[virtual] = self._fp8_block
        return {n: b for n, b in out.items() if n in self.names()}

    def _handle(self, fn: str):
        if fn not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[fn] = safe_open(os.path.join(self.dir, fn), "pt")
            except Exception as e:
                raise HFCheckpointError(f"{self.dir}/{fn}: cannot open safetensors file ({e})") from e
        return self._handles[fn]

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file_of[name]).get_slice(name).get_shape())

    def _add_fused(self, name: str, prefix: str, kind: str) -> None:
        shape = self._shape(name)
        if len(shape) != 3:
            raise HFCheckpointError(f"{self.dir}: fused expert tensor {name} must be 3-D [E, ., .], got {shape}")
        for e in range(shape[0]):
            if kind == "gate_up_proj":
                self._virtual[f"{prefix}.{e}.gate_proj.weight"] = (name, e, "gate")
                self._virtual[f"{prefix}.{e}.up_proj.weight"] = (name, e, "up")
            else:
                self._virtual[f"{prefix}.{e}.down_proj.weight"] = (name, e, "all")

    def fused_parts(self) -> dict[str, tuple[str, int, str]]:
        """{per-expert name: (fused tensor name, expert, "gate" | "up" | "all")} of the fused expert tensors."""
        return dict(self._virtual)

    def names(self) -> set[str]:
        """Tensor names as the loader sees them (fused experts replaced by per-expert names)."""
        fused = {v[0] for v in self._virtual.values()}
        return (set(self._file_of) - fused - set(self._fp8.values())) | set(self._virtual)

    def get(self, name: str) -> torch.Tensor:
        if name in self._virtual:
            fused, e, part = self._virtual[name]
            # FP8: the expert's whole [2I, H] with its own scale grid, then split (gate/up share none of it)
            w = self._dequantized(fused, e) if fused in self._fp8 else self._handle(self._file_of[fused]).get_slice(fused)[e]
            if part == "all":
                return w
            half = w.shape[0] // 2
            return w[:half] if part == "gate" else w[half:]
        if name not in self._file_of:
            raise HFCheckpointError(f"{self.dir}: tensor {name} not in the checkpoint")
        if name in self._fp8:
            return self._dequantized(name)
        return self._handle(self._file_of[name]).get_tensor(name)

    def tensor_dtype(self, name: str) -> torch.dtype | None:
        """The dtype `name` is stored in (from the safetensors header; fused experts: their tensor's). None for
        block-FP8 weights: they are read, trained and written dequantized."""
        stored = self._virtual[name][0] if name in self._virtual else name
        if stored not in self._file_of:
            return None
        return _SAFETENSORS_DTYPES.get(self._handle(self._file_of[stored]).get_slice(stored).get_dtype())

    def close(self) -> None:
        self._handles.clear()

    def dtype(self) -> torch.dtype | None:
        value = self.config.get("dtype") or self.config.get("torch_dtype")
        return getattr(torch, value, None) if isinstance(value, str) else None


def fp8_weights_of(hf_dir: str) -> dict[str, tuple[int, int]]:
    """{name: block size} of the weights `hf_dir` stores in block FP8: none (no shard opened) unless its
    config.json states fp8 quantization."""
    from slime.utils.fp8_blocks import Fp8BlockFormat

    with open(os.path.join(hf_dir, "config.json")) as f:
        if Fp8BlockFormat.from_config(json.load(f)) is None:
            return {}
    ckpt = HFCheckpoint(hf_dir)
    try:
        return ckpt.fp8_weights()
    finally:
        ckpt.close()
