"""Upstream slime's launcher for example and end-to-end scripts (`import slime.utils.external_utils.command_utils
as U`): `U.execute_train(train_args, num_gpus_per_node, megatron_model_type)` runs train.py (or train_async.py)
with `scripts/models/<type>.sh`'s MODEL_ARGS, `U.convert_checkpoint` the HF -> torch_dist converter,
`U.hf_download_dataset` a dataset download, plus the helpers those scripts use. Every command is printed
(`EXEC: ...`) and run with bash; a failing one raises CalledProcessError, as upstream's.

Mapped onto this project (docs/plugins.md, "Upstream's launcher"):
- A run starts its own Ray cluster and stops it at the end, so there is no `ray start` and no clean-up by
  process name (upstream's `pkill -9 ray/sglang/slime`) before it: train.py runs directly, its environment exported
  in the command (upstream's `ray job submit --runtime-env-json`). With SLIME_SCRIPT_EXTERNAL_RAY=1 or RAY_ADDRESS
  set, the run joins that cluster (RAY_ADDRESS, default "auto": the one on this node).
- Device environment and counts come from slime.accelerator: the job gets `Accelerator.launcher_env` (on CUDA
  upstream's CUDA_DEVICE_MAX_CONNECTIONS / NVLS switch, core dumps on request), and `num_gpus_per_node` pins the
  first N devices through the accelerator's visible-devices variable (what `ray start --num-gpus N` limits).
- Hub downloads need the network: on a machine that cannot reach the hub they fail at once, in one line.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import shlex
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

# re-exported (`x as x`): upstream scripts call U.exec_command and U.dataclass_cli; no __all__, so that
# `from ...command_utils import *` gives every public name, as upstream's module (which has none) does
from slime.utils.external_utils.typer_utils import dataclass_cli as dataclass_cli
from slime.utils.misc import exec_command as exec_command

repo_base_dir = Path(__file__).resolve().parents[3]
DATASETS_DIR = "/root/datasets"  # where hf_download_dataset puts `org/name` (as upstream: /root/datasets/name)
HUB_CONNECT_TIMEOUT_S = 5.0


class LaunchError(RuntimeError):
    """A launcher call that cannot work as asked (missing model script or checkpoint, no network, too few
    devices): one line naming the problem and the fix, raised before anything runs."""


# ------------------------------------------------------------------------------------------------ environment
_warned_bool_env_values: set[str] = set()


def get_bool_env_var(name: str, default: str = "false") -> bool:
    """SGLang's reading of a boolean variable: "true"/"1" are true, "false"/"0" false, anything else false with
    one notice per distinct value."""
    value = os.getenv(name, default).lower()
    if value not in ("true", "1", "false", "0") and value not in _warned_bool_env_values:
        _warned_bool_env_values.add(value)
        print(f"get_bool_env_var({name}) see non-understandable value={value} and treat as false")
    return value in ("true", "1")


def get_env_enable_infinite_run() -> bool:
    return get_bool_env_var("SLIME_TEST_ENABLE_INFINITE_RUN", "false")


def _parse_extra_env_vars(text: str) -> dict[str, Any]:
    """ExecuteTrainConfig.extra_env_vars: a JSON object, or space-separated KEY=VALUE words ("" -> {})."""
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    if parsed is not None or text.strip() == "null":  # "5", "[...]": JSON, but no environment
        raise LaunchError(f"extra_env_vars: {text!r} is JSON but not an object; give a JSON object or KEY=VALUE words")
    env = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if not sep:
            raise LaunchError(f"extra_env_vars: {word!r} is not KEY=VALUE; give KEY=VALUE words or a JSON object")
        env[key] = value
    return env


def check_has_nvlink() -> bool:
    """This host's GPUs are joined by NVLink (False where there is no nvidia-smi)."""
    from slime.accelerator.cuda import has_nvlink

    return has_nvlink()


