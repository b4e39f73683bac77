"""Run scripts, device profiles, MODEL_ARGS, Dockerfiles and docker/npu_patch: what can be checked without
docker or a cluster. The run script's --dry-run is executed for real (it starts nothing)."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "scripts/run-glm5.3-flash-300B.sh"
MODEL_SH = ROOT / "scripts/models/glm5.3-flash.sh"
SHELL_FILES = [RUN, MODEL_SH, ROOT / "scripts/check-device.sh", *sorted((ROOT / "scripts/profiles").glob("*.sh"))]
# The simulated NPU as the detected accelerator of a child process (tests/npu_sim; not hardware).
NPU_SIM_ENV = {"PYTHONPATH": str(ROOT / "tests/npu_sim"), "SLIME_ACCELERATOR_PLUGINS": "slime_npu_sim",
               "SLIME_ACCELERATOR": "npu"}


# Variables the profiles and the run script read: a developer's shell must not change the tests' results.
SCRIPT_VARS = {"PLAN_DEVICE", "NUM_NODES", "GPUS_PER_NODE", "TP", "PP", "EP", "CP", "ETP", "MAX_TOKENS_PER_GPU",
               "COLOCATE", "ROLLOUT_NUM_NODES", "ROLLOUT_GPUS_PER_ENGINE", "SGLANG_MEM_FRACTION_STATIC",
               "UPDATE_WEIGHT_MODE", "UPDATE_WEIGHT_BUFFER_SIZE", "RAY_START_ARGS", "HF_CHECKPOINT", "MASTER_ADDR",
               "PYTHONPATH", "RECOMPUTE", "OPTIMIZER_CPU_OFFLOAD"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIME_") and k not in SCRIPT_VARS}
    env.update({"PYTHON": sys.executable, "SLIME_ACCELERATOR": "cpu", "RAY_AUTH_MODE": "disabled"})
    env.update(extra)
    return env


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=300)


@functools.lru_cache(maxsize=None)
def _dry_run_cached(env_items: tuple[tuple[str, str], ...]) -> subprocess.CompletedProcess:
    return _run(["bash", str(RUN), "--dry-run"], **dict(env_items))


def _dry_run(**env: str) -> tuple[str, list[str]]:
    """Dry-run output and the train.py arguments of the command it prints."""
    r = _dry_run_cached(tuple(sorted(env.items())))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("command:"))
    argv = shlex.split(line[len("command:"):])
    assert argv[:3] == ["ray", "job", "submit"] and "train.py" in argv
    return r.stdout, argv[argv.index("train.py") + 1:]


def _opt(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# --- shell scripts --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_shell_syntax(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_run_script_names_no_device():
    """Device specifics come from the accelerator and the profile files, never from the run script."""
    text = RUN.read_text()
    hits = re.findall(r"\b(cuda|npu|nccl|hccl|gpu_ids|CUDA_VISIBLE_DEVICES|ASCEND_RT_VISIBLE_DEVICES)\b", text, re.I)
    assert not hits, hits
    for profile in ("cuda", "npu"):
        assert (ROOT / "scripts/profiles" / f"{profile}.sh").is_file()


def test_dry_run_npu_profile_from_detected_accelerator():
    out, args = _dry_run(**NPU_SIM_ENV)  # no SLIME_PROFILE: picked from `python -m slime.accelerator --name`
    assert "accelerator: npu (detected: npu" in out and "planner device 950dt" in out
    # 950DT: split placement (no IPC) and the accelerator's HCCL settings in the job's environment
    assert "8 engine(s) x 8 devices on 8 separate node(s)" in out
    assert "--colocate" not in args and _opt(args, "--update-weight-mode") == "distributed"
    assert _opt(args, "--rollout-num-gpus") == "64"
    submit = shlex.split(out[out.index("command:"):].splitlines()[0])
    runtime_json = next(t for t in submit if t.startswith("--runtime-env-json=")).split("=", 1)[1]
    runtime_env = json.loads(runtime_json)["env_vars"]
    assert runtime_env["HCCL_CONNECT_TIMEOUT"] == "1800" and runtime_env["TASK_QUEUE_ENABLE"] == "2"
    assert str(ROOT) in runtime_env["PYTHONPATH"].split(":")
    assert re.search(r"^plan: .* -> fits; step >= \d+ s$", out, re.M)


def test_dry_run_cuda_and_a3_profiles():
    out, args = _dry_run(SLIME_PROFILE="cuda", HF_CHECKPOINT=_published_checkpoint())
    assert "colocated on the trainer's devices" in out and "NVIDIA H200" in out and "-> fits" in out
    assert {"--colocate", "--offload-train", "--offload-rollout", "--sequence-parallel", "--use-dynamic-batch-size"} <= set(args)
    assert (_opt(args, "--tensor-model-parallel-size"), _opt(args, "--expert-model-parallel-size"),
            _opt(args, "--max-tokens-per-gpu")) == ("8", "8", "4096")
    assert (_opt(args, "--actor-num-nodes"), _opt(args, "--pipeline-model-parallel-size")) == ("4", "4")
    assert {"--use-distributed-optimizer", "--optimizer-cpu-offload", "--use-precision-aware-optimizer"} <= set(args)
    assert _opt(args, "--recompute-granularity") == "full" and _opt(args, "--recompute-method") == "uniform"
    assert (_opt(args, "--expert-tensor-parallel-size"), _opt(args, "--context-parallel-size")) == ("1", "1")
    # the A3 branch of the npu profile, plus an override from the environment reaching command and plan
    out, args = _dry_run(SLIME_PROFILE="npu", PLAN_DEVICE="a3", MAX_TOKENS_PER_GPU="262144")  # too many even with full recompute
    assert (_opt(args, "--actor-num-nodes"), _opt(args, "--actor-num-gpus-per-node"),
            _opt(args, "--tensor-model-parallel-size"), _opt(args, "--rollout-num-gpus-per-engine")) == ("16", "16", "16", "16")
    assert _opt(args, "--max-tokens-per-gpu") == "262144" and "Atlas A3" in out and "DOES NOT FIT" in out


def _profile(name: str, **env: str) -> dict[str, str]:
    """The variables a profile sets (sourced in bash, no python)."""
    keys = sorted(SCRIPT_VARS - {"HF_CHECKPOINT", "MASTER_ADDR", "PYTHONPATH"})
    script = f'source scripts/profiles/{name}.sh; ' + "; ".join(f'echo "{k}=${{{k}}}"' for k in keys)
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=_env(**env), capture_output=True, text=True, check=True)
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


@pytest.mark.parametrize("name,plan_device", [("cuda", ""), ("npu", ""), ("npu", "950pr"), ("npu", "a3")])
def test_every_profile_fits_by_the_planner(name, plan_device):
    """Each profile's defaults, planned as the trainer runs them (expert-TP 1, no MTP, the distributed
    optimizer, the profile's recompute and CPU offload), fit; and the layout is one the trainer accepts."""
    from slime.plan import Layout, ModelShape, RolloutSettings, TrainSettings, get_device, plan

    v = _profile(name, **({"PLAN_DEVICE": plan_device} if plan_device else {}))
    world = int(v["NUM_NODES"]) * int(v["GPUS_PER_NODE"])
    colocate = v["COLOCATE"] == "1"
    layout = Layout(int(v["NUM_NODES"]), int(v["GPUS_PER_NODE"]), tp=int(v["TP"]), pp=int(v["PP"]), ep=int(v["EP"]),
                    cp=int(v["CP"]), etp=int(v["ETP"]) if v["ETP"] else None)
    rs = RolloutSettings(devices_per_engine=int(v["ROLLOUT_GPUS_PER_ENGINE"]), colocate=colocate, offload=colocate,
                         rollout_devices=world if colocate else int(v["ROLLOUT_NUM_NODES"]) * int(v["GPUS_PER_NODE"]),
                         mem_fraction_static=float(v["SGLANG_MEM_FRACTION_STATIC"]), global_batch_size=512,
                         update_weight_buffer_bytes=int(v["UPDATE_WEIGHT_BUFFER_SIZE"]))
    assert v["ETP"] == "1"  # train.py rejects anything else today (CP > 1 runs since context parallel)
    assert int(v["ROLLOUT_GPUS_PER_ENGINE"]) <= int(v["GPUS_PER_NODE"])  # an engine runs on one node
    ts = TrainSettings(max_tokens_per_gpu=int(v["MAX_TOKENS_PER_GPU"]), recompute=v["RECOMPUTE"], with_mtp=False,
                       distributed_optimizer=True, optimizer_cpu_offload=v["OPTIMIZER_CPU_OFFLOAD"] == "1")
    device = get_device(v["PLAN_DEVICE"])
    p = plan(ModelShape.from_config("glm5.3-flash"), layout, device, ts, rs)
    assert p.fits, (v, p.phases, p.usable, p.problems)
    assert colocate == device.ipc  # split placement exactly where the device has no IPC (950DT)


