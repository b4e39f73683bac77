"""Block-FP8 HF checkpoint -> the same checkpoint in bfloat16, with upstream slime's command line:

    python tools/fp8_cast_bf16.py --input-fp8-hf-path /root/DeepSeek-V3 --output-bf16-hf-path /root/DeepSeek-V3-bf16

Every float8 weight with a `<name>_scale_inv` grid (config.json's quantization_config: e4m3, weight_block_size)
is dequantized block by block (slime.utils.fp8_blocks.dequantize, in float32, then rounded once to bfloat16) and
its scale grid dropped; every other tensor is copied as stored. Shards keep their file names; the index maps the
remaining tensors; config.json loses its quantization_config (the output is not FP8), and the tokenizer, chat
template and remote-code files are copied. Runs on the host's CPU, one shard in memory at a time (plus the shard
that holds a scale grid stored apart from its weight).
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

from slime.utils.fp8_blocks import SCALE_SUFFIX, Fp8BlockFormat, dequantize  # noqa: E402

COPIED = ("tokenizer*", "chat_template*", "*.py", "*.jinja", "generation_config.json", "special_tokens_map.json")


def _weight_map(src: str) -> dict[str, str]:
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return json.load(f)["weight_map"]
    shards = sorted(glob.glob(os.path.join(src, "*.safetensors")))
    out = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            out.update(dict.fromkeys(f.keys(), os.path.basename(shard)))
    return out


def _read_tensor(src: str, file_name: str, name: str) -> torch.Tensor:
    with safe_open(os.path.join(src, file_name), "pt") as f:
        return f.get_tensor(name)


def _cast_shard(src: str, file_name: str, weight_map: dict[str, str], block: tuple[int, int]) -> dict:
    tensors = load_file(os.path.join(src, file_name))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in weight_map:
            continue  # folded into its weight
        scale = name + SCALE_SUFFIX
        if tensor.element_size() == 1 and tensor.is_floating_point() and scale in weight_map:
            scale_inv = tensors[scale] if scale in tensors else _read_tensor(src, weight_map[scale], scale)
            tensor = dequantize(tensor, scale_inv, block, dtype=torch.bfloat16, name=name)
        elif tensor.element_size() == 1 and tensor.is_floating_point():
            print(f"warning: {name} is float8 without {scale}; copied as stored", file=sys.stderr)
        out[name] = tensor
    return out


def cast_checkpoint(src: str, dst: str) -> int:
    """Write the bfloat16 checkpoint; returns how many weights were dequantized."""
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    fmt = Fp8BlockFormat.from_config(config) or Fp8BlockFormat()
    weight_map = _weight_map(src)
    if not weight_map:
        raise SystemExit(f"fp8_cast_bf16: no *.safetensors in {src}; point --input-fp8-hf-path at an HF checkpoint")
    os.makedirs(dst, exist_ok=True)
    cast, kept = 0, {}
    for file_name in sorted(set(weight_map.values())):
        tensors = _cast_shard(src, file_name, weight_map, fmt.block)
        cast += sum(1 for n in tensors if n + SCALE_SUFFIX in weight_map)
        if tensors:  # a shard of scale grids only has nothing left
            save_file(tensors, os.path.join(dst, file_name), metadata={"format": "pt"})
        kept.update(dict.fromkeys(tensors, file_name))
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(kept.items()))}, f, indent=2)
    config.pop("quantization_config", None)
    config.get("text_config", {}).pop("quantization_config", None)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for pattern in COPIED:
        for path in glob.glob(os.path.join(src, pattern)):
            if os.path.isfile(path):
                shutil.copy(path, dst)
    return cast


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-fp8-hf-path", required=True)
    ap.add_argument("--output-bf16-hf-path", required=True)
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.input_fp8_hf_path, "config.json")):
        print(f"fp8_cast_bf16: no config.json in {a.input_fp8_hf_path}; point --input-fp8-hf-path at an HF "
              "checkpoint", file=sys.stderr)
        return 2
    cast = cast_checkpoint(a.input_fp8_hf_path, a.output_bf16_hf_path)
    print(f"fp8_cast_bf16: {cast} weights dequantized to bfloat16 in {a.output_bf16_hf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
