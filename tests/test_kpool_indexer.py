"""The `kpool_indexer` op (GLM-5.3-Flash's k-pool compressed lightning indexer) against transformers'
`Glm5NextTextIndexer` on the same weights: the selected key positions are equal, column for column (the
selected pools best first, then the tail, -1 padding), for one sequence and for each sequence of a pack
(each equal to transformers run on that sequence alone); lengths shorter than a pool, exact multiples and
with tails; top-k budgets below and above the number of pools; always_select_tail on and off; float64, float32
and bfloat16 (bf16 pool keys as transformers rounds them; no near-ties on these inputs, so the rounding of the
two score orders cannot swap a pool).
Context-parallel segments (a chunk's queries against its sequence's prefix) give the full sequence's rows."""

from __future__ import annotations

import pytest
import torch

from slime.accelerator.ops.kpool_indexer import kpool_indexer, output_width

modeling = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

HIDDEN, Q_LORA, HEADS, DIM = 24, 20, 3, 8


def hf_config(topk: int, kpool: int, tail: bool):
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig(
        hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=Q_LORA, kv_lora_rank=16,
        qk_nope_head_dim=8, v_head_dim=8, index_n_heads=HEADS, index_head_dim=DIM, index_topk=topk, index_kpool=kpool,
        index_kpool_always_select_tail=tail, num_hidden_layers=4, vocab_size=64, pad_token_id=0,
        intermediate_size=40, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        linear_num_heads=2, linear_head_dim=8)


def make_indexer(topk: int, kpool: int, tail: bool, dtype, seed: int = 0):
    indexer = modeling.Glm5NextTextIndexer(hf_config(topk, kpool, tail), layer_idx=3).to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in indexer.parameters():  # transformers initialises ape 0 and gate 1: random ones test the pooling
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return indexer


def op_inputs(indexer, x: torch.Tensor, q_resid: torch.Tensor):
    """The op's inputs from the module's weights: the projections the model's indexer module computes."""
    q = indexer.wq_b(q_resid).view(x.shape[0], HEADS, DIM)
    k = indexer.k_norm(indexer.wk(x))
    gate = torch.nn.functional.linear(x, indexer.index_kpool_compress_gate)
    weights = indexer.weights_proj(x).float() * HEADS ** -0.5
    if x.dtype == torch.float64:
        weights = indexer.weights_proj(x) * HEADS ** -0.5
    return q, k, gate, indexer.index_kpool_compress_ape, weights


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def hf_alone(indexer, x, q_resid) -> torch.Tensor:
    """transformers' indexer on one sequence, its top-k under slime's tie rule (lowest pool first among equal
    scores: the engine's transformers patch; with few heads whole pools score exactly 0 after the ReLU)."""
    from slime.accelerator.transformers_patches import StableTopk

    mask = torch.ones(1, x.shape[0], dtype=torch.bool)
    with StableTopk():
        return indexer(x[None], q_resid[None], mask, None)[0]


def run_op(indexer, x, q_resid, cu_q, cu_k, topk, kpool, tail):
    q, k, gate, ape, weights = op_inputs(indexer, x, q_resid)
    return kpool_indexer(q, k, gate, ape, weights, cu_q, cu_k, topk, kpool, tail)


