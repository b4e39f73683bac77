"""SIMULATED sgl_kernel_npu.fla (tests only)."""
