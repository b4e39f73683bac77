"""Block-FP8 HF checkpoint -> the same checkpoint in bfloat16, with upstream slime's command line:

    python tools/fp8_cast_bf16.py --input-fp8-hf-path /root/DeepSeek-V3 --output-bf16-hf-path /root/DeepSeek-V3-bf16

Every float8 weight with its `<name>_scale_inv` grid (config.json's quantization_config: e4m3, weight_block_size)
is dequantized block by block (slime.utils.fp8_blocks.dequantize, in float32, then rounded once to bfloat16) and
its scale grid dropped; every other tensor is copied as stored. Shards keep their file names; the index maps the
remaining tensors; config.json loses its quantization_config (the output is not FP8), and the tokenizer, chat
template and remote-code files are copied. Runs on the host's CPU, one shard in memory at a time (plus the shard
that holds a scale grid stored apart from its weight).

The weights are paired with their scales from the shards' headers, before anything is written, by the pairing
slime's HF reader and the embedded engine use (slime/utils/fp8_pairs.py): a checkpoint they would refuse (a
float8 weight without its scale, a scale without its float8 weight, a scale grid that does not fit, an e5m2
weight, a float8 weight in a module quantization_config.modules_to_not_convert names) is refused in one line,
exit 2, as are a tensor stored in two shards and an output directory that is the input. Upstream's script
instead warned about a float8 weight without its scale and copied it as float8, and dropped an orphan scale
from the shards but not from the index.
"""

import argparse
import glob
import json
import os
import shutil
import sys

# The checkout this script lives in, whatever the working directory (upstream runs it from the repo root).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from slime.utils import safetensors_header  # noqa: E402
from slime.utils.fp8_blocks import Fp8FormatError, dequantize  # noqa: E402
from slime.utils.fp8_pairs import Fp8Layout, pair_scales, stored_specs  # noqa: E402

COPIED = ("tokenizer*", "chat_template*", "*.py", "*.jinja", "generation_config.json", "special_tokens_map.json")


class CastError(ValueError):
    """An input this tool refuses; the message is one line naming the problem and the fix."""


def _shards(src: str) -> list[str]:
    """The checkpoint's shard files: those its index names, else every *.safetensors."""
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [fn for fn in files if not os.path.isfile(os.path.join(src, fn))]
        if missing:
            raise CastError(f"{src}: model.safetensors.index.json names missing shards {missing[:3]}; copy them "
                            "or fix the index")
        return files
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(src, "*.safetensors")))


def _plan(src: str, config: dict) -> tuple[dict[str, str], dict[str, str], tuple[int, int]]:
    """({tensor: its shard}, {float8 weight: its scale}, block) from the shards' headers; CastError when the
    checkpoint's block-FP8 weights are malformed (slime.utils.fp8_pairs)."""
    file_of, specs = {}, []
    for file_name in _shards(src):
        try:  # a truncated or foreign shard is one line, not safetensors' error
            safetensors_header.check(os.path.join(src, file_name), flag="--input-fp8-hf-path")
        except safetensors_header.SafetensorsHeaderError as e:
            raise CastError(str(e)) from e
        for spec in stored_specs(os.path.join(src, file_name)):
            if spec[0] in file_of:  # which copy the reader would take is undefined; the index names one shard
                raise CastError(f"{src}: {spec[0]} is stored in both {file_of[spec[0]]} and {file_name}; keep it in "
                                "one shard")
            file_of[spec[0]] = file_name
            specs.append(spec)
    if not specs:
        raise CastError(f"no *.safetensors in {src}; point --input-fp8-hf-path at an HF checkpoint")
    try:
        layout = Fp8Layout.from_config(config) or Fp8Layout()
        return file_of, pair_scales(specs, layout), layout.fmt.block
    except Fp8FormatError as e:
        raise CastError(f"{src}: {e}") from e


def _read_tensor(src: str, file_name: str, name: str) -> torch.Tensor:
    with safe_open(os.path.join(src, file_name), "pt") as f:
        return f.get_tensor(name)


def _cast_shard(src: str, file_name: str, file_of: dict[str, str], pairs: dict[str, str],
                block: tuple[int, int]) -> dict:
    tensors = load_file(os.path.join(src, file_name))
    scales = set(pairs.values())
    out = {}
    for name, tensor in tensors.items():
        if name in scales:
            continue  # folded into its weight
        if name in pairs:
            scale = pairs[name]
            scale_inv = tensors[scale] if scale in tensors else _read_tensor(src, file_of[scale], scale)
            tensor = dequantize(tensor, scale_inv, block, dtype=torch.bfloat16, name=name)
        out[name] = tensor
    return out


def cast_checkpoint(src: str, dst: str) -> int:
    """Write the bfloat16 checkpoint; returns how many weights were dequantized. CastError, with nothing
    written, for a checkpoint whose block-FP8 weights the HF reader and the embedded engine refuse."""
    if os.path.realpath(src) == os.path.realpath(dst):  # each shard would be overwritten while others need it
        raise CastError(f"--output-bf16-hf-path {dst} is the input checkpoint; give a new directory")
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    file_of, pairs, block = _plan(src, config)
    os.makedirs(dst, exist_ok=True)
    kept = {}
    for file_name in sorted(set(file_of.values())):
        tensors = _cast_shard(src, file_name, file_of, pairs, block)
        if tensors:  # a shard of scale grids only has nothing left
            save_file(tensors, os.path.join(dst, file_name), metadata={"format": "pt"})
        kept.update(dict.fromkeys(tensors, file_name))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(kept.items()))}, f, indent=2)
    config.pop("quantization_config", None)
    (config.get("text_config") or {}).pop("quantization_config", None)  # text_config may be null
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for pattern in COPIED:
        for path in glob.glob(os.path.join(src, pattern)):
            if os.path.isfile(path):
                shutil.copy(path, dst)
    return len(pairs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-fp8-hf-path", required=True)
    ap.add_argument("--output-bf16-hf-path", required=True)
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.input_fp8_hf_path, "config.json")):
        print(f"fp8_cast_bf16: no config.json in {a.input_fp8_hf_path}; point --input-fp8-hf-path at an HF "
              "checkpoint", file=sys.stderr)
        return 2
    try:
        cast = cast_checkpoint(a.input_fp8_hf_path, a.output_bf16_hf_path)
    except CastError as e:
        print(f"fp8_cast_bf16: {e}", file=sys.stderr)
        return 2
    print(f"fp8_cast_bf16: {cast} weights dequantized to bfloat16 in {a.output_bf16_hf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