# ------------------------------------------------------------------------------------------------ small helpers
def create_run_id() -> str:
    """UTC yymmdd-HHMMSS plus three random digits, e.g. 261206-223501-042."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%y%m%d-%H%M%S") + f"-{random.Random().randint(0, 999):03d}"


def save_to_temp_file(text: str, ext: str) -> str:
    """Write text to a fresh /tmp/slime_temp_file_*.EXT (e.g. a YAML config a script builds) and return its path."""
    path = Path(f"/tmp/slime_temp_file_{time.time()}_{random.randrange(0, 10_000_000)}.{ext}")
    path.write_text(text)
    print(f"Write the following content to {path=}: {text=}")
    return str(path)


def get_default_wandb_args(test_file: str, run_name_prefix: str | None = None, run_id: str | None = None) -> str:
    """train.py's W&B flags for a script (project slime-<script name>, group <run id>[_<GITHUB_COMMIT_NAME>]);
    "" without WANDB_API_KEY."""
    key = os.environ.get("WANDB_API_KEY")
    if not key:
        print("Skip wandb configuration since WANDB_API_KEY is not found")
        return ""
    script = Path(test_file)
    name = script.stem if len(script.stem) >= 6 else f"{script.parent.name}_{script.stem}"
    group = run_id or create_run_id()
    if os.environ.get("GITHUB_COMMIT_NAME") is not None:
        group += f"_{os.environ['GITHUB_COMMIT_NAME']}"
    if run_name_prefix is not None:
        group = f"{run_name_prefix}_{group}"
    return (f"--use-wandb --wandb-project slime-{name} --wandb-group {group} --wandb-key '{key}' "
            "--disable-wandb-random-suffix ")


def rsync_simple(path_src: str, path_dst: str) -> None:
    """Copy the contents of path_src into path_dst (created); `cp -a` where rsync is not installed."""
    if shutil.which("rsync"):
        exec_command(f"mkdir -p {shlex.quote(path_dst)} && rsync -a --info=progress2 {shlex.quote(path_src)}/ "
                     f"{shlex.quote(path_dst)}")
    else:
        exec_command(f"mkdir -p {shlex.quote(path_dst)} && cp -a {shlex.quote(path_src)}/. {shlex.quote(path_dst)}")


NUM_GPUS_OF_HARDWARE = {"H100": 8, "GB200": 4, "GB300": 4}
GENERATION_HARDWARE = {"H100": "Hopper", "GB200": "Blackwell", "GB300": "Blackwell"}


# ------------------------------------------------------------------------------------------------ hub downloads
def _hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def require_hub(what: str) -> None:
    """LaunchError at once (no hang) when the Hugging Face hub cannot be reached: HF_HUB_OFFLINE is set, or no TCP
    connection to HF_ENDPOINT within HUB_CONNECT_TIMEOUT_S."""
    endpoint = _hub_endpoint()
    fix = "download it on a machine with network access and copy it here, or put it there yourself"
    if get_bool_env_var("HF_HUB_OFFLINE"):
        raise LaunchError(f"{what}: HF_HUB_OFFLINE is set, so nothing is downloaded from {endpoint}; {fix}")
    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise LaunchError(f"{what}: cannot reach {endpoint} ({type(e).__name__}: {e}): no network here? {fix}") from None


def hf_download_command(full_name: str, local_dir: str) -> str:
    hf = Path(sys.executable).with_name("hf")  # the hub CLI of this interpreter's environment
    cli = shlex.quote(str(hf)) if hf.exists() else "hf"
    return f"{cli} download --repo-type dataset {full_name} --local-dir {shlex.quote(local_dir)}"


def hf_download_dataset(full_name: str) -> None:
    """`hf download --repo-type dataset ORG/NAME` into DATASETS_DIR/NAME (needs the network: see require_hub)."""
    org, sep, name = full_name.partition("/")
    if not (org and sep and name) or "/" in name:
        raise LaunchError(f"hf_download_dataset: {full_name!r} is not a hub dataset id; give it as ORG/NAME")
    local_dir = os.path.join(DATASETS_DIR, name)
    require_hub(f"hf_download_dataset({full_name!r}) into {local_dir}")
    exec_command(hf_download_command(full_name, local_dir))


# ------------------------------------------------------------------------------------------------ checkpoints
def model_script(megatron_model_type: str) -> Path:
    """scripts/models/<type>.sh (MODEL_ARGS); LaunchError naming the ones there are when it is missing."""
    path = repo_base_dir / "scripts" / "models" / f"{megatron_model_type}.sh"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.sh"))
        raise LaunchError(f"megatron_model_type={megatron_model_type!r}: no {path}; use one of {', '.join(known)} "
                          "(or None to take the architecture from --hf-checkpoint's config.json)")
    return path


def _multinode_torchrun_args() -> str:
    """torchrun's rendezvous from SLURM (upstream: SLURM_JOB_HOSTNAMES=$(scontrol show hostnames ...), SLURM_NODEID)."""
    hostnames = os.environ.get("SLURM_JOB_HOSTNAMES", "").split()
    if not hostnames or "SLURM_NODEID" not in os.environ:
        raise LaunchError("convert_checkpoint(multinode=True) needs SLURM_JOB_HOSTNAMES (export SLURM_JOB_HOSTNAMES="
                          "$(scontrol show hostnames \"$SLURM_JOB_NODELIST\")) and SLURM_NODEID")
    return (f"--master-addr {hostnames[0]} --master-port 23456 --nnodes={len(hostnames)} "
            f"--node-rank {int(os.environ['SLURM_NODEID'])} ")


