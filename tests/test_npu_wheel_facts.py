"""slime's Ascend code and the torch_npu simulator held against the facts read from the published torch-npu
wheels (tests/data/torch_npu_facts.json, written by scripts/npu-wheel-facts.py; the wheels are read, never
installed). Not hardware: these checks say the calls match the schemas and docstrings, nothing about the
kernels' numerics on an NPU.

- every kernel call of ops.py's op groups (slime/accelerator/ascend/dense_ops.py, attention_ops.py, moe_ops.py)
  against the schema of the pinned and the newest wheel
  (argument names, order, keyword-only arguments, required arguments, how many results are used);
- the arguments each mapping hands its kernel on the inputs the model gives it (ranks, layouts, dtypes,
  limits, length conventions) against the docstrings;
- the simulator's signatures against the schemas;
- the release table and the SoC names against every published wheel.

SLIME_NPU_OPS_PY=<file> holds another copy of ops.py (e.g. an older revision) to the same call-site checks.
The re-extraction test (marker npu_wheels) runs only with SLIME_NPU_WHEELS=<dir of downloaded wheels>.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import os
import re
import sys

import pytest
import torch

npu_sim = pytest.importorskip("npu_sim")

from npu_sim.torch_npu._common import facts as npu_sim_facts  # noqa: E402
from slime.accelerator.ascend import support  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTS = npu_sim_facts()  # tests/data/torch_npu_facts.json, parsed once with the simulator
OPS_PY = os.environ.get("SLIME_NPU_OPS_PY") or os.path.join(REPO, "slime", "accelerator", "ascend", "ops.py")
# the modules whose functions call the kernels (ops.py imports the op implementations from them)
KERNEL_CALLERS = [OPS_PY] if os.environ.get("SLIME_NPU_OPS_PY") else [
    os.path.join(REPO, "slime", "accelerator", "ascend", f) for f in ("dense_ops.py", "attention_ops.py", "moe_ops.py")]
WHEELS = [FACTS["pinned"], FACTS["newest"]]


def _script():
    spec = importlib.util.spec_from_file_location("npu_wheel_facts", os.path.join(REPO, "scripts", "npu-wheel-facts.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()


def _of(entries: list[dict], version: str):
    return next((e["value"] for e in entries if version in e["versions"]), None)


def schema(op: str, wheel: str) -> dict | None:
    text = _of(FACTS["ops"][op]["schema"], wheel)
    return None if text is None else SCRIPT.parse_schema(text)


def doc(op: str, wheel: str) -> dict:
    return _of(FACTS["ops"][op]["doc"], wheel) or {}


def _ops_module():
    """OPS_PY imported under its own name (the installed slime.accelerator.ascend.ops stays as it is)."""
    name = "slime.accelerator.ascend._ops_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, OPS_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return sys.modules[name]


# --------------------------------------------------------------------------------- static: call sites

def _kernel_calls(tree: ast.AST) -> list[tuple[str, ast.Call, ast.AST | None]]:
    """(kernel, call, parent) for `_kernel("k")(...)` and `v(...)` after `v = _kernel("k")` in a function."""
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}

    def kernel_name(node) -> str | None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_kernel" \
                and node.args and isinstance(node.args[0], ast.Constant):
            return node.args[0].value
        return None

    found = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
        aliases = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = kernel_name(node.value)
                if name:
                    aliases[node.targets[0].id] = name
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            name = kernel_name(node.func) or (aliases.get(node.func.id) if isinstance(node.func, ast.Name) else None)
            if name:
                found.append((name, node, parents.get(node)))
    # `(kernel(a) if cond else kernel(b))[0]`: the subscript belongs to each branch's call
    out = []
    for name, call, parent in found:
        if isinstance(parent, ast.IfExp):
            parent = parents.get(parent)
        out.append((name, call, parent))
    return list({id(c): (n, c, p) for n, c, p in out}.values())


def _call_site_problems(source: str, wheel: str, label: str = "ops.py") -> list[str]:
    tree = ast.parse(source)
    problems = []
    calls = list(_kernel_calls(tree))
    assert calls, "no kernel calls found"
    for name, call, parent in calls:
        where = f"{label}:{call.lineno} {name}"
        s = schema(name, wheel)
        if s is None:
            problems.append(f"{where}: not in torch_npu {wheel}")
            continue
        positional = [a for a in s["args"] if not a["kwonly"]]
        names = {a["name"] for a in s["args"]}
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            problems.append(f"{where}: *args / **kwargs cannot be checked")
            continue
        if len(call.args) > len(positional):
            problems.append(f"{where}: {len(call.args)} positional arguments, the schema takes {len(positional)} "
                            f"before its keyword-only ones")
        given = {a["name"] for a in positional[: len(call.args)]} | {k.arg for k in call.keywords}
        for k in call.keywords:
            if k.arg not in names:
                problems.append(f"{where}: unknown keyword {k.arg!r} (schema: {s['schema'][:80]}...)")
            elif k.arg in {a["name"] for a in positional[: len(call.args)]}:
                problems.append(f"{where}: {k.arg!r} given positionally and by keyword")
        missing = [a["name"] for a in s["args"] if a["default"] is None and a["name"] not in given]
        if missing:
            problems.append(f"{where}: required argument(s) {missing} not passed")
        ret = s["schema"].rsplit("->", 1)[1].strip()
        if isinstance(parent, ast.Subscript):
            if s["returns"] == 1 and not ret.endswith("[]"):
                problems.append(f"{where}: result subscripted, but the op returns one Tensor ({ret})")
            elif isinstance(parent.slice, ast.Constant) and s["returns"] > 1 and parent.slice.value >= s["returns"]:
                problems.append(f"{where}: result [{parent.slice.value}] of {s['returns']}")
        if isinstance(parent, ast.Assign) and isinstance(parent.targets[0], ast.Tuple):
            if len(parent.targets[0].elts) != s["returns"]:
                problems.append(f"{where}: unpacked into {len(parent.targets[0].elts)}, the op returns {s['returns']}")
    # torch.ops.npu ops raise RuntimeError for an unknown keyword or argument type: a TypeError handler
    # around a kernel call never runs (the kernels are bound as torch.ops.npu.<op> in every wheel read).
    call_ids = {id(c) for _, c, _ in calls}
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            inner = {id(n) for stmt in node.body for n in ast.walk(stmt)}
            for h in node.handlers:
                caught = [e.id for e in ([h.type] if isinstance(h.type, ast.Name) else getattr(h.type, "elts", []))
                          if isinstance(e, ast.Name)]
                if "TypeError" in caught and inner & call_ids:
                    problems.append(f"{label}:{h.lineno}: except TypeError around a kernel call; torch.ops raise "
                                    f"RuntimeError for a schema mismatch")
    return problems


@pytest.mark.parametrize("wheel", WHEELS)
def test_every_kernel_call_matches_the_wheel_schema(wheel):
    problems = []
    for path in KERNEL_CALLERS:
        with open(path, encoding="utf-8") as f:
            problems += _call_site_problems(f.read(), wheel, os.path.basename(path))
    assert not problems, "\n".join(problems)


def test_kernels_are_bound_through_torch_ops_in_every_wheel():
    """Why RuntimeError: each kernel slime calls is torch.ops.npu.<op> (custom_ops.py or the codegen yaml)."""
    for entry in FACTS["runtime"]:
        for op in ("npu_rms_norm", "npu_rotary_mul", "npu_moe_token_permute", "npu_grouped_matmul"):
            assert op in entry["value"]["custom_ops_bound"], (op, entry["versions"])


def test_mapping_kernels_and_named_derivatives_exist_from_their_release():
    """Every kernel of a mapping and every derivative its `backward` text names is in each wheel read that
    counts as at least the mapping's `since` (a name followed by "from R" from release R)."""
    ops = _ops_module()
    problems = []
    for wheel in FACTS["wheels"]:
        release = support.release_key(support.release_of(wheel))
        for m in ops.MAPPINGS.values():
            if release < support.release_key(m.since):
                continue
            needed = [(k, m.since) for k in m.kernels]
            needed += [(n, since or m.since) for n, since in re.findall(r"(npu_\w+)(?: from (\d+\.\d+\.\d+))?", m.backward)]
            for name, since in needed:
                if release >= support.release_key(since) and schema(name, wheel) is None:
                    problems.append(f"{m.op}: {name} named (since {since}) but absent from torch_npu {wheel} "
                                    f"(Ascend PyTorch {support.release_of(wheel)})")
    assert not problems, "\n".join(problems[:12])


