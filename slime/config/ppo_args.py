"""Upstream slime's PPO-with-critic and on-policy-distillation flags, with upstream's names and meaning.

`--advantage-estimator ppo` trains a critic (the policy's network with a one-output value head) beside the
actor on the same ranks (slime.backends.megatron.critic); `--megatron-config-path` gives the actor and the
critic their own flag values (upstream's YAML of role overrides). `--use-opd` subtracts
`--opd-kl-coef * (log pi_student - log pi_teacher)` from the advantages; the teacher's log-probs come from
the rollout (`sglang`: Sample.teacher_log_probs, e.g. set by a reward post-process that asked a teacher
server) or from a teacher checkpoint the trainer runs (`megatron`: --opd-teacher-load).
"""

from __future__ import annotations

import argparse
import copy
import os

from slime.config.parser_helpers import ArgumentError, add_argument_once as _add

# Role overrides that would split the actor's and the critic's layout or placement (both share the ranks).
_SHARED_LAYOUT = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                  "actor_num_nodes", "actor_num_gpus_per_node", "global_batch_size", "micro_batch_size",
                  "use_dynamic_batch_size", "max_tokens_per_gpu", "hf_checkpoint")


def add_ppo_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("PPO critic and on-policy distillation")
    _add(g, parser, "--num-critic-only-steps", type=int, default=0,
         help="with --advantage-estimator ppo: the first N rollouts train the critic only (the actor waits)")
    _add(g, parser, "--value-clip", type=float, default=0.2,
         help="critic loss: max of (V - R)^2 and (V_clipped - R)^2, V_clipped within value-clip of the old value")
    _add(g, parser, "--lambd", type=float, default=1.0, help="GAE lambda of --advantage-estimator ppo")
    _add(g, parser, "--megatron-config-path", type=str, default=None,
         help="YAML 'megatron: [{role: actor|critic, overrides: {lr: 1e-5, load: ..., save: ...}}]': flag values "
              "(argparse names) of one role over the command line's; the layout stays the command line's")
    _add(g, parser, "--use-opd", action="store_true",
         help="on-policy distillation: advantages minus --opd-kl-coef * (student - teacher log-prob) per token")
    _add(g, parser, "--opd-type", choices=("sglang", "megatron"), default=None,
         help="where the teacher's log-probs come from: sglang = the rollout's Sample.teacher_log_probs; "
              "megatron = the trainer runs --opd-teacher-load")
    _add(g, parser, "--opd-kl-coef", type=float, default=1.0, help="weight of the OPD reverse-KL term")
    _add(g, parser, "--opd-teacher-load", type=str, default=None,
         help="--opd-type megatron: the teacher, an HF dir or a torch_dist checkpoint with the policy's architecture")
    _add(g, parser, "--opd-teacher-ckpt-step", type=int, default=None,
         help="--opd-teacher-load's iteration to load from a --save root, instead of its latest")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ArgumentError(msg)


