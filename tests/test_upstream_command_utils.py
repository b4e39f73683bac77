"""Upstream's launcher for example scripts, slime.utils.external_utils.command_utils: the commands it builds equal
upstream's for the same inputs (tests/data/upstream_command_utils_cases.json, recorded by
tests/data/record_upstream_command_utils_cases.py at the commit it names) once mapped onto this checkout (this
interpreter instead of python3 / torchrun, paths under the checkout, no Ray start-up or clean-up: runs start their
own cluster), the environment it gives a run, its one-line refusals, and the built train.py command launched for
real with --dry-run."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import slime.utils.external_utils.command_utils as U
from slime.accelerator.cuda import CudaAccelerator

with open(os.path.join(os.path.dirname(__file__), "data", "upstream_command_utils_cases.json")) as f:
    RECORD = json.load(f)
REPO = str(U.repo_base_dir)
PY = sys.executable
LAUNCH_ENV = ("SLIME_SCRIPT_EXTERNAL_RAY", "SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "MASTER_ADDR", "RAY_ADDRESS",
              "WANDB_API_KEY", "GITHUB_COMMIT_NAME", "SLURM_JOB_HOSTNAMES", "SLURM_NODEID", "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES")


class GpuNode(CudaAccelerator):
    """CUDA's launcher environment on a node of `count` GPUs without NVLink (as the record's nvidia-smi answer)."""

    count = 8

    def device_count(self) -> int:
        return self.count


@pytest.fixture
def launcher(monkeypatch):
    """The module with a clean launch environment and exec_command recording instead of running."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    ran: list[str] = []
    monkeypatch.setattr(U, "exec_command", lambda cmd, capture_output=False: ran.append(cmd))
    return ran


@pytest.fixture
def gpu_node(monkeypatch):
    import slime.accelerator
    import slime.accelerator.cuda

    monkeypatch.setattr(slime.accelerator.cuda, "has_nvlink", lambda: False)
    node = GpuNode()
    monkeypatch.setattr(slime.accelerator, "get_accelerator", lambda: node)
    return node


def _ours(cmd: str) -> tuple[dict, str | None, list[str]]:
    """(exported env, sourced model script, argv after the interpreter) of our train command."""
    parts = cmd.split(" && ")
    env = dict(word.split("=", 1) for word in shlex.split(parts[0].removeprefix("export ")))
    source = shlex.split(parts[1])[1] if len(parts) == 3 else None
    python, script, rest = parts[-1].split(" ", 2)
    assert python == shlex.quote(PY)
    return env, source, [os.path.relpath(script, REPO), *rest.split()]


def _upstream(cmd: str) -> tuple[dict, str | None, list[str]]:
    env = json.loads(re.search(r"--runtime-env-json='(.*?)' -- ", cmd).group(1))["env_vars"]
    source = re.search(r'source "(.*?)"', cmd)
    argv = cmd.split(" -- python3 ", 1)[1].split()
    return env, source.group(1).replace("{REPO}", REPO) if source else None, argv


