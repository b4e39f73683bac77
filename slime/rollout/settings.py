"""Values the rollout components derive from parsed flags. slime.config defines and checks the flags and
imports these; the components use them from here, so they never import the configuration back."""

from __future__ import annotations

from typing import Any

# Flags whose meaning is upstream's rollout loop (streaming groups, first finished kept, the rest aborted and,
# with --partial-rollout, resumed later): a built-in run that sets one runs that loop (sglang_rollout) too.
STREAMING_FLAGS = ("dynamic_sampling_filter_path", "over_sampling_batch_size", "partial_rollout")
# Flags that name upstream's plugin contracts (slime.rollout.plugin_rollout runs them).
PLUGIN_FLAGS = ("rollout_function_path", "data_source_path", "custom_generate_function_path")


def eval_datasets(args: Any) -> list[tuple[str, str]]:
    """[(name, path)] from --eval-prompt-data NAME PATH ... (a lone PATH is named 'eval')."""
    values = list(args.eval_prompt_data or [])
    if len(values) == 1:
        return [("eval", values[0])]
    return [(values[i], values[i + 1]) for i in range(0, len(values) - 1, 2)]


def request_concurrency(args: Any, num_engines: int) -> int:
    """Generate requests in flight over the fleet: --sglang-server-concurrency per engine (upstream's
    client-side limit), within --max-concurrency."""
    return fleet_request_limit(args.sglang_server_concurrency, num_engines, args.max_concurrency)


def fleet_request_limit(per_engine: int, num_engines: int, max_concurrency: int | None) -> int:
    """The one rule for both the built-in loop and plugins' http_utils: per-engine limit x engines (at least
    one), capped by --max-concurrency when given, never below 1."""
    fleet = int(per_engine) * max(1, int(num_engines))
    return max(1, min(int(max_concurrency), fleet) if max_concurrency is not None else fleet)
