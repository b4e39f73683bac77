"""The reference ops reproduce transformers' GLM-5 (glm_moe_dsa) modules exactly: router (incl. ties),
DSA indexer (with slime's tie rule patched in: ties -> lowest key position, in decode and full forward),
RMSNorm, interleaved RoPE and the DSA-masked eager attention."""

from __future__ import annotations

import pytest
import torch

from slime.accelerator.ops import reference as R

glm = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")


def tiny(**overrides):
    from slime_plugins.models.glm5.tiny import tiny_config

    return tiny_config("glm_moe_dsa", **overrides)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_moe_route_equals_transformers_router_with_ties(n_group, topk_group):
    cfg = tiny(n_routed_experts=16, num_experts_per_tok=3, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5)
    router = glm.GlmMoeDsaTopkRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.weight[5] = router.weight[3]  # experts 3 and 5 tie on every token
        router.weight[9] = router.weight[3]
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
        router.e_score_correction_bias[[3, 5, 9]] = 0.2
    hidden = torch.randn(13, cfg.hidden_size, generator=g)
    hidden[4] = 0  # every logit ties for this token
    logits, w_hf, idx_hf = router(hidden)
    w, idx = R.moe_route(logits, router.e_score_correction_bias, 3, n_group, topk_group, 2.5, True)
    assert torch.equal(idx, idx_hf), "expert choice (incl. tie order) differs from transformers"
    assert torch.equal(w, w_hf), "weights differ from transformers"


def test_rms_norm_equals_transformers_bitwise():
    norm = glm.GlmMoeDsaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48) + 0.5)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 48).to(dtype)
        n = norm.to(dtype)
        assert torch.equal(R.rms_norm(x, n.weight, 1e-5), n(x)), dtype