# --------------------------------------------------------------------------------- the simulator's signatures

def _default(text):
    if text is None:
        return inspect.Parameter.empty
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


@pytest.mark.parametrize("wheel", WHEELS)
def test_simulator_signatures_match_the_schemas(wheel):
    """Pinned wheel: the simulator's parameters are the schema's (names, order, keyword-only, defaults).
    Newest: every simulated parameter is there with the same kind, and the ones it adds have defaults."""
    from npu_sim.torch_npu import _OPS

    for op in SCRIPT.OPS:
        sig = inspect.signature(_OPS[op])
        sim = [(p.name, p.kind == p.KEYWORD_ONLY, p.default) for p in sig.parameters.values()]
        real = [(a["name"], a["kwonly"], _default(a["default"])) for a in schema(op, wheel)["args"]]
        if wheel == FACTS["pinned"]:
            assert sim == real, op
        else:
            real_by_name = {n: (kw, d) for n, kw, d in real}
            for name, kw, _ in sim:
                assert real_by_name.get(name, (None,))[0] == kw, (op, name)
            extra = [(n, d) for n, kw, d in real if n not in {s[0] for s in sim}]
            assert all(d is not inspect.Parameter.empty for _, d in extra), (op, extra)


def test_simulator_raises_runtime_error_like_torch_ops():
    with npu_sim.activate():
        import torch_npu

        x = torch.randn(1, 4, 2, 8)
        r = torch.ones(1, 4, 1, 8)
        with pytest.raises(RuntimeError, match="unknown keyword"):
            torch_npu.npu_rotary_mul(x, r, r, mode="interleave")
        with pytest.raises(RuntimeError, match="positional"):
            torch_npu.npu_moe_gating_top_k(torch.randn(2, 8), 2, None)  # bias is keyword-only
        with pytest.raises(RuntimeError, match="4-D"):
            torch_npu.npu_rotary_mul(x[0], r[0], r[0])


