"""The torch_npu simulator is strict (documented-contract violations raise) and its runtime / accelerator
stand-ins behave as documented. A simulation, not hardware: these tests guard the simulator itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

npu_sim = pytest.importorskip("npu_sim")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


@pytest.fixture
def npu():
    with npu_sim.activate():
        import torch_npu

        yield torch_npu


def qkv(t=6, n=2, d=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, n, d, generator=g) for _ in range(3)]


def test_fusion_attention_contract(npu):
    q, k, v = qkv()
    out = npu.npu_fusion_attention(q, k, v, 2, "TND", atten_mask=MASK, actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], sparse_mode=3)
    assert len(out) == 7 and out[0].shape == q.shape and out[1].dtype == torch.float32
    # scale defaults to 1.0, not D**-0.5
    unscaled = npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6])[0]
    probs = torch.softmax(torch.einsum("snd,tnd->nst", q.double(), k.double()), -1)
    torch.testing.assert_close(unscaled.double(), torch.einsum("nst,tnd->snd", probs, v.double()), rtol=1e-6, atol=1e-6)
    # zero-length sequences are allowed (repeated offsets)
    npu.npu_fusion_attention(q, k, v, 2, "TND", atten_mask=MASK, actual_seq_qlen=[2, 2, 6], actual_seq_kvlen=[2, 2, 6], sparse_mode=3)


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(actual_seq_qlen=torch.tensor([2, 6]), actual_seq_kvlen=[2, 6]), RuntimeError),  # int[]: host ints only
        (dict(actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 6]), RuntimeError),  # must end at T
        (dict(actual_seq_qlen=[4, 2, 6], actual_seq_kvlen=[4, 2, 6]), RuntimeError),  # not cumulative
        (dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], sparse_mode=3), RuntimeError),  # mask missing
        (dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], sparse_mode=3, atten_mask=~MASK), RuntimeError),
        (dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], head_num=4), RuntimeError),  # head_num != N
        (dict(actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6], input_layout="BSND"), RuntimeError),  # 3-D is not BSND
        (dict(), RuntimeError),  # TND needs the cumulative lengths
    ],
)
def test_fusion_attention_rejects(npu, kwargs, error):
    q, k, v = qkv()
    args = dict(head_num=2, input_layout="TND") | kwargs
    with pytest.raises(error):
        npu.npu_fusion_attention(q, k, v, args.pop("head_num"), args.pop("input_layout"), **args)


def test_fusion_attention_rejects_dv_larger_than_dk(npu):
    q, k, _ = qkv()
    with pytest.raises(RuntimeError, match="Dk >= Dv"):
        npu.npu_fusion_attention(q, k, torch.randn(6, 2, 16), 2, "TND", actual_seq_qlen=[6], actual_seq_kvlen=[6])


def test_rotary_mul_contract(npu):
    x = torch.randn(1, 5, 2, 8)  # BSND, r1/r2 1S1D
    ones, zeros = torch.ones(1, 5, 1, 8), torch.zeros(1, 5, 1, 8)
    with pytest.raises(RuntimeError, match="full width"):
        npu.npu_rotary_mul(x, ones[..., :4], zeros[..., :4])
    with pytest.raises(RuntimeError, match="dtype"):
        npu.npu_rotary_mul(x, ones.double(), zeros.double())
    torch.testing.assert_close(npu.npu_rotary_mul(x, ones, zeros), x)
    quarter = npu.npu_rotary_mul(x, zeros, ones, rotary_mode="interleave")
    torch.testing.assert_close(quarter[..., 0], -x[..., 1])  # GPT-J pairs (0, 1)
    half = npu.npu_rotary_mul(x, zeros, ones)
    torch.testing.assert_close(half[..., 0], -x[..., 4])  # NeoX pairs (0, 4)


def test_rotary_mul_refuses_what_the_docstring_leaves_out(npu):
    """Every wheel read documents 4-D input only, and for interleave r1/r2 only 11SD/1S1D/S11D."""
    x3 = torch.randn(5, 2, 8)
    for mode in ("half", "interleave"):
        with pytest.raises(RuntimeError, match="4-D"):
            npu.npu_rotary_mul(x3, torch.ones(5, 1, 8), torch.zeros(5, 1, 8), rotary_mode=mode)
    x = torch.randn(2, 5, 3, 8)
    bs1d = torch.ones(2, 5, 1, 8)
    npu.npu_rotary_mul(x, bs1d, bs1d)  # half takes BS1D
    with pytest.raises(RuntimeError, match="fits none of 11SD/1S1D/S11D"):
        npu.npu_rotary_mul(x, bs1d, bs1d, rotary_mode="interleave")
    with pytest.raises(RuntimeError, match="unknown keyword"):
        npu.npu_rotary_mul(x, bs1d, bs1d, mode="half")  # torch.ops: RuntimeError, not TypeError


def test_rotary_mode_missing_before_7_0():
    with npu_sim.activate(release="6.0.0"):
        import torch_npu

        x = torch.randn(1, 3, 1, 4)
        with pytest.raises(RuntimeError, match="rotary_mode"):
            torch_npu.npu_rotary_mul(x, torch.ones(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), rotary_mode="interleave")


def test_rms_norm_swiglu_contract(npu):
    x = torch.randn(4, 6)
    y, rstd = npu.npu_rms_norm(x, torch.ones(6))
    assert y.shape == x.shape and rstd.dtype == torch.float32
    for gamma_dtype in (torch.bfloat16, torch.float64):
        with pytest.raises(RuntimeError, match="gamma dtype"):
            npu.npu_rms_norm(x, torch.ones(6, dtype=gamma_dtype))
    with pytest.raises(RuntimeError, match="gamma dtype"):  # the docstring: gamma's dtype = self's
        npu.npu_rms_norm(x.bfloat16(), torch.ones(6))
    with pytest.raises(RuntimeError, match="contiguous"):
        npu.npu_swiglu(torch.randn(6, 4).t())
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(npu.npu_swiglu(x), torch.nn.functional.silu(a) * b)  # gate first


def test_grouped_matmul_contract(npu):
    x, w = torch.randn(5, 4), torch.randn(3, 4, 2)
    cumsum = torch.tensor([2, 2, 5])
    y = npu.npu_grouped_matmul([x], [w], group_list=cumsum, split_item=3, group_type=0, group_list_type=0)[0]
    torch.testing.assert_close(y[:2], x[:2] @ w[0])
    torch.testing.assert_close(y[2:], x[2:] @ w[2])
    counts = npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 0, 3]), split_item=3, group_type=0, group_list_type=1)[0]
    torch.testing.assert_close(counts, y)
    dw = npu.npu_grouped_matmul([x.t()], [y], group_list=cumsum, split_item=3, group_type=2, group_list_type=0)[0]
    assert dw.shape == (3, 4, 2) and torch.isnan(dw[1]).all(), "empty k-groups are undocumented: poisoned"
    for bad in (
        dict(x=x, weight=[w], group_list=cumsum, split_item=3, group_type=0),  # not a list
        dict(x=[x], weight=[w], group_list=cumsum, split_item=0, group_type=0),  # split_item
        dict(x=[x], weight=[w], group_list=[2, 2, 5], split_item=3, group_type=0),  # list group_list
        dict(x=[x], weight=[w], group_list=torch.tensor([5, 2, 2]), split_item=3, group_type=0),  # not cumulative
        dict(x=[x], weight=[w[:1]], group_list=torch.tensor([5]), split_item=3, group_type=0, group_list_type=1),
    ):
        with pytest.raises((RuntimeError, TypeError)):
            npu.npu_grouped_matmul(bad.pop("x"), bad.pop("weight"), **bad)
    xg = x.clone().requires_grad_(True)
    out = npu.npu_grouped_matmul([xg], [w], group_list=cumsum, split_item=3, group_type=0)[0]
    with pytest.raises(RuntimeError, match="derivative"):
        out.sum().backward()  # the kernel has no autograd: callers must wrap it


def test_gating_top_k_contract(npu):
    x = torch.zeros(2, 8)  # all tied: the documented stable sort picks the lowest ids
    y, idx, norm = npu.npu_moe_gating_top_k(x, 2, k_group=1, group_count=2, group_select_mode=1, norm_type=1, out_flag=True)
    assert idx.dtype == torch.int32 and idx.tolist() == [[0, 1], [0, 1]]
    torch.testing.assert_close(y, torch.full((2, 2), 0.5))  # renormalised sigmoid weights
    assert norm.shape == x.shape and norm.dtype == torch.float32
    with pytest.raises(RuntimeError, match="bias dtype"):
        npu.npu_moe_gating_top_k(x, 2, bias=torch.zeros(8, dtype=torch.float64), norm_type=1)
    with pytest.raises(RuntimeError, match="> 2"):
        npu.npu_moe_gating_top_k(x, 1, group_count=4, norm_type=1)
    with pytest.raises(RuntimeError, match="renorm"):
        npu.npu_moe_gating_top_k(x, 2, renorm=1, norm_type=1)


def test_gating_backward_only_from_26_1():
    x = torch.randn(3, 8, requires_grad=True)
    with npu_sim.activate(release="7.3.0"):
        import torch_npu

        assert not hasattr(torch_npu, "npu_moe_gating_top_k_backward")
        y = torch_npu.npu_moe_gating_top_k(x, 2, norm_type=1)[0]
        with pytest.raises(RuntimeError, match="derivative"):
            y.sum().backward()
    with npu_sim.activate():
        import torch_npu

        y = torch_npu.npu_moe_gating_top_k(x, 2, norm_type=1, out_flag=True)[0]
        (y * torch.arange(2.0)).sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0


def test_permute_contract(npu):
    """Docstrings of every wheel read: bfloat16 tokens / probs, int64 indices and sorted_indices in;
    sorted_indices out int32."""
    bf = torch.bfloat16
    tokens = torch.arange(3.0, dtype=bf).view(3, 1)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, torch.tensor([[1, 0], [0, 2], [1, 2]]))
    assert sorted_indices.dtype == torch.int32
    assert sorted_indices.tolist() == [2, 0, 1, 4, 3, 5]  # destination row of each (token, k) copy
    assert permuted[:, 0].tolist() == [0.0, 1.0, 0.0, 2.0, 1.0, 2.0]
    with pytest.raises(RuntimeError, match="tokens must be bfloat16"):
        npu.npu_moe_token_permute(tokens.float(), torch.tensor([[1, 0], [0, 2], [1, 2]]))
    with pytest.raises(RuntimeError, match="indices must be int64"):
        npu.npu_moe_token_permute(tokens, torch.tensor([[1, 0], [0, 2], [1, 2]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="probs must be bfloat16"):
        npu.npu_moe_token_unpermute(permuted, sorted_indices.long(), probs=torch.ones(3, 2))
    with pytest.raises(RuntimeError, match="sorted_indices must be int64"):
        npu.npu_moe_token_unpermute(permuted, sorted_indices, probs=torch.ones(3, 2, dtype=bf))
    out = npu.npu_moe_token_unpermute(permuted, sorted_indices.long(), probs=torch.full((3, 2), 0.5, dtype=bf))
    torch.testing.assert_close(out, tokens)
    # No tokens (an expert-parallel rank that received none): empty outputs of the right width.
    empty, empty_map = npu.npu_moe_token_permute(torch.zeros(0, 4, dtype=bf), torch.zeros(0, 2, dtype=torch.int64))
    assert empty.shape == (0, 4) and empty_map.shape == (0,)
    assert npu.npu_moe_token_unpermute(empty, empty_map.long(), probs=torch.zeros(0, 2, dtype=bf)).shape == (0, 4)
    assert npu.npu_moe_token_unpermute(empty, empty_map.long()).shape == (0, 4)


def test_dsa_kernel_contracts(npu):
    q = torch.randn(5, 4, 128, dtype=torch.bfloat16)
    k = torch.randn(5, 1, 128, dtype=torch.bfloat16)
    w = torch.randn(5, 4, dtype=torch.bfloat16)
    ends, counts = torch.tensor([2, 5], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)
    idx, _ = npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_query=ends, actual_seq_lengths_key=counts,
                                       layout_query="TND", layout_key="TND", sparse_count=3)
    assert idx.shape == (5, 1, 3) and idx[0, 0].tolist()[1:] == [-1, -1]  # first token sees only itself
    with pytest.raises(RuntimeError, match="128"):
        npu.npu_lightning_indexer(q[..., :64].contiguous(), k[..., :64].contiguous(), w, actual_seq_lengths_query=ends,
                                  actual_seq_lengths_key=counts, layout_query="TND", layout_key="TND")
    with pytest.raises(RuntimeError, match="int32"):
        npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_query=ends.long(), actual_seq_lengths_key=counts,
                                  layout_query="TND", layout_key="TND")
    with pytest.raises(RuntimeError, match="per-batch token counts and must sum to T2=5"):  # key lengths: counts
        npu.npu_lightning_indexer(q, k, w, actual_seq_lengths_query=ends, actual_seq_lengths_key=ends,
                                  layout_query="TND", layout_key="TND")
    qn, qr = torch.randn(5, 2, 512, dtype=torch.bfloat16), torch.randn(5, 2, 64, dtype=torch.bfloat16)
    kn, kr = torch.randn(5, 1, 512, dtype=torch.bfloat16), torch.randn(5, 1, 64, dtype=torch.bfloat16)
    good = torch.tensor([[0, -1], [1, 0], [0, -1], [1, 0], [2, -1]], dtype=torch.int32).view(5, 1, 2)
    kw = dict(actual_seq_lengths_query=ends, actual_seq_lengths_kv=counts, query_rope=qr, key_rope=kr,
              layout_query="TND", layout_kv="TND", attention_mode=2)
    assert npu.npu_sparse_flash_attention(qn, kn, kn, good, 0.1, **kw)[0].shape == (5, 2, 512)
    with pytest.raises(RuntimeError, match="must sum to T2"):
        npu.npu_sparse_flash_attention(qn, kn, kn, good, 0.1, **(kw | dict(actual_seq_lengths_kv=ends)))
    with pytest.raises(RuntimeError, match="valid entries first"):
        npu.npu_sparse_flash_attention(qn, kn, kn, good.flip(-1).contiguous(), 0.1, **kw)
    with pytest.raises(RuntimeError, match="attention_mode"):
        npu.npu_sparse_flash_attention(qn, kn, kn, good, 0.1, **(kw | dict(attention_mode=0)))


def test_runtime_stand_in_and_restore():
    before_attr, before_module = getattr(torch, "npu", None), sys.modules.get("torch_npu")
    with npu_sim.activate() as acc:
        m = torch.npu
        assert m.is_available() and m.device_count() == 1 and "simulated" in m.get_device_name()
        with pytest.raises(RuntimeError, match="Invalid device"):
            m.set_device(3)
        start, end = m.Event(enable_timing=True), m.Event(enable_timing=True)
        start.record()
        end.record()
        assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
        with m.stream(m.Stream()):
            m.synchronize()
        free, total = m.mem_get_info()
        assert 0 < free <= total and m.memory_allocated() > 0
        m.manual_seed(5)
        a = torch.rand(2)
        m.set_rng_state(m.get_rng_state())
        m.manual_seed(5)
        assert torch.equal(a, torch.rand(2))
        stats = acc.memory_stats()
        assert all(isinstance(stats[key], int) for key in ("allocated", "reserved", "peak_allocated", "total", "free"))
        assert acc.device() == torch.device("cpu") and acc.process_group_backend() == "gloo"
        assert acc.name == "npu" and "SIMULATED" in acc.describe()
        env = acc.worker_env([1, 0])
        assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1" and env["SLIME_ACCELERATOR"] == "npu"
        assert "slime_npu_sim" in env["SLIME_ACCELERATOR_PLUGINS"] and npu_sim.slime_npu_sim.SIM_DIR in env["PYTHONPATH"]
        t = torch.arange(6.0)
        assert torch.equal(acc.open_tensor(acc.share_tensor(t)), t)
    assert getattr(torch, "npu", None) is before_attr and sys.modules.get("torch_npu") is before_module


@pytest.mark.parametrize("soc,device_name,source", [
    ("", "Ascend910_9392", "torch_npu.npu_fusion_attention"),  # default: an Atlas A3
    ("950PR", "Ascend950PR_9579", "reference"),  # npu_fusion_attention's docs list 950DT, not 950PR: the probe fails
])
def test_plugin_makes_npu_available_in_a_fresh_process(soc, device_name, source):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests", "npu_sim"), SLIME_ACCELERATOR_PLUGINS="slime_npu_sim",
               SLIME_ACCELERATOR="npu", SLIME_NPU_SIM_SOC=soc)
    code = (
        "import torch; from slime.accelerator import get_accelerator; a = get_accelerator();"
        "x = torch.randn(3, 2, 4, device=a.device());"
        "cu = torch.tensor([0, 3], dtype=torch.int32);"
        "a.ops.attention(x, x, x, cu, cu);"
        "print(type(a).__name__, a.name, a.ops.source('attention'), a.process_group_backend(), torch.npu.get_device_name())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["SimulatedAscendAccelerator", "npu", source, "gloo", device_name, "(simulated)"]
    if source == "reference":
        lines = [ln for ln in out.stderr.splitlines() if "ops[npu].attention" in ln]
        assert len(lines) == 1 and "probe of torch_npu.npu_fusion_attention (mode TND) on 950PR failed" in lines[0], out.stderr


# --------------------------------------------------------------------------------- per-SoC and per-release rules
@pytest.mark.parametrize("soc,refused", [
    ("A3", set()),
    ("950PR", {"npu_rms_norm", "npu_rotary_mul", "npu_moe_gating_top_k", "npu_fusion_attention"}),
    ("950DT", {"npu_rms_norm", "npu_rotary_mul", "npu_moe_gating_top_k"}),
])
def test_kernels_not_documented_for_the_soc_fail_when_called(soc, refused):
    """On an aclnn-only SoC a kernel without a build imports fine and fails at its first call."""
    x = torch.randn(4, 2, 8)
    calls = {
        "npu_rms_norm": lambda n: n.npu_rms_norm(x, torch.ones(8)),
        "npu_rotary_mul": lambda n: n.npu_rotary_mul(x[None], torch.ones(1, 4, 1, 8), torch.zeros(1, 4, 1, 8)),
        "npu_moe_gating_top_k": lambda n: n.npu_moe_gating_top_k(torch.randn(2, 8), 2, k_group=1, group_count=2,
                                                                  group_select_mode=1, norm_type=1),
        "npu_fusion_attention": lambda n: n.npu_fusion_attention(x, x, x, 2, "TND", actual_seq_qlen=[4],
                                                                  actual_seq_kvlen=[4]),
        "npu_swiglu": lambda n: n.npu_swiglu(x),
    }
    with npu_sim.activate(soc=soc):
        import torch_npu

        assert torch.npu.get_device_name().startswith({"A3": "Ascend910_93", "950PR": "Ascend950PR",
                                                       "950DT": "Ascend950DT"}[soc])
        for name, call in calls.items():
            assert hasattr(torch_npu, name)  # present: the failure comes at call time
            if name in refused:
                with pytest.raises(RuntimeError, match=f"no kernel for Ascend{soc.replace('A3', '910_9392')}"):
                    call(torch_npu)
            else:
                call(torch_npu)


def _indexer_args(heads, wdtype=torch.bfloat16):
    q = torch.randn(5, heads, 128, dtype=torch.bfloat16)
    k = torch.randn(5, 1, 128, dtype=torch.bfloat16)
    ends, counts = torch.tensor([2, 5], dtype=torch.int32), torch.tensor([2, 3], dtype=torch.int32)
    return (q, k, torch.randn(5, heads, dtype=wdtype)), dict(actual_seq_lengths_query=ends, actual_seq_lengths_key=counts,
                                                             layout_query="TND", layout_key="TND", sparse_count=2)


def test_950_indexer_takes_only_its_head_counts_and_no_float32_weights():
    with npu_sim.activate(soc="950PR"):
        import torch_npu

        for heads in (8, 16, 24, 32, 64):
            args, kw = _indexer_args(heads)
            torch_npu.npu_lightning_indexer(*args, **kw)
        for heads in (4, 12, 48):
            args, kw = _indexer_args(heads)
            with pytest.raises(RuntimeError, match="8, 16, 24, 32 or 64"):
                torch_npu.npu_lightning_indexer(*args, **kw)
        args, kw = _indexer_args(16, torch.float32)
        with pytest.raises(RuntimeError, match="float32"):
            torch_npu.npu_lightning_indexer(*args, **kw)
    with npu_sim.activate(soc="A3"):  # A2/A3: any head count <= 64, float32 weights accepted
        import torch_npu

        for heads, wdtype in ((12, torch.bfloat16), (16, torch.float32)):
            args, kw = _indexer_args(heads, wdtype)
            torch_npu.npu_lightning_indexer(*args, **kw)


@pytest.mark.parametrize("soc,heads,ok", [("A3", 4, True), ("A3", 6, False), ("A3", 256, False),
                                          ("950PR", 6, True), ("950PR", 129, False)])
def test_sparse_flash_attention_head_counts_per_soc(soc, heads, ok):
    ends = torch.tensor([2, 5], dtype=torch.int32)
    qn, qr = torch.randn(5, heads, 512, dtype=torch.bfloat16), torch.randn(5, heads, 64, dtype=torch.bfloat16)
    kn, kr = torch.randn(5, 1, 512, dtype=torch.bfloat16), torch.randn(5, 1, 64, dtype=torch.bfloat16)
    idx = torch.tensor([[0, -1], [1, 0], [0, -1], [1, 0], [2, -1]], dtype=torch.int32).view(5, 1, 2)
    kw = dict(actual_seq_lengths_query=ends, actual_seq_lengths_kv=torch.tensor([2, 3], dtype=torch.int32),
              query_rope=qr, key_rope=kr, layout_query="TND", layout_kv="TND", attention_mode=2)
    with npu_sim.activate(soc=soc):
        import torch_npu

        if ok:
            assert torch_npu.npu_sparse_flash_attention(qn, kn, kn, idx, 0.1, **kw)[0].shape == (5, heads, 512)
        else:
            with pytest.raises(RuntimeError, match="query heads"):
                torch_npu.npu_sparse_flash_attention(qn, kn, kn, idx, 0.1, **kw)


def test_grouped_matmul_group_list_must_end_at_the_grouped_extent(npu):
    x, w = torch.randn(6, 4), torch.randn(2, 4, 3)
    with pytest.raises(RuntimeError, match=r"group_list\[-1\] must equal"):
        npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 4]), split_item=3, group_type=0)
    with pytest.raises(RuntimeError, match=r"group_list\[-1\] must equal"):
        npu.npu_grouped_matmul([x.t()], [torch.randn(6, 3)], group_list=torch.tensor([2, 5]), split_item=3, group_type=2)


def test_rms_norm_refuses_1d_input(npu):
    with pytest.raises(RuntimeError, match="1-D"):
        npu.npu_rms_norm(torch.randn(8), torch.ones(8))
    npu.npu_rms_norm(torch.randn(1, 8), torch.ones(8))


def test_grouped_matmul_has_the_6_0_0_signature_before_7_0_0():
    x, w = torch.randn(5, 4), [torch.randn(4, 2), torch.randn(4, 2)]
    with npu_sim.activate(release="6.0.0"):
        import torch_npu

        with pytest.raises(RuntimeError, match="group_type"):
            torch_npu.npu_grouped_matmul([x], [torch.stack(w)], group_list=torch.tensor([2, 5]), split_item=3, group_type=0)
        y = torch_npu.npu_grouped_matmul([x], w, group_list=[2, 5], split_item=3)[0]  # host cumulative ends
        torch.testing.assert_close(y, torch.cat((x[:2] @ w[0], x[2:] @ w[1])))
        with pytest.raises(RuntimeError, match="host list"):
            torch_npu.npu_grouped_matmul([x], w, group_list=torch.tensor([2, 5]), split_item=3)
    with npu_sim.activate(release="7.0.0"):
        import torch_npu

        y7 = torch_npu.npu_grouped_matmul([x], [torch.stack(w)], group_list=torch.tensor([2, 5]), split_item=3, group_type=0)[0]
        torch.testing.assert_close(y7, y)
