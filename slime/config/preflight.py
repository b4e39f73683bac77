"""Checks of a run's inputs and outputs before Ray starts (`train.py` calls `run_preflight`).

What is checked, each failure one line naming the file or flag and the fix (`PreflightError`):
- `--hf-checkpoint`: config.json parses, its model_type is supported, every safetensors shard's header
  is readable and its tensors' byte ranges match the dtype/shape and the file size (no weight is read);
- `--prompt-data`: every line is a JSON object with `--input-key`; a rule reward (`--rm-type`) also needs
  `--label-key` on every line; the prompt count is reported;
- `--save`, `--output-dir`, `--save-hf`: writable (a probe file in the nearest existing directory, removed);
- `--load`: what the trainer will read (`checkpoint_layout.find_checkpoint`), its files intact: a torch_dist
  iteration's `.metadata` storage ranges fit its `.distcp` files and `common.pt` is a complete archive; the
  former per-rank `rank_*.pt` archives are complete; an HF dir passes the --hf-checkpoint checks;
- runs are never overwritten: an output dir holding metrics.jsonl, or a `--save` dir holding checkpoints,
  is refused unless `--load` resumes from it, the same command re-runs it before its first checkpoint
  (`slime.utils.run_identity`: it restarts) or `--overwrite-output` is given.
Nothing is created: the probes are removed before returning, directories are made later by the run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
import zipfile
from typing import Any

from slime.config.preflight_inputs import check_data_inputs, check_inputs
from slime.config.preflight_report import (  # noqa: F401 (also this module's API)
    UNLABELLED_REWARDS, PreflightError, PreflightReport, _reward_base)
from slime.utils import safetensors_header

TRACKER = "latest_checkpointed_iteration.txt"  # same name as slime.backends.megatron.checkpoint.TRACKER
METRICS_FILE = "metrics.jsonl"


def add_preflight_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("run safety")
    if "--overwrite-output" not in parser._option_string_actions:
        g.add_argument("--overwrite-output", action="store_true",
                       help="allow writing into an output/--save dir that holds another run's metrics or checkpoints")
    from slime.config.device_kernels import add_device_kernel_arguments

    add_device_kernel_arguments(g, parser)  # --require-device-kernels (checked in run_preflight)


# ------------------------------------------------------------------ model
def supported_model_types() -> tuple[str, ...]:
    """Model types the trainer can build: the model registry's when present, else the GLM-5 backend's."""
    try:
        from slime_plugins.models import registry  # type: ignore[attr-defined]

        return tuple(registry.supported_model_types())
    except (ImportError, AttributeError):
        from slime_plugins.models.glm5.config import SUPPORTED_MODEL_TYPES

        return tuple(SUPPORTED_MODEL_TYPES)


def check_safetensors(path: str, flag: str = "--hf-checkpoint") -> int:
    """Validate a safetensors file from its header alone; returns the number of tensors."""
    try:
        return safetensors_header.check(path, flag)
    except safetensors_header.SafetensorsHeaderError as e:
        raise PreflightError(str(e)) from e


def check_hf_checkpoint(hf_dir: str, flag: str = "--hf-checkpoint", config: dict | None = None) -> dict[str, Any]:
    """`config`: hf_dir's config.json as already read (validation's args.hf_config), else it is read here."""
    flag = f"{flag} {hf_dir}"
    if not os.path.isdir(hf_dir):
        raise PreflightError(f"{flag} is not a directory; pass an HF model dir (config.json + *.safetensors)")
    config_path = os.path.join(hf_dir, "config.json")
    if config is None:
        config = _read_config(config_path, flag)
    supported = supported_model_types()
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in supported:
        raise PreflightError(f"{config_path}: model_type {model_type!r} is not supported; supported: "
                             f"{', '.join(supported)}")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise PreflightError(f"{index} is unreadable or has no weight_map ({e!r}); fix or re-download it") from e
        missing = [s for s in shards if not os.path.isfile(os.path.join(hf_dir, s))]
        if missing:
            raise PreflightError(f"{index} lists missing shard files {', '.join(missing[:5])}; download them")
    else:
        shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(hf_dir, "*.safetensors")))
        if not shards:
            raise PreflightError(f"{flag}: no *.safetensors weights; convert the checkpoint to safetensors")
    for shard in shards:
        check_safetensors(os.path.join(hf_dir, shard), flag.split()[0])
    return config


def _read_config(config_path: str, flag: str) -> Any:
    if not os.path.isfile(config_path):
        raise PreflightError(f"{flag}: no config.json; pass an HF model directory (config.json + *.safetensors)")
    try:
        with open(config_path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreflightError(f"{config_path} is not valid JSON ({e}); fix or re-download it") from e


# ------------------------------------------------------------------ prompts and reward
def check_prompts(args: Any, report: PreflightReport) -> None:
    path = args.prompt_data
    input_key, label_key = args.input_key, args.label_key
    from slime.rollout.rewards import BUILTIN

    base = _reward_base(args.rm_type)
    rule_reward = not args.custom_rm_path and base in BUILTIN and base not in UNLABELLED_REWARDS
    from slime.rollout.prompt_files import PromptFileError, read_records

    count = labelled = 0
    try:
        for where, rec in read_records(path):  # .jsonl lines or .parquet rows (PATH@[start:end] slices them)
            if not isinstance(rec, dict) or input_key not in rec:
                raise PreflightError(f"{where} has no key {input_key!r}; set --input-key to the prompt's key")
            has_label = label_key is not None and rec.get(label_key) is not None
            if rule_reward and not has_label:
                raise PreflightError(f"{where} has no label {label_key!r}, which --rm-type {args.rm_type} "
                                     "scores against; set --label-key or add labels")
            count += 1
            labelled += has_label
    except PromptFileError as e:
        raise PreflightError(str(e)) from e
    if not count:
        raise PreflightError(f"--prompt-data {path} holds no prompts; pass a JSONL file with one object per line")
    report.prompts, report.labelled = count, labelled


def check_reward(args: Any) -> None:
    custom = args.custom_rm_path
    if custom:
        import importlib.util

        module = custom.replace(":", ".").rsplit(".", 1)[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise PreflightError(f"--custom-rm-path {custom}: module {module!r} is not importable; check the name "
                                 "and PYTHONPATH")
        return
    from slime.rollout.rewards import BUILTIN

    rm_type = args.rm_type
    if rm_type is not None and _reward_base(rm_type) not in BUILTIN:
        raise PreflightError(f"--rm-type {rm_type!r} is unknown; choose one of {', '.join(sorted(BUILTIN))} (or a "
                             "boxed_ prefix) or pass --custom-rm-path module.fn")


# ------------------------------------------------------------------ outputs
def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_writable(path: str, flag: str) -> None:
    """A probe file in `path` (or the nearest existing directory above it), removed at once."""
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        raise PreflightError(f"{flag} {path}: {base} is a file, not a directory; pass a directory path")
    try:
        fd, probe = tempfile.mkstemp(prefix=".slime-probe-", dir=base)
    except OSError as e:
        raise PreflightError(f"{flag} {path} is not writable ({e.strerror} in {base}); pass a writable directory") from e
    os.close(fd)
    os.remove(probe)


def _read_tracker(root: str) -> int | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as e:
        raise PreflightError(f"{path} cannot be read ({e.strerror}); fix its permissions") from e
    if text == "release":  # Megatron's release checkpoint (upstream's converter writes one)
        return -1
    if not text.isdigit():
        raise PreflightError(f"{path} should hold a rollout id, got {text!r}; delete it or fix --load")
    return int(text)


def check_rank_file(path: str) -> None:
    """A torch.save zip archive: its central directory (at the end of the file) and every member's range."""
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    raise PreflightError(f"--load file {path} is truncated (member {info.filename}); restore it or "
                                         "resume from an earlier iteration")
    except (zipfile.BadZipFile, OSError) as e:
        raise PreflightError(f"--load file {path} is not a readable checkpoint ({e}); restore it or resume from an "
                             "earlier iteration") from e


