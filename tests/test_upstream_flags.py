"""Upstream slime flags on train.py: MODEL_ARGS files vs their configs, --sglang-* passthrough and
--sglang-config, the math rewards, the LR schedule, implementation-flag warnings."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["glm5-744B-A40B", "glm5.2-744B-A40B", "glm4.7-30B-A3B", "glm4.7-355B-A32B", "glm4.5-355B-A32B",
          "qwen3-4B", "qwen3-30B-A3B", "qwen3-32B"]


def _model_args(name: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'source {shlex.quote(str(ROOT / "scripts/models" / name))}.sh; '
                                        'printf "%s\\0" "${MODEL_ARGS[@]}"'],
                         check=True, capture_output=True, text=True).stdout
    return out.split("\0")[:-1]


def _base(tmp_path: Path, config: dict) -> list[str]:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ["--hf-checkpoint", str(tmp_path), "--num-rollout", "2", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--global-batch-size", "4"]


def _config(name: str) -> dict:
    cfg = name if name != "glm4.5-355B-A32B" else "glm4.7-355B-A32B"
    return json.loads((ROOT / "scripts/models/configs" / f"{cfg}.json").read_text())


@pytest.mark.parametrize("name", MODELS)
def test_model_scripts_agree_with_their_configs(name, tmp_path):
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    args = build_parser().parse_args(_base(tmp_path, _config(name)) + _model_args(name))
    assert model_arg_mismatches(args, _config(name)) == []
    # and each disagrees with a config of another family (the check can fail)
    other = _config("qwen3-4B" if not name.startswith("qwen3-4B") else "glm5-744B-A40B")
    assert len(model_arg_mismatches(args, other)) >= 3


def test_switch_left_out_means_megatron_default(tmp_path):
    """Without --untie-embeddings-and-output-weights Megatron ties them; an untied config disagrees."""
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    argv = [a for a in _model_args("qwen3-32B") if a != "--untie-embeddings-and-output-weights"]
    args = build_parser().parse_args(_base(tmp_path, _config("qwen3-32B")) + argv)
    assert model_arg_mismatches(args, _config("qwen3-32B")) == [
        "--untie-embeddings-and-output-weights absent: config.json says tie_word_embeddings=false"]


def test_moe_layer_freq_forms():
    from slime.config.model_args import ModelArgsError, parse_layer_freq

    assert parse_layer_freq("[0]*3+[1]*2", None) == [0, 0, 0, 1, 1]
    assert parse_layer_freq("[1, 1, 0]", None) == [1, 1, 0]
    assert parse_layer_freq("2", 4) == [1, 0, 1, 0]
    with pytest.raises(ModelArgsError, match="list expression"):
        parse_layer_freq("__import__('os')", 4)


def test_any_sglang_option_passes_through(tmp_path):
    from slime.config.rollout_args import sglang_passthrough
    from slime.config.sglang_args import embedded_ignored_line
    from slime.config.arguments import parse_args

    args = parse_args(_base(tmp_path, _config("qwen3-4B")) + [
        "--sglang-enable-dp-attention", "--sglang-dp-size", "8", "--sglang-disaggregation-ib-device", "mlx5_1,mlx5_2",
        "--sglang-mem-fraction-static", "0.7", "--sglang-max-running-requests", "16"])
    assert args.sglang_dp_size == 8 and args.sglang_enable_dp_attention is True  # typed as SGLang types them
    cmd = sglang_passthrough(args)
    assert cmd[:4] == ["--mem-fraction-static", "0.7", "--max-running-requests", "16"]
    tail = [cmd[4:][i:i + 2] for i in range(0, len(cmd) - 4)]
    assert ["--dp-size", "8"] in tail and ["--disaggregation-ib-device", "mlx5_1,mlx5_2"] in tail
    assert "--enable-dp-attention" in cmd and len(cmd) == 9
    line = embedded_ignored_line(args)
    assert line.startswith("embedded engine: ignoring") and "\n" not in line
    assert "--sglang-dp-size" in line and "--sglang-max-running-requests," not in line.split("(")[0]


def test_sglang_reserved_option_is_refused(tmp_path, capsys):
    from slime.config.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(_base(tmp_path, _config("qwen3-4B")) + ["--sglang-tp-size", "2"])
    assert "slime sets SGLang's --tp-size itself" in capsys.readouterr().err


YAML_OK = """sglang:
  - name: default
    server_groups:
      - worker_type: prefill
        num_gpus: 2
        overrides: {chunked_prefill_size: 512}
      - worker_type: decode
        num_gpus: 2