def _config(kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    if "config" in kwargs:
        kwargs["config"] = U.ExecuteTrainConfig(**kwargs["config"])
    return kwargs


def test_record_names_the_upstream_commit():
    assert RECORD["repository"] == "THUDM/slime" and len(RECORD["commit"]) == 40 and len(RECORD["execute_train"]) == 4


@pytest.mark.parametrize("case", RECORD["execute_train"], ids=lambda c: str(c["kwargs"]["num_gpus_per_node"]))
def test_execute_train_runs_upstreams_command_mapped(case, launcher, gpu_node, monkeypatch, capsys):
    for key, value in case["env"].items():
        monkeypatch.setenv(key, value)
    U.execute_train(**_config(case["kwargs"]))
    submitted = [c for c in case["commands"] if "ray job submit" in c]
    if not submitted:  # SLIME_SCRIPT_ENABLE_RAY_SUBMIT=0: upstream submits nothing; we run nothing, say what
        assert launcher == [] and "SLIME_SCRIPT_ENABLE_RAY_SUBMIT is off, not running: export " in capsys.readouterr().out
        return
    assert len(launcher) == 1, launcher  # no clean-up by process name, no `ray start`: the run starts its own Ray
    env, source, argv = _ours(launcher[0])
    up_env, up_source, up_argv = _upstream(submitted[0])
    assert (source, argv) == (up_source, up_argv)
    # the pinning is what upstream's `ray start --num-gpus N` limits the run to (with an external Ray: its own)
    ray_start = [c for c in case["commands"] if "ray start" in c]
    gpus = int(re.search(r"--num-gpus (\d+)", ray_start[0]).group(1)) if ray_start else gpu_node.count
    assert env.pop("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpu_node.count)))) == \
        ",".join(map(str, range(gpus)))
    external = case["env"].get("SLIME_SCRIPT_EXTERNAL_RAY") == "1"
    assert env.pop("RAY_ADDRESS", None) == ("auto" if external else None)
    assert env.pop("PYTHONPATH").split(":") == [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(":"))]
    assert env.pop("PYTHONUNBUFFERED") == "1"
    del up_env["PYTHONPATH"]  # upstream's Megatron-LM checkout; megatron-core is installed here
    assert env == {k: str(v) for k, v in up_env.items()}


def test_execute_train_on_this_host_adds_no_device_env_and_refuses_core_dumps(launcher):
    from slime.accelerator import get_accelerator

    env = U.train_job_env(1, {"A": "1"})
    assert set(env) == {"PYTHONPATH", "PYTHONUNBUFFERED", "RAY_USE_UVLOOP", "no_proxy", "MASTER_ADDR", "A"} | \
        set(get_accelerator().launcher_env())
    if get_accelerator().memory_is_host():
        with pytest.raises(ValueError, match=r"^cuda_core_dump: the cpu device writes no device core dumps; leave"):
            U.execute_train("--lr 1", 1, None, config=U.ExecuteTrainConfig(cuda_core_dump=True))
        assert launcher == []


def test_execute_train_refusals_come_before_anything_runs(launcher, gpu_node):
    calls = []
    gpu_node.count = 2
    with pytest.raises(U.LaunchError, match=r"num_gpus_per_node=4 but this node has 2 cuda devices; pass"):
        U.execute_train("--lr 1", 4, None, before_ray_job_submit=lambda: calls.append(1))
    with pytest.raises(U.LaunchError, match=r"megatron_model_type='qwen9-1T': no .*qwen9-1T.sh; use one of .*qwen3-4B"):
        U.execute_train("--lr 1", 1, "qwen9-1T")
    with pytest.raises(U.LaunchError, match=r"train_script='nope.py': neither ./nope.py nor .* exists"):
        U.execute_train("--lr 1", 1, None, train_script="nope.py")
    with pytest.raises(U.LaunchError, match=r"extra_env_vars: 'B' is not KEY=VALUE"):
        U.execute_train("--lr 1", 1, None, config=U.ExecuteTrainConfig(extra_env_vars="A=1 B"))
    with pytest.raises(U.LaunchError, match=r"extra_env_vars: '\[\"A=1\"\]' is JSON but not an object"):
        U.execute_train("--lr 1", 1, None, config=U.ExecuteTrainConfig(extra_env_vars='["A=1"]'))
    assert launcher == [] and calls == []


def test_execute_train_keeps_exported_pinning_and_joins_a_named_cluster(launcher, gpu_node, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    order = []
    U.execute_train("--lr 1", 2, None, before_ray_job_submit=lambda: order.append(len(launcher)))
    env, _, _ = _ours(launcher[0])
    assert order == [0] and "CUDA_VISIBLE_DEVICES" not in env and env["RAY_ADDRESS"] == "10.0.0.1:6379"


def test_execute_train_launches_train_py_through_its_dry_run(tmp_path, monkeypatch, capfd):
    """The built command for real: scripts/models/qwen3-4B.sh's MODEL_ARGS against its config.json, through
    train.py's flag checks (--dry-run: no weights, no Ray); a bad flag fails the call with train.py's exit 2."""
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "hf").mkdir()
    shutil.copy(os.path.join(REPO, "scripts/models/configs/qwen3-4B.json"), tmp_path / "hf" / "config.json")
    args = (f"--hf-checkpoint {tmp_path}/hf --output-dir {tmp_path}/out --prompt-data {tmp_path}/p.jsonl "
            "--rm-type math --num-rollout 1 --rollout-batch-size 4 --n-samples-per-prompt 2 --colocate "
            "--actor-num-nodes 1 --actor-num-gpus-per-node 1 --dry-run")
    U.execute_train(args, num_gpus_per_node=1, megatron_model_type="qwen3-4B")
    out = capfd.readouterr().out
    assert "MODEL_ARGS agree with config.json" in out and "dry run OK" in out, out[-3000:]
    with pytest.raises(subprocess.CalledProcessError) as e:
        U.execute_train(args + " --no-such-flag", num_gpus_per_node=1, megatron_model_type="qwen3-4B")
    assert e.value.returncode == 2 and "--no-such-flag" in capfd.readouterr().err


@pytest.mark.parametrize("case", RECORD["convert_checkpoint"], ids=lambda c: str(c["kwargs"]["num_gpus_per_node"]))
def test_convert_checkpoint_command_is_upstreams_mapped(case, launcher, monkeypatch, tmp_path):
    for key, value in case["env"].items():
        monkeypatch.setenv(key, value)
    kw = case["kwargs"]
    hf = kw.get("hf_checkpoint") or f"/root/models/{kw['model_name']}"
    dst = f"{kw.get('dir_dst', '/root')}/{kw['model_name']}_torch_dist"
    ours = U.convert_checkpoint_command(hf, dst, kw["megatron_model_type"], kw["num_gpus_per_node"],
                                        kw.get("multinode", False), kw.get("extra_args", ""))
    mapped = (case["commands"][0].replace("{REPO}", REPO).replace("/root/Megatron-LM:", "")
              .replace("torchrun ", f"{PY} -m torch.distributed.run ")
              .replace(" tools/convert_hf_to_torch_dist.py", f" {REPO}/tools/convert_hf_to_torch_dist.py"))
    assert ours == mapped


def test_convert_checkpoint_skips_an_existing_output_and_refuses_a_missing_checkpoint(launcher, tmp_path, capsys):
    (tmp_path / "M_torch_dist").mkdir()
    U.convert_checkpoint("M", "glm5-tiny", 1, dir_dst=str(tmp_path))
    assert launcher == [] and f"convert_checkpoint skip {tmp_path}/M_torch_dist since exists" in capsys.readouterr().out
    with pytest.raises(U.LaunchError, match=r"convert_checkpoint: no HF checkpoint at /nowhere/N \(config.json"):
        U.convert_checkpoint("N", "glm5-tiny", 1, dir_dst=str(tmp_path), hf_checkpoint="/nowhere/N")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(U.LaunchError, match=r"multinode=True\) needs SLURM_JOB_HOSTNAMES"):
        U.convert_checkpoint("N", "glm5-tiny", 1, True, dir_dst=str(tmp_path), hf_checkpoint=str(tmp_path / "hf"))
    U.convert_checkpoint("N", "glm5-tiny", 2, dir_dst=str(tmp_path), hf_checkpoint=str(tmp_path / "hf"))
    assert launcher == [U.convert_checkpoint_command(str(tmp_path / "hf"), f"{tmp_path}/N_torch_dist", "glm5-tiny", 2)]


def test_hf_download_dataset_is_upstreams_command_when_the_hub_answers(launcher, monkeypatch):
    monkeypatch.setattr(U, "require_hub", lambda what: None)
    (name, commands), = RECORD["hf_download_dataset"]
    U.hf_download_dataset(name)
    cli = os.path.join(os.path.dirname(PY), "hf")
    assert launcher == [c.replace("hf download", f"{cli if os.path.exists(cli) else 'hf'} download", 1)
                        for c in commands]
    with pytest.raises(U.LaunchError, match=r"'dapo-math' is not a hub dataset id; give it as ORG/NAME"):
        U.hf_download_dataset("dapo-math")


def test_hf_download_dataset_fails_at_once_in_one_line_offline(launcher, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(U.LaunchError, match=r"^hf_download_dataset\('a/b'\) into /root/datasets/b: HF_HUB_OFFLINE is "
                                            r"set, so nothing is downloaded from https://huggingface.co; download"):
        U.hf_download_dataset("a/b")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # a port nobody listens on: connection refused, as an unreachable hub
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(U.LaunchError, match=rf"cannot reach http://127.0.0.1:{port} \(ConnectionRefusedError") as e:
        U.hf_download_dataset("a/b")
    assert "\n" not in str(e.value) and launcher == []


def test_rsync_and_fp8_cast_commands_are_upstreams_mapped(launcher, monkeypatch):
    (src, dst, commands), = RECORD["rsync_simple"]
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/rsync")
    U.rsync_simple(src, dst)
    assert launcher == commands
    (src, dst, commands), = RECORD["fp8_cast_bf16"]
    launcher.clear()
    U.fp8_cast_bf16(src, dst)
    assert launcher[0].split() == commands[0].replace("python tools/", f"{PY} {REPO}/tools/").split()


def test_rsync_copies_contents_without_rsync(tmp_path, monkeypatch):
    (tmp_path / "src" / "d").mkdir(parents=True)
    (tmp_path / "src" / "d" / "f").write_text("x")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    U.rsync_simple(str(tmp_path / "src"), str(tmp_path / "out" / "dst"))
    assert (tmp_path / "out" / "dst" / "d" / "f").read_text() == "x"


QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 128]}