def check_torch_dist(iter_dir: str) -> None:
    """A torch_dist (torch.distributed.checkpoint) directory: .metadata readable, storage ranges inside files."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(iter_dir).read_metadata()
    except Exception as e:
        raise PreflightError(f"--load {iter_dir}/.metadata is unreadable ({type(e).__name__}: {e}); restore it or "
                             "resume from an earlier iteration") from e
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = info.relative_path
        if rel not in sizes:
            p = os.path.join(iter_dir, rel)
            if not os.path.isfile(p):
                raise PreflightError(f"--load {iter_dir}: data file {rel} is missing; restore it or resume from an "
                                     "earlier iteration")
            sizes[rel] = os.path.getsize(p)
        if info.offset + info.length > sizes[rel]:
            raise PreflightError(f"--load file {os.path.join(iter_dir, rel)} is truncated; restore it or resume from "
                                 "an earlier iteration")


def check_load(args: Any, report: PreflightReport) -> None:
    """--load: what the trainer will read (slime.backends.megatron.checkpoint_layout), each file intact."""
    from slime.backends.megatron.checkpoint import layout as L

    load = args.load
    try:
        found = L.find_checkpoint(load, "--load")
    except L.CheckpointFormatError as e:
        raise PreflightError(str(e)) from e
    if found.kind == L.NONE:
        return  # nothing to resume: the run starts from --hf-checkpoint (and may save here)
    if found.kind == L.HF:
        check_hf_checkpoint(found.path, flag="--load")
        return
    d = found.path
    if found.kind == L.TORCH_DIST:
        if os.path.isfile(os.path.join(d, ".metadata")):
            check_torch_dist(d)
        if os.path.isfile(os.path.join(d, "common.pt")):
            check_rank_file(os.path.join(d, "common.pt"))
    else:
        for p in sorted(glob.glob(os.path.join(d, "rank_*.pt"))) + glob.glob(os.path.join(d, "extra.pt")):
            check_rank_file(p)
        meta = os.path.join(d, "meta.json")
        try:
            with open(meta) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            raise PreflightError(f"--load file {meta} is unreadable ({e}); restore it") from e
    if not args.finetune and found.iteration != -1:  # a release checkpoint starts at rollout 0
        report.resume_iteration = found.iteration
        report.resume_root = os.path.dirname(os.path.normpath(d))


def check_checkpoint_keys(args: Any, report: PreflightReport, hf_config: dict) -> None:
    """--load / --ref-load torch_dist checkpoints: their layout, and every weight the model loads present
    (slime.backends.megatron.checkpoint_check, from .metadata alone) against `hf_config` (--hf-checkpoint's
    config.json, as check_hf_checkpoint read it)."""
    from slime.backends.megatron.checkpoint.check import check_run_checkpoints
    from slime.backends.megatron.checkpoint.layout import CheckpointFormatError

    try:
        lines, _ = check_run_checkpoints(args, hf_config)
    except CheckpointFormatError as e:
        raise PreflightError(str(e)) from e
    report.checkpoints.extend(lines)


def check_no_overwrite(args: Any, report: PreflightReport) -> None:
    """Refuse to write into another run's output or checkpoint dir (unless resuming it or told to)."""
    if args.overwrite_output:
        return
    resuming = report.resume_iteration is not None
    metrics = os.path.join(args.output_dir, METRICS_FILE) if args.output_dir else None
    if metrics and os.path.isfile(metrics) and os.path.getsize(metrics) > 0 and not resuming:
        from slime.utils.run_identity import same_run

        if same_run(args):  # this command's own run, stopped before its first checkpoint: restart it
            with open(metrics) as f:
                report.restart_records = sum(1 for line in f if line.strip())
            return
        raise PreflightError(f"--output-dir {args.output_dir} holds another run's {METRICS_FILE}; resume it with "
                             "--load CKPT_DIR, pass --overwrite-output, or choose a fresh --output-dir")
    save = args.save
    if save and _read_tracker(save) is not None:
        same = resuming and os.path.realpath(report.resume_root) == os.path.realpath(save)
        if not same:
            raise PreflightError(f"--save {save} holds another run's checkpoints; resume with --load {save}, pass "
                                 "--overwrite-output, or choose a fresh --save dir")


