"""A SIMULATED `torch_npu` for tests. It is not hardware and not Huawei's package.

It implements the torch_npu ops slime calls, following their documented contracts (Ascend op-plugin
docs and op_plugin_functions.yaml / derivatives.yaml): layouts, cumulative lengths without a leading 0,
True = masked out, scale default 1.0, gate-first swiglu, group_list cumsum vs counts, split_item,
returned tuples. The math is plain torch in float64 (independent of slime's reference ops); any
documented-contract violation raises, as the real kernels do. Importing it installs a host-backed
`torch.npu` runtime stand-in (torch.cuda-like API), as importing the real package installs torch.npu.

`simulate_release("7.2.0")` makes it behave like an older Ascend PyTorch release: ops added later
disappear, derivatives added later raise on backward (see _RELEASE_OF), and 6.0.0's npu_grouped_matmul
has that release's signature. Each op checks its arguments against the schema of the simulated release's wheel and raises
RuntimeError as torch.ops does; ranks, layouts and dtypes follow the docstrings read from the wheels
(tests/data/torch_npu_facts.json, scripts/npu-wheel-facts.py). `simulate_defects(...)` makes a kernel
finite but wrong, to test slime's numerical probes. `simulate_soc("950PR")` (or SLIME_NPU_SIM_SOC in a fresh process) picks the
SoC: torch.npu.get_device_name() names it, and kernels whose docs leave it out raise when called, as
aclnn-only SoCs do; the Ascend 950 indexer takes only 8/16/24/32/64 query heads and no float32 weights.
The default SoC is an Atlas A3, where every simulated kernel is documented.
"""

from __future__ import annotations

import os
import sys

from . import _common, _runtime
from ._attention import npu_fusion_attention, npu_lightning_indexer, npu_sparse_flash_attention
from ._moe import (
    npu_grouped_matmul, npu_grouped_matmul_6_0, npu_moe_gating_top_k, npu_moe_token_permute,
    npu_moe_token_unpermute,
)
from . import _nn
from ._quant import npu_dynamic_block_quant
from ._nn import npu_rms_norm, npu_rotary_mul, npu_swiglu

SIMULATED = True

# First Ascend PyTorch (op-plugin branch) release that has each op, from op_plugin_functions.yaml.
_RELEASE_OF = {
    "npu_rms_norm": "6.0.0",
    "npu_rotary_mul": "6.0.0",
    "npu_fusion_attention": "6.0.0",
    "npu_swiglu": "6.0.0",
    "npu_grouped_matmul": "6.0.0",
    "npu_moe_gating_top_k": "7.0.0",
    "npu_moe_token_permute": "7.1.0",
    "npu_moe_token_unpermute": "7.1.0",
    "npu_lightning_indexer": "7.3.0",
    "npu_sparse_flash_attention": "7.3.0",
    "npu_moe_gating_top_k_backward": "26.1.0",
    "npu_dynamic_block_quant": "7.2.0",  # in the 2.7.1 / 2.8.0 wheels (tests/data/npu_fp8_facts.json)
}
_OPS = {
    "npu_rms_norm": npu_rms_norm,
    "npu_rotary_mul": npu_rotary_mul,
    "npu_fusion_attention": npu_fusion_attention,
    "npu_swiglu": npu_swiglu,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_moe_gating_top_k": npu_moe_gating_top_k,
    "npu_moe_token_permute": npu_moe_token_permute,
    "npu_moe_token_unpermute": npu_moe_token_unpermute,
    "npu_lightning_indexer": npu_lightning_indexer,
    "npu_sparse_flash_attention": npu_sparse_flash_attention,
    "npu_dynamic_block_quant": npu_dynamic_block_quant,
}


def npu_moe_gating_top_k_backward(x_norm, grad_y, expert_idx, *, renorm=0, norm_type=0, routed_scaling_factor=1.0, eps=1e-20):
    raise _common.fail("npu_moe_gating_top_k_backward", "direct calls are not simulated (reached through autograd)")


_OPS["npu_moe_gating_top_k_backward"] = npu_moe_gating_top_k_backward
__version__ = _common.RELEASE_WHEELS[_common.NEWEST_RELEASE] + "+sim"


def _rotary_mul_before_7_0(self, r1, r2, *args, **kwargs):
    if args or kwargs:  # the schema before Ascend PyTorch 7.0.0 is npu_rotary_mul(Tensor self, Tensor r1, Tensor r2)
        raise _common.fail("npu_rotary_mul", "unknown argument rotary_mode (added in Ascend PyTorch 7.0.0)")
    return _nn.npu_rotary_mul(self, r1, r2)


def simulate_release(release: str | None = None) -> None:
    """Behave like Ascend PyTorch `release` (None = newest): hide later ops, set __version__. Every op is
    bound like torch.ops.npu.<op>: its arguments are matched against the schema of the release's wheel in
    tests/data/torch_npu_facts.json, and a mismatch raises RuntimeError."""
    global __version__
    release = release or _common.NEWEST_RELEASE
    _common.set_release(release)
    module = sys.modules[__name__]
    ops = dict(_OPS)
    if not _common.at_least("7.0.0"):
        ops.update(npu_grouped_matmul=npu_grouped_matmul_6_0, npu_rotary_mul=_rotary_mul_before_7_0)
    for name, fn in ops.items():
        if _common.at_least(_RELEASE_OF[name]):
            setattr(module, name, _common.torch_ops_call(name, fn))
        elif hasattr(module, name):
            delattr(module, name)
    __version__ = _common.RELEASE_WHEELS[release] + "+sim"


def simulate_defects(*names: str) -> None:
    """Make kernels finite but wrong (names in _common.DEFECTS, e.g. "npu_lightning_indexer:
    key_lengths_as_prefix_sums"); no names = none. For the tests of slime's numerical probes."""
    _common.set_defects(names)


def simulate_soc(name: str | None = None) -> None:
    """Behave like SoC `name` ("A2", "A3", "950PR", "950DT"; None = the default, A3)."""
    _common.set_soc(name or _common.DEFAULT_SOC)


def current_soc() -> str:
    return _common.soc()


def current_release() -> str:
    return _common._release[0]


install_runtime = _runtime.install
uninstall_runtime = _runtime.uninstall
if __name__ == "torch_npu":  # imported as the package itself (PYTHONPATH=tests/npu_sim): act like it
    simulate_soc(os.environ.get("SLIME_NPU_SIM_SOC") or None)
    npu = _runtime.install()
# Imported as npu_sim.torch_npu (in-process tests): npu_sim.activate() installs and restores.
