"""The trainer rank in-process (world size 1, no Ray) on the tiny GLM-5 checkpoint: packed log-probs
match transformers, a train step moves the policy the right way, checkpoints restore exactly."""

import os
import random
import time

import pytest
import torch

from slime.backends.megatron.data import RolloutBatch
from slime.config.arguments import parse_args


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from slime_plugins.models.glm5.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "glm5"))


@pytest.fixture(scope="module")
def actor_and_args(tiny_ckpt, tmp_path_factory):
    from slime.backends.megatron.actor import MegatronTrainRayActor

    save = tmp_path_factory.mktemp("save")
    args = parse_args(["--hf-checkpoint", tiny_ckpt, "--num-rollout", "4", "--global-batch-size", "6",
                       "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24", "--lr", "3e-3",
                       "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "k3", "--save", str(save)])
    actor = MegatronTrainRayActor(1, 0)
    assert actor.init(args, with_ref=args.use_ref_model) == 0
    from megatron.core import parallel_state as ps

    assert ps.get_expert_tensor_parallel_world_size() == args.expert_tensor_parallel_size == 1  # passed through
    return actor, args


def _batch(seed=0, n=6):
    rng = random.Random(seed)
    seqs = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 13))] for _ in range(n)]
    resp = [rng.randint(1, len(s) - 1) for s in seqs]
    masks = [[int(rng.random() > 0.2) for _ in range(r)] for r in resp]
    for m in masks:
        m[0] = 1
    return RolloutBatch(tokens=seqs, response_lengths=resp, rewards=[float(i % 2) for i in range(n)], loss_masks=masks)