def test_dry_run_command_parses_with_train_py_flags():
    """Every flag the script passes is one train.py defines (rollout/SGLang flags once their module exists)."""
    from slime.config.arguments import build_parser, validate_args

    for env in ({"SLIME_PROFILE": "cuda", "HF_CHECKPOINT": _published_checkpoint()}, NPU_SIM_ENV,
                {"SLIME_PROFILE": "npu", "PLAN_DEVICE": "a3"}):
        _check_train_py_flags(_dry_run(**env)[1], build_parser, validate_args)


def _check_train_py_flags(args, build_parser, validate_args):
    parsed, unknown = build_parser().parse_known_args(args)
    try:
        import slime.config.rollout_args  # noqa: F401
        rollout_flags_available = True
    except ImportError:
        rollout_flags_available = False
    if rollout_flags_available:
        assert unknown == [], f"train.py does not define: {unknown}"
    else:  # only the rollout issue's flags (and their values) may be missing until slime.config.rollout_args lands
        pending = {"--prompt-data", "--input-key", "--label-key", "--apply-chat-template", "--rm-type",
                   "--rollout-batch-size", "--n-samples-per-prompt", "--rollout-max-response-len",
                   "--rollout-temperature", "--sglang-mem-fraction-static"}
        unknown_flags = {u for u in unknown if u.startswith("--")}
        assert unknown_flags <= pending, f"train.py does not define: {sorted(unknown_flags - pending)}"
        pytest.skip("slime.config.rollout_args not present yet: rollout/SGLang flags unchecked")
    parsed.hf_checkpoint = str(ROOT)  # validation needs an existing directory, nothing more
    validate_args(parsed)
    mp = parsed.tensor_model_parallel_size * parsed.pipeline_model_parallel_size * parsed.context_parallel_size
    assert parsed.data_parallel_size == parsed.world_size // mp >= 1


