"""Fast paths of the CPU training step, against the code they replace:
- megatron's linear without communication (slime/accelerator/megatron_patches/linear.py): the GLM-5 model's
  logits and every grad are bitwise those of megatron's own autograd Functions; each fast path hands every
  case it does not cover (sequence parallel, all-reduced input grads, fused wgrad, deferred wgrad, autocast,
  a TP group of two ranks) to the original;
- the DSA indexer's per-head scores (ops.reference._indexer_head_scores) are bitwise transformers'
  broadcast matmul."""

from __future__ import annotations

import pytest
import torch

from slime.accelerator.megatron_patches import linear
from slime.accelerator.ops import reference as ref

LINEAR_PATCHES = ("linear_without_communication", "tp_copy_identity_one_rank", "tp_reduce_identity_one_rank")


def _recording_original(calls):
    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "original"
    return original


def test_linear_fast_path_only_without_communication():
    calls = []
    fast = linear.make_linear(_recording_original(calls))
    x, w, b = torch.randn(5, 2, 4), torch.randn(3, 4), torch.randn(3)
    torch.testing.assert_close(fast(x, w, b, False, False, False), torch.matmul(x, w.t()) + b, rtol=0, atol=0)
    assert torch.equal(fast(x, w, None, False, False, False), torch.matmul(x, w.t()))
    assert not calls
    for args in [(True, False, False), (False, True, False), (False, False, True)]:
        assert fast(x, w, None, *args) == "original"
    assert fast(x, w, None, False, False, False, grad_output_buffer=[]) == "original"
    assert fast(x, w, None, False, False, False, async_grad_allreduce=False) == "original"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast(x, w, None, False, False, False) == "original"
    assert len(calls) == 6
    assert fast.warned is False  # megatron's original reads and sets it through the module-global name


def test_identity_mapping_only_on_one_rank(monkeypatch):
    class Group:
        def __init__(self, n):
            self.n = n

        def size(self):
            return self.n

    calls = []
    mapping = linear.make_identity_mapping(_recording_original(calls))
    monkeypatch.setattr(linear, "_group_if_none", lambda group: group)
    x = torch.randn(3, 2)
    assert mapping(x, group=Group(1)) is x and not calls
    assert mapping(x, group=Group(2)) == "original" and len(calls) == 1
    assert mapping(x, group=None) == "original" and len(calls) == 2  # no process group: megatron's behaviour


def test_model_step_bitwise_equal_to_megatron_functions(tmp_path, monkeypatch):
    from glm5_helpers import random_batch, write_checkpoint

    from slime.accelerator import patches
    from slime.backends.megatron import load_hf_model

    model = load_hf_model(write_checkpoint(tmp_path / "ckpt", "glm_moe_dsa", seed=3), dtype=torch.float32).train()
    ids, pos = random_batch(2, 11, 512, 0)

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos)
        nodes = _graph_node_names(logits.grad_fn)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, nodes

    megatron_nodes = {"LinearWithGradAccumulationAndAsyncCommunicationBackward", "_CopyToModelParallelRegionBackward",
                      "_ReduceFromModelParallelRegionBackward"}
    fast, fast_grads, nodes = step()
    assert not nodes & megatron_nodes and "MmBackward0" in nodes
    records = [r for r in patches._APPLIED[("cpu", "megatron")] if r.patch.name in LINEAR_PATCHES]
    assert {r.patch.name for r in records} == set(LINEAR_PATCHES)
    for record in records:
        for owner, attr, original in record.originals:
            monkeypatch.setattr(owner, attr, original)
    slow, slow_grads, nodes = step()
    assert megatron_nodes <= nodes  # megatron's Functions ran
    assert torch.equal(fast, slow)
    assert fast_grads.keys() == slow_grads.keys() and len(fast_grads) > 20
    for name, g in slow_grads.items():
        assert torch.equal(fast_grads[name], g), name


def _graph_node_names(root) -> set[str]:
    seen, todo, names = set(), [root], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, s, h, d, t", [(2, 33, 2, 32, 33), (1, 17, 4, 16, 40), (3, 8, 8, 64, 5)])
def test_indexer_head_scores_match_the_broadcast_matmul(dtype, n, s, h, d, t):
    """One [S*H, D] x [D, T] matmul per sequence instead of the keys broadcast over the S query rows: the same
    products and sums. Bitwise equal on some CPUs (AVX-512 here before), not on others (AVX2: the two shapes
    take kernels that sum in another order), so compared with the float64 broadcast form at rounding level."""
    g = torch.Generator().manual_seed(n * 100 + s)
    q = torch.randn(n, s, h, d, generator=g, dtype=dtype)
    k = torch.randn(n, t, d, generator=g, dtype=dtype)
    out = ref._indexer_head_scores(q, k)
    assert out.dtype == dtype and out.shape == (n, s, h, t)
    want = torch.matmul(q.double(), k.double().transpose(-1, -2).unsqueeze(1))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), want, rtol=8 * eps, atol=8 * eps * d ** 0.5)
    assert not torch.equal(out, torch.zeros_like(out))