def test_packed_log_probs_match_transformers(actor_and_args, tiny_ckpt):
    from transformers import AutoModelForCausalLM

    actor, _ = actor_and_args
    batch = _batch(1)
    out = actor.compute_log_probs(batch)["log_probs"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()  # MoE grouped mm has no float64
    with torch.no_grad():
        for i, (s, r) in enumerate(zip(batch.tokens, batch.response_lengths)):
            logp = torch.log_softmax(hf(torch.tensor([s])).logits[0].double(), -1)
            expect = torch.stack([logp[j - 1, s[j]] for j in range(len(s) - r, len(s))])
            got = out["old_log_probs"][i]
            assert got.shape == (r,)
            torch.testing.assert_close(got.double(), expect, atol=2e-5, rtol=0)  # two float32 implementations, one sample vs packed
            # the reference starts equal to the policy
            torch.testing.assert_close(out["ref_log_probs"][i], got, atol=0, rtol=0)


def test_train_step_raises_logprob_of_positive_advantage(actor_and_args):
    actor, _ = actor_and_args
    batch = _batch(2)
    lp = actor.compute_log_probs(batch)["log_probs"]
    batch.old_log_probs = [lp["old_log_probs"][i] for i in range(len(batch))]
    batch.ref_log_probs = [lp["ref_log_probs"][i] for i in range(len(batch))]
    sign = [1.0 if i % 2 else -1.0 for i in range(len(batch))]
    batch.advantages = [torch.full((r,), s) for r, s in zip(batch.response_lengths, sign)]
    m = actor.train(0, batch)
    assert m["train/steps"] == 1 and m["train/grad_norm"] > 0 and torch.isfinite(torch.tensor(m["train/loss"]))
    assert m["train/kl"] == pytest.approx(0.0, abs=1e-6) and m["train/clip_frac"] == 0.0  # first step: ratio 1
    after = actor.compute_log_probs(batch)["log_probs"]["old_log_probs"]
    delta = [float(((after[i] - batch.old_log_probs[i]) * torch.tensor(batch.loss_masks[i])).sum())
             for i in range(len(batch))]
    # positive-advantage samples gain log-probability on average, negative ones lose it
    assert sum(d for d, s in zip(delta, sign) if s > 0) > 0 > sum(d for d, s in zip(delta, sign) if s < 0)


def _optimizer_state(actor) -> dict[str, torch.Tensor]:
    """Adam moments of every parameter, by parameter name."""
    names = {id(p): n for n, p in actor.model.module.named_parameters()}
    out = {}
    for sub in actor.optimizer.chained_optimizers:
        index = getattr(sub, "model_param_group_index_map", None)  # distributed optimizer: this rank's shards
        if index is None:
            pairs = [(names[id(p)], p) for p in sub.optimizer.state]
        else:
            pairs = [(names[id(mp)], sub.optimizer.param_groups[g]["params"][o]) for mp, (g, o) in index.items()]
        for name, p in pairs:
            for k, v in sub.optimizer.state[p].items():
                if torch.is_tensor(v) and v.numel() > 1:
                    out[f"{name}.{k}"] = v.clone()
    return out


def _train_once(actor, seed):
    batch = _batch(seed)
    lp = actor.compute_log_probs(batch)["log_probs"]["old_log_probs"]
    batch.old_log_probs = [lp[i] for i in range(len(batch))]
    batch.advantages = [torch.ones(r) for r in batch.response_lengths]
    return actor.train(4, batch)


def test_checkpoint_restores_model_optimizer_rng(actor_and_args):
    """torch_dist save + load at the same layout restores weights, Adam moments and RNG exactly; Megatron's
    directory layout; --no-load-optim / --no-load-rng / --finetune restore only what they say."""
    from slime.backends.megatron.checkpoint import torch_dist as ckpt
    from slime.backends.megatron.model_setup import host_copy

    actor, args = actor_and_args
    actor.save(3, {"data_source": {"offset": 12, "epoch": 1}})
    assert open(os.path.join(args.save, "latest_checkpointed_iteration.txt")).read() == "3"
    assert {"metadata.json", "common.pt"} <= set(os.listdir(os.path.join(args.save, "iter_0000003")))  # torch_dist
    saved, saved_opt = host_copy(actor.model), _optimizer_state(actor)
    assert saved_opt and all(v.abs().sum() > 0 for v in saved_opt.values() if v.dtype.is_floating_point)
    rng_after_save = torch.rand(3)
    _train_once(actor, 3)
    assert any(not torch.equal(saved[k], v) for k, v in host_copy(actor.model).items())
    moved_opt = _optimizer_state(actor)
    resumed = ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())
    assert resumed.start_rollout_id == 4 and resumed.extra_state == {"data_source": {"offset": 12, "epoch": 1}}
    assert resumed.restored == ("model", "optimizer", "rng")
    for k, v in host_copy(actor.model).items():
        assert torch.equal(saved[k], v), k
    for k, v in _optimizer_state(actor).items():
        assert torch.equal(saved_opt[k], v), k
    torch.testing.assert_close(torch.rand(3), rng_after_save, atol=0, rtol=0)  # RNG continues as after save

    # --no-load-optim --no-load-rng: weights only; the moments stay those of the later step
    _train_once(actor, 3)
    moved_opt = _optimizer_state(actor)
    r = ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout(), ckpt.LoadOptions(optimizer=False, rng=False))
    assert r.restored == ("model",) and r.start_rollout_id == 4
    assert all(torch.equal(saved[k], v) for k, v in host_copy(actor.model).items())
    assert all(torch.equal(moved_opt[k], v) for k, v in _optimizer_state(actor).items())
    assert not torch.equal(torch.rand(3), rng_after_save)
    # --finetune: weights only, from rollout 0 without the run's extra state
    r = ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout(), ckpt.LoadOptions(finetune=True))
    assert (r.start_rollout_id, r.extra_state, r.restored) == (0, {}, ("model",))
    ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())  # back to the saved state for later tests


