"""The arithmetic and plumbing of the performance benchmarks (not their figures): phase accounting of
rl_iteration, bucketing / subsets / shared-buffer packing of weight_sync, py-spy profile parsing."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import pytest
import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rl = _load("rl_iteration")
ts = _load("train_step")
ws = _load("weight_sync")
summary = _load("profile_summary")


def _record(i: int, gen: float, lp: float, train: float, sync: float, save: float, rollout: float, it: float):
    return {"rollout_id": i, "rollout/generate_time": gen, "time/rollout": rollout, "time/log_probs": lp,
            "time/train": train, "time/weight_sync": sync, "time/save": save, "time/iteration": it,
            "rollout/response_tokens": 512.0, "train/tokens": 1100.0, "weight_sync/bytes": 2.0**20}


def test_phases_split_the_iteration_exactly():
    p = rl.phases(_record(0, gen=0.20, lp=0.08, train=0.19, sync=0.05, save=0.01, rollout=0.21, it=0.60))
    assert p["handoff"] == pytest.approx(0.01)
    assert p["driver"] == pytest.approx(0.60 - (0.20 + 0.08 + 0.19 + 0.01 + 0.05 + 0.01))
    parts = sum(p[k] for _, k in rl.COMPUTE + rl.OVERHEAD)
    assert parts == pytest.approx(p["iteration"])


def test_phases_use_engine_and_trainer_splits_when_reported():
    r = _record(0, gen=0.20, lp=0.0, train=0.19, sync=0.05, save=0.0, rollout=0.21, it=0.60)
    r.update({"rollout/engine_generate_time": 0.15, "time/train_forward": 0.06, "time/train_backward": 0.08,
              "time/train_optimizer": 0.02, "time/train_pack": 0.01})
    p = rl.phases(r)
    assert p["generate"] == pytest.approx(0.15) and p["requests"] == pytest.approx(0.05)
    assert p["train_compute"] == pytest.approx(0.16) and p["train_other"] == pytest.approx(0.03)
    assert sum(p[k] for _, k in rl.COMPUTE + rl.OVERHEAD) == pytest.approx(p["iteration"])
    del r["time/train_optimizer"]  # an incomplete split: the whole train time counts as compute
    assert rl.phases(r)["train_compute"] == pytest.approx(0.19)


def test_report_overhead_uses_steady_and_fastest_iterations():
    recs = [_record(0, 2.0, 0.5, 1.0, 0.3, 0.0, 2.0, 4.0),  # warm-up: excluded from steady figures
            _record(1, 0.2, 0.1, 0.2, 0.05, 0.0, 0.2, 0.6),
            _record(2, 0.4, 0.1, 0.2, 0.05, 0.0, 0.4, 0.8)]
    text = rl.report(recs)
    # steady mean: iteration 0.7, compute 0.6 -> overhead 0.1 = 14.3%; fastest: 0.6 - 0.5 = 0.1 = 16.7%
    assert "steady mean 0.100 s = 14.3%" in text
    assert "fastest iteration 0.100 s = 16.7%" in text
    assert "first iteration 12.5%" in text


def test_report_counts_missing_generate_time_as_rollout_time():
    r = _record(0, 0.0, 0.1, 0.1, 0.0, 0.0, 0.3, 0.5)
    del r["rollout/generate_time"]
    p = rl.phases(r)
    assert p["generate"] == pytest.approx(0.3) and p["handoff"] == 0.0


def test_rl_iteration_model_picks_its_script_and_refuses_another_models_checkpoint(tmp_path, capsys, monkeypatch):
    a = rl.parse_args(["--model", "glm5"])
    assert a.script.endswith("scripts/run-glm5-tiny-cpu.sh") and a.run_dir == "/tmp/slime-bench-rl/glm5"
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "glm5_next"}')
    with pytest.raises(SystemExit) as e:
        rl.parse_args(["--model", "glm5", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds a glm5_next checkpoint, not glm_moe_dsa" in err and err.count("\n") == 1
    monkeypatch.setitem(rl.SCRIPTS, "glm5", "no-such-script.sh")
    with pytest.raises(SystemExit) as e:
        rl.parse_args(["--model", "glm5"])
    assert e.value.code == 2 and "no-such-script.sh does not exist" in capsys.readouterr().err


def test_rl_iteration_leaves_the_evaluations_out_of_the_iterations(tmp_path):
    import json

    (tmp_path / "run").mkdir()
    lines = [{"kind": "eval", "eval_step": 0, "time/eval_answer": 1.5},
             _record(0, 2.0, 0.5, 1.0, 0.3, 0.0, 2.0, 4.0), _record(1, 0.2, 0.1, 0.2, 0.05, 0.0, 0.2, 0.6),
             {"kind": "eval", "eval_step": 2, "time/eval_answer": 0.5, "eval/answer": 0.7}]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = rl._steady_records(str(tmp_path))
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert rl.eval_line(rl._read_metrics(str(tmp_path))) == ("held-out evaluations (outside the iterations above): "
                                                             "2, 1.000 s each on average, 2.000 s in all")
    assert rl.eval_line(records) is None


def test_exporter_closes_buckets_like_export_hf():
    named = [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate([3, 5, 2, 8, 1])]  # float32: 4 B each
    buckets = list(ws.exporter(named, bucket_bytes=32, copy=True)())
    # closed once a bucket reaches 32 bytes: [3+5]=32 B, [2+8]=40 B, [1]
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    out = dict(t for b in buckets for t in b)
    for name, t in named:
        assert torch.equal(out[name], t) and out[name].data_ptr() != t.data_ptr()  # a copy, as the GLM export
    views = list(ws.exporter(named, bucket_bytes=32, copy=False)())
    assert views[0][0][1].data_ptr() == named[0][1].data_ptr()


def test_prefix_of_skips_tensors_that_would_overshoot():
    mib = 2**20
    named = [("big", torch.empty(mib, dtype=torch.uint8)), ("a", torch.empty(mib // 2, dtype=torch.uint8)),
             ("b", torch.empty(mib // 4, dtype=torch.uint8)), ("c", torch.empty(mib // 2, dtype=torch.uint8))]
    assert [n for n, _ in ws.prefix_of(named, 0.8)] == ["a", "b"]
    assert [n for n, _ in ws.prefix_of(named, 10)] == ["big", "a", "b", "c"]


def test_parse_args_rejects_bad_modes_and_sizes(capsys):
    with pytest.raises(SystemExit):
        ws.parse_args(["--modes", "ipc,ipc-handles,carrier-pigeon"])
    assert "carrier-pigeon" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ws.parse_args(["--sizes", "512", "--max-mb", "64"])
    a = ws.parse_args(["--sizes", "64,8,1024", "--max-mb", "100"])
    assert a.sizes == [8.0, 64.0]


def test_glm_layout_turns_expert_weights_into_transposed_views_only():
    torch.manual_seed(0)
    named = [("model.layers.1.mlp.experts.3.gate_proj.weight", torch.randn(6, 4)),
             ("model.layers.1.mlp.gate.weight", torch.randn(8, 4)),
             ("model.layers.1.mlp.experts.3.up_proj.weight", torch.randn(6, 4)),
             ("model.layers.1.mlp.experts.3.down_proj.weight", torch.randn(4, 6))]
    out = ws.glm_layout(named)
    e = "model.layers.1.mlp.experts.3."  # a layer's expert weights in export order, where its first one was
    assert [n for n, _ in out] == [e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight",
                                   "model.layers.1.mlp.gate.weight"]
    got = dict(out)
    for name, t in named:
        assert torch.equal(got[name], t) and got[name].shape == t.shape
        assert got[name].is_contiguous() == (".experts." not in name)


def test_train_step_sides_alternate_after_one_warm_up_each():
    order, syncs = [], []
    ta, tb = ts.interleaved(lambda: order.append("a"), lambda: order.append("b"), 3, lambda: syncs.append(1))
    assert order == ["a", "b"] * 4 and len(ta) == len(tb) == 3 and all(t >= 0 for t in ta + tb)
    assert len(syncs) == 2 * 6  # before and after every timed step


def test_components_time_wrapped_calls_and_restore_them():
    class Target:
        def work(self, x):
            return x + 1

    obj = Target()
    comp = ws.Components()
    comp.wrap(obj, "work", lambda x: f"work {x}")
    assert obj.work(1) == 2 and obj.work(1) == 2
    assert set(comp.seconds) == {"work 1"} and comp.seconds["work 1"] >= 0.0
    comp.uninstall()
    assert "work" not in vars(obj)  # the instance attribute is gone again
    assert obj.work(2) == 3


def test_profile_summary_counts_inclusive_samples_once_per_stack(tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text('process 7:"python -m slime.backends.embedded --x";main (a.py:1);f (a.py:2);f (a.py:3) 3\n'
                   'process 7:"python -m slime.backends.embedded --x";main (a.py:1);g (b.py:9) 1\n')
    stacks = summary.read_stacks(str(raw))
    assert [n for _, n in stacks] == [3, 1]
    text = summary.summarize(stacks, None, 10)
    assert "4 samples" in text
    assert "100.0%  main (a.py)" in text
    assert " 75.0%  f (a.py)" in text  # recursion (two frames of f) counted once
    assert "process 7 slime.backends.embedded" in text
    assert "1 samples in stacks containing 'g ('" in summary.summarize(stacks, "g (", 5)


def test_glm5_next_train_step_benchmark_sides_agree(capsys):
    """A 4-layer (KDA, KDA, DSA full, DSA shared) hidden-32 model on 16 tokens (> index_topk 8): both sides load
    the same checkpoint, their logits agree and the ratio line is printed (times are not asserted)."""
    bench = _load("glm5_next_train_step")
    r = bench.run(argparse.Namespace(seq=16, batch=1, steps=1, hidden=32, layers=4, no_memory=True))
    assert r["rel"] < 1e-4
    assert all(t > 0 for t in r["wall"] + r["cpu"])
    assert "ratio transformers/megatron: wall" in capsys.readouterr().out


def test_mhc_benchmark_sides_agree(capsys):
    """The family's HyperConnection and transformers' on 64 tokens of 3 streams: outputs and grads (weights and
    streams) agree; the ratio line is printed."""
    bench = _load("mhc")
    r = bench.run(argparse.Namespace(tokens=64, hidden=48, hc=3, repeats=1, no_memory=True))
    assert r["rel"]["outputs"] < 1e-6 and r["rel"]["grads"] < 1e-5
    assert r["held"][0] < r["held"][1]  # ours keeps no normalised streams for backward
    assert all(t > 0 for t in r["wall"] + r["cpu"])
    assert "ratio transformers/ours: wall" in capsys.readouterr().out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
