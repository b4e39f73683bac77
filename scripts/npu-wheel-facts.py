#!/usr/bin/env python3
"""Read the published torch-npu wheels (never installed, never imported) and write the facts slime's Ascend
code relies on to tests/data/torch_npu_facts.json.

Per wheel: the schema of every op slime calls (torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml),
constraints from its docstring (torch_npu/_op_plugin_docs.py: ranks, layouts, dtypes, limits), whether a
meta (shape) registration exists and what it checks (torch_npu/op_plugin/meta/_meta_registrations.py), the
runtime API slime calls on torch.npu (torch_npu/npu/*.py), the IPC rebuild function, and the SoC names
(torch_npu/include/.../NpuVariables.h and the name table compiled into libtorch_npu.so). Also the PyPI list of
published cp311 x86_64 wheels with their upload dates (for the release table).

    python scripts/npu-wheel-facts.py                    # download into /tmp/torch_npu_wheels, write the JSON
    python scripts/npu-wheel-facts.py --wheels DIR       # wheels already downloaded there
    python scripts/npu-wheel-facts.py --check            # compare with the committed JSON, write nothing

The wheels are downloaded with `pip download --no-deps` (about 40 MB each). Nothing is installed.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import subprocess
import sys
import urllib.request
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "torch_npu_facts.json")
OLDEST_SUPPORTED = (2, 7, 1)  # pyproject.toml: torch-npu>=2.7.1
PINNED = "2.12.0"  # the simulator's schema reference; docker/Dockerfile.npu installs 2.12.0.post3 of the same release

# Kernels slime calls (slime/accelerator/ascend/ops.py) and the derivatives its MAPPINGS text names.
OPS = (
    "npu_rms_norm", "npu_rotary_mul", "npu_fusion_attention", "npu_swiglu", "npu_moe_gating_top_k",
    "npu_moe_token_permute", "npu_moe_token_unpermute", "npu_grouped_matmul", "npu_lightning_indexer",
    "npu_sparse_flash_attention",
)
DERIVATIVES = (
    "npu_rms_norm_backward", "npu_rotary_mul_backward", "npu_fusion_attention_grad", "npu_swiglu_backward",
    "npu_moe_gating_top_k_backward", "npu_moe_token_permute_grad", "npu_moe_token_permute_grad_v2",
    "npu_moe_token_unpermute_grad", "npu_lightning_indexer_grad", "npu_sparse_flash_attention_grad",
)
# torch.npu functions slime calls (slime/accelerator/device_module.py, ascend/accelerator.py).
RUNTIME_API = (
    "is_available", "device_count", "set_device", "current_device", "synchronize", "Stream", "Event",
    "current_stream", "stream", "memory_allocated", "max_memory_allocated", "memory_reserved", "mem_get_info",
    "reset_peak_memory_stats", "empty_cache", "manual_seed_all", "get_rng_state", "set_rng_state",
    "get_device_name", "is_bf16_supported",
)


# --- PyPI -----------------------------------------------------------------------------------------

def published_wheels() -> list[dict]:
    """Every torch-npu release with a cp311 x86_64 wheel, oldest upload first."""
    with urllib.request.urlopen("https://pypi.org/pypi/torch-npu/json", timeout=60) as r:
        data = json.load(r)
    rows = []
    for version, files in data["releases"].items():
        for f in files:
            if "-cp311-cp311-" in f["filename"] and "x86_64" in f["filename"] and not f.get("yanked"):
                rows.append({"version": version, "uploaded": f["upload_time"][:10], "file": f["filename"]})
                break
    return sorted(rows, key=lambda r: (r["uploaded"], version_key(r["version"])))


def version_key(v: str) -> tuple:
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?(?:\.post(\d+))?", v)
    base = tuple(int(x) for x in m.group(1, 2, 3))
    rc = int(m[4]) if m[4] else None
    return base + ((-1, rc) if rc is not None else (0, int(m[5] or 0)))


def supported(v: str) -> bool:
    return "rc" not in v and version_key(v)[:3] >= OLDEST_SUPPORTED


def download(versions: list[str], dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    for v in versions:
        if glob.glob(os.path.join(dest, f"torch_npu-{v}-cp311-*.whl")):
            continue
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", f"torch-npu=={v}", "--only-binary=:all:",
                        "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64", "--platform",
                        "manylinux2014_x86_64", "-d", dest, "-q"], check=True)


# --- schema ---------------------------------------------------------------------------------------

def split_top(s: str, sep: str = ",") -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_schema(line: str) -> dict:
    """'name(Tensor a, *, int b=1) -> (Tensor, Tensor)' -> args [{name, type, default, kwonly}], returns n."""
    m = re.match(r"^([\w.]+)\((.*)\)\s*->\s*(.+)$", line.strip())
    args, kwonly = [], False
    for a in split_top(m[2]):
        if a == "*":
            kwonly = True
            continue
        decl, _, default = a.partition("=")
        typ, name = decl.strip().rsplit(" ", 1)
        args.append({"name": name, "type": typ, "default": default.strip() if default else None, "kwonly": kwonly})
    ret = m[3].strip()
    n = len(split_top(ret[1:-1])) if ret.startswith("(") else 1
    return {"schema": line.strip(), "args": args, "returns": n}


def schemas(yaml_text: str) -> dict[str, dict]:
    found = {}
    for m in re.finditer(r"func:\s*(\w+)(\.\w+)?\((.*)$", yaml_text, re.M):
        name, overload = m[1], m[2] or ""
        if name in OPS + DERIVATIVES and not overload and name not in found:
            found[name] = (name + "(" + m[3]).strip()  # tests parse it with parse_schema
    return found


# --- docstrings -----------------------------------------------------------------------------------

def docstrings(src: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r'_add_torch_npu_docstr\(\s*"(\w+)"\s*,\s*"""(.*?)"""', src, re.S):
        if m[1] in OPS and m[1] not in out:
            out[m[1]] = m[2]
    return out


def _line(doc: str, pattern: str) -> str | None:
    for line in doc.splitlines():
        if re.search(pattern, line):
            return line.strip()
    return None


def _dtypes(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = re.findall(r"(?:torch\.)?(bfloat16|float16|float32|int32|int64|BFLOAT16|FP32|FP16|BF16)", text)
    norm = {"BFLOAT16": "bfloat16", "BF16": "bfloat16", "FP16": "float16", "FP32": "float32"}
    return sorted({norm.get(n, n) for n in names})


def doc_facts(op: str, doc: str) -> dict:
    """Constraints read from one op's docstring; None where the text does not say."""
    f: dict = {}
    if op == "npu_rotary_mul":
        line = _line(doc, r"^input[：:]")
        m = re.search(r"(\d)维", line or "")
        f["input_dims"] = [int(m[1])] if m else None
        m = re.search(r"layout支持:\s*([A-Z、]+)", doc)
        f["input_layouts"] = m[1].split("、") if m else None
        bsnd = re.findall(r"input为BSND:\s*([0-9A-Z、]+)", doc)
        f["r1_layouts_bsnd_half"] = bsnd[0].split("、") if len(bsnd) > 0 else None
        f["r1_layouts_bsnd_interleave"] = bsnd[1].split("、") if len(bsnd) > 1 else None
        f["d_max_exclusive"] = int(m[1]) if (m := re.search(r"D\s*<\s*(\d+)", doc)) else None
        f["interleave_bn_max_exclusive"] = int(m[1]) if (m := re.search(r"B\s*\*\s*N\s*<\s*(\d+)", doc)) else None
        f["dtypes"] = _dtypes(line)
    elif op == "npu_rms_norm":
        gamma = _line(doc, r"^gamma[：:]")
        f["gamma_dtype_equals_self"] = bool(gamma and re.search(r"数据类型需要和self保持一致|same.*dtype", gamma))
        f["dtypes"] = _dtypes(_line(doc, r"^self[：:]"))
        m = re.search(r"(\d)-(\d)维", _line(doc, r"^self[：:]") or "")
        f["self_dims"] = [int(m[1]), int(m[2])] if m else None
    elif op == "npu_moe_token_permute":
        f["tokens_dtypes"] = _dtypes(_line(doc, r"^tokens\(torch"))
        f["indices_dtypes"] = _dtypes(_line(doc, r"^indices\(torch"))
        f["sorted_indices_out_dtypes"] = _dtypes(_line(doc, r"^sorted_indices\(torch"))
        f["topk_max"] = int(m[1]) if (m := re.search(r"topK小于等于(\d+)", doc)) else None
    elif op == "npu_moe_token_unpermute":
        f["permuted_tokens_dtypes"] = _dtypes(_line(doc, r"^permuted_tokens\(torch"))
        f["sorted_indices_dtypes"] = _dtypes(_line(doc, r"^sorted_indices\(torch"))
        f["probs_dtypes"] = _dtypes(_line(doc, r"^probs\(torch"))
    elif op == "npu_grouped_matmul":
        counts = [int(x) for x in re.findall(r"最多支持(\d+)个group", doc)]
        f["group_type0_max_groups"] = min(counts) if counts else None
        enum = _line(doc, r"group_type支持的枚举值为")
        f["group_type_documented"] = sorted({int(x) for x in re.findall(r"(-?\d)代表", enum or "")}) or None
        f["group_list_tensor_dtypes"] = ["int64"] if re.search(r"group_list.*数据类型支持torch\.int64", doc) else None
    elif op in ("npu_lightning_indexer", "npu_sparse_flash_attention"):
        kname = "actual_seq_lengths_key" if op == "npu_lightning_indexer" else "actual_seq_lengths_kv"
        k = _line(doc, r"^" + kname)
        # The query's TND rule ("前缀和", prefix sums) is on the line after the parameter's own line.
        qi = doc.find("actual_seq_lengths_query")
        qblock = doc[qi: doc.find(kname, qi)] if qi >= 0 else ""
        f["query_lengths_tnd"] = "prefix_sums" if "前缀和" in qblock else None
        f["key_lengths"] = "prefix_sums" if k and "前缀和" in k else ("valid_token_counts" if k and "有效token数" in k else None)
        f["key_lengths_text"] = k
        f["query_dtypes"] = _dtypes(_line(doc, r"^query（Tensor）"))
        f["layouts_query"] = re.findall(r"[A-Z_]{3,7}", m[1]) if (m := re.search(r"layout_query（str）：(.*)", doc)) else None
    elif op == "npu_fusion_attention":
        f["actual_seq_qlen"] = "prefix_sums" if re.search(r"actual_seq_qlen.*累加和", doc) else None
        f["actual_seq_kvlen"] = "prefix_sums" if re.search(r"actual_seq_kvlen.*累加和", doc) else None
        f["tnd_max_sequences"] = int(m[1]) * 1024 if (m := re.search(r"varlen场景下长度最大支持(\d+)K", doc)) else None
        f["nq_max"] = int(m[1]) if (m := re.search(r"Nq取值范围1~(\d+)", doc)) else None
        f["d_max"] = int(m[1]) if (m := re.search(r"取值范围1~(\d+)\.", doc)) else None
    elif op == "npu_moe_gating_top_k":
        f["experts_max"] = int(m[1]) if (m := re.search(r"不大于`(\d+)`", doc)) else None
        f["bias_dtype_equals_x"] = bool(re.search(r"bias.*数据类型需要与`x`保持一致", doc))
        f["renorm_only_0"] = bool(re.search(r"renorm.*当前仅支持`0`", doc))
        f["x_dtypes"] = _dtypes(_line(doc, r"\*\*x\*\*"))
    elif op == "npu_swiglu":
        f["dtypes"] = _dtypes(_line(doc, r"“x”：Tensor"))
    return f


