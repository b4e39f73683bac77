"""The parallel sizes against the model (config.json) and the trainer's devices, before Ray starts and in
--dry-run: attention heads, query groups, vocabulary and FFN widths by TP, routed experts by EP, decoder layers
by PP, and the trainer world by TP x PP x CP. Each problem is one line naming the sizes that would work.

What is checked is what the trainer itself refuses later (in a trainer rank, after Ray started): the model
family's `check_parallel(tp, ep)` (slime_plugins.models.common.config) and the world/pipeline rules. The
vocabulary is among them: Megatron pads the vocabulary of a checkpoint (make_vocab_size_divisible_by x TP
rows, slime.backends.megatron.checkpoint.keys), but the trainer's embedding and output layer split the
checkpoint's own vocab_size over TP ranks, so vocab_size % TP must be 0."""

from __future__ import annotations

import argparse
import os

from slime.config.parser_helpers import ArgumentError


def check_parallel_sizes(args: argparse.Namespace) -> None:
    """Raises ArgumentError (one line) for the first parallel size the model or the device count refuses."""
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep = args.expert_model_parallel_size
    arch = _architecture(args.hf_config)
    where = f"{os.path.join(args.hf_checkpoint, 'config.json')}"
    devices = f"{world} trainer device(s)"
    if arch is not None:
        bad = _model_refusal(arch, tp, 1)
        if bad:
            raise ArgumentError(
                f"--tensor-model-parallel-size {tp} does not split the model ({where}: {bad}); valid sizes for "
                f"this model with {devices}, PP {pp}, CP {cp}: {_sizes(_valid_tp(arch, world, pp, cp))}")
        bad = _model_refusal(arch, 1, ep)
        if bad:
            raise ArgumentError(
                f"--expert-model-parallel-size {ep} does not split the experts ({where}: {bad}); valid sizes for "
                f"this model with {devices}, PP {pp}: {_sizes(_valid_ep(arch, world, pp))}")
        layers = _num_layers(arch)
        if layers is not None and pp > layers:
            raise ArgumentError(
                f"--pipeline-model-parallel-size {pp} exceeds the model's {layers} decoder layers ({where}); valid "
                f"sizes with {devices}, TP {tp}, CP {cp}: {_sizes(_valid_pp(layers, world, tp, cp))}")
    if world % (tp * pp * cp):
        raise ArgumentError(_world_line(args, arch, world, tp, pp, cp))


def _world_line(args: argparse.Namespace, arch, world: int, tp: int, pp: int, cp: int) -> str:
    """The world does not divide into TP x PP x CP: the sizes of each that would, the other two as given."""
    tps = _valid_tp(arch, world, pp, cp) if arch is not None else _divisors_of_quotient(world, pp * cp)
    layers = _num_layers(arch) if arch is not None else None
    pps = _valid_pp(layers, world, tp, cp) if layers is not None else _divisors_of_quotient(world, tp * cp)
    cps = _divisors_of_quotient(world, tp * pp)
    return (f"the {world} trainer device(s) (--actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{args.actor_num_gpus_per_node}) do not divide into TP {tp} x PP {pp} x CP {cp} = {tp * pp * cp}; valid "
            f"sizes, the other two as given: --tensor-model-parallel-size {_sizes(tps)}; "
            f"--pipeline-model-parallel-size {_sizes(pps)}; --context-parallel-size {_sizes(cps)}; or a trainer "
            f"world that is a multiple of {tp * pp * cp}")


def parsed_architecture(hf_config: dict | None):
    """The family's architecture dataclass of config.json, or None when there is none or the family is unknown or
    refuses it (reported by the model checks, not by the layout checks that call this)."""
    if not hf_config:
        return None
    from slime_plugins.models.registry import UnsupportedModelError, get_family

    try:
        return get_family(hf_config.get("model_type")).parse(hf_config)
    except (UnsupportedModelError, ValueError, TypeError, KeyError):
        return None


def _architecture(hf_config: dict | None):
    """parsed_architecture, when its family states how it splits (check_parallel)."""
    arch = parsed_architecture(hf_config)
    return arch if hasattr(arch, "check_parallel") else None


def _model_refusal(arch, tp: int, ep: int) -> str | None:
    """The family's own reason the model does not split over (tp, ep), without its prefix; None when it does."""
    try:
        arch.check_parallel(tp, ep)
    except ValueError as e:
        text = str(e)
        return text.split(": ", 1)[1] if text.startswith("model does not split") else text
    return None


def _num_layers(arch) -> int | None:
    layers = getattr(arch, "num_hidden_layers", None)
    return layers if isinstance(layers, int) else None


def _divisors_of_quotient(world: int, used: int) -> list[int]:
    """Sizes s with world % (used x s) == 0 (none when `used` itself does not divide the world)."""
    if world % used:
        return []
    rest = world // used
    return [s for s in range(1, rest + 1) if rest % s == 0]


def _valid_tp(arch, world: int, pp: int, cp: int) -> list[int]:
    if world % (pp * cp):
        return []
    sizes = _divisors_of_quotient(world, pp * cp)
    return [t for t in sizes if _model_refusal(arch, t, 1) is None]


def _valid_ep(arch, world: int, pp: int) -> list[int]:
    # expert-TP is 1 here (validation refuses others), so Megatron's expert groups need world % (ep x pp) == 0
    sizes = _divisors_of_quotient(world, pp)
    return [e for e in sizes if _model_refusal(arch, 1, e) is None]


def _valid_pp(layers: int, world: int, tp: int, cp: int) -> list[int]:
    sizes = _divisors_of_quotient(world, tp * cp)
    return [p for p in sizes if p <= layers]


def _sizes(values: list[int]) -> str:
    return ", ".join(map(str, values)) if values else "none"
