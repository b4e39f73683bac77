"""What the preflight checks share (`slime.config.preflight` runs them, `slime.config.preflight_inputs` holds
some): the one-line error, the report they fill, which rewards need a label. A leaf of the configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Built-in rewards that grade against the prompt's label (all but "random"); a boxed_ prefix grades the
# last \\boxed{} of the response with the same rule.
UNLABELLED_REWARDS = ("random",)


def _reward_base(rm_type: str | None) -> str | None:
    return rm_type[len("boxed_"):] if rm_type and rm_type.startswith("boxed_") else rm_type


class PreflightError(ValueError):
    """An input or output that would fail the run later. One line: the file or flag, and the fix."""


@dataclass
class PreflightReport:
    prompts: int = 0
    labelled: int = 0
    resume_iteration: int | None = None  # the --load iteration the run will resume after
    resume_root: str | None = None  # the checkpoint root (holding the tracker) of that iteration
    restart_records: int = 0  # the same run re-run before its first checkpoint: its records to discard
    shortest_prompt: int | None = None  # tokens; known when --rollout-max-prompt-len made preflight tokenize
    warnings: list[str] = field(default_factory=list)  # accepted, but likely not what was meant: one line each
    checkpoints: list[str] = field(default_factory=list)  # what --load / --ref-load torch_dist checkpoints hold

    def lines(self, args: Any) -> list[str]:
        out = list(self.checkpoints)
        if args.prompt_data:
            out.append(f"prompts: {self.prompts} in {args.prompt_data} ({self.labelled} with a label)")
        if self.resume_iteration is not None:
            out.append(f"resuming from {args.load} after rollout {self.resume_iteration}")
        if self.restart_records:
            n = self.restart_records
            out.append(f"restarting from rollout 0: this run was stopped before its first checkpoint; {n} metric "
                       f"record{'s' if n != 1 else ''} of its unsaved rollouts discarded")
        out += [f"warning: {w}" for w in self.warnings]
        return out