def _fp8_checkpoint(src, edit=None, quant=None) -> dict:
    """A two-shard block-FP8 checkpoint in [64, 128] blocks (a weight of odd shape whose scale grid sits in the
    other shard, a 3-d expert weight, a norm); `edit(shards)` changes the tensors before they are written.
    Returns the tensors as written."""
    from safetensors.torch import save_file

    from slime.utils.fp8_blocks import quantize

    g = torch.Generator().manual_seed(3)
    q, scale = quantize(torch.randn(130, 200, generator=g) * 3, (64, 128))
    qe, se = quantize(torch.randn(2, 70, 40, generator=g), (64, 128))
    shards = {"s1.safetensors": {"a.weight": q, "norm.weight": torch.rand(200, generator=g), "e.weight": qe,
                                 "e.weight_scale_inv": se},
              "s2.safetensors": {"a.weight_scale_inv": scale}}
    if edit is not None:
        edit(shards)
    src.mkdir()
    for file_name, tensors in shards.items():
        save_file(tensors, src / file_name)
    weight_map = {n: f for f, tensors in shards.items() for n in tensors}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps({"model_type": "x", "quantization_config": quant or QUANT}))
    (src / "tokenizer.json").write_text("{}")
    return {n: t for tensors in shards.values() for n, t in tensors.items()}