# --------------------------------------------------------------------------------- dynamic: what reaches the kernels

@contextlib.contextmanager
def _recording():
    """Record the arguments of every simulated kernel call: {kernel: [(args, kwargs)]}."""
    import torch_npu

    seen: dict[str, list] = {}
    saved = {}
    for name in SCRIPT.OPS:
        fn = getattr(torch_npu, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def rec(*a, _fn=fn, _name=name, **k):
            seen.setdefault(_name, []).append((a, k))
            return _fn(*a, **k)

        setattr(torch_npu, name, rec)
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch_npu, name, fn)


_DT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int32": torch.int32,
       "int64": torch.int64}


def _dtypes(names):
    return {_DT[n] for n in names}


def _model_calls(ops, g) -> list:
    """The mappings on inputs of the shapes and dtypes the model hands them (GLM-5: bf16 activations,
    float32 norm weights and router, int32 expert ids, several packed sequences), one callable each."""
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype)

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    ops._SFA_OK[0] = True  # as resolve() sets it once the kernel exists and its probe passed
    idx = torch.randint(0, 4, (8, 2), generator=g, dtype=torch.int32)
    k = rnd(8, 1, 576)
    topk = torch.tensor([[0, -1], [0, 1], [1, 2], [0, -1], [0, 1], [1, 2], [0, 3], [2, 4]], dtype=torch.int32)

    def permute_unpermute():
        permuted, sort_map = ops.moe_permute(rnd(8, 16), idx)
        ops.moe_unpermute(permuted, sort_map, rnd(8, 2, dtype=torch.float32))

    return [
        lambda: ops.rms_norm(rnd(8, 64), rnd(64, dtype=torch.float32)),  # bf16 activations, float32 weight
        lambda: ops.rms_norm(rnd(8, 64), rnd(64)),
        lambda: ops.apply_rotary(rnd(8, 4, 64), rnd(8, 32), rnd(8, 32), 64, False),
        lambda: ops.apply_rotary(rnd(8, 4, 64), rnd(8, 32), rnd(8, 32), 64, True),
        permute_unpermute,
        lambda: ops.moe_unpermute(rnd(16, 16), torch.randperm(16, generator=g).int(), rnd(8, 2, dtype=torch.float32)),
        lambda: ops.moe_permute(rnd(8, 16, dtype=torch.float32), idx),  # float32 tokens
        lambda: ops.grouped_matmul(rnd(8, 16), rnd(4, 16, 8), torch.tensor([2, 0, 5, 1])),
        lambda: ops.grouped_matmul(rnd(8, 4), rnd(1100, 4, 2), torch.tensor([8] + [0] * 1099)),  # > 1024 experts
        lambda: ops.lightning_indexer(rnd(8, 8, 128), rnd(8, 128), rnd(8, 8), cu, cu, 2),
        lambda: ops.sparse_attention(rnd(8, 2, 576), k, k[..., :512], topk, cu, cu),
        lambda: ops.attention(rnd(8, 2, 64), rnd(8, 2, 64), rnd(8, 2, 64), cu, cu),
    ]