def test_crash_mid_save_keeps_the_previous_checkpoint(actor_and_args, monkeypatch):
    """A write that fails after the first shard file: save raises, the tracker still names the previous
    checkpoint, no iter directory appears for the failed one, and the previous one loads; the next save
    replaces the partial temp directory."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from slime.backends.megatron.checkpoint import torch_dist as ckpt
    from slime.backends.megatron.model_setup import host_copy

    actor, args = actor_and_args
    actor.save(3, {"data_source": {"offset": 12}})
    saved = host_copy(actor.model)
    original = FileSystemWriterAsync.write_preloaded_data
    calls = []

    def fail_after_first_file(transform_list, local_proc_idx, *rest, **kw):
        calls.append(local_proc_idx)
        if len(calls) > 1:
            raise OSError("no space left on device (injected)")
        return original(transform_list, local_proc_idx, *rest, **kw)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(fail_after_first_file))
    _train_once(actor, 5)
    with pytest.raises(Exception, match="injected"):
        actor.save(5, {"data_source": {"offset": 20}})
    assert len(calls) == 2 and any(f.endswith(".distcp") for f in os.listdir(os.path.join(args.save, ".tmp_iter_0000005")))
    assert open(os.path.join(args.save, "latest_checkpointed_iteration.txt")).read() == "3"
    assert not os.path.exists(os.path.join(args.save, "iter_0000005"))
    resumed = ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())
    assert resumed.start_rollout_id == 4 and resumed.extra_state == {"data_source": {"offset": 12}}
    assert all(torch.equal(saved[k], v) for k, v in host_copy(actor.model).items())
    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", original)
    actor.save(5, {})
    assert open(os.path.join(args.save, "latest_checkpointed_iteration.txt")).read() == "5"
    assert not os.path.exists(os.path.join(args.save, ".tmp_iter_0000005"))
    ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())


def test_former_per_rank_checkpoint_is_still_read(actor_and_args, tmp_path):
    """slime's former format (iter_*/rank_00000.pt + extra.pt + meta.json) loads at the layout that wrote it;
    at another layout it is one line naming the fix."""
    import json

    from slime.backends.megatron.checkpoint import torch_dist as ckpt
    from slime.backends.megatron.model_setup import host_copy

    actor, _ = actor_and_args
    d = tmp_path / "old" / "iter_0000002"
    d.mkdir(parents=True)
    torch.save({"model": actor.model.state_dict(), "optimizer": actor.optimizer.state_dict(), "rng": ckpt.rng_state()},
               d / "rank_00000.pt")
    torch.save({"rollout_id": 2, "extra": {"data_source": {"offset": 4}}}, d / "extra.pt")
    (d / "meta.json").write_text(json.dumps({"rollout_id": 2, "layout": actor._layout()}))
    (tmp_path / "old" / "latest_checkpointed_iteration.txt").write_text("2")
    saved = host_copy(actor.model)
    _train_once(actor, 6)
    r = ckpt.load(str(tmp_path / "old"), actor.model, actor.optimizer, 0, actor._layout())
    assert (r.start_rollout_id, r.extra_state) == (3, {"data_source": {"offset": 4}})
    assert all(torch.equal(saved[k], v) for k, v in host_copy(actor.model).items())
    with pytest.raises(ValueError, match="former per-rank format.*same trainer world size"):
        ckpt.load(str(tmp_path / "old"), actor.model, actor.optimizer, 0, {**actor._layout(), "tp": 2})


def test_ref_load_reads_a_torch_dist_checkpoint(actor_and_args):
    """--ref-load DIR of torch_dist: the reference is the checkpoint's model, not --hf-checkpoint's."""
    import argparse

    from slime.backends.megatron import model_setup

    actor, args = actor_and_args
    saved = model_setup.host_copy(actor.model)
    ref = model_setup.load_reference(argparse.Namespace(**{**vars(args), "ref_load": args.save}))
    got = model_setup.host_copy(ref)
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    hf = model_setup.host_copy(model_setup.load_reference(args))  # --ref-load = the HF dir: differs after training
    assert any(not torch.equal(hf[k], saved[k]) for k in saved)


def test_log_probs_at_rollout_temperature_equal_the_engines(actor_and_args, tiny_ckpt, monkeypatch):
    """At --rollout-temperature 0.7 the trainer's old, reference and actor log-probs are those of the
    engine's sampling distribution (log_softmax(logits / T)), as the engine reports them."""
    from slime.backends.embedded import EmbeddedEngine, EngineConfig
    from slime.backends.megatron import model_setup

    actor, args = actor_and_args
    temperature = 0.7
    # Short sequences (<= index_topk = 8 tokens): DSA keeps every key, so both sides see the same keys.
    prompts = [[5, 17, 42], [7, 3], [250, 11, 9, 4, 300], [8], [60, 61, 62, 63], [101, 7, 7]]  # 6: the global batch

    def engine_samples(engine, seed):
        reqs = [engine.submit(engine.make_request(p, {"max_new_tokens": 8 - len(p), "temperature": temperature,
                                                      "sampling_seed": seed + i, "ignore_eos": True}, True))
                for i, p in enumerate(prompts)]
        outs = []
        for r in reqs:
            assert r.done.wait(60)
            outs.append(engine.response(r))
        batch = RolloutBatch(tokens=[p + o["output_ids"] for p, o in zip(prompts, outs)],
                             response_lengths=[len(o["output_ids"]) for o in outs], rewards=[float(i % 2) for i in range(6)],
                             loss_masks=[[1] * len(o["output_ids"]) for o in outs])
        expect = [torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]], dtype=torch.float64) for o in outs]
        return batch, expect

    engine = EmbeddedEngine(EngineConfig(model_path=tiny_ckpt))  # float32, the checkpoint = the reference policy
    try:
        assert engine.model_info()["weights_checksum"] is True  # advertises the trainer's post-sync check
        ref_batch, ref_expect = engine_samples(engine, seed=11)
        for bucket in model_setup.export_hf(actor.model, 1 << 30):  # the actor's weights (trained by earlier tests)
            engine.update_from_named_tensors(bucket, "actor")
        batch, expect = engine_samples(engine, seed=21)
    finally:
        engine.shutdown()

    untempered = actor.compute_log_probs(batch)["log_probs"]["old_log_probs"]
    monkeypatch.setattr(args, "rollout_temperature", temperature)
    out = actor.compute_log_probs(batch)["log_probs"]
    ref = actor.compute_log_probs(ref_batch)["log_probs"]["ref_log_probs"]
    for i in range(len(prompts)):
        torch.testing.assert_close(out["old_log_probs"][i].double(), expect[i], atol=1e-4, rtol=0)
        torch.testing.assert_close(ref[i].double(), ref_expect[i], atol=1e-4, rtol=0)
    # Without the temperature the two sides disagree (the check above can fail).
    assert max(float((untempered[i].double() - e).abs().max()) for i, e in enumerate(expect)) > 1e-2
    # The actor's log-probs in the loss use the same temperature: first-step ratio 1, nothing clipped.
    batch.old_log_probs = [out["old_log_probs"][i] for i in range(len(batch))]
    batch.ref_log_probs = [out["ref_log_probs"][i] for i in range(len(batch))]
    batch.advantages = [torch.ones(r) for r in batch.response_lengths]
    m = actor.train(5, batch)
    assert m["train/clip_frac"] == 0.0 and torch.isfinite(torch.tensor(m["train/loss"])) and m["train/grad_norm"] > 0