def test_dry_run_without_profile_fails_in_one_line():
    r = _run(["bash", str(RUN), "--dry-run"])  # cpu: no scripts/profiles/cpu.sh
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no profile for accelerator 'cpu'" in lines[0] and "SLIME_PROFILE" in lines[0]
    r = _run(["bash", str(RUN), "--bogus"])
    assert r.returncode == 2 and "unknown argument '--bogus'" in r.stderr


def test_check_device_script():
    r = _run(["bash", "scripts/check-device.sh", "--dry-run", "--", "--sections", "ops,collective"])
    assert r.returncode == 0, r.stderr
    assert "benchmarks/device_check.py --out" in r.stdout and "--sections ops" in r.stdout
    assert "| grouped_matmul | float32 |" in r.stdout and "1-rank group, backend `gloo`" in r.stdout
    assert "=== model" not in r.stdout  # the extra arguments reached the plan
    r = _run(["bash", "scripts/check-device.sh"])  # CPU only: refuses with the reason
    assert r.returncode == 2 and "no GPU or NPU" in r.stderr


# --- MODEL_ARGS -------------------------------------------------------------------------------------
def _model_args() -> list[str]:
    r = subprocess.run(["bash", "-c", f'source "{MODEL_SH}"; printf "%s\\0" "${{MODEL_ARGS[@]}}"'],
                       capture_output=True, text=True, check=True)
    return r.stdout.split("\0")[:-1]


def test_model_args_match_the_registry_config():
    from slime.plan import ModelShape
    from slime.plan.model_args import mismatches, to_hf_config

    args = _model_args()
    config = json.loads((ROOT / "scripts/models/configs/glm5.3-flash.json").read_text())
    assert mismatches(args, config) == []
    derived = to_hf_config(args)
    assert derived["model_type"] == "glm5_next" and derived["first_k_dense_replace"] == 3
    assert derived["layer_types"] == config["text_config"]["layer_types"]  # --linear-attention-freq 4
    # the architecture MODEL_ARGS describe has exactly the registry config's parameter count
    text = {**config["text_config"], **{k: v for k, v in derived.items() if k != "first_k_dense_replace"}}
    full = {**config, "text_config": text}
    assert ModelShape.from_config(full).total_param_count() == ModelShape.from_config(config).total_param_count()
    assert "NO PUBLIC CONFIG" not in MODEL_SH.read_text() and "ASSUMED" not in MODEL_SH.read_text()
    assert not (ROOT / "scripts/models/glm5.3-flash-300B.sh").exists()
    assert not (ROOT / "scripts/models/configs/glm5.3-flash-300B.json").exists()


