"""Pipeline parallel: the decoder layers of each stage, and one training or log-prob pass over packed
micro-batches through Megatron-core's own schedules (`get_forward_backward_func`: 1F1B across stages,
a plain micro-batch loop at pp = 1).

Every stage packs the same micro-batches (every rank holds the rollout batch): the first stage feeds
token ids, all stages need the sequence boundaries and positions (attention, RoPE), and only the last
stage has logits, so `on_logits` (log-probs, entropy, loss) runs there. Packed micro-batches differ in
length, so the model config sets `variable_seq_lengths` and the stages exchange each activation's shape.
"""

from __future__ import annotations

from typing import Callable, Sequence


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Decoder layers of each pipeline stage, as Megatron splits them: `first` / `last` layers on the first /
    last stage when given (--decoder-first/last-pipeline-num-layers), the rest evenly over the others. With
    neither given and num_layers % pp != 0, the last stage takes the remainder. Raises ValueError (one line)."""
    if pp < 1:
        raise ValueError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1; drop them")
        return [num_layers]
    if num_layers < pp:
        raise ValueError(f"--pipeline-model-parallel-size {pp} exceeds the model's {num_layers} decoder layers; lower it")
    if first is None and last is None:
        base = num_layers // pp
        return [base] * (pp - 1) + [num_layers - base * (pp - 1)]
    for flag, v in (("first", first), ("last", last)):
        if v is not None and v < 1:
            raise ValueError(f"--decoder-{flag}-pipeline-num-layers must be >= 1, got {v}")
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if (rest > 0) != (middle_stages > 0) or (middle_stages and rest % middle_stages):
        given = " + ".join(f"{k} {v}" for k, v in (("first", first), ("last", last)) if v is not None)
        raise ValueError(f"pipeline stages do not split {num_layers} decoder layers: {given} leave {rest} layers for "
                         f"{middle_stages} other stage(s), which must be a positive multiple; change "
                         "--decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-size")
    each = rest // middle_stages if middle_stages else 0
    return ([first] if first is not None else []) + [each] * middle_stages + ([last] if last is not None else [])


def forward_backward(model, micro_batches: Sequence, forward: Callable, on_logits: Callable, forward_only: bool) -> None:
    """One pass of Megatron's schedule over `micro_batches` (the same list on every stage of a pipeline).

    forward(model, mb) -> the model's output (logits on the last stage, hidden states elsewhere);
    on_logits(mb, logits) -> loss tensor, already normalized for the whole optimizer step (last stage only;
    in forward_only passes any scalar tensor). Gradients accumulate in the model's grad buffers.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    count = len(micro_batches)
    if not count:
        return

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)

        def loss_func(logits):
            # The schedule divides each micro-batch's loss by the micro-batch count; ours is already the
            # step's share (normalized by the step's samples or tokens), so that division is undone here.
            return on_logits(mb, logits) * count, {}

        return forward(chunk, mb), loss_func

    first = micro_batches[0]
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model], num_microbatches=count,
        seq_length=int(first.tokens.shape[-1]), micro_batch_size=1, forward_only=forward_only)