CASES = [  # lengths of a pack, topk, kpool: shorter than a pool, multiples, tails, budgets below / above the pools
    ([3], 8, 4), ([8], 8, 4), ([13], 8, 4), ([29], 8, 4), ([17], 40, 4), ([30], 12, 3),
    ([13, 4, 21], 8, 4), ([2, 16, 9], 16, 4), ([11, 11], 4, 4), ([9, 1, 14], 10, 5), ([7], 8, 1),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("lengths, topk, kpool", CASES)
def test_equals_transformers_per_sequence(lengths, topk, kpool, tail, dtype):
    indexer = make_indexer(topk, kpool, tail, dtype, seed=sum(lengths) + kpool)
    g = torch.Generator().manual_seed(len(lengths) * 7 + topk)
    total = sum(lengths)
    x = torch.randn(total, HIDDEN, generator=g, dtype=torch.float64).to(dtype)
    q_resid = torch.randn(total, Q_LORA, generator=g, dtype=torch.float64).to(dtype)
    got = run_op(indexer, x, q_resid, cu(lengths), cu(lengths), topk, kpool, tail)
    assert got.dtype == torch.int32 and got.shape == (total, output_width(topk, kpool, tail))
    offsets = cu(lengths).tolist()
    for b in range(len(lengths)):
        rows = slice(offsets[b], offsets[b + 1])
        want = hf_alone(indexer, x[rows], q_resid[rows])
        assert torch.equal(got[rows], want.to(torch.int32)), f"sequence {b} of {lengths}"
    pools = [n // kpool for n in lengths]
    if max(pools) > topk // kpool:  # the budget really drops pools somewhere
        last = offsets[pools.index(max(pools)) + 1] - 1
        assert (got[last, : topk] >= 0).sum() == topk
    if not tail:  # before a sequence's first pool is complete nothing is visible to select
        for b in range(len(lengths)):
            assert (got[offsets[b] : offsets[b] + min(kpool - 1, lengths[b])] == -1).all()


def test_selection_really_follows_the_scores():
    """A pool whose key aligns with every query head wins; pools past a query are never chosen."""
    kpool, topk, sk = 4, 4, 16
    q = torch.ones(sk, 2, 4, dtype=torch.float64)
    k = -torch.ones(sk, 4, dtype=torch.float64)
    k[8:12] = 1.0  # pool 2 scores positive, the others 0 after the ReLU
    gate, ape = torch.zeros(sk, 4, dtype=torch.float64), torch.zeros(kpool, 4, dtype=torch.float64)
    out = kpool_indexer(q, k, gate, ape, torch.ones(sk, 2, dtype=torch.float64), cu([sk]), cu([sk]), topk, kpool, False)
    assert out[11].tolist() == [8, 9, 10, 11] and out[15].tolist() == [8, 9, 10, 11]
    assert out[10].tolist() == [0, 1, 2, 3]  # pool 2 not complete yet at position 10: ties -> the lowest pool
    assert out[2].tolist() == [-1] * 4


def test_context_parallel_segments_give_the_sequence_rows():
    """A chunk's queries against its sequence's prefix (as a CP rank passes them) give the same rows as the
    whole sequence: pools start at the sequence's first key, not the chunk's."""
    torch.manual_seed(0)
    n, kpool, topk = 24, 4, 8
    q, k = torch.randn(n, HEADS, DIM, dtype=torch.float64), torch.randn(n, DIM, dtype=torch.float64)
    gate, ape = torch.randn(n, DIM, dtype=torch.float64), torch.randn(kpool, DIM, dtype=torch.float64)
    w = torch.randn(n, HEADS, dtype=torch.float64)
    whole = kpool_indexer(q, k, gate, ape, w, cu([n]), cu([n]), topk, kpool)
    chunks = [(6, 12), (18, 24)]  # CP2, rank 0 of a 24-token sequence: chunks 1 and 2 of 4 ... any prefix ends
    rows = torch.cat([torch.arange(a, b) for a, b in chunks])
    keys = torch.cat([torch.arange(0, b) for _, b in chunks])
    got = kpool_indexer(q[rows], k[keys], gate[keys], ape, w[rows], cu([b - a for a, b in chunks]),
                        cu([b for _, b in chunks]), topk, kpool)
    assert torch.equal(got, whole[rows])


@pytest.mark.parametrize("accel", ["cpu", "npu-sim"], indirect=True)
def test_op_table_serves_the_reference(accel):
    """No device kernel computes the k-pool indexer (none published for CUDA or Ascend): the table's op is the
    reference on every accelerator, and it says so."""
    from slime.accelerator.ops import reference_op

    assert accel.ops.kpool_indexer is reference_op("kpool_indexer")
    assert accel.ops.source("kpool_indexer") == "reference"
    torch.manual_seed(1)
    q, k = torch.randn(9, 2, 4), torch.randn(9, 4)
    out = accel.ops.kpool_indexer(q, k, torch.randn(9, 4), torch.randn(2, 4), torch.randn(9, 2), cu([9]), cu([9]), 4, 2)
    assert out.shape == (9, 5) and (out[8, :4] >= 0).all()


@pytest.mark.parametrize("bad, match", [
    (dict(topk=5), "multiple of kpool"), (dict(ape=torch.zeros(3, 4)), "ape must be"),
    (dict(gate=torch.zeros(9, 3)), "gate"), (dict(k=torch.zeros(9, 2, 4)), "one shared key head"),
])
def test_bad_inputs_name_the_problem(bad, match):
    args = dict(q=torch.zeros(9, 2, 4), k=torch.zeros(9, 4), gate=torch.zeros(9, 4), ape=torch.zeros(2, 4),
                weights=torch.zeros(9, 2), cu_seqlens_q=cu([9]), cu_seqlens_k=cu([9]), topk=4, kpool=2)
    with pytest.raises(ValueError, match=match):
        kpool_indexer(**(args | bad))


def test_the_engines_transformers_patch_gives_the_ops_tie_rule():
    """With slime's transformers patch set applied (as the embedded engine runs transformers' model), the
    indexer keeps the lowest pools among equal scores, like the op: here every pool key is 0, so all scores tie."""
    from slime.accelerator import get_accelerator
    from slime.accelerator.patches import is_applied

    acc = get_accelerator()
    was_applied = is_applied(acc.name, "transformers")
    assert "glm5_next_indexer_stable_topk" in acc.apply_patches("transformers")
    try:
        indexer = make_indexer(8, 4, True, torch.float64, seed=1)
        with torch.no_grad():
            indexer.k_norm.weight.zero_()
            indexer.k_norm.bias.zero_()
        g = torch.Generator().manual_seed(2)
        x = torch.randn(22, HIDDEN, generator=g, dtype=torch.float64)
        q_resid = torch.randn(22, Q_LORA, generator=g, dtype=torch.float64)
        want = indexer(x[None], q_resid[None], torch.ones(1, 22, dtype=torch.bool), None)[0].to(torch.int32)
        got = run_op(indexer, x, q_resid, cu([22]), cu([22]), 8, 4, True)
        assert torch.equal(got, want)
        assert got[21].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 20, 21, -1]  # pools 0 and 1, then the tail
    finally:
        if not was_applied:
            acc.revert_patches("transformers")