"""


@pytest.mark.parametrize("text, needle", [
    (YAML_OK.replace("prefill\n", "prefil\n"), "worker_type 'prefil' must be one of"),
    (YAML_OK.replace("num_gpus: 2\n        overrides", "num_gpus: 3\n        overrides"), "not a multiple"),
    ("server_groups: []\n", "top-level 'sglang:' list"),
    (YAML_OK.replace("      - worker_type: decode\n        num_gpus: 2\n", ""), "both a prefill and a decode"),
    (YAML_OK + "    colour: red\n", "unknown keys ['colour']"),
    ("sglang: [\n", "not valid YAML"),
])
def test_sglang_config_is_validated(tmp_path, text, needle, capsys):
    from slime.config.arguments import parse_args

    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(_base(tmp_path, _config("qwen3-4B")) + ["--sglang-config", str(path),
                                                            "--rollout-num-gpus-per-engine", "2"])
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_sglang_config_devices_must_match(tmp_path, capsys):
    from slime.config.arguments import parse_args

    path = tmp_path / "s.yaml"
    path.write_text(YAML_OK)
    base = _base(tmp_path, _config("qwen3-4B")) + ["--sglang-config", str(path), "--rollout-num-gpus-per-engine", "2"]
    args = parse_args(base + ["--rollout-num-gpus", "4"])
    assert [g.worker_type for g in args.sglang_deployments[0].groups] == ["prefill", "decode"]
    assert args.sglang_deployments[0].groups[0].overrides == {"chunked_prefill_size": 512}
    with pytest.raises(SystemExit):
        parse_args(base + ["--rollout-num-gpus", "8"])
    assert "use 4 devices but --rollout-num-gpus is 8" in capsys.readouterr().err


# ------------------------------------------------------------------ rewards
@pytest.mark.parametrize("response, label, want", [
    ("<think>try 3</think> so \\boxed{\\frac{1}{2}}", "0.5", 1),
    ("<think>..</think> \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1),
    ("<think>..</think> \\boxed{(1, 2)}", "(1,2)", 1),
    ("<think>..</think> \\boxed{7}", "\\boxed{7}", 1),
    ("\\boxed{7}", "7", 0),  # reasoning never finished: no reward
    ("<think>\\boxed{7}</think> the end", "7", 0),  # no boxed answer after the reasoning
    ("<think>..</think> \\boxed{8}", "7", 0),
])
def test_deepscaler_reward(response, label, want):
    from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward

    assert get_deepscaler_rule_based_reward(response, label) == want


@pytest.mark.parametrize("response, label, want", [
    ("long work...\nAnswer: 42", "42", 1.0),
    ("Answer: 1,234 dollars", "1234", 1.0),
    ("Answer: \\boxed{17}", "17", 1.0),
    ("Answer: 41", "42", -1.0),
    ("the answer is 42", "42", -1.0),  # DAPO grades only "Answer:" lines
    ("Answer: 42" + "x" * 400, "42", -1.0),  # outside the final 300 characters
])
def test_dapo_reward(response, label, want):
    from slime.rollout.rm_hub.math_dapo_utils import compute_score

    assert compute_score(response, label)["score"] == want


def test_rm_types_selectable_and_unknown_rejected_before_ray(tmp_path, capsys):
    from slime.config.rollout_args import rollout_defaults
    from slime.rollout.rewards import compute_reward, get_reward_fn, reward_value
    from slime.rollout.rm_hub.f1 import f1_score
    from slime.rollout.sample import Sample
    from slime.config.arguments import parse_args

    for rm in ("deepscaler", "dapo", "math", "f1", "gpqa", "random", "boxed_f1"):
        args = rollout_defaults(rm_type=rm, reward_key="score" if rm == "dapo" else None)
        value = compute_reward(get_reward_fn(args), args, Sample(group_index=0, index=3, prompt="p", label="7", response="\\boxed{a b}"))
        assert isinstance(reward_value(value, args.reward_key), float)
    assert f1_score("the cat sat", "cat sat down")[0] == pytest.approx(0.8)
    with pytest.raises(SystemExit):
        parse_args(_base(tmp_path, _config("qwen3-4B")) + ["--prompt-data", "x.jsonl", "--rm-type", "bleu"])
    assert "--rm-type 'bleu' is unknown" in capsys.readouterr().err


# ------------------------------------------------------------------ schedule, implementation flags
@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_lr_schedule_follows_megatron_formulas(style, tmp_path):
    """Megatron's scheduler driven by our flags: warmup then decay to --min-lr over all steps of the run."""
    import math

    from slime.backends.megatron.lr_schedule import build_lr_scheduler
    from slime.config.arguments import parse_args

    args = parse_args(_base(tmp_path, _config("qwen3-4B")) + [
        "--num-rollout", "10", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", style, "--lr-warmup-iters", "2"])

    class Opt:  # the scheduler only touches param_groups
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    sched = build_lr_scheduler(args, Opt())
    lrs = []
    for _ in range(10):
        lrs.append(Opt.param_groups[0]["lr"])
        sched.step(1)
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(5e-4)  # linear warmup from --lr-warmup-init 0
    for step in range(2, 10):
        frac = (step - 2) / 8
        want = {"constant": 1e-3, "linear": 1e-3 - frac * 9e-4,
                "cosine": 1e-4 + 0.5 * (math.cos(math.pi * frac) + 1) * 9e-4}[style]
        assert lrs[step] == pytest.approx(want, rel=1e-9)
    resumed = build_lr_scheduler(args, Opt(), start_rollout_id=5)
    assert Opt.param_groups[0]["lr"] == pytest.approx(lrs[5]) and resumed.num_steps == 5


def test_implementation_warning_names_unhonored_flags(tmp_path):
    from slime.config.arguments import parse_args
    from slime.config.megatron_flags import implementation_warning

    class Ops:
        accelerator_name = "cpu"

        def source(self, op):
            return "flash_attn.flash_attn_varlen_func" if op == "attention" else "reference"

    args = parse_args(_base(tmp_path, _config("qwen3-4B")) + [
        "--attention-backend", "flash", "--moe-grouped-gemm", "--moe-enable-deepep"])
    line = implementation_warning(args, Ops())
    assert "\n" not in line and "--attention-backend" not in line
    assert "--moe-grouped-gemm (no device grouped_matmul kernel on cpu" in line and "--moe-enable-deepep" in line
    assert implementation_warning(parse_args(_base(tmp_path, _config("qwen3-4B"))), Ops()) is None


def test_reinforce_plus_plus_returns_respect_the_loss_mask():
    """Masked tokens get neither KL penalty nor return; the reward sits on the last kept token (float64 by hand)."""
    import torch

    from slime.utils import ppo_utils

    ret = ppo_utils.reinforce_plus_plus_returns(torch.tensor([1.0, 2.0]), torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]),
                                                [4, 1], 0.5, 1.0, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]))
    # sample 0 token rewards [-0.05, 0, -0.15 + 1, 0] -> reverse cumsum [0.8, 0.85, 0.85, 0] -> masked
    assert torch.allclose(ret.double(), torch.tensor([0.8, 0.0, 0.85, 0.0, 1.75], dtype=torch.float64), atol=1e-7)
    adv = ppo_utils.compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 2.0]), [4, 1],
                                       torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]), 1, kl=torch.zeros(5), kl_coef=0.5)
    assert adv[1] == 0 and adv[3] == 0