def test_model_args_mismatch_and_bad_flags():
    from slime.plan.model_args import main, parse_model_args, to_hf_config

    args = _model_args()
    bad = list(args)
    bad[bad.index("--num-layers") + 1] = "46"
    assert main(["glm5.3-flash", "--", *bad]) == 2  # 46 layers contradict --moe-layer-freq
    bad[bad.index("--moe-layer-freq") + 1] = "[0]*3+[1]*43"
    assert main(["glm5.3-flash", "--", *bad]) == 1
    with pytest.raises(ValueError, match="unknown flag '--num-layerz'"):
        parse_model_args(["--num-layerz", "3"])
    with pytest.raises(ValueError, match="need --multi-latent-attention"):
        to_hf_config(["--num-layers", "2"])
    with pytest.raises(ValueError, match="covers 8 layers but --num-layers is 45"):
        to_hf_config(["--num-layers", "45", "--linear-attention-freq", "[1,1,1,0]*2", "--multi-latent-attention"])
    with pytest.raises(ValueError, match="one head count"):
        to_hf_config(["--linear-num-key-heads", "64", "--linear-num-value-heads", "32", "--multi-latent-attention"])
    rope = [*args[:args.index("--position-embedding-type")], "--position-embedding-type", "rope"]
    with pytest.raises(ValueError, match="--position-embedding-type rope is not supported by the glm5_next model"):
        to_hf_config(rope)


def test_model_args_cli_reports_mismatch(capsys):
    from slime.plan.model_args import main

    assert main(["glm5-744B-A40B", "--", *_model_args()]) == 1
    err = capsys.readouterr().err
    assert "num_hidden_layers: MODEL_ARGS 45 != config 78" in err and len(err.strip().splitlines()) == 1
    assert "model_type: MODEL_ARGS 'glm5_next' != config 'glm_moe_dsa'" in err


@functools.lru_cache(maxsize=None)
def _published_checkpoint() -> str:
    """One directory for the module whose config.json is Glm5NextConfig().to_dict() (dry runs share it)."""
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="glm5_next_config_")
    atexit.register(shutil.rmtree, path, True)
    return str(_glm5_next_checkpoint(Path(path)))