def test_fp8_cast_bf16_dequantizes_every_block_fp8_weight(tmp_path):
    """The checkpoint -> bf16 equal to the float64 dequantization within bf16's rounding; scales dropped, config
    no longer FP8."""
    from safetensors.torch import load_file

    from slime.utils.fp8_blocks import expand_blocks

    src, dst = tmp_path / "fp8", tmp_path / "bf16"
    stored = _fp8_checkpoint(src)
    U.fp8_cast_bf16(str(src), str(dst))
    got = load_file(dst / "s1.safetensors")
    assert sorted(got) == ["a.weight", "e.weight", "norm.weight"] and not os.path.exists(dst / "s2.safetensors")
    for name in ("a.weight", "e.weight"):
        qq, ss = stored[name], stored[name + "_scale_inv"]
        ref = qq.double() * expand_blocks(ss.double(), *qq.shape[-2:], (64, 128))
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name].double(), ref, rtol=2 ** -8, atol=0)
    assert torch.equal(got["norm.weight"], stored["norm.weight"])
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert index == {"a.weight": "s1.safetensors", "e.weight": "s1.safetensors", "norm.weight": "s1.safetensors"}
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    assert (dst / "tokenizer.json").exists()


def _fp8_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_cast_bf16_tool", os.path.join(REPO, "tools", "fp8_cast_bf16.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pop(name):
    return lambda shards: next(t.pop(name) for t in shards.values() if name in t)