def test_interleaved_rotary_matches_transformers_up_to_the_documented_permutation():
    g = torch.Generator().manual_seed(1)
    rd = 8
    q = torch.randn(1, 3, 6, rd, generator=g, dtype=torch.float64)  # [B, H, S, rd]
    k = torch.randn(1, 1, 6, rd, generator=g, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    freqs = torch.arange(6, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None], emb.sin()[None]
    q_hf, k_hf = glm.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    to_thd = lambda t: t[0].transpose(0, 1)  # [S, H, rd]
    q_ours = R.apply_rotary(to_thd(q), cos[0], sin[0], rd, interleaved=True)
    k_ours = R.apply_rotary(to_thd(k), cos[0], sin[0], rd, interleaved=True)
    deinterleave = lambda t: torch.cat((t[..., 0::2], t[..., 1::2]), -1)
    torch.testing.assert_close(deinterleave(q_ours), to_thd(q_hf), rtol=0, atol=1e-12)
    scores_ours = torch.einsum("shd,thd->hst", q_ours, k_ours.expand(-1, 3, -1))
    scores_hf = torch.einsum("shd,thd->hst", to_thd(q_hf), to_thd(k_hf).expand(-1, 3, -1))
    torch.testing.assert_close(scores_ours, scores_hf, rtol=0, atol=1e-12)


@pytest.fixture
def stable_tie_indexer():
    """transformers' indexer with slime's "transformers" patch set (ties -> lowest position), as the
    embedded engine runs it; reverted afterwards unless something applied it before."""
    from slime.accelerator import get_accelerator
    from slime.accelerator.patches import is_applied

    acc = get_accelerator()
    was_applied = is_applied(acc.name, "transformers")
    assert "glm_moe_dsa_indexer_stable_topk" in acc.apply_patches("transformers")
    yield
    if not was_applied:
        acc.revert_patches("transformers")


def random_indexer(cfg, seed):
    idx_mod = glm.GlmMoeDsaIndexer(cfg, layer_idx=0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in idx_mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return idx_mod, g


def indexer_op_inputs(idx_mod, cfg, hidden, q_resid, cos, sin):
    """The module's projections + RoPE, as THD tensors for ops.lightning_indexer: q [S, H, D], k [S, D], w [S, H]."""
    s = hidden.shape[1]
    h, d, rd = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    with torch.no_grad():
        q = idx_mod.wq_b(q_resid).view(1, s, h, d)
        k = idx_mod.k_norm(idx_mod.wk(hidden)).unsqueeze(2)
        q_rot, k_rot = glm.apply_rotary_pos_emb_interleave(q[..., :rd], k[..., :rd], cos, sin, unsqueeze_dim=2)
        q = torch.cat((q_rot, q[..., rd:]), -1)[0]
        k = torch.cat((k_rot, k[..., rd:]), -1)[0, :, 0]
        weights = idx_mod.weights_proj(hidden)[0].float() * h**-0.5
    return q, k, weights


def test_lightning_indexer_equals_transformers_indexer(stable_tie_indexer):
    cfg = tiny(index_topk=5)
    idx_mod, g = random_indexer(cfg, 2)
    s = 12
    hidden = torch.randn(1, s, cfg.hidden_size, generator=g)
    q_resid = torch.randn(1, s, cfg.q_lora_rank, generator=g)
    rope = glm.GlmMoeDsaRotaryEmbedding(cfg)
    cos, sin = rope(hidden, torch.arange(s)[None])
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
    want = idx_mod(hidden, q_resid, (cos, sin), causal, None)[0]  # [S, min(topk, S)]

    # The same projections + RoPE as the module, then the op on THD tensors.
    q, k, weights = indexer_op_inputs(idx_mod, cfg, hidden, q_resid, cos, sin)
    cu = torch.tensor([0, s], dtype=torch.int32)
    got = R.lightning_indexer(q, k, weights, cu, cu, cfg.index_topk)
    for i in range(s):
        visible = [j for j in want[i].tolist() if j <= i]  # transformers also lists masked positions
        assert got[i].tolist() == visible + [-1] * (cfg.index_topk - len(visible)), i


def test_index_score_ties_keep_the_same_keys_in_decode_and_full_forward(stable_tie_indexer):
    """Engineered exact ties at the top-k cut: zero hidden states give zero indexer keys (k_norm bias 0),
    which score exactly 0 for every query, between positive and negative scores (gates of both signs),
    and zero queries score 0 on every key. The patched transformers indexer in cached decode steps (one
    query row each) and in one full forward, and ops.lightning_indexer on both shapes, keep the same keys:
    the highest scores, then the lowest positions among equal ones."""
    from transformers import DynamicCache

    cfg = tiny(index_topk=4)
    idx_mod, g = random_indexer(cfg, 5)
    with torch.no_grad():
        idx_mod.k_norm.bias.zero_()
    s, topk = 15, cfg.index_topk
    hidden = torch.randn(1, s, cfg.hidden_size, generator=g)
    hidden[0, [1, 2, 4, 5, 7, 9, 10, 12]] = 0
    q_resid = torch.randn(1, s, cfg.q_lora_rank, generator=g)
    cos, sin = glm.GlmMoeDsaRotaryEmbedding(cfg)(hidden, torch.arange(s)[None])
    q, k, weights = indexer_op_inputs(idx_mod, cfg, hidden, q_resid, cos, sin)

    # float64 scores and the rule by hand: best score first, lowest position among equal scores.
    scores = torch.einsum("sh,sht->st", weights.double(),
                          torch.einsum("shd,td->sht", q.double(), k.double()).mul(cfg.index_head_dim**-0.5).clamp_min(0))
    expected = [sorted(range(i + 1), key=lambda j: (-scores[i, j].item(), j))[:topk] for i in range(s)]
    ranked = [sorted(scores[i, : i + 1].tolist(), reverse=True) for i in range(s)]
    straddling = [i for i in range(topk, s) if ranked[i][topk - 1] == ranked[i][topk]]
    assert len(straddling) >= 3, f"the input must tie across the top-k cut, rows {straddling}"

    causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
    full_hf = idx_mod(hidden, q_resid, (cos, sin), causal, None)[0]
    cache = DynamicCache(config=cfg)
    decode_hf = [idx_mod(hidden[:, i:i + 1], q_resid[:, i:i + 1], (cos[:, i:i + 1], sin[:, i:i + 1]),
                         torch.ones(1, 1, i + 1, dtype=torch.bool), None, cache=cache)[0, 0] for i in range(s)]
    cu = torch.tensor([0, s], dtype=torch.int32)
    full_op = R.lightning_indexer(q, k, weights, cu, cu, topk)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i in range(s):
        decode_op = R.lightning_indexer(q[i:i + 1], k[: i + 1], weights[i:i + 1], one,
                                        torch.tensor([0, i + 1], dtype=torch.int32), topk)[0]
        want = expected[i]
        assert [j for j in full_hf[i].tolist() if j <= i] == want, f"transformers full forward, row {i}"
        assert decode_hf[i].tolist() == want, f"transformers decode step {i}"
        assert [j for j in full_op[i].tolist() if j >= 0] == want, f"ops.lightning_indexer full, row {i}"
        assert [j for j in decode_op.tolist() if j >= 0] == want, f"ops.lightning_indexer decode, row {i}"


def test_sparse_attention_equals_transformers_masked_eager_attention():
    g = torch.Generator().manual_seed(3)
    s, h, dqk, dv, topk = 9, 2, 12, 8, 4
    q = torch.randn(1, h, s, dqk, generator=g)
    k = torch.randn(1, h, s, dqk, generator=g)
    v = torch.randn(1, h, s, dv, generator=g)
    topk_idx = torch.stack([torch.randperm(s, generator=g)[:topk] for _ in range(s)]).to(torch.int32)
    index_mask = torch.ones(1, s, s, dtype=torch.bool).scatter(-1, topk_idx[None].long(), False).unsqueeze(1)
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None] & ~index_mask
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)

    class Module:
        num_key_value_groups = 1
        training = False

    want, _ = glm.eager_attention_forward(Module(), q, k, v, additive, scaling=dqk**-0.5)  # [1, S, H, Dv]
    cu = torch.tensor([0, s], dtype=torch.int32)
    got = R.sparse_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), topk_idx, cu, cu)
    rows_with_keys = mask[0, 0].any(-1)
    torch.testing.assert_close(got[rows_with_keys], want[0][rows_with_keys], rtol=1e-5, atol=1e-6)
    assert (got[~rows_with_keys] == 0).all(), "queries without a visible key give 0"


