"""megatron-core patch sets: every target exists and is documented, apply/revert restore the originals,
and megatron (GPT dense + MoE, RNG tracker, DDP + optimizer + clipping) runs on the patched device."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from packaging.specifiers import SpecifierSet
from importlib import metadata


from slime.accelerator import get_accelerator, patches
from slime.accelerator.megatron_patches import common_patches
from slime.accelerator.megatron_patches.device_shim import with_accelerator_torch

MEGATRON_VERSION = metadata.version("megatron-core")


# The one patch that adds an attribute (add_if_missing): a module global megatron binds only when
# TransformerEngine imports; the test checks that the original code reads that name.
ADDS_MISSING_GLOBAL = {"moe_te_general_gemm_missing": ("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction")}


def _owner_and_attr(target):
    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    parts = path.split(".")
    for p in parts[:-1]:
        owner = getattr(owner, p)
    return owner, parts[-1]


def _current(owner, attr):
    return owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)


@pytest.mark.parametrize("accel_name", ["cpu", "npu"])
def test_every_patch_targets_installed_megatron_and_is_documented(accel_name):
    registered = patches.patch_set(accel_name, "megatron")
    assert {p.name for p in registered} >= {p.name for p in common_patches()}
    assert patches.patch_set("cuda", "megatron") == []  # CUDA runs megatron unpatched
    for p in registered:
        assert MEGATRON_VERSION in SpecifierSet(p.versions), (p.name, p.versions)
        for field in (p.why, p.replaces, p.remove_when):
            assert len(field.split()) >= 3, (p.name, field)
        for target in p.targets:
            owner, attr = _owner_and_attr(target)
            assert p.add_if_missing == (p.name in ADDS_MISSING_GLOBAL), p.name
            if p.name in ADDS_MISSING_GLOBAL:
                mod, cls = ADDS_MISSING_GLOBAL[p.name]
                fwd = getattr(importlib.import_module(mod), cls).forward
                assert attr in fwd.__code__.co_names  # the name the original code reads
            else:
                assert _current(owner, attr) is not None, f"{p.name}: {target} missing in megatron-core {MEGATRON_VERSION}"


def test_apply_is_once_and_revert_restores_originals():
    from slime.backends.megatron.parallel import apply_megatron_patches, revert_megatron_patches

    acc = get_accelerator()
    revert_megatron_patches()
    targets = [(p.name, *_owner_and_attr(t)) for p in patches.patch_set(acc.name, "megatron") for t in p.targets]
    before = {(name, id(owner), attr): _current(owner, attr) for name, owner, attr in targets}
    names = apply_megatron_patches()
    assert names == [p.name for p in patches.patch_set(acc.name, "megatron")]
    patched = {(n, id(o), a): _current(o, a) for n, o, a in targets}
    unchanged = {k[0] for k in before if patched[k] is before[k]}
    # every target changes but te_general_gemm (None -> None when TE is absent) and, when slime's import hook
    # made jit_fuser eager before megatron imported (this process: conftest imports slime first), the jit ones
    from slime.accelerator.megatron_patches import jit

    eager_from_import = {p.name for p in jit.PATCHES} if jit.eager_at_import() else set()
    assert unchanged == {"moe_te_general_gemm_missing", *eager_from_import}
    assert apply_megatron_patches() == names and all(_current(o, a) is patched[(n, id(o), a)] for n, o, a in targets)
    acc.revert_patches("megatron")
    assert all(_current(o, a) is before[(n, id(o), a)] for n, o, a in targets)
    from megatron.core.transformer.moe import moe_utils

    assert not hasattr(moe_utils, "te_general_gemm")  # the added global is removed again
    apply_megatron_patches()


def test_deleted_megatron_target_fails_the_set_with_one_line(monkeypatch):
    """A real target that no longer exists (as after a megatron refactor) stops the apply with one line
    naming the patch and the target; nothing of the set stays applied."""
    from megatron.core.tensor_parallel import random

    from slime.backends.megatron.parallel import apply_megatron_patches, revert_megatron_patches

    acc = get_accelerator()
    revert_megatron_patches()
    monkeypatch.delattr(random, "_get_cuda_rng_state")
    before = random.CudaRNGStatesTracker.add
    with pytest.raises(patches.PatchError) as info:
        apply_megatron_patches()
    msg = str(info.value)
    assert "\n" not in msg and "'rng_get_state'" in msg
    assert "megatron.core.tensor_parallel.random:_get_cuda_rng_state" in msg and MEGATRON_VERSION in msg
    assert not patches.is_applied(acc.name, "megatron") and random.CudaRNGStatesTracker.add is before
    monkeypatch.undo()
    apply_megatron_patches()


def test_alias_bindings_are_replaced_without_being_listed():
    from megatron.core.optimizer import clip_grads, optimizer

    from slime.backends.megatron.parallel import apply_megatron_patches

    apply_megatron_patches()
    listed = {t for p in patches.patch_set(get_accelerator().name, "megatron") for t in p.targets}
    assert "megatron.core.optimizer.optimizer:get_grad_norm_fp32" not in listed
    assert optimizer.get_grad_norm_fp32 is clip_grads.get_grad_norm_fp32  # `from .clip_grads import` binding
    assert clip_grads.get_grad_norm_fp32.__module__ == "slime.accelerator.megatron_patches.optim"


def test_patches_cli_lists_every_patch_of_every_set():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "slime.accelerator", "--patches"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    for accel_name in ("cpu", "npu"):
        section = out.stdout.split(f"[{accel_name}] megatron:")[1].split("\n[")[0]
        for p in patches.patch_set(accel_name, "megatron"):
            assert f"  {p.name}  " in section and p.why in section and p.remove_when in section
            assert all(f"target: {t}" in section for t in p.targets)
    assert "[cuda] megatron: 0 patches" in out.stdout
    assert "glm_moe_dsa_indexer_stable_topk" in out.stdout.split("[cuda] transformers:")[1]


def test_device_shim_maps_only_listed_cuda_members():
    def uses_cuda(n):
        return torch.zeros(n, device=torch.cuda.current_device()), torch.cuda.Stream()

    def uses_unmapped():
        return torch.cuda.get_device_properties(0)

    t, s = with_accelerator_torch(uses_cuda)(3)
    assert t.device == get_accelerator().current_device() and isinstance(s, get_accelerator().Stream)
    with pytest.raises(AttributeError, match="get_device_properties.*uses_unmapped"):
        with_accelerator_torch(uses_unmapped)()
    assert torch.cuda.current_device is not None and "torch.cuda" in torch.cuda.__name__  # torch itself untouched


def test_jit_fused_functions_run_eagerly_and_match_float64():
    """megatron's torch.compile'd fusions (jit_fuser) run as their eager functions: no dynamo frame is
    compiled (on CPU that would build C++ with g++), closures decorated later are eager too, and the
    fused SwiGLU / bias-GeLU forward and backward equal float64 references."""
    import torch._dynamo.utils as dynamo_utils
    import torch.nn.functional as F
    from megatron.core import jit as megatron_jit
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.transformer.moe import experts

    from slime.accelerator.megatron_patches import jit
    from slime.backends.megatron.parallel import apply_megatron_patches

    def double(x):
        return 2 * x

    assert jit.eager(torch.compile(double)) is double  # a wrapper made before the patch gives its function back
    apply_megatron_patches()
    for target in jit.PATCHES[0].targets:
        fn = _current(*_owner_and_attr(target))
        assert not hasattr(fn, "_torchdynamo_orig_callable"), target
    assert megatron_jit.jit_fuser is jit.eager_fuser and experts.jit_fuser is jit.eager_fuser
    frames = dynamo_utils.counters["frames"]["total"]
    g = torch.Generator().manual_seed(5)
    y = torch.randn(3, 5, 14, generator=g, requires_grad=True)  # odd shape, even last dim (gate | up)
    bias = torch.randn(14, generator=g, requires_grad=True)
    y64, bias64 = (t.detach().double().requires_grad_() for t in (y, bias))
    upstream = torch.randn(3, 5, 7, generator=g)
    for fused, reference in [
        (bias_swiglu_impl(y, bias), (lambda a, b: F.silu(a) * b)(*torch.chunk(y64 + bias64, 2, dim=-1))),
        (bias_gelu_impl(y, bias)[..., :7], F.gelu(y64 + bias64, approximate="tanh")[..., :7]),
    ]:
        torch.testing.assert_close(fused.double(), reference, rtol=1e-5, atol=1e-6)
        got = torch.autograd.grad(fused, (y, bias), upstream)
        want = torch.autograd.grad(reference, (y64, bias64), upstream.double())
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    assert dynamo_utils.counters["frames"]["total"] == frames  # nothing went through torch.compile


def test_megatron_imported_after_slime_never_imports_the_compiler_stack():
    """A fresh process that imports slime before megatron (train.py, the trainer actors, spawned ranks):
    megatron's modules are decorated with the eager jit_fuser, so torch._dynamo is never imported."""
    import subprocess
    import sys

    code = ("import sys, slime, megatron.core.models.gpt, megatron.core.transformer.moe.experts as experts; "
            "from slime.accelerator.megatron_patches import jit; "
            "from megatron.core.fusions import fused_bias_swiglu as f; "
            "print(experts.jit_fuser is jit.eager_fuser, hasattr(f.swiglu, '_torchdynamo_orig_callable'), "
            "'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"], out.stdout