def test_balance_data_splits_steps_into_equal_count_sets_of_near_equal_tokens():
    from slime.backends.megatron.data import balanced_dp_shard

    counts = [100, 10, 90, 20, 80, 30, 70, 40]
    step = list(range(8))
    shards = [balanced_dp_shard(step, counts, r, 2) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == step and len(shards[0]) == len(shards[1]) == 4
    loads = [sum(counts[i] for i in s) for s in shards]
    assert loads == [220, 220]  # strided (without --balance-data) the ranks would carry 340 and 100
    assert sum(counts[i] for i in step[0::2]) == 340


def test_tracking_flags_without_packages_are_one_line_each(tmp_path, monkeypatch):
    import importlib.util

    from slime.utils import tracking
    from slime.config.arguments import parse_args

    real = importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    args = parse_args(_base(tmp_path, _config("qwen3-4B")) + ["--use-wandb", "--wandb-project", "p", "--use-tensorboard"])
    lines = tracking.tracking_warnings(args)
    assert len(lines) == 2 and "wandb is not installed" in lines[0] and "tensorboard is not installed" in lines[1]
    t = tracking.Tracker(args)  # goes on without them
    t.log({"rollout/reward_mean": 0.5}, 1)
    t.close()


def test_yarn_flags_are_checked_against_rope_scaling(tmp_path):
    """DeepSeek-V3-family MODEL_ARGS: --rotary-scaling-factor / --mscale / --mscale-all-dim against config.json's
    YaRN rope_scaling; without rope scaling the factor must be 1 and the mscale flags change nothing."""
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    def mismatches(argv, cfg):  # the YaRN lines (the architecture switches left out disagree too)
        lines = model_arg_mismatches(build_parser().parse_args(_base(tmp_path, cfg) + argv), cfg)
        return [line for line in lines if line.startswith(("--rotary-scaling-factor", "--mscale"))]

    r1, moonlight = _config("deepseek-r1"), _config("moonlight-16B-A3B")
    yarn = ["--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0"]
    assert mismatches(yarn, r1) == []
    wrong = ["--rotary-scaling-factor", "32", "--mscale", "1.0", "--mscale-all-dim", "0.707"]
    assert mismatches(wrong, r1) == [
        "--rotary-scaling-factor 32.0: config.json says rope_scaling.factor=40",
        "--mscale-all-dim 0.707: config.json says rope_scaling.mscale_all_dim=1.0"]
    plain = ["--rotary-scaling-factor", "1", "--mscale", "0.5", "--mscale-all-dim", "1.0"]
    assert mismatches(plain, moonlight) == []
    assert mismatches(yarn, moonlight) == [
        "--rotary-scaling-factor 40.0: config.json says rope_scaling.factor=1.0"]


def test_glm4_switches_are_compared_both_ways(tmp_path):
    """--post-self-attn-layernorm / --post-mlp-layernorm / --rotary-interleaved: given for glm4 (its config agrees),
    left out for glm4 or given for another GQA family: one line each."""
    from slime.config.arguments import build_parser
    from slime.config.model_args import model_arg_mismatches

    switches = ["--post-self-attn-layernorm", "--post-mlp-layernorm", "--rotary-interleaved"]

    def lines(argv, cfg):
        out = model_arg_mismatches(build_parser().parse_args(_base(tmp_path, cfg) + ["--num-layers", "40"] + argv), cfg)
        return sorted(line for line in out if line.startswith(tuple(switches)))

    glm4, qwen3 = _config("glm4-9B"), _config("qwen3-4B") | {"num_hidden_layers": 40}
    assert lines(switches, glm4) == []
    assert lines([], glm4) == ["--post-mlp-layernorm absent: config.json says post_mlp_layernorm (glm4)",
                               "--post-self-attn-layernorm absent: config.json says post_self_attn_layernorm (glm4)",
                               "--rotary-interleaved absent: config.json says interleaved rotary (glm4)"]
    assert lines(["--rotary-interleaved"], qwen3) == [
        "--rotary-interleaved given: config.json says not interleaved rotary (glm4)"]
