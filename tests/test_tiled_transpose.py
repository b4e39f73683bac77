"""The tiled host transpose of the weight sync (shared_buckets.copy_transposed): bit for bit what
`.t().contiguous()` of the stored matrix gives, for shapes that are not multiples of a tile, bfloat16 and
float32, on one thread and split over two."""

from __future__ import annotations

import pytest
import torch

from slime.backends.megatron.weight_sync import shared_buckets as sb


def _stored(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    # values whose bits matter: signed zeros, infinities, NaN, subnormals
    flat = w.view(-1)
    flat[:5] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan"), 1e-40]).to(dtype)
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("stored", [(67, 1029), (1031, 70), (600, 130), (2, 40000)])
def test_tiled_transpose_is_bitwise_the_contiguous_transpose(dtype, threads, stored):
    w = _stored(stored, dtype, seed=sum(stored))
    src = w.t()  # a transposed view, as the export yields expert weights
    assert src.numel() >= sb._MIN_TILED and not src.is_contiguous()
    dst = torch.full(src.shape, 7, dtype=dtype)
    sb.copy_transposed(dst, src, threads=threads)
    ref = w.t().contiguous()
    assert torch.equal(dst.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_transpose_of_column_slices_and_tiny_tiles(threads, monkeypatch):
    """Views of part of the stored columns (an expert's gate `w[:, :I].t()` and up `w[:, I:].t()`), and tiles
    far smaller than the matrix (edges in both dimensions), still copy exactly."""
    monkeypatch.setattr(sb, "_TILE_ROWS", 7)
    monkeypatch.setattr(sb, "_TILE_COLS", 5)
    monkeypatch.setattr(sb, "_MIN_TILED", 0)
    w = _stored((45, 2 * 33), torch.bfloat16, seed=3)
    for src in (w[:, :33].t(), w[:, 33:].t(), w.t()):
        dst = torch.zeros(src.shape, dtype=src.dtype)
        sb.copy_transposed(dst, src, threads=threads)
        assert torch.equal(dst.view(torch.int16), src.contiguous().view(torch.int16))


def test_small_or_unfit_copies_fall_back_to_copy():
    """A matrix below the tiling threshold, a 3-D tensor and a non-contiguous target are plain copies."""
    w = _stored((9, 11), torch.float32, seed=1)
    dst = torch.zeros(11, 9)
    sb.copy_transposed(dst, w.t())
    assert torch.equal(dst.view(torch.int32), w.t().contiguous().view(torch.int32))
    w3 = torch.randn(2, 300, 300)
    dst3 = torch.zeros(2, 300, 300)
    sb.copy_transposed(dst3, w3.transpose(1, 2))
    assert torch.equal(dst3, w3.transpose(1, 2).contiguous())
    big = torch.zeros(600, 600)
    sb.copy_transposed(big[:300, :300], w3[0].t())  # target not contiguous
    assert torch.equal(big[:300, :300], w3[0].t())