# ------------------------------------------------------------------ all
def run_preflight(args: Any) -> PreflightReport:
    """Every check above, in order of what a user most likely got wrong; raises PreflightError."""
    report = PreflightReport()
    check_inputs(args, report)  # the accelerator, engine, CPUs, output dirs that are the model dir
    # config.json as validation read it (args.hf_config): not read again
    hf_config = check_hf_checkpoint(args.hf_checkpoint, config=args.hf_config) if args.hf_checkpoint else None
    check_reward(args)
    if args.prompt_data:
        check_prompts(args, report)
    check_data_inputs(args, report)  # eval sets, --rollout-max-prompt-len, training-flag warnings
    if args.load:
        check_load(args, report)
    if hf_config is not None:
        check_checkpoint_keys(args, report, hf_config)
    for flag in ("output_dir", "save", "save_hf"):
        value = getattr(args, flag)
        if value:
            check_writable(value.replace("{rollout_id}", "0"), "--" + flag.replace("_", "-"))
    check_no_overwrite(args, report)
    _print_op_table(args)
    return report


def _print_op_table(args: Any) -> None:
    """Which kernel or reference serves each of the model's ops here; --require-device-kernels refuses fallbacks."""
    from slime.config.device_kernels import check_device_kernels
    from slime.config.preflight_inputs import check_accelerator

    for line in check_device_kernels(args, check_accelerator(args)):
        print(line, flush=True)