def test_transformers_patch_set_is_documented_and_the_same_on_every_accelerator():
    """The indexer patches everywhere; the KDA chunk fitting only on CPU (a device runs fla's kernel)."""
    from slime.accelerator.patches import patch_set

    for name in ("cpu", "cuda", "npu"):
        patches = {p.name: p for p in patch_set(name, "transformers")}  # glm5_next's only where transformers has it
        cpu_only = {"glm5_next_kda_fitted_chunk"} if name == "cpu" else set()
        assert set(patches) == {"glm_moe_dsa_indexer_stable_topk", "glm5_next_indexer_stable_topk"} | cpu_only
        patch = patches["glm_moe_dsa_indexer_stable_topk"]
        assert patch.versions == ">=5.2,<6"
        assert patch.targets == ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa:GlmMoeDsaIndexer.forward",)
        kpool = patches["glm5_next_indexer_stable_topk"]
        assert kpool.versions == ">=5.24,<6"
        assert kpool.targets == ("transformers.models.glm5_next.modeling_glm5_next:Glm5NextTextIndexer.forward",)
        assert all(getattr(p, f).strip() for p in patches.values() for f in ("why", "replaces", "remove_when"))


@pytest.mark.parametrize("length", [1, 7, 13, 16, 17, 40, 64, 65, 100])
def test_fitted_kda_chunk_equals_transformers_64_token_chunk(length):
    """The CPU patch's chunk (16 / 32 / 64 tokens, the smallest that holds the sequence) gives transformers'
    64-token-chunk KDA output and final state within float32 rounding (1e-5), with and without an initial state."""
    tk = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    from slime.accelerator.transformers_patches import _kda_fitted_chunk, fitted_chunk_size

    original = tk.chunk_kimi_delta_attention
    original = getattr(original, "__wrapped__", original) if getattr(original, "slime_fitted_chunk", False) else original
    fitted = _kda_fitted_chunk(original)
    assert fitted_chunk_size(length) == (16 if length <= 16 else 32 if length <= 32 else 64)
    g = torch.Generator().manual_seed(length)
    b, h, dk, dv = 2, 3, 8, 5
    q, k = (torch.randn(b, length, h, dk, generator=g) for _ in range(2))
    v = torch.randn(b, length, h, dv, generator=g)
    gate = -torch.rand(b, length, h, dk, generator=g) * 2  # log decays <= 0
    beta = torch.rand(b, length, h, generator=g)
    for state in (None, torch.randn(b, h, dk, dv, generator=g)):
        kwargs = dict(g=gate, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        want, want_state = original(q, k, v, **kwargs)
        got, got_state = fitted(q, k, v, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