def _argument_problems(seen: dict, wheel: str) -> list[str]:
    problems = []

    def arg(call, i, name, default=None):
        a, k = call
        return a[i] if len(a) > i else k.get(name, default)

    d = doc("npu_rms_norm", wheel)
    for call in seen.get("npu_rms_norm", []):
        x, gamma = arg(call, 0, "self"), arg(call, 1, "gamma")
        if d.get("gamma_dtype_equals_self") and gamma.dtype != x.dtype:
            problems.append(f"npu_rms_norm: gamma {gamma.dtype} with self {x.dtype} (docstring: gamma's dtype = self's)")
    d = doc("npu_rotary_mul", wheel)
    for call in seen.get("npu_rotary_mul", []):
        x, r1, mode = arg(call, 0, "self"), arg(call, 1, "r1"), arg(call, 3, "rotary_mode", "half")
        if x.dim() not in d["input_dims"]:
            problems.append(f"npu_rotary_mul ({mode}): {x.dim()}-D input, documented {d['input_dims']}-D")
            continue
        layouts = d["r1_layouts_bsnd_half" if mode == "half" else "r1_layouts_bsnd_interleave"]
        ok = any(all((r == 1) if p == "1" else (r == s) for p, s, r in zip(lay, x.shape, r1.shape)) for lay in layouts)
        if not ok:
            problems.append(f"npu_rotary_mul ({mode}): r1 {tuple(r1.shape)} for BSND input {tuple(x.shape)}: "
                            f"documented {layouts}")
    d = doc("npu_moe_token_permute", wheel)
    for call in seen.get("npu_moe_token_permute", []):
        tokens, indices = arg(call, 0, "tokens"), arg(call, 1, "indices")
        if tokens.dtype not in _dtypes(d["tokens_dtypes"]) or indices.dtype not in _dtypes(d["indices_dtypes"]):
            problems.append(f"npu_moe_token_permute: tokens {tokens.dtype}, indices {indices.dtype}; documented "
                            f"{d['tokens_dtypes']} / {d['indices_dtypes']}")
    d = doc("npu_moe_token_unpermute", wheel)
    for call in seen.get("npu_moe_token_unpermute", []):
        p, si, probs = arg(call, 0, "permuted_tokens"), arg(call, 1, "sorted_indices"), arg(call, 2, "probs")
        if p.dtype not in _dtypes(d["permuted_tokens_dtypes"]) or si.dtype not in _dtypes(d["sorted_indices_dtypes"]) \
                or (probs is not None and probs.dtype not in _dtypes(d["probs_dtypes"])):
            problems.append(f"npu_moe_token_unpermute: permuted {p.dtype}, sorted_indices {si.dtype}, probs "
                            f"{None if probs is None else probs.dtype}; documented {d}")
    d = doc("npu_grouped_matmul", wheel)
    for call in seen.get("npu_grouped_matmul", []):
        w, gt = arg(call, 1, "weight"), call[1].get("group_type")
        if gt == 0 and w[0].shape[0] > d["group_type0_max_groups"]:
            problems.append(f"npu_grouped_matmul: {w[0].shape[0]} groups, documented <= {d['group_type0_max_groups']}")
    for op, key in (("npu_lightning_indexer", "actual_seq_lengths_key"), ("npu_sparse_flash_attention", "actual_seq_lengths_kv")):
        d = doc(op, wheel)
        for a, k in seen.get(op, []):
            lengths, total = k[key], (a[1].shape[0])
            if d["key_lengths"] == "valid_token_counts" and int(lengths.sum()) != total and len(lengths) > 1:
                problems.append(f"{op}: {key}={lengths.tolist()} for {total} keys; documented as each batch's "
                                f"valid token count (sum = {total})")
    return problems


def test_what_reaches_the_kernels_follows_the_docstrings():
    """Not how the simulator reacts: the recorded arguments themselves, held against the docstrings of the
    pinned and the newest wheel (with the simulator's own checks off where the code under test is old)."""
    ops = _ops_module()
    with npu_sim.activate():
        with _recording() as seen:
            for call in _model_calls(ops, torch.Generator().manual_seed(0)):
                try:
                    call()
                except RuntimeError as e:  # the simulator refused a call: reported with the recorded ones
                    seen.setdefault("_refused", []).append(str(e).splitlines()[0])
    for wheel in WHEELS:
        problems = _argument_problems(seen, wheel) + seen.get("_refused", [])
        assert not problems, f"torch_npu {wheel}:\n" + "\n".join(problems)
    for kernel in ("npu_rms_norm", "npu_rotary_mul", "npu_moe_token_permute", "npu_moe_token_unpermute",
                   "npu_grouped_matmul", "npu_lightning_indexer", "npu_sparse_flash_attention"):
        assert kernel in seen, f"{kernel} never reached: the check above saw nothing"
    modes = {c[1].get("rotary_mode", "half") for c in seen["npu_rotary_mul"]}
    assert modes == {"half", "interleave"}