def test_reused_train_log_probs_give_the_same_step_as_a_separate_old_forward(actor_and_args, tmp_path):
    """One optimizer step per rollout: train() on its own forward's detached log-probs (no old-policy
    forward) gives bit-identical loss, metrics, grad norm and weights to train() on compute_log_probs'
    old log-probs; the train-rollout mismatch metric equals the driver's formula on the separate forward's."""
    from slime.backends.megatron.checkpoint import torch_dist as ckpt
    from slime.backends.megatron.model_setup import host_copy
    from slime.train import reuses_train_log_probs

    actor, args = actor_and_args
    assert reuses_train_log_probs(args, 6) and not reuses_train_log_probs(args, 12)  # 12 samples: two steps
    actor.save(7, {})
    rng = random.Random(5)

    def fresh_batch(reuse):
        b = _batch(4)
        b.rollout_log_probs = [[-rng.random() for _ in range(r)] for r in b.response_lengths]
        b.reuse_train_log_probs = reuse
        return b

    rng_state = rng.getstate()
    separate = fresh_batch(False)
    lp = actor.compute_log_probs(separate)["log_probs"]
    separate.old_log_probs = [lp["old_log_probs"][i] for i in range(len(separate))]
    separate.ref_log_probs = [lp["ref_log_probs"][i] for i in range(len(separate))]
    driver_metrics = _all_advantages(args, separate)
    m_separate = actor.train(8, separate)
    w_separate = host_copy(actor.model)

    ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())  # back to the same weights/optimizer
    rng.setstate(rng_state)
    reused = fresh_batch(True)
    lp = actor.compute_log_probs(reused)
    assert set(lp["log_probs"]) == {"ref_log_probs"}  # no old-policy forward ran
    reused.ref_log_probs = [lp["log_probs"]["ref_log_probs"][i] for i in range(len(reused))]
    assert "train_rollout_logprob_abs_diff" not in _all_advantages(args, reused)  # the trainer reports it
    m_reused = actor.train(8, reused)

    for key in ("train/loss", "train/pg_loss", "train/kl", "train/ppo_kl", "train/clip_frac", "train/grad_norm"):
        assert m_reused[key] == m_separate[key], key
    assert m_reused["train/ppo_kl"] == 0.0 and m_reused["train/clip_frac"] == 0.0
    for k, v in host_copy(actor.model).items():
        assert torch.equal(w_separate[k], v), k
    # same tokens and values; the driver sums in float32, the trainer per micro-batch in float64
    for key in ("train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max"):
        assert m_reused[key] == pytest.approx(driver_metrics[key], rel=1e-6), key
    assert all(m_reused[f"time/train_{k}"] >= 0 for k in ("pack", "forward", "backward", "optimizer"))
    with pytest.raises(ValueError, match="one optimizer step per rollout"):
        actor.train(9, RolloutBatch(**{**vars(_batch(6, n=12)), "reuse_train_log_probs": True}))


