"""Fused elementwise functions run eagerly on CPU: megatron decorates them with `jit_fuser`, which is
`torch.compile` on torch >= 2.2. On CPU, TorchInductor generates C++ for each one and builds it with g++
at its first call (151 s for megatron's swiglu with a cold cache on 2 busy cores; the build is cached under
/tmp/torchinductor_<user>, but tracing and the cache lookup run again in every fresh process: each trainer
rank, Ray actor and spawned test worker), and a run needs a C++ compiler installed. Decorating also imports
torch._dynamo and TorchInductor into every process that imports megatron. The eager functions compute the
same thing: the decorator only fuses them. Part of the shared CPU / Ascend set: upstream slime's NPU port
removes megatron's jit_fuser as well, and the simulated-NPU tests run on CPU.
"""

from __future__ import annotations

import inspect

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.patches import Patch

# Every function megatron-core 0.16 decorates with @jit_fuser at import time, by module; methods as
# "Class.method". (megatron.core.ssm is left out: slime builds no Mamba / gated-delta layers.)
JIT_FUSED = {
    "megatron.core.activations": ("squared_relu", "quick_gelu", "fast_gelu"),
    "megatron.core.fusions.fused_bias_dropout": ("bias_dropout_add_fused_train", "bias_dropout_add_fused_inference"),
    "megatron.core.fusions.fused_bias_geglu": (
        "geglu", "bias_geglu", "geglu_back", "bias_geglu_back", "quick_gelu", "quick_geglu", "weighted_quick_geglu",
        "quick_geglu_back", "weighted_quick_geglu_back", "weighted_bias_quick_geglu", "weighted_bias_quick_geglu_back"),
    "megatron.core.fusions.fused_bias_gelu": ("bias_gelu", "bias_gelu_back"),
    "megatron.core.fusions.fused_bias_swiglu": (
        "swiglu", "bias_swiglu", "weighted_swiglu", "swiglu_back", "bias_swiglu_back", "weighted_swiglu_back"),
    "megatron.core.fusions.fused_cross_entropy": (
        "calculate_logits_max", "calculate_predicted_logits", "calculate_cross_entropy_loss", "calculate_gradients"),
    "megatron.core.fusions.fused_pad_routing_map": ("fused_pad_routing_map",),
    "megatron.core.fusions.fused_weighted_squared_relu": (
        "weighted_squared_relu", "_squared_relu_back", "weighted_squared_relu_back"),
    "megatron.core.transformer.attention": ("Attention._apply_output_gate",),
    "megatron.core.transformer.moe.router": ("TopKRouter._apply_expert_bias",),
    "megatron.core.transformer.moe.token_dispatcher": ("MoEFlexTokenDispatcher.dispatch_preprocess",),
    "megatron.core.transformer.torch_norm": ("L2Norm._norm",),
    "megatron.core.transformer.utils": ("gelu_impl", "erf_gelu"),
}


def eager(compiled):
    """The function torch.compile wrapped (it keeps it as `_torchdynamo_orig_callable`); a plain function
    is kept (decorated while jit_fuser was already eager: `after_megatron_jit_import`)."""
    fn = getattr(compiled, "_torchdynamo_orig_callable", None)
    if fn is not None:
        return fn
    if inspect.isfunction(compiled):
        return compiled
    raise TypeError(f"{compiled!r} is neither a torch.compile wrapper nor a function: megatron's jit_fuser "
                    f"changed; update slime/accelerator/megatron_patches/jit.py")


def eager_fuser(fn):
    """jit_fuser for functions decorated after the patch (GroupedMLP's activation closures): no compile."""
    return fn


def after_megatron_jit_import(jit_module) -> None:
    """slime's import hook (slime/import_hooks.py) calls this as megatron.core.jit finishes executing, in a
    process that imported slime first: on a device with a megatron patch set (the CPU and Ascend sets hold
    the patches below), jit_fuser is eager before any megatron module decorates with it, so torch._dynamo
    and TorchInductor are not even imported. CUDA keeps torch.compile."""
    from slime.accelerator import get_accelerator

    if "megatron" in type(get_accelerator()).patch_sets:
        jit_module.jit_fuser = eager_fuser


def eager_at_import() -> bool:
    """Whether this process's megatron modules were decorated with the eager jit_fuser from the start."""
    import megatron.core.jit

    return megatron.core.jit.jit_fuser is eager_fuser


PATCHES = [
    Patch(
        name="jit_fuser_eager_functions",
        targets=tuple(f"{module}:{name}" for module, names in JIT_FUSED.items() for name in names),
        replacement=eager,
        why="megatron's fused activations, bias-dropout-add, cross-entropy pieces and router bias update are "
            "torch.compile'd: on CPU their first call in every process builds C++ with g++ (a minute or more "
            "per process on 2 cores, and a C++ compiler as a run-time dependency)",
        replaces="the torch.compile wrappers jit_fuser put around these functions at import (the wrapped "
                 "eager function, unchanged, is what runs); nothing to replace where slime's import hook made "
                 "jit_fuser eager before megatron imported them",
        versions=MEGATRON_VERSIONS,
        remove_when="megatron-core lets the caller choose the fuser (or torch.compile on CPU needs no C++ "
                    "build), and the start-up cost is gone",
    ),
    Patch(
        name="jit_fuser_eager_decorator",
        targets=("megatron.core.jit:jit_fuser",),
        replacement=lambda orig: eager_fuser,
        why="GroupedMLP builds its GLU activation closures with @jit_fuser at construction time, after "
            "import, so they would be torch.compile'd (and built with g++) when first called",
        replaces="megatron.core.jit.jit_fuser = torch.compile (bound in every megatron module that imports "
                 "it; slime's import hook sets it as megatron.core.jit executes when slime is imported first)",
        versions=MEGATRON_VERSIONS,
        remove_when="megatron-core lets the caller choose the fuser (megatron.core.jit.disable_jit_fuser "
                    "only rebinds its own module global, not the names other modules imported)",
        check_signature=False,  # a decorator taking the function, not torch.compile's options
    ),
]
