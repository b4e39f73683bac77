"""Packing (THD, B=1), micro-batching under a token budget, and response log-prob gathering."""

import random

import pytest
import torch

from slime.accelerator import get_accelerator
from slime.backends.megatron import data as D


def _batch(seqs, resp_lens, masks=None):
    masks = masks or [[1] * r for r in resp_lens]
    return D.RolloutBatch(tokens=seqs, response_lengths=resp_lens, rewards=[0.0] * len(seqs), loss_masks=masks)


def test_pack_hand_example():
    # sample A: prompt [5, 6], response [7, 8, 9]; sample B: prompt [3], response [4]
    b = _batch([[5, 6, 7, 8, 9], [3, 4]], [3, 1], [[1, 0, 1], [1]])
    mb = D.pack(b, [0, 1], pad_multiple=4)
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 3, 4, 0]]  # 7 real + 1 pad to a multiple of 4
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0]]
    assert mb.cu_seqlens.tolist() == [0, 5, 7, 8] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 5 and mb.num_tokens == 7
    # A's response tokens 7,8,9 are predicted by rows 1,2,3; B's token 4 by row 5
    assert mb.response_logit_rows.tolist() == [1, 2, 3, 5]
    assert mb.response_targets.tolist() == [7, 8, 9, 4]
    assert mb.loss_mask.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert mb.response_lengths == [3, 1]
    assert D.pack(b, [1]).tokens.tolist() == [[3, 4]]  # no padding by default


def test_rollout_batch_validation():
    with pytest.raises(ValueError, match="response_length 2 must be in"):
        _batch([[1, 2]], [2])
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        _batch([[1, 2, 3]], [2], [[1]])
    with pytest.raises(ValueError, match="rewards has 0 entries"):
        D.RolloutBatch(tokens=[[1, 2]], response_lengths=[1], rewards=[], loss_masks=[[1]])
    sub = _batch([[1, 2], [3, 4, 5]], [1, 2]).select([1])
    assert sub.tokens == [[3, 4, 5]] and sub.response_lengths == [2]


def test_packed_log_probs_equal_unpacked_float64():
    """A context-free 'model' (logits depend on the token only) makes packed and per-sample logits
    comparable row by row; gathered log-probs must equal a float64 per-sample reference."""
    g = torch.Generator().manual_seed(1)
    vocab = 37
    table = torch.randn(vocab, vocab, generator=g, dtype=torch.float64)
    rng = random.Random(0)
    seqs, resp = [], []
    for _ in range(5):
        n = rng.randint(2, 11)
        seqs.append([rng.randrange(vocab) for _ in range(n)])
        resp.append(rng.randint(1, n - 1))
    b = _batch(seqs, resp)
    mb = D.pack(b, range(5), pad_multiple=8)
    logits = table[mb.tokens]  # [1, T, V]
    lp, ent = D.response_log_probs(logits.float(), mb, get_accelerator().ops, chunk_size=3)
    expect_lp, expect_ent = [], []
    for s, r in zip(seqs, resp):
        logp = torch.log_softmax(table[torch.tensor(s)], -1)  # float64, unpacked
        for j in range(len(s) - r, len(s)):
            expect_lp.append(logp[j - 1, s[j]])
            expect_ent.append(-(logp[j - 1].exp() * logp[j - 1]).sum())
    torch.testing.assert_close(lp.double(), torch.stack(expect_lp), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), torch.stack(expect_ent), atol=1e-5, rtol=0)
    assert [len(x) for x in D.split_per_sample(lp, mb.response_lengths)] == resp


def test_dynamic_micro_batches_budget_and_cover():
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 17))]
        budget = rng.randint(20, 90)
        min_count = rng.randint(1, len(lengths))
        bins = D.dynamic_micro_batches(lengths, budget, min_count)
        flat = sorted(i for b in bins for i in b)
        assert flat == list(range(len(lengths)))  # each sample exactly once
        assert len(bins) >= min_count and all(bins)
        for b in bins:  # within budget unless a single over-long sample
            assert sum(lengths[i] for i in b) <= budget or len(b) == 1
            assert b == sorted(b)
        ffd = D.first_fit_decreasing(lengths, budget)
        assert len(D.dynamic_micro_batches(lengths, budget)) == len(ffd)


def test_dynamic_micro_batches_hand_example():
    # budget 10: FFD packs 6+4 and 5+3 and 9 -> 3 bins; asked for 4, the 2-sample bin splits
    assert D.first_fit_decreasing([6, 5, 4, 3, 9], 10) == [[4], [0, 2], [1, 3]]
    bins = D.dynamic_micro_batches([6, 5, 4, 3, 9], 10, min_count=4)
    assert len(bins) == 4 and sorted(map(tuple, bins)) == [(0,), (1, 3), (2,), (4,)]
    with pytest.raises(ValueError, match="cannot make 3"):
        D.dynamic_micro_batches([1, 2], 10, 3)


def test_steps_and_dp_shards():
    assert D.step_indices(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert D.dp_shard([0, 1, 2, 3, 4, 5], 1, 2) == [1, 3, 5]
    assert D.fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        D.step_indices(7, 4)


def test_mtp_targets_and_loss_hand_example():
    """MTP depth k at response row r predicts token r + k + 1 of the same sample; the loss is Megatron's masked
    cross entropy times scale / depths, reduced like the RL loss (per-sample mean or per token), vs float64."""
    from slime.backends.megatron.loss import mtp_loss

    # sample A: prompt [5, 6], response [7, 8, 9]; sample B: prompt [3], response [4]; padded to 8
    b = _batch([[5, 6, 7, 8, 9], [3, 4]], [3, 1], [[1, 0, 1], [1]])
    mb = D.pack(b, [0, 1], pad_multiple=4)
    targets, valid = D.mtp_targets(mb, 1)
    # A's rows predict 7, 8, 9 at the main head; depth 1 predicts 8, 9, (past A's end); B's one row: past its end
    assert targets.tolist() == [8, 9, 0, 0] and valid.tolist() == [1, 1, 0, 0]
    targets2, valid2 = D.mtp_targets(mb, 2)
    assert targets2.tolist()[:1] == [9] and valid2.tolist() == [1, 0, 0, 0]
    lp = torch.log(torch.tensor([0.5, 0.25, 0.1, 0.2], dtype=torch.float64))
    mask = mb.loss_mask.double() * valid.double()  # [1, 0, 0, 0]: A's second response token is masked out
    loss, metric = mtp_loss([lp], [mask], mb.response_lengths, normalizer=2.0, scale=0.3, per_token=False)
    # per-sample means: A = -log 0.5 over its one counted token, B = 0 (no target); sum / 2 samples x 0.3
    assert float(loss) == pytest.approx(0.3 * (-torch.log(torch.tensor(0.5)).item()) / 2)
    assert metric == pytest.approx(-torch.log(torch.tensor(0.5)).item())
    mask = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    loss, _ = mtp_loss([lp, lp], [mask, mask], mb.response_lengths, normalizer=4.0, scale=0.3, per_token=True)
    assert float(loss) == pytest.approx(0.3 / 2 * 2 * -(torch.log(torch.tensor(0.5)) + torch.log(torch.tensor(0.25))).item() / 4)