def test_train_rollout_from_the_payload_equals_the_driver_path(actor_and_args):
    """The trainer-side rollout (object-store payload -> log-probs -> advantages -> train) gives the same
    loss, metrics and weights as the former driver path (compute_log_probs, the advantages, train)."""
    from types import SimpleNamespace

    from slime.backends.megatron.checkpoint import torch_dist as ckpt
    from slime.backends.megatron.model_setup import host_copy
    from slime.backends.megatron.rollout_data import batch_from_payload, pack_samples

    actor, args = actor_and_args
    actor.save(9, {})
    rng = random.Random(11)
    base = _batch(6)
    samples = [SimpleNamespace(tokens=t, response_length=r, reward=float(rng.random()), loss_mask=m,
                               rollout_log_probs=[-rng.random() for _ in range(r)])
               for t, r, m in zip(base.tokens, base.response_lengths, base.loss_masks)]
    payload = pack_samples(samples)
    driver = batch_from_payload(payload)
    assert driver.tokens == base.tokens and driver.loss_masks == base.loss_masks
    lp = actor.compute_log_probs(driver)["log_probs"]
    driver.old_log_probs = [lp["old_log_probs"][i] for i in range(len(driver))]
    driver.ref_log_probs = [lp["ref_log_probs"][i] for i in range(len(driver))]
    m_driver = _all_advantages(args, driver)
    m_driver.update(actor.train(10, driver))
    w_driver = host_copy(actor.model)

    ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())
    m_trainer = actor.train_rollout(10, payload, False)
    for key in ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm", "train/advantage_abs_mean",
                "train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff_max"):
        assert m_trainer[key] == pytest.approx(m_driver[key], rel=1e-6, abs=1e-9), key
    for k, v in host_copy(actor.model).items():
        torch.testing.assert_close(v, w_driver[k], rtol=1e-6, atol=1e-8, msg=k)
    assert m_trainer["time/log_probs"] >= m_trainer["time/log_probs_old"] > 0
    ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())


def _all_advantages(args, batch) -> dict[str, float]:
    """Advantages of the whole rollout in one process (the loop computes them on the trainer ranks, each for
    its share); returns the advantage metrics."""
    from slime.backends.megatron.rollout_data import share_advantages

    return share_advantages(args, batch, range(len(batch)))


@pytest.fixture
def async_saves(actor_and_args, tmp_path):
    """The module's actor with --async-save into a fresh --save root (and back afterwards)."""
    actor, args = actor_and_args
    before = args.save, args.async_save
    args.save, args.async_save = str(tmp_path / "async"), True
    yield actor, args
    actor.finish_save()
    args.save, args.async_save = before


def _held_writes(monkeypatch):
    """Every torch_dist file write waits until the returned event is set (the writes of an async save stay in
    flight meanwhile)."""
    import threading

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original, release = FileSystemWriterAsync.write_preloaded_data, threading.Event()

    def held(*a, **kw):
        assert release.wait(60), "never released"
        return original(*a, **kw)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(held))
    return release


def _tracker(root) -> str | None:
    path = os.path.join(root, "latest_checkpointed_iteration.txt")
    return open(path).read() if os.path.exists(path) else None