def _glm5_next_checkpoint(tmp_path: Path, **text_overrides) -> Path:
    """A directory whose config.json is transformers' Glm5NextConfig().to_dict() (the published defaults)."""
    from transformers import Glm5NextConfig

    cfg = Glm5NextConfig().to_dict()
    cfg["text_config"].update(text_overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("profile", ["cuda", "npu"])
def test_dry_run_on_the_published_config(profile, tmp_path):
    """With config.json = Glm5NextConfig().to_dict(): exit 0, MODEL_ARGS match, no "would fail" line, the
    meta-device parameter count (313.8B, 17.4B active) and the planned device count."""
    from slime_plugins.models.registry import supported_model_types

    r = _dry_run_cached((("HF_CHECKPOINT", _published_checkpoint()), ("SLIME_PROFILE", profile)))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "MODEL_ARGS match it" in out and "  dry run OK" in out  # train.py's own dry run of the command passed
    failing = [line for line in (out + r.stderr).splitlines() if "would fail" in line]
    registered = "glm5_next" in supported_model_types()
    if not registered:  # until the family registers, train.py says the one thing the run would stop at
        assert len(failing) == 1 and "model_type 'glm5_next' is not supported" in failing[0], failing
        failing = []
    assert not failing, failing
    total, active = re.search(r"^parameters: ([\d.]+)B total, ([\d.]+)B active per token", out, re.M).groups()
    assert abs(float(total) / 313.8 - 1) < 0.01 and float(active) == 17.4
    devices = int(re.search(r"^devices: (\d+) planned", out, re.M).group(1))
    assert devices == {"cuda": 32, "npu": 192}[profile]  # npu: 950DT, 16 trainer + 8 engine nodes of 8
    assert re.search(r"^plan: .* -> fits; step >= \d+ s$", out, re.M)
    if profile == "cuda":  # a config that contradicts MODEL_ARGS stops the run before anything starts
        (tmp_path / "other").mkdir()
        ckpt = _glm5_next_checkpoint(tmp_path / "other", num_hidden_layers=44)
        r = _run(["bash", str(RUN), "--dry-run"], SLIME_PROFILE=profile, HF_CHECKPOINT=str(ckpt))
        assert r.returncode != 0 and "num_hidden_layers: MODEL_ARGS 45 != config 44" in r.stderr
    if not registered:
        pytest.xfail("slime_plugins/models/glm5_next registers no FAMILY yet: train.py's dry run says the run would "
                     "stop at model_type 'glm5_next'")


# --- Dockerfiles ------------------------------------------------------------------------------------
DOCKER_INSTRUCTIONS = {"FROM", "ARG", "ENV", "RUN", "COPY", "ADD", "WORKDIR", "SHELL", "CMD", "ENTRYPOINT",
                       "LABEL", "EXPOSE", "USER", "VOLUME", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}
# torch_npu <-> CANN pairs from the Ascend PyTorch compatibility table (docs: torch-npu contracts notes).
TORCH_NPU_CANN = {"2.7.1": "8.3.RC1", "2.8.0": "8.3.RC1", "2.9.0": "8.5.0", "2.9.0.post2": "9.0.0",
                  "2.10.0.post4": "9.1.0", "2.11.0": "9.1.0", "2.12.0": "9.1.0",
                  "2.12.0.post3": "9.1.0"}


def parse_dockerfile(path: Path) -> dict:
    """Logical instructions, ARG defaults (global = before the first FROM) and resolved FROM images."""
    text = path.read_text()
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"
    global_args, stage_args, froms, env_names = {}, {}, [], set()
    for inst in logical:
        word, _, rest = inst.partition(" ")
        assert word.upper() in DOCKER_INSTRUCTIONS, f"{path.name}: unknown instruction {word!r}"
        if word == "ARG":
            name, eq, default = rest.strip().partition("=")
            assert eq and default, f"{path.name}: ARG {name} has no pinned default"
            (stage_args if froms else global_args)[name] = default
        elif word == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], rest.split()[0])
            froms.append(image)
        elif word == "ENV":
            env_names.update(re.findall(r"(\w+)=", rest))
        elif froms and word == "RUN":
            for var in re.findall(r"\$\{(\w+)\}", rest):  # a build stage sees only ARGs declared after FROM
                assert var in stage_args or var in env_names, f"{path.name}: ${{{var}}} is not declared in the stage"
    return {"args": {**global_args, **stage_args}, "froms": froms, "instructions": logical}


def docs_versions_table() -> dict[str, tuple[str, str]]:
    """ARG -> (Dockerfile.npu cell, Dockerfile cell) from docs/ascend.md's pinned-versions table."""
    rows = {}
    for line in (ROOT / "docs/ascend.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`[A-Z_]+`", cells[1]):
            rows[cells[1].strip("`")] = (cells[2], cells[3])
    return rows


def _cell_version(cell: str) -> str | None:
    return None if cell.startswith("—") else cell.split()[0]


@pytest.mark.parametrize("name,column", [("Dockerfile.npu", 0), ("Dockerfile", 1)])
def test_dockerfile_pins_match_the_guide(name, column):
    parsed = parse_dockerfile(ROOT / "docker" / name)
    table = docs_versions_table()
    assert table, "docs/ascend.md has no pinned-versions table"
    for arg, value in parsed["args"].items():
        assert arg in table, f"{name}: ARG {arg} is not in docs/ascend.md's versions table"
        assert _cell_version(table[arg][column]) == value, f"{name}: {arg}={value} but the guide says {table[arg][column]!r}"
    for arg, cells in table.items():
        if _cell_version(cells[column]) is not None:
            assert arg in parsed["args"], f"the guide pins {arg} for {name}, which does not declare it"
    for image in parsed["froms"]:
        assert ":" in image and not image.endswith(":latest"), image


def test_npu_image_pairs_and_base_image():
    args = parse_dockerfile(ROOT / "docker/Dockerfile.npu")["args"]
    assert args["TORCH_NPU_VERSION"].split(".post")[0] == args["TORCH_VERSION"]  # torch_npu X.Y needs torch X.Y
    assert TORCH_NPU_CANN[args["TORCH_NPU_VERSION"]] == args["CANN_VERSION"]
    (image,) = parse_dockerfile(ROOT / "docker/Dockerfile.npu")["froms"]
    assert re.fullmatch(r"quay\.io/ascend/cann:[\w.]+-\w+-ubuntu22\.04-py3\.11", image), image
    assert f"`{image}`" in (ROOT / "docs/ascend.md").read_text()