# --------------------------------------------------------------------------------- releases and SoCs

def _derived_releases() -> dict[str, str | None]:
    """Each published wheel's release, again from the facts: a wheel the release notes list is that
    release; any other the newest release whose listed wheels were uploaded on or before it."""
    uploaded = {r["version"]: r["uploaded"] for r in FACTS["published_cp311_x86_64"]}
    listed = {w: r for r, (ws, _) in support.PTA_RELEASES.items() for w in ws.split(", ")}
    first = {r: min(uploaded[w] for w in ws.split(", ")) for r, (ws, _) in support.PTA_RELEASES.items()}
    out = {}
    for v, day in uploaded.items():
        earlier = [r for r, d in first.items() if d <= day]
        out[v] = listed.get(v) or (max(earlier, key=lambda r: (first[r], support.release_key(r))) if earlier else None)
    return out


def test_release_of_places_every_published_wheel():
    published = [r["version"] for r in FACTS["published_cp311_x86_64"]]
    assert len(published) >= 57 and {"2.9.1", "2.10.0", "2.10.0.post2", "2.14.0"} <= set(published)
    derived = _derived_releases()
    placed = {v: support.release_of(v) for v in published}
    assert all(placed.values()), [v for v, r in placed.items() if r is None]
    assert placed == derived
    assert placed["2.9.1"] == placed["2.10.0"] == placed["2.10.0.post2"] == "26.0.0"
    assert support.release_of("2.12.0.post9") == "26.1.0" and support.release_of("2.15.0") == "26.1.0"
    assert support.release_of("2.1.0.post3") is None and support.release_of("nightly") is None


def test_releases_hold_what_the_mappings_need():
    """Every wheel read that counts as release R has each kernel from its `since` on, the gating backward
    from 26.1.0 and a meta registration taking grouped matmul's group_type 2 from 26.0.0 (ops.py's switches)."""
    ops = _ops_module()
    for wheel in FACTS["wheels"]:
        rel = support.release_key(support.release_of(wheel))
        for m in ops.MAPPINGS.values():
            if rel >= support.release_key(m.since):
                assert all(schema(k, wheel) for k in m.kernels), (wheel, m.op)
        if rel >= support.release_key("26.1.0"):
            assert schema("npu_moe_gating_top_k_backward", wheel), wheel
        meta = _of(FACTS["ops"]["npu_grouped_matmul"]["meta"], wheel)
        assert (2 in meta["group_type_allowed"]) == (rel >= support.release_key("26.0.0")), wheel


def test_soc_of_maps_every_soc_name_of_every_wheel():
    names = FACTS["soc_names"]
    kinds = {}
    for name in names:
        if name.startswith("Ascend950") or name.startswith("Ascend910_95"):
            soc = support.soc_of(name)
            assert support.is_950(soc), name
            kinds[name] = soc
        elif name.startswith("Ascend910_93"):
            assert support.soc_of(name) == "A3", name
        elif name.startswith("Ascend910B"):
            assert support.soc_of(name) == "A2", name
    for name, soc in kinds.items():
        m = re.match(r"Ascend950(PR|DT)_(\w+)", name)
        if m:
            assert soc == "950" + m[1], name
        m = re.match(r"Ascend910_(95\w+)", name)
        if m:  # the same id in the later tables names the kind
            later = [n for n in names if re.match(rf"Ascend950(PR|DT)_{m[1]}$", n)]
            assert later and soc == support.soc_of(later[0]), (name, later)
    assert {"Ascend910_9589", "Ascend910_9599"} <= set(kinds) and set(kinds.values()) == {"950", "950PR", "950DT"}


# --------------------------------------------------------------------------------- re-extraction (optional)

@pytest.mark.npu_wheels
@pytest.mark.skipif(not os.environ.get("SLIME_NPU_WHEELS"), reason="set SLIME_NPU_WHEELS to a folder of torch-npu wheels")
def test_facts_match_a_fresh_extraction_from_the_wheels():
    fresh = SCRIPT.build(os.environ["SLIME_NPU_WHEELS"], SCRIPT.published_wheels())
    for key in ("wheels", "ops", "runtime", "soc_names"):
        assert fresh[key] == FACTS[key], key
    committed = {r["version"] for r in FACTS["published_cp311_x86_64"]}
    assert committed <= {r["version"] for r in fresh["published_cp311_x86_64"]}  # PyPI only adds wheels