@pytest.fixture
def megatron_world1(accel):
    from slime.backends.megatron.parallel import init_parallel

    init_parallel(1, 1, 1, seed=11)
    yield accel


def _gpt(moe: bool, bf16: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, add_bias_linear=False,
        num_moe_experts=4 if moe else None, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
        moe_router_score_function="sigmoid" if moe else "softmax", moe_router_enable_expert_bias=moe,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4 if moe else None), vocab_size=64, max_sequence_length=32)
    return model.to(get_accelerator().device()), cfg


def test_rng_tracker_seeds_are_reproducible_and_isolated(megatron_world1):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    outer = torch.rand(1)  # advance the default generator
    with tracker.fork():
        a = torch.rand(4)
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the tracked state advances
    tensor_parallel.model_parallel_cuda_manual_seed(11, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()  # force_reset builds a new tracker
    with tracker.fork():
        a2 = torch.rand(4)
    assert torch.equal(a, a2)
    state = get_accelerator().get_rng_state()
    with tracker.fork("expert-parallel-rng"):
        torch.rand(8)
    assert torch.equal(state, get_accelerator().get_rng_state())  # fork leaves the default state alone
    assert outer.numel() == 1


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_forward_backward_matches_float64(megatron_world1, moe):
    model, _ = _gpt(moe)
    ids = torch.randint(0, 64, (2, 7))
    pos = torch.arange(7).expand(2, 7)
    loss = model(ids, pos, None, labels=ids).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    # Same model in float64: the patched CPU path computes the same function.
    model64 = model.double()
    model64.zero_grad(set_to_none=True)
    loss64 = model64(ids, pos, None, labels=ids).mean()
    loss64.backward()
    assert math.isclose(loss.item(), loss64.item(), rel_tol=1e-5)
    for n, p in model64.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n].double(), p.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("bf16,dist_opt", [(False, False), (True, True)], ids=["fp32", "bf16-distopt"])
def test_ddp_optimizer_steps_reduce_loss(megatron_world1, bf16, dist_opt):
    from slime.backends.megatron.optimizer import build_optimizer

    model, cfg = _gpt(moe=True, bf16=bf16)
    if bf16:  # megatron's bf16 wrapper: casts the embedding-side inputs, returns fp32 logits
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
        model.config = cfg
    ddp, opt = build_optimizer(model, lr=1e-2, clip_grad=0.05, bf16=bf16, use_distributed_optimizer=dist_opt)
    ids = torch.randint(0, 64, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    losses, norms = [], []
    for _ in range(4):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        assert ok
        losses.append(loss.item())
        norms.append(grad_norm)
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(n > 0.05 for n in norms)  # clipping was active (norm reported before clipping)
