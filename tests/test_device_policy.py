"""The accelerator's check_and_update_config runs once per run, in the configuration layer
(slime.config.device_policy): train.py's preparation applies it before Ray; the loop's entry (train(args), which
arguments handed in directly also reach) reads `args.device_policy` and does not run it again."""

from __future__ import annotations

import json
import types

import pytest

import slime.train
import slime.train_async
from slime.accelerator import CpuAccelerator, DeviceConfigError
from slime.config.arguments import parse_args
from slime.config.device_policy import apply_device_policy


@pytest.fixture
def hook_calls(monkeypatch):
    """Calls of the CPU accelerator's check_and_update_config (then the real one)."""
    calls = []
    real = CpuAccelerator.check_and_update_config

    def counting(self, args):
        calls.append(args)
        real(self, args)

    monkeypatch.setattr(CpuAccelerator, "check_and_update_config", counting)
    monkeypatch.setenv("SLIME_CPU_THREADS", "1")  # the real hook leaves a thread count the user set alone
    return calls


@pytest.fixture
def argv(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4_moe", "num_hidden_layers": 2,
                                                      "n_routed_experts": 4, "num_experts_per_tok": 2}))
    return ["--hf-checkpoint", str(tmp_path), "--num-rollout", "3", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--output-dir", str(tmp_path / "out")]


class _RayWouldStart(Exception):
    pass


@pytest.fixture
def launched(monkeypatch):
    """slime.run.launch.launch runs up to Ray's start, which records the args and stops it there."""
    seen = []

    def init_ray(num_cpus):
        seen.append(num_cpus)
        raise _RayWouldStart

    monkeypatch.setattr("slime.ray.placement_group.init_ray", init_ray)
    return seen


def test_applied_once_however_often_asked(hook_calls, argv):
    args = parse_args(argv)
    assert not hook_calls  # parsing alone applies no device policy
    apply_device_policy(args)
    apply_device_policy(args)
    assert len(hook_calls) == 1 and args.device_policy == "cpu"


@pytest.mark.parametrize("program", [slime.train, slime.train_async])
def test_args_handed_to_train_directly_get_the_policy_once(hook_calls, launched, argv, program):
    args = parse_args(argv)
    for _ in range(2):  # the same namespace again: already applied
        with pytest.raises(_RayWouldStart):
            program.train(args)
    assert len(hook_calls) == 1 and len(launched) == 2


def test_the_command_line_applies_it_before_ray_and_the_loop_does_not_again(hook_calls, launched, argv,
                                                                              monkeypatch):
    preflight = types.SimpleNamespace(lines=lambda args: [], resume_iteration=None, restart_records=False)
    monkeypatch.setattr("slime.config.preflight.run_preflight", lambda args: preflight)
    monkeypatch.setattr(slime.train, "_start_run", lambda args, pf: None)
    prepared = slime.train._prepare(argv, None)
    assert len(hook_calls) == 1 and prepared.device_policy == "cpu"
    with pytest.raises(_RayWouldStart):
        slime.train.train(prepared)
    assert len(hook_calls) == 1 and len(launched) == 1


def test_a_refusal_is_one_line_and_exit_2_before_the_loop(launched, argv, monkeypatch, capsys):
    def refuse(self, args):
        raise DeviceConfigError("--bf16: the cpu device has no bfloat16 compute; drop --bf16 (float32)")

    monkeypatch.setattr(CpuAccelerator, "check_and_update_config", refuse)
    preflight = types.SimpleNamespace(lines=lambda args: [], resume_iteration=None, restart_records=False)
    monkeypatch.setattr("slime.config.preflight.run_preflight", lambda args: preflight)
    monkeypatch.setattr(slime.train, "_start_run", lambda args, pf: None)
    assert slime.train._prepare(argv, None) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "train.py: error: --bf16: the cpu device has no bfloat16 compute; drop --bf16 (float32)"
    assert not launched