def convert_checkpoint_command(hf_checkpoint: str, path_dst: str, megatron_model_type: str, num_gpus_per_node: int,
                               multinode: bool = False, extra_args: str = "") -> str:
    """The bash command convert_checkpoint runs: MODEL_ARGS sourced, then tools/convert_hf_to_torch_dist.py under
    torchrun (this interpreter's torch.distributed.run) with this checkout first on PYTHONPATH."""
    extra = f" {extra_args.strip()}" if extra_args.strip() else ""
    return (f"source {shlex.quote(str(model_script(megatron_model_type)))} && "
            f"PYTHONPATH={shlex.quote(str(repo_base_dir))}:${{PYTHONPATH:-}} "
            f"{shlex.quote(sys.executable)} -m torch.distributed.run --nproc-per-node {num_gpus_per_node} "
            f"{_multinode_torchrun_args() if multinode else ''}"
            f"{shlex.quote(str(repo_base_dir / 'tools' / 'convert_hf_to_torch_dist.py'))} ${{MODEL_ARGS[@]}} "
            f"--hf-checkpoint {shlex.quote(hf_checkpoint)} --save {shlex.quote(path_dst)}{extra}")


def convert_checkpoint(model_name: str, megatron_model_type: str, num_gpus_per_node: int, multinode: bool = False,
                       extra_args: str = "", dir_dst: str = "/root", hf_checkpoint: str | None = None) -> None:
    """HF checkpoint (default /root/models/MODEL_NAME) -> DIR_DST/MODEL_NAME_torch_dist, skipped when that
    exists (a re-run reuses it)."""
    hf_checkpoint = hf_checkpoint or f"/root/models/{model_name}"
    path_dst = f"{dir_dst}/{model_name}_torch_dist"
    if Path(path_dst).exists():
        print(f"convert_checkpoint skip {path_dst} since exists")
        return
    if not os.path.isfile(os.path.join(hf_checkpoint, "config.json")):
        raise LaunchError(f"convert_checkpoint: no HF checkpoint at {hf_checkpoint} (config.json missing); "
                          "download it there first or pass hf_checkpoint=DIR")
    exec_command(convert_checkpoint_command(hf_checkpoint, path_dst, megatron_model_type, num_gpus_per_node,
                                            multinode, extra_args))


def fp8_cast_bf16(path_src: str, path_dst: str) -> None:
    """A block-FP8 HF checkpoint -> the same checkpoint in bfloat16 (tools/fp8_cast_bf16.py), skipped when
    path_dst exists."""
    if Path(path_dst).exists():
        print(f"fp8_cast_bf16 skip {path_dst} since exists")
        return
    tool = repo_base_dir / "tools" / "fp8_cast_bf16.py"
    exec_command(f"{shlex.quote(sys.executable)} {shlex.quote(str(tool))} --input-fp8-hf-path "
                 f"{shlex.quote(path_src)} --output-bf16-hf-path {shlex.quote(path_dst)}")


# ------------------------------------------------------------------------------------------------ training runs
@dataclass
class ExecuteTrainConfig:
    """execute_train's options that scripts extend (upstream's fields; read from SLIME_SCRIPT_* by dataclass_cli)."""

    cuda_core_dump: bool = False  # device core dumps of a crashing kernel, under CORE_DUMP_DIR (CUDA only)
    num_nodes: int = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))  # read at import, as upstream
    extra_env_vars: str = ""  # JSON object or KEY=VALUE words, added to the job's environment


CORE_DUMP_DIR = "/root/shared_data"


def uses_external_ray() -> bool:
    """The run joins a Ray cluster started elsewhere (SLIME_SCRIPT_EXTERNAL_RAY=1, or RAY_ADDRESS names one)."""
    return get_bool_env_var("SLIME_SCRIPT_EXTERNAL_RAY") or os.environ.get("RAY_ADDRESS", "") not in ("", "local")