def test_image_pins_within_project_ranges():
    from packaging.specifiers import SpecifierSet

    text = (ROOT / "pyproject.toml").read_text()
    ranges = dict(re.findall(r'"([a-z][a-z0-9-]*)([<>=!~][^"]*)"', text))
    dist_of = {"MEGATRON_CORE_VERSION": "megatron-core", "RAY_VERSION": "ray", "TORCH_NPU_VERSION": "torch-npu",
               "SGLANG_VERSION": "sglang", "TORCH_VERSION": "torch"}
    for name in ("Dockerfile", "Dockerfile.npu"):
        args = parse_dockerfile(ROOT / "docker" / name)["args"]
        for arg, dist in dist_of.items():
            if arg in args:
                assert args[arg] in SpecifierSet(ranges[dist]), f"{name}: {dist} {args[arg]} outside pyproject {ranges[dist]}"


def test_guide_states_validation_status():
    text = (ROOT / "docs/ascend.md").read_text()
    assert "Nothing in this project has run on an Ascend device" in text
    assert "tests/npu_sim" in text and "never been built" in text
    for section in ("## Container set-up", "## Multi-node set-up", "## Launch", "## Troubleshooting",
                    "## Ascend deviations", "scripts/check-device.sh"):
        assert section in text, section


# --- docker/npu_patch -------------------------------------------------------------------------------
def npu_patch_problems(patch_dir: Path) -> list[str]:
    """Patch files without a README section, sections without a file, sections missing a required field."""
    readme = (patch_dir / "README.md").read_text()
    patches_part = readme.split("## Patches", 1)[1] if "## Patches" in readme else ""
    sections = dict(re.findall(r"^### `?([^`\n]+?)`?\s*\n(.*?)(?=^### |\Z)", patches_part, re.M | re.S))
    files = {p.name for p in patch_dir.iterdir() if p.is_file() and p.name != "README.md"}
    problems = [f"{f}: no README entry" for f in sorted(files - set(sections))]
    problems += [f"{s}: README entry without a file" for s in sorted(set(sections) - files)]
    for name, body in sections.items():
        for field in ("Purpose", "Target versions", "Upstream status", "Remove when"):
            if f"**{field}**" not in body:
                problems.append(f"{name}: missing **{field}**")
    return problems


def test_npu_patch_readme_matches_files():
    assert npu_patch_problems(ROOT / "docker/npu_patch") == []
    assert "no source patches" in (ROOT / "docker/npu_patch/README.md").read_text().lower()


def test_npu_patch_checker_catches_mismatches(tmp_path):
    (tmp_path / "README.md").write_text(
        "# x\n## Patches\n### `sglang__a.patch`\n- **Purpose**: p\n- **Target versions**: 0.5.23\n"
        "- **Upstream status**: not reported\n- **Remove when**: never\n### `ray__gone.patch`\n- **Purpose**: p\n")
    (tmp_path / "sglang__a.patch").write_text("--- a/x\n+++ b/x\n")
    (tmp_path / "megatron-core__b.patch").write_text("--- a/y\n+++ b/y\n")
    problems = npu_patch_problems(tmp_path)
    assert "megatron-core__b.patch: no README entry" in problems
    assert "ray__gone.patch: README entry without a file" in problems
    assert "ray__gone.patch: missing **Remove when**" in problems
    assert not any(p.startswith("sglang__a.patch") for p in problems)


# --- accelerator CLI used by the scripts --------------------------------------------------------------
def test_accelerator_cli_name_and_env(capsys):
    from conftest import use_accelerator

    from slime.accelerator.__main__ import job_env, main

    with use_accelerator("npu-sim") as acc:
        env = job_env(acc)
        assert main(["--name", "--env"]) == 0
        lines = capsys.readouterr().out.splitlines()
    assert acc.visible_devices_env not in env and acc.ray_noset_env not in env  # pinning stays per worker
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800" and env["TASK_QUEUE_ENABLE"] == "2"
    assert lines[0] == "npu" and "TASK_QUEUE_ENABLE=2" in lines[1:]
    assert not any(ln.startswith(acc.visible_devices_env + "=") for ln in lines)
