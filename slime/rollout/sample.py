"""One generated response and everything the trainer needs from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SampleStatus(str, Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS / a stop token
    TRUNCATED = "truncated"  # hit --rollout-max-response-len (or the context length)
    ABORTED = "aborted"  # the engine aborted it (pause / weight update); re-issued by the manager
    FAILED = "failed"


@dataclass
class Sample:
    group_index: int  # one per prompt: the n samples of a prompt share it (GRPO groups)
    index: int  # unique over the run (continues across checkpoints)
    prompt: Any  # the prompt as given in the data (string or chat messages)
    prompt_length: int = 0
    tokens: list[int] = field(default_factory=list)  # prompt + response token ids
    response: str = ""
    response_length: int = 0
    loss_mask: list[int] | None = None  # per response token, 1 = trained on
    rollout_log_probs: list[float] | None = None  # engine log-probs of the response tokens
    reward: float | None = None
    label: Any = None
    status: SampleStatus = SampleStatus.PENDING
    weight_version: str | None = None  # weights the response was generated with
    engine_index: int | None = None
    attempts: int = 0  # requests sent for it (> 1 after an engine failure or abort)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length:]
