"""Device placement: buffers and tables that megatron allocates on `torch.cuda.current_device()`."""

from __future__ import annotations

import functools
import math

import torch

from slime.accelerator.megatron_patches.versions import MEGATRON_VERSIONS
from slime.accelerator.patches import Patch


def device() -> torch.device:
    from slime.accelerator import get_accelerator

    return get_accelerator().current_device()


def buffer_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """GlobalMemoryBuffer.get_tensor: a view into a grow-only named buffer on the accelerator."""
    needed = math.prod(tensor_shape)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < needed:
        ctx = mem_alloc_context() if mem_alloc_context else _null()
        with ctx:
            buf = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype, device=device())
    return buf[:needed].view(*tensor_shape)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def rotary_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """RotaryEmbedding.get_emb: rotary angle table [S, 1, 1, dim] on the accelerator."""
    if self.inv_freq.device != device():
        self.inv_freq = self.inv_freq.to(device())
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


@functools.lru_cache(maxsize=8)
def _causal_mask(sq: int, dev: torch.device) -> torch.Tensor:
    return torch.ones(sq, sq, dtype=torch.bool, device=dev).triu(diagonal=1)


def default_causal_mask(sq: int) -> torch.Tensor:
    """get_default_causal_mask: True above the diagonal (masked), on the accelerator."""
    return _causal_mask(int(sq), device())


PATCHES = [
    Patch(
        name="global_memory_buffer_device",
        targets=("megatron.core.utils:GlobalMemoryBuffer.get_tensor",),
        replacement=lambda orig: buffer_get_tensor,
        why="sequence-parallel all-gathers and the linear layers' backward draw scratch tensors from it",
        replaces="torch.empty(..., device=torch.cuda.current_device()) in GlobalMemoryBuffer.get_tensor",
        versions=MEGATRON_VERSIONS,
        remove_when="megatron-core allocates the buffer on a caller-given or accelerator-derived device",
    ),
    Patch(
        name="rotary_embedding_device",
        targets=("megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_emb",),
        replacement=lambda orig: rotary_get_emb,
        why="GPTModel's rotary table is built on every forward",
        replaces="moving inv_freq to torch.cuda.current_device() in RotaryEmbedding.get_emb",
        versions=MEGATRON_VERSIONS,
        remove_when="megatron-core keeps inv_freq on the module's own device",
    ),
    Patch(
        name="default_causal_mask_device",
        targets=("megatron.core.transformer.utils:get_default_causal_mask",),
        replacement=lambda orig: default_causal_mask,
        why="the unfused softmax of megatron's local DotProductAttention builds the causal mask every forward",
        replaces='torch.ones(sq, sq, device="cuda") in get_default_causal_mask (its fused_softmax binding: alias sweep)',
        versions=MEGATRON_VERSIONS,
        remove_when="megatron-core builds the mask on the scores' device",
    ),
]