# --- meta registrations, runtime API, SoC names ---------------------------------------------------

def meta_facts(src: str) -> dict[str, dict]:
    out = {}
    for op in OPS:
        m = re.search(r'@impl\(m, "%s"\)\n(?:@impl\(m, "[\w.]+"\)\n)*def \w+\((.*?)\):\n(.*?)(?=\n@impl|\n\n\n)' % op, src, re.S)
        if not m:
            continue
        body = m[2]
        facts: dict = {"signature": " ".join(m[1].split())}
        if op == "npu_grouped_matmul":
            facts["group_type_allowed"] = sorted({int(x) for x in re.findall(r"group_type == (-?\d)", body)})
            facts["group_type2_output_is_groups_m_n"] = "group_type != 2" in body
        out[op] = facts
    return out


def runtime_facts(z: zipfile.ZipFile) -> dict:
    defined: set[str] = set()
    exported: set[str] = set()
    for name in z.namelist():
        if not re.match(r"torch_npu/npu/[\w]+\.py$", name):
            continue
        tree = ast.parse(z.read(name).decode("utf-8", "replace"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        defined.add(t.id)
                        if t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                            exported.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            elif isinstance(node, ast.ImportFrom):
                defined.update(a.asname or a.name for a in node.names)
    red = z.read("torch_npu/multiprocessing/reductions.py").decode() if "torch_npu/multiprocessing/reductions.py" in z.namelist() else ""
    return {
        "missing": [n for n in RUNTIME_API if n not in defined and n not in exported],
        "rebuild_npu_tensor": "def rebuild_npu_tensor" in red,
        "custom_ops_bound": sorted(set(re.findall(r"torch_npu\.(\w+) = torch\.ops\.npu\.\1",
                                                  z.read("torch_npu/utils/custom_ops.py").decode())) & set(OPS + DERIVATIVES))
        if "torch_npu/utils/custom_ops.py" in z.namelist() else [],
    }


def soc_names(z: zipfile.ZipFile) -> list[str]:
    names: set[str] = set()
    header = "torch_npu/include/torch_npu/csrc/core/npu/NpuVariables.h"
    if header in z.namelist():
        names.update(re.findall(r"\b(Ascend\w+)\s*[,=\n]", z.read(header).decode()))
    lib = z.read("torch_npu/lib/libtorch_npu.so")
    names.update(m.decode() for m in re.findall(rb"(?<=\x00)(Ascend(?:910|950|310)[A-Za-z0-9_]*)(?=\x00)", lib))
    return sorted(names)


def read_wheel(path: str) -> dict:
    z = zipfile.ZipFile(path)
    docs = docstrings(z.read("torch_npu/_op_plugin_docs.py").decode())
    meta_src = z.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode()
    return {
        "schemas": schemas(z.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()),
        "docs": {op: doc_facts(op, d) for op, d in docs.items()},
        "meta": meta_facts(meta_src),
        "runtime": runtime_facts(z),
        "socs": soc_names(z),
    }


# --- output ---------------------------------------------------------------------------------------

def by_value(per_version: dict[str, object]) -> list[dict]:
    """{version: value} -> [{"value": v, "versions": [...]}], one entry per distinct value."""
    groups: list[dict] = []
    for v, value in per_version.items():
        for g in groups:
            if g["value"] == value:
                g["versions"].append(v)
                break
        else:
            groups.append({"value": value, "versions": [v]})
    return groups


def build(wheel_dir: str, published: list[dict]) -> dict:
    read: dict[str, dict] = {}
    for row in published:
        if not supported(row["version"]):
            continue
        path = os.path.join(wheel_dir, row["file"])
        if not os.path.exists(path):
            raise SystemExit(f"missing {path}: run without --wheels to download it")
        print(f"reading {row['file']}", file=sys.stderr)
        read[row["version"]] = read_wheel(path)
    versions = sorted(read, key=version_key)
    ops = {}
    for op in OPS + DERIVATIVES:
        entry = {"schema": by_value({v: read[v]["schemas"].get(op) for v in versions})}
        if op in OPS:
            entry["doc"] = by_value({v: read[v]["docs"].get(op) for v in versions})
            entry["meta"] = by_value({v: read[v]["meta"].get(op) for v in versions})
        ops[op] = entry
    socs = {}
    for v in versions:
        for name in read[v]["socs"]:
            socs.setdefault(name, []).append(v)
    return {
        "source": "scripts/npu-wheel-facts.py: files read from the torch-npu cp311 x86_64 wheels on PyPI (not imported)",
        "wheels": versions,
        "pinned": PINNED,
        "newest": versions[-1],
        "published_cp311_x86_64": [{"version": r["version"], "uploaded": r["uploaded"]} for r in published],
        "ops": ops,
        "runtime": by_value({v: read[v]["runtime"] for v in versions}),
        "soc_names": socs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default="/tmp/torch_npu_wheels", help="where the wheels are (downloaded if absent)")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args()
    published = published_wheels()
    download([r["version"] for r in published if supported(r["version"])], args.wheels)
    facts = build(args.wheels, published)
    text = json.dumps(facts, indent=1, ensure_ascii=False, sort_keys=False) + "\n"
    if args.check:
        with open(args.out, encoding="utf-8") as f:
            same = f.read() == text
        print("facts unchanged" if same else f"facts differ from {args.out}: re-run scripts/npu-wheel-facts.py")
        return 0 if same else 1
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({len(facts['wheels'])} wheels, {len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