def read_role_overrides(path: str, role: str) -> dict:
    """The `overrides` (or `args`) of the one entry of `role` in upstream's --megatron-config-path YAML."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ArgumentError(f"--megatron-config-path {path}: {str(e).splitlines()[0]}; pass a readable YAML file") from e
    entries = raw.get("megatron") if isinstance(raw, dict) else None
    _require(isinstance(entries, list), f"--megatron-config-path {path}: needs a top-level 'megatron' list, e.g. "
                                        "megatron: [{name: default, role: critic, overrides: {lr: 1e-5}}]")
    mine = [e for e in entries if isinstance(e, dict) and e.get("role") == role]
    _require(all(isinstance(e, dict) and e.get("role") in ("actor", "critic") for e in entries),
             f"--megatron-config-path {path}: every entry needs role: actor or role: critic")
    _require(len(mine) <= 1, f"--megatron-config-path {path}: {len(mine)} entries with role {role}; keep one")
    overrides = (mine[0].get("overrides") or mine[0].get("args") or {}) if mine else {}
    _require(isinstance(overrides, dict), f"--megatron-config-path {path}: role {role}'s overrides must be a mapping")
    return overrides


def apply_role_overrides(args: argparse.Namespace, overrides: dict, role: str) -> argparse.Namespace:
    """A copy of `args` with `overrides` set (a string for a numeric flag is converted: YAML reads 1e-5 as
    text). Unknown names and layout flags are refused in one line."""
    out = copy.copy(args)
    for key, value in overrides.items():
        if key in ("num_nodes", "num_gpus_per_node"):
            continue  # upstream ignores them too: placement follows the command line
        _require(hasattr(args, key), f"--megatron-config-path: {role} override {key!r} is not a train.py flag "
                                     "(use argparse names, e.g. lr, load, save, lr_warmup_iters)")
        _require(key not in _SHARED_LAYOUT, f"--megatron-config-path: {role} override {key!r} would give the actor "
                                            "and the critic different layouts; set it on the command line")
        current = getattr(args, key)
        if isinstance(value, str) and isinstance(current, (int, float)) and not isinstance(current, bool):
            try:
                value = type(current)(float(value)) if isinstance(current, float) else int(value)
            except ValueError:
                raise ArgumentError(f"--megatron-config-path: {role} override {key}={value!r} is not a number") from None
        setattr(out, key, value)
    return out


def _check_teacher_dir(path: str) -> None:
    from slime.backends.megatron.checkpoint import layout as L

    try:
        found = L.find_checkpoint(path, "--opd-teacher-load")
    except L.CheckpointFormatError as e:
        raise ArgumentError(str(e)) from e
    _require(found.kind in (L.HF, L.TORCH_DIST),
             f"--opd-teacher-load {path} holds no model; pass an HF dir (config.json + *.safetensors) or a torch_dist "
             "checkpoint dir of the policy's architecture")


def validate_ppo_args(args: argparse.Namespace) -> None:
    """PPO / OPD combinations (upstream's checks), the critic's arguments (args.critic_args), use_critic."""
    args.use_critic = args.advantage_estimator == "ppo"
    _require(args.num_critic_only_steps >= 0, f"--num-critic-only-steps must be >= 0, got {args.num_critic_only_steps}")
    _require(args.value_clip > 0, f"--value-clip must be > 0, got {args.value_clip}")
    _require(0 <= args.lambd <= 1 and 0 <= args.gamma <= 1, "--gamma and --lambd must be in [0, 1]")
    _require(args.num_critic_only_steps == 0 or args.use_critic,
             "--num-critic-only-steps needs --advantage-estimator ppo (the only estimator with a critic)")
    args.critic_args = None
    command_line = copy.copy(args)  # each role's overrides apply to the command line's values (upstream's)
    if args.megatron_config_path:
        actor = read_role_overrides(args.megatron_config_path, "actor")
        for key, value in vars(apply_role_overrides(args, actor, "actor")).items():
            setattr(args, key, value)
    if args.use_critic:
        _require(args.context_parallel_size == 1,
                 "--advantage-estimator ppo with --context-parallel-size > 1: the critic's values under context "
                 "parallel are not built; use --context-parallel-size 1")
        critic = read_role_overrides(args.megatron_config_path, "critic") if args.megatron_config_path else {}
        critic_args = apply_role_overrides(command_line, critic, "critic")
        critic_args.kl_coef, critic_args.use_opd = 0.0, False  # upstream's critic role: neither applies
        critic_args.critic_args = None
        args.critic_args = critic_args
    if args.use_opd:
        _require(args.opd_type is not None, "--use-opd needs --opd-type sglang or --opd-type megatron")
        if args.opd_type == "megatron":
            _require(args.opd_teacher_load is not None,
                     "--opd-type megatron needs --opd-teacher-load DIR (the teacher: an HF dir or a torch_dist checkpoint)")
            _require(args.dry_run or os.path.exists(args.opd_teacher_load),
                     f"--opd-teacher-load {args.opd_teacher_load} does not exist; pass the teacher's checkpoint dir")
            if os.path.exists(args.opd_teacher_load):
                _check_teacher_dir(args.opd_teacher_load)
        else:
            _require(args.opd_teacher_load is None,
                     "--opd-teacher-load is for --opd-type megatron; with --opd-type sglang the rollout supplies the "
                     "teacher's log-probs (Sample.teacher_log_probs): drop it")
    else:
        _require(args.opd_teacher_load is None, "--opd-teacher-load is set but --use-opd is not: add --use-opd")
