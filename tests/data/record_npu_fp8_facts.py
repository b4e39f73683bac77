"""Record tests/data/npu_fp8_facts.json: what the published torch-npu wheels say about npu_dynamic_block_quant (the
block quantization slime's block-FP8 weight sync maps to on an Ascend 950), read from the wheels
scripts/npu-wheel-facts.py downloads (never installed or imported), plus the CANN operator's documented limits.

    python tests/data/record_npu_fp8_facts.py [--wheels /tmp/torch_npu_wheels]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import zipfile

OP = "npu_dynamic_block_quant"
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "npu_fp8_facts.json")

# hicann/ops-nn quant/dynamic_block_quant/README.md (commit 1297f177, read 2026-12-06): the aclnn operator behind the
# torch_npu function. Not in the wheels; recorded as read.
OPS_NN = {
    "source": "github.com/hicann/ops-nn quant/dynamic_block_quant/README.md at 1297f177568ae0b2473eedd8bb3d8e4315bbc58d",
    "products": ["Ascend 950PR/Ascend 950DT", "Atlas A3", "Atlas A2"],
    "a2_a3": {"dst_types": ["int8"], "x_dims": [2], "round_mode": ["rint"]},
    "950": {"dst_types": ["int8", "hifloat8", "float8_e5m2", "float8_e4m3fn"], "x_dims": [2, 3],
            "x_dtypes": ["float16", "bfloat16", "float32"], "round_mode_fp8": ["rint"],
            "row_block_size": [1, 128, 256, 512], "col_block_size": [64, 128, 192, 256]},
    "scale": "scale = max(block amax / dst max, min_scale); y = cast(x / scale); a block of zeros with min_scale 0 "
             "gives scale 0 and y 0 (the corrected formula of the torch_npu doc issue; the int8 example's scale "
             "0.0063 for inputs in [0, 1) is amax / 127)",
    "callers": "vllm-ascend (SFA k_nope, A5) and MindSpeed's FP8 block recipes call it with "
               "dst_type=torch.float8_e4m3fn, row_block_size 1 or 128, col_block_size 128",
}


def _docstring(src: str) -> str | None:
    m = re.search(r'_add_torch_npu_docstr\(\s*"%s",\s*"""(.*?)"""' % OP, src, re.S)
    return m[1] if m else None


def read_wheel(path: str) -> dict:
    with zipfile.ZipFile(path) as z:
        yaml = z.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()
        docs = z.read("torch_npu/_op_plugin_docs.py").decode()
        meta = z.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode()
    schema = re.search(r"func: (%s\(.*?\) -> \([^)]*\))" % OP, yaml)
    doc = (_docstring(docs) or "").replace("\r\n", "\n")
    products = re.search(r"支持的型号[:：][ \t]*\n(.*?)\n[ \t]*\n", doc, re.S)
    return {
        "schema": schema[1] if schema else None,
        "doc_products": [p.strip() for p in products[1].splitlines() if p.strip()] if products else None,
        "doc_dst_type": (m[1].strip() if (m := re.search(r"dst_type \(int\)：(.*)", doc)) else None),
        "doc_x": (m[1].strip() if (m := re.search(r"^x \(Tensor\)：(.*)", doc, re.M)) else None),
        "meta_note": (m[1].strip() if (m := re.search(r"def %s_meta.*?\n\s*#(.*?)\n" % OP, meta, re.S)) else None),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheels", default="/tmp/torch_npu_wheels")
    args = ap.parse_args()
    per_version = {}
    for path in sorted(glob.glob(os.path.join(args.wheels, "torch_npu-*-cp311-*.whl"))):
        version = os.path.basename(path).split("-")[1]
        per_version[version] = read_wheel(path)
    facts = {"source": f"torch-npu cp311 x86_64 wheels in {args.wheels} (scripts/npu-wheel-facts.py), read not imported",
             "torch_npu": per_version, "ops_nn": OPS_NN}
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(facts, f, indent=1, ensure_ascii=False, sort_keys=True)
        f.write("\n")
    print(f"wrote {OUT} ({len(per_version)} wheels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