FP8_REFUSALS = {  # what slime's HF reader and the embedded engine refuse (slime/utils/fp8_pairs.py)
    "missing_scale": (_pop("a.weight_scale_inv"), None, "a.weight is float8 without its a.weight_scale_inv"),
    "orphan_scale": (lambda s: s["s2.safetensors"].update({"norm.weight_scale_inv": torch.ones(1, 2)}), None,
                     "norm.weight_scale_inv scales no float8 weight norm.weight"),
    "scale_grid": (lambda s: s["s2.safetensors"].update({"a.weight_scale_inv": torch.ones(3, 3)}), None,
                   "a.weight_scale_inv has shape [3, 3], a [130, 200] weight in [64, 128] blocks needs [3, 2]"),
    "e5m2_weight": (lambda s: s["s1.safetensors"].update({"e.weight": s["s1.safetensors"]["e.weight"].float().to(
        torch.float8_e5m2)}), None, "e.weight is float8_e5m2, block FP8 here is e4m3"),
    "unconverted_module": (None, {**QUANT, "modules_to_not_convert": ["e"]},
                           "e.weight is float8, but quantization_config.modules_to_not_convert keeps its module"),
}


@pytest.mark.parametrize("case", sorted(FP8_REFUSALS))
def test_fp8_cast_bf16_refuses_what_the_reader_and_the_engine_refuse(tmp_path, capsys, case):
    """A malformed block-FP8 checkpoint: one line on stderr naming the tensor, exit 2, nothing written (upstream's
    script warned about a missing scale and copied the float8 weight, and kept an orphan scale in the index)."""
    edit, quant, match = FP8_REFUSALS[case]
    src, dst = tmp_path / "fp8", tmp_path / "bf16"
    _fp8_checkpoint(src, edit, quant)
    assert _fp8_tool().main(["--input-fp8-hf-path", str(src), "--output-bf16-hf-path", str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fp8_cast_bf16: {src}: malformed block-FP8 weights: {match}"), err
    assert "re-quantize" in err and not dst.exists()


def test_fp8_cast_bf16_refusal_exits_2_through_the_launcher(tmp_path, capfd):
    """U.fp8_cast_bf16 on a checkpoint whose float8 weight lacks its scale, and on a truncated shard: the tool exits
    2 with one line (the launcher raises CalledProcessError), no traceback, nothing written."""
    src, dst = tmp_path / "fp8", tmp_path / "bf16"
    _fp8_checkpoint(src, _pop("a.weight_scale_inv"))
    with pytest.raises(subprocess.CalledProcessError) as e:
        U.fp8_cast_bf16(str(src), str(dst))
    err = capfd.readouterr().err
    assert e.value.returncode == 2 and "Traceback" not in err and not dst.exists()
    assert [ln for ln in err.splitlines() if ln] == [
        f"fp8_cast_bf16: {src}: malformed block-FP8 weights: a.weight is float8 without its a.weight_scale_inv; "
        "re-quantize it with slime.utils.fp8_blocks.quantize (e4m3 + float32 weight_scale_inv per [64, 128] block)"]
    shard = src / "s1.safetensors"
    shard.write_bytes(shard.read_bytes()[:20])
    assert _fp8_tool().main(["--input-fp8-hf-path", str(src), "--output-bf16-hf-path", str(dst)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"--input-fp8-hf-path shard {shard}" in err and not dst.exists(), err


def test_fp8_cast_bf16_refuses_its_input_as_output_and_a_tensor_in_two_shards(tmp_path, capsys):
    """Writing into the input would overwrite a shard whose scale grid another shard still needs; a tensor stored
    twice has no defined source. Each: one line, exit 2, the input untouched."""
    src = tmp_path / "fp8"
    _fp8_checkpoint(src, lambda s: s["s2.safetensors"].update({"norm.weight": torch.zeros(200)}))
    shards = {p.name: p.read_bytes() for p in src.iterdir()}
    assert _fp8_tool().main(["--input-fp8-hf-path", str(src), "--output-bf16-hf-path", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"fp8_cast_bf16: {src}: norm.weight is stored in both s1.safetensors and s2.safetensors; keep it " \
                  "in one shard\n" and not (tmp_path / "out").exists()
    assert _fp8_tool().main(["--input-fp8-hf-path", str(src), "--output-bf16-hf-path", f"{src}/"]) == 2
    err = capsys.readouterr().err
    assert err == f"fp8_cast_bf16: --output-bf16-hf-path {src}/ is the input checkpoint; give a new directory\n"
    assert {p.name: p.read_bytes() for p in src.iterdir()} == shards


def test_helpers_equal_upstream(monkeypatch, capsys):
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    for case in RECORD["wandb"]:
        with monkeypatch.context() as m:
            for key, value in case["env"].items():
                m.setenv(key, value)
            kwargs = {k: v for k, v in case.items() if k not in ("env", "result")}
            assert U.get_default_wandb_args(**kwargs) == case["result"]
    for text, want in RECORD["extra_env_vars"]:
        assert U._parse_extra_env_vars(text) == want
    for value, default, want in RECORD["bool_env"]:
        monkeypatch.delenv("CU_BOOL", raising=False)
        if value is not None:
            monkeypatch.setenv("CU_BOOL", value)
        assert U.get_bool_env_var("CU_BOOL", default) is want
    assert (U.NUM_GPUS_OF_HARDWARE, U.GENERATION_HARDWARE) == (RECORD["num_gpus_of_hardware"],
                                                              RECORD["generation_hardware"])
    assert re.fullmatch(r"\d{6}-\d{6}-\d{3}", U.create_run_id())
    path = U.save_to_temp_file("a: 1\n", "yaml")
    try:
        assert path.endswith(".yaml") and open(path).read() == "a: 1\n"
    finally:
        os.unlink(path)
    assert U.exec_command("echo hi", capture_output=True) == "hi\n"


@dataclasses.dataclass
class CliOptions:
    name: str
    count: int = 1


def test_dataclass_cli_reads_options_and_environment():
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()

    @app.command()
    @U.dataclass_cli
    def main(options: CliOptions):
        print(f"{options.name}|{options.count * 2}")

    runner = CliRunner()
    res = runner.invoke(app, [], env={"SLIME_SCRIPT_NAME": "env", "SLIME_SCRIPT_COUNT": "10"})
    assert res.exit_code == 0 and "env|20" in res.stdout
    res = runner.invoke(app, ["--count", "4"], env={"SLIME_SCRIPT_NAME": "x"})
    assert res.exit_code == 0 and "x|8" in res.stdout
    assert runner.invoke(app, [], env={}).exit_code == 2  # --name is required
    with pytest.raises(TypeError, match="must be annotated with a dataclass"):
        U.dataclass_cli(lambda options: None)


def test_star_import_gives_every_public_name_as_upstreams_module():
    """Upstream's module has no __all__: `from ...command_utils import *` gives all its public names, the
    re-exported exec_command and dataclass_cli included."""
    scope: dict = {}
    exec("from slime.utils.external_utils.command_utils import *", scope)
    assert {"execute_train", "convert_checkpoint", "fp8_cast_bf16", "hf_download_dataset", "rsync_simple",
            "get_default_wandb_args", "ExecuteTrainConfig", "exec_command", "dataclass_cli"} <= set(scope)
