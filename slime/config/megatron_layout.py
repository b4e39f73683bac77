"""The layout checks of Megatron-core's `parallel_state.initialize_model_parallel` (megatron-core 0.16.1), run
before Ray starts so that a layout Megatron would refuse at start-up is reported by the parser, in Megatron's
own words, and a layout Megatron accepts is never refused for its shape.

Mirrored in order (the first refusal is the one Megatron raises):
- world % (TP * PP * CP): the decoder grid;
- a virtual pipeline needs PP > 1;
- world % (expert-TP * EP * PP): the expert grid (expert-TP defaults to TP); EP folds over the DP x CP (and
  TP / expert-TP) ranks of a pipeline stage, so EP 8 with PP 2 needs 16 devices, whatever TP and CP are;
- with the default rank order "tp-cp-ep-dp-pp" (the only one slime uses) Megatron's two further asserts (same
  DP size of the attention and expert parts unless PP is last; same PP groups in both grids) always hold.
tests/test_megatron_layout.py calls Megatron's own function on a fake world and checks the same verdict.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # None: Megatron's default, the TP size
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved schedule)


def megatron_refusal(layout: ParallelLayout) -> str | None:
    """The error initialize_model_parallel raises for `layout` (its message), or None when it accepts it."""
    w, tp, pp, cp, ep = layout.world, layout.tp, layout.pp, layout.cp, layout.ep
    model = tp * pp * cp
    if w % model:
        return f"world_size ({w}) is not divisible by {model}"
    if layout.vpp is not None and not pp > 1:
        return "pipeline-model-parallel size should be greater than 1 with interleaved schedule"
    etp = tp if layout.etp is None else layout.etp
    expert = etp * ep * pp
    if w % expert:
        return f"world_size ({w}) is not divisible by expert_tensor_model_pipeline_parallel size ({expert})"
    return None