def _device_pinning(num_gpus_per_node: int) -> dict[str, str]:
    """The first num_gpus_per_node devices through the accelerator's visible-devices variable (a value already
    exported is kept); LaunchError when the node has fewer. Host-memory devices (CPU) have nothing to pin."""
    from slime.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.memory_is_host() or acc.visible_devices_env is None:
        return {}
    count = acc.device_count()
    if num_gpus_per_node > count:
        raise LaunchError(f"num_gpus_per_node={num_gpus_per_node} but this node has {count} {acc.name} devices; "
                          f"pass num_gpus_per_node<={count} (and the matching --actor-num-gpus-per-node)")
    if acc.visible_devices_env in os.environ or num_gpus_per_node == count:
        return {}
    return {acc.visible_devices_env: ",".join(str(i) for i in range(num_gpus_per_node))}


def train_job_env(num_gpus_per_node: int, extra_env_vars: dict | None = None,
                  config: ExecuteTrainConfig | None = None) -> dict[str, str]:
    """The environment execute_train gives the run (upstream's runtime-env env_vars, mapped as the module says)."""
    from slime.accelerator import get_accelerator

    config = config or ExecuteTrainConfig()
    master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    env = {
        "PYTHONPATH": ":".join(p for p in (str(repo_base_dir), os.environ.get("PYTHONPATH", "")) if p),
        "PYTHONUNBUFFERED": "1",  # the run's lines as they are printed
        "RAY_USE_UVLOOP": "0",
        "no_proxy": f"127.0.0.1,{master_addr}",
        "MASTER_ADDR": master_addr,  # torch.distributed's rendezvous host in a multi-node run
        **(({"RAY_ADDRESS": os.environ.get("RAY_ADDRESS", "auto")}) if uses_external_ray() else {}),
        **get_accelerator().launcher_env(CORE_DUMP_DIR if config.cuda_core_dump else None),
        **_device_pinning(num_gpus_per_node),
        **(extra_env_vars or {}),
        **_parse_extra_env_vars(config.extra_env_vars),
    }
    return {str(k): str(v) for k, v in env.items()}


def resolve_train_script(train_script: str) -> str:
    """A relative train_script from the working directory, else from this checkout (upstream runs from its root)."""
    if os.path.isabs(train_script) or os.path.exists(train_script):
        return train_script
    in_repo = repo_base_dir / train_script
    if not in_repo.is_file():
        raise LaunchError(f"train_script={train_script!r}: neither ./{train_script} nor {in_repo} exists; "
                          "pass train.py, train_async.py or a script's path")
    return str(in_repo)


def train_command(train_args: str, megatron_model_type: str | None, env: dict[str, str],
                  train_script: str = "train.py") -> str:
    """The bash command execute_train runs: the job's environment exported, MODEL_ARGS sourced, then
    `python TRAIN_SCRIPT ${MODEL_ARGS[@]} TRAIN_ARGS` with this interpreter."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    source = f"source {shlex.quote(str(model_script(megatron_model_type)))} && " if megatron_model_type else ""
    model_args = "${MODEL_ARGS[@]} " if megatron_model_type else ""
    return (f"export {exports} && {source}{shlex.quote(sys.executable)} "
            f"{shlex.quote(resolve_train_script(train_script))} {model_args}{train_args}")


def execute_train(train_args: str, num_gpus_per_node: int, megatron_model_type: str | None,
                  train_script: str = "train.py", before_ray_job_submit: Callable[[], Any] | None = None,
                  extra_env_vars: dict | None = None, config: ExecuteTrainConfig | None = None) -> None:
    """Run TRAIN_SCRIPT with scripts/models/MEGATRON_MODEL_TYPE.sh's MODEL_ARGS (None: none) and TRAIN_ARGS on
    num_gpus_per_node devices of this node; before_ray_job_submit() runs first (e.g. a teacher server).
    SLIME_SCRIPT_ENABLE_RAY_SUBMIT=0 prints the command instead of running it. CalledProcessError if the run
    fails."""
    command = train_command(train_args, megatron_model_type, train_job_env(num_gpus_per_node, extra_env_vars, config),
                            train_script)
    if before_ray_job_submit is not None:
        before_ray_job_submit()
    if not get_bool_env_var("SLIME_SCRIPT_ENABLE_RAY_SUBMIT", "1"):
        print(f"execute_train: SLIME_SCRIPT_ENABLE_RAY_SUBMIT is off, not running: {command}", flush=True)
        return
    exec_command(command)
