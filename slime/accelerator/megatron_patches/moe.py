"""MoE: router, alltoall token dispatcher and the TransformerEngine-only GEMM reference."""

from __future__ import annotations

import dataclasses

import torch

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.patches import Patch

ROUTER = "megatron.core.transformer.moe.router"
DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _acc():
    from slime.accelerator import get_accelerator

    return get_accelerator()


def router_gating(self, input: torch.Tensor) -> torch.Tensor:
    """Router.gating: router weights stay on the accelerator (the original moves CPU weights to CUDA)."""
    from megatron.core.transformer.moe import router as router_mod

    dev = input.device
    if self.weight.device != dev:
        self.weight.data = self.weight.data.to(dev)
    if self.bias is not None and self.bias.device != dev:
        self.bias.data = self.bias.data.to(dev)
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    return router_mod.router_gating_linear(input, self.weight, self.bias, dtype)


def make_topk_router_init(original):
    """TopKRouter.__init__ allocates the expert-bias buffers on torch.cuda.current_device(): build the
    router with expert bias off, then register the same buffers on the accelerator."""

    def __init__(self, config, *args, **kwargs):
        if not config.moe_router_enable_expert_bias:
            return original(self, config, *args, **kwargs)
        original(self, dataclasses.replace(config, moe_router_enable_expert_bias=False), *args, **kwargs)
        self.config = config
        self.enable_expert_bias = True
        dev = _acc().current_device()
        n = config.num_moe_experts
        for name in ("local_tokens_per_expert", "expert_bias"):  # set to None by the bias-less build
            self.__dict__.pop(name, None)
        self.register_buffer("local_tokens_per_expert", torch.zeros(n, dtype=torch.float32, device=dev),
                             persistent=False)
        self.register_buffer("expert_bias", torch.zeros(n, dtype=torch.float32, device=dev))

    return __init__


def make_dispatcher_init(original):
    """MoEAlltoAllTokenDispatcher.__init__ creates a class-wide torch.cuda.Stream: create it from the
    accelerator first, so the original skips its own."""

    def __init__(self, *args, **kwargs):
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as cls

        if cls.cuda_dtoh_stream is None:
            cls.cuda_dtoh_stream = _acc().Stream()
        original(self, *args, **kwargs)

    return __init__


def _to_host(t, as_numpy: bool = False, record: bool = False):
    if torch.is_tensor(t) and t.device.type != "cpu":
        host = t.to("cpu", non_blocking=True)
        if record:
            t.record_stream(_acc().current_stream())
        t = host
    if as_numpy and torch.is_tensor(t):
        t = t.numpy()
    return t


def dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """_maybe_dtoh_and_synchronize with the accelerator's streams/events (copies split sizes to host on
    the side stream at the dtoh point, waits for them at the sync point). Split sizes become host
    numpy arrays on every device, as they do on CUDA."""
    if self.drop_and_pad:
        return tokens_per_expert
    acc = _acc()
    if point == self.cuda_dtoh_point:
        side = self.cuda_dtoh_stream
        current = acc.current_stream()
        on_side = current != side
        if on_side:
            side.wait_stream(current)
        with acc.stream(side):
            tokens_per_expert = _to_host(tokens_per_expert, record=on_side)
            self.input_splits = _to_host(self.input_splits, as_numpy=True, record=on_side)
            self.output_splits = _to_host(self.output_splits, as_numpy=True, record=on_side)
            self.output_splits_tp = _to_host(self.output_splits_tp, as_numpy=True, record=on_side)
            self.num_out_tokens = _to_host(self.num_out_tokens, record=on_side)
            if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = _to_host(self.num_global_tokens_per_local_expert,
                                                                   record=on_side)
        self.d2h_event = side.record_event()
    if point == self.cuda_sync_point:
        self.d2h_event.synchronize()
    return tokens_per_expert


def _p(name, targets, replacement, why, replaces, remove_when, **kw):
    return Patch(name=name, targets=tuple(targets), replacement=replacement, why=why, replaces=replaces,
                 versions=MEGATRON_VERSIONS, remove_when=remove_when, **kw)


PATCHES = [
    _p("moe_te_general_gemm_missing", [f"{MOE_UTILS}:te_general_gemm"], lambda orig: orig,
       "RouterGatingLinearFunction tests `te_general_gemm is not None`, but the name is only bound when "
       "TransformerEngine imports, so every MoE forward raises NameError without TE",
       "the unbound module global te_general_gemm (bound to None when TE is absent, kept when present)",
       "megatron-core binds te_general_gemm = None in its TE import fallback", add_if_missing=True),
    _p("moe_router_gating_device", [f"{ROUTER}:Router.gating"], lambda orig: router_gating,
       "every MoE forward computes router logits",
       "moving CPU router weights to torch.cuda.current_device() in Router.gating",
       "megatron-core leaves router weights on the module's device"),
    _p("moe_router_expert_bias_device", [f"{ROUTER}:TopKRouter.__init__"], make_topk_router_init,
       "sigmoid routers with expert bias (DeepSeek-V3 / GLM style) register bias buffers at build time",
       "torch.zeros(..., device=torch.cuda.current_device()) for expert_bias / local_tokens_per_expert",
       "megatron-core allocates router buffers on an accelerator-derived device"),
    _p("moe_alltoall_stream", [f"{DISPATCHER}:MoEAlltoAllTokenDispatcher.__init__"], make_dispatcher_init,
       "the alltoall dispatcher (expert parallel) is built once per MoE layer",
       "torch.cuda.Stream() for the class-wide device-to-host copy stream",
       "megatron-core takes streams from a device-agnostic API"),
    _p("moe_alltoall_dtoh_sync", [f"{DISPATCHER}:MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"],
       lambda orig: dtoh_and_synchronize,
       "every alltoall dispatch copies split sizes to host and synchronizes before the all-to-all",
       "torch.cuda.current_stream / torch.cuda.stream / Tensor.is_cuda / record_stream in the dtoh step",
       "megatron-core takes streams from a device-agnostic API"),
]