def test_async_save_writes_the_state_of_the_save_while_training_goes_on(async_saves, tmp_path, monkeypatch):
    """--async-save: save returns with the files still to be written (held here until the step below is done)
    and nothing published; a train step then changes most weights; once finished, the checkpoint holds the state
    at the save, byte for byte the files a synchronous save of that state writes (the DCP metadata differs only in
    its own path and save id)."""
    from torch.distributed.checkpoint import FileSystemReader

    from slime.backends.megatron.checkpoint import torch_dist as ckpt
    from slime.backends.megatron.model_setup import host_copy

    actor, args = async_saves
    sync_root = str(tmp_path / "sync")
    ckpt.save(sync_root, 7, actor.model, actor.optimizer, 0, actor._layout(), {"data_source": {"offset": 7}},
              vocab_divisible_by=args.make_vocab_size_divisible_by)
    saved = host_copy(actor.model)
    trained_event = _held_writes(monkeypatch)
    metrics = actor.save(7, {"data_source": {"offset": 7}})
    assert metrics["time/save_staging"] > 0 and "time/async_save_finish" not in metrics
    assert _tracker(args.save) is None and not os.path.exists(os.path.join(args.save, "iter_0000007"))
    _train_once(actor, 7)
    trained = host_copy(actor.model)
    changed = [k for k in saved if not torch.equal(saved[k], trained[k])]
    assert len(changed) >= len(saved) // 2, (len(changed), len(saved))  # the step moved most tensors
    trained_event.set()
    finished = actor.finish_save()
    assert finished["time/async_save_finish"] >= finished["time/async_save_wait"] >= 0
    assert _tracker(args.save) == "7" and not os.path.exists(os.path.join(args.save, ".tmp_iter_0000007"))
    a, b = os.path.join(sync_root, "iter_0000007"), os.path.join(args.save, "iter_0000007")
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        if name != ".metadata":
            assert open(os.path.join(a, name), "rb").read() == open(os.path.join(b, name), "rb").read(), name
    ma, mb = FileSystemReader(a).read_metadata(), FileSystemReader(b).read_metadata()
    assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
    resumed = ckpt.load(args.save, actor.model, actor.optimizer, 0, actor._layout())
    assert resumed.start_rollout_id == 8 and resumed.extra_state == {"data_source": {"offset": 7}}
    assert all(torch.equal(saved[k], v) for k, v in host_copy(actor.model).items())
    assert actor.finish_save() == {}  # nothing pending


def test_async_save_is_published_only_once_written_and_before_the_next_save(async_saves, monkeypatch):
    """A non-blocking finish (each train_rollout's) leaves a save whose files are still being written; the next
    save publishes it first, then starts its own."""
    import threading

    actor, args = async_saves
    release = _held_writes(monkeypatch)
    actor.save(8, {})
    assert actor.finish_save(blocking=False) == {} and _tracker(args.save) is None
    release.set()
    deadline = time.monotonic() + 60
    while not (finished := actor.finish_save(blocking=False)):
        assert time.monotonic() < deadline, "the writes never finished"
        time.sleep(0.01)
    assert _tracker(args.save) == "8" and "time/async_save_finish" in finished
    release.clear()
    actor.save(9, {})  # held again: publishing it waits for the release
    threading.Timer(0.3, release.set).start()
    metrics = actor.save(10, {})  # publishes 9 first
    assert metrics["time/async_save_wait"] > 0.1 and _tracker(args.save) == "9"
    assert actor.finish_save()["time/async_save_finish"] > 0 and _tracker(args.save) == "10"
    assert sorted(n for n in os.listdir(args.save) if n.startswith("iter_")) == ["iter_0000008", "iter_0000009",
                                                                               "iter_0000010"]


def test_async_save_write_failure_is_raised_when_finished_and_publishes_nothing(async_saves, monkeypatch):
    """A write that fails in the background: finishing raises it (megatron's CheckpointException naming the
    error), the tracker still names the previous checkpoint, and no iteration directory appears for it."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    actor, args = async_saves
    actor.save(11, {})
    actor.finish_save()
    original = FileSystemWriterAsync.write_preloaded_data

    def fail(*a, **kw):
        raise OSError("no space left on device (injected)")

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(fail))
    actor.save(12, {})
    with pytest.raises(Exception, match="injected"):
        actor.finish_save()
    assert _tracker(args.save) == "11" and not os.path.exists(os.path.join(args.save, "iter_0000012"))
    assert actor.finish_save() == {}  # the failed save is not pending any more
    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", original)
    actor.save(12, {})  # the next save replaces the partial temp directory
    actor.finish_save()
    assert _tracker(args.save) == "12" and not os.path.exists(os.path.join(args.save, ".tmp_iter_0000012"))


def test_async_save_needs_save(tiny_ckpt, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--hf-checkpoint", tiny_ckpt, "--num-rollout", "2", "--global-batch-size", "6", "--async-save"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--async-save needs --save DIR")
