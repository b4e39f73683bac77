"""Training samples from an agent session's turns (upstream slime's `slime.agent.trajectory` contract).

An adapter calls `TrajectoryManager.record_turn(sid, turn=..., prompt_messages=..., response_message=...)` once
per model call of a session. The prompts are placed in a per-session tree of chat messages: a turn whose
history matches an earlier branch message by message (dict equality) continues that branch, a different
history (a sub-agent, a compacted context) opens a new one. `get_trajectory(sid, base_sample=...)` turns
every root-to-leaf path into `Sample`s: the turns' token ids laid end to end, the model's outputs trained
(loss mask 1, the engine's log-probs), everything the prompts added in between (tool output, user text,
template glue) context (loss mask 0, log-prob 0.0).

Each turn's prompt is the chat template's rendering of the history, so it normally extends the tokens
held so far exactly. When it does not (a replayed reply re-tokenizes differently):
- the divergence lies inside the last model output and the new output is short: that output is replaced
  by the prompt's version as context (REALIGN);
- otherwise the sample is closed and the turn starts a new one (FORK).
A generated turn shared by several paths is trained in the first sample only (later ones carry it as
context), so every output is trained once.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Iterator
from typing import Any

from slime.utils.types import Sample

logger = logging.getLogger(__name__)

DEFAULT_FORK_THRESHOLD_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """One `/generate` call of a session: what the adapter hands `record_turn`."""

    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    output_log_probs: list[float] = dataclasses.field(default_factory=list)
    ill_formed: bool = False


class MessageNode:
    """A chat message in a session's tree (the root holds none). `turn` is set only on an assistant
    message the model generated here; every other node (system, user, tool, a replayed or rewritten
    assistant message) only places later turns."""

    def __init__(self, *, role: str | None = None, message: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None, parent: MessageNode | None = None) -> None:
        self.role = role
        self.message = message
        self.metadata = dict(metadata or {})
        self.parent = parent
        self.children: list[MessageNode] = []
        self.turn: TurnRecord | None = None
        self.turn_index: int | None = None
        self.response_trained = False  # set once a sample trained this output

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def add_child(self, child: MessageNode) -> MessageNode:
        child.parent = self
        self.children.append(child)
        return child

    def path_from_root(self) -> list[MessageNode]:
        """The nodes below the root down to this one, root side first."""
        path = []
        node: MessageNode | None = self
        while node is not None and not node.is_root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def leaves(self) -> Iterator[MessageNode]:
        if not self.children:
            yield self
        for child in self.children:
            yield from child.leaves()


class DriftKind(enum.Enum):
    CLEAN = "clean"  # the prompt extends the held tokens exactly
    REALIGN = "realign"  # it diverges inside the last output, which was short: replace that output
    FORK = "fork"  # anything else: a new sample


def _common_prefix_len(a: list[int], b: list[int], chunk: int = 4096) -> int:
    """How many leading ids `a` and `b` share (compared a chunk at a time: long agent contexts mostly agree)."""
    n = min(len(a), len(b))
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        if a[start:end] != b[start:end]:
            return next(i for i in range(start, end) if a[i] != b[i])
    return n


class _SampleBuilder:
    """The token ids, loss mask and log-probs of one sample, turn by turn."""

    def __init__(self, fork_threshold: int) -> None:
        self.fork_threshold = fork_threshold
        self.tokens: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.last_response_start: int | None = None
        self.first_prompt_len = 0

    def drift(self, turn: TurnRecord) -> DriftKind:
        agree = _common_prefix_len(self.tokens, turn.prompt_ids)
        if agree == len(self.tokens):
            return DriftKind.CLEAN
        start = self.last_response_start
        if start is not None and agree >= start and len(turn.output_ids) < self.fork_threshold:
            return DriftKind.REALIGN
        return DriftKind.FORK

    def add(self, turn: TurnRecord, kind: DriftKind, trained: bool) -> None:
        if kind is DriftKind.FORK:
            raise ValueError("a turn that forks starts a new sample")
        first = self.last_response_start is None
        if kind is DriftKind.REALIGN:  # the prompt's version of the last output, as context
            del self.tokens[self.last_response_start:], self.loss_mask[self.last_response_start:]
            del self.logprobs[self.last_response_start:]
        self._extend(turn.prompt_ids[len(self.tokens):], 0, None)
        self.last_response_start = len(self.tokens)
        self._extend(turn.output_ids, int(trained), turn.output_log_probs if trained else None)
        if first:
            self.first_prompt_len = len(turn.prompt_ids)

    def _extend(self, ids: list[int], mask: int, logprobs: list[float] | None) -> None:
        self.tokens += ids
        self.loss_mask += [mask] * len(ids)
        self.logprobs += list(logprobs) if logprobs else [0.0] * len(ids)

    def trains_something(self) -> bool:
        return any(self.loss_mask[self.first_prompt_len:])

    def sample(self, base: Sample, metadata: dict[str, Any], max_tokens: int) -> Sample:
        """The sample: all tokens, the response being everything after the first turn's prompt; cut at
        `max_tokens` when set."""
        keep = max_tokens if max_tokens and len(self.tokens) > max_tokens else len(self.tokens)
        start = self.first_prompt_len
        mask, logprobs = self.loss_mask[:keep], self.logprobs[:keep]
        return Sample(index=base.index, group_index=base.group_index,
                      rollout_id=base.index if base.rollout_id is None else base.rollout_id,
                      prompt=base.prompt, label=base.label, tokens=self.tokens[:keep],
                      response_length=len(mask) - start, loss_mask=mask[start:], rollout_log_probs=logprobs[start:],
                      reward=0.0, status=Sample.Status.COMPLETED, metadata=dict(metadata))


class TrajectoryManager:
    """Per-session message trees and their samples (module doc)."""

    def __init__(self, *, fork_threshold_tokens: int | None = None) -> None:
        self._fork_threshold = DEFAULT_FORK_THRESHOLD_TOKENS if fork_threshold_tokens is None \
            else fork_threshold_tokens
        self._trees: dict[str, MessageNode] = {}
        self._turn_count: dict[str, int] = {}

    def has_session(self, sid: str) -> bool:
        return sid in self._trees

    def turn_count(self, sid: str) -> int:
        return self._turn_count.get(sid, 0)

    def record_turn(self, sid: str, *, turn: TurnRecord, prompt_messages: list[dict[str, Any]],
                    response_message: dict[str, Any] | None, metadata: dict[str, Any] | None = None) -> None:
        if not prompt_messages:
            logger.warning("record_turn(sid=%s): no prompt messages, turn not recorded", sid)
            return
        if turn.output_log_probs and len(turn.output_log_probs) != len(turn.output_ids):
            raise AssertionError(f"turn.output_log_probs length {len(turn.output_log_probs)} != "
                                 f"turn.output_ids length {len(turn.output_ids)}")
        node = self._trees.setdefault(sid, MessageNode())
        depth = 0
        while depth < len(prompt_messages):  # follow the history as far as the tree has it
            msg = prompt_messages[depth]
            match = next((c for c in node.children if c.role == msg.get("role") and c.message == msg), None)
            if match is None:
                break
            node, depth = match, depth + 1
        node, depth = self._absorb_rewrite(sid, node, prompt_messages, depth)
        for msg in prompt_messages[depth:]:
            node = node.add_child(MessageNode(role=msg.get("role"), message=msg))
        leaf = MessageNode(role="assistant", message=response_message, metadata=metadata)
        leaf.turn, leaf.turn_index = turn, self.turn_count(sid) + 1
        node.add_child(leaf)
        self._turn_count[sid] = leaf.turn_index

    def _absorb_rewrite(self, sid: str, node: MessageNode, messages: list[dict[str, Any]],
                        depth: int) -> tuple[MessageNode, int]:
        """A replayed assistant message that differs from the one generated here (re-rendered by the client)
        takes that node's place instead of branching off, when the generated one is the node's only
        assistant child, has no continuation and was short: it then only places later turns (it would
        otherwise stay a dead branch training on its own). Longer outputs branch and keep training."""
        if self._fork_threshold <= 0 or depth >= len(messages) or messages[depth].get("role") != "assistant":
            return node, depth
        assistants = [c for c in node.children if c.role == "assistant"]
        if len(assistants) > 1:
            logger.warning("record_turn(sid=%s turn=%s): %d assistant replies at the branch point; which one the "
                           "replayed one rewrites is unknown, so it branches", sid, self.turn_count(sid) + 1,
                           len(assistants))
        if len(assistants) != 1:
            return node, depth
        old = assistants[0]
        if old.children or old.turn is None or len(old.turn.output_ids) >= self._fork_threshold:
            return node, depth
        old.metadata["merged_rewrite"] = {"abandoned_turn_index": old.turn_index,
                                          "abandoned_response_tokens": len(old.turn.output_ids)}
        old.turn, old.turn_index, old.message = None, None, messages[depth]
        return old, depth + 1

    def get_trajectory(self, sid: str, *, base_sample: Sample, reward: float = 0.0,
                       extra_metadata: dict[str, Any] | None = None, max_sample_tokens: int = 0) -> list[Sample]:
        """Every path's samples, each with the whole `reward`; the session is forgotten (a second call
        gives [])."""
        root = self._trees.get(sid)
        if root is None:
            return []
        samples: list[Sample] = []
        for leaf in root.leaves():
            if not leaf.is_root:
                samples += self._path_samples(leaf.path_from_root(), base_sample, extra_metadata, max_sample_tokens)
        for s in samples:
            s.reward = reward
        self.drop_session(sid)
        return samples

    def drop_session(self, sid: str) -> None:
        self._trees.pop(sid, None)
        self._turn_count.pop(sid, None)

    def _path_samples(self, path: list[MessageNode], base: Sample, extra: dict[str, Any] | None,
                      max_tokens: int) -> list[Sample]:
        generated = [n for n in path if n.role == "assistant" and n.turn is not None]
        metadata = {**(extra or {}),
                    "truncated": bool(generated) and generated[-1].turn.finish_reason == "length",
                    "use_tool": any(bool((n.message or {}).get("tool_calls")) for n in generated),
                    "ill_formed": any(n.turn.ill_formed for n in generated)}
        builders: list[_SampleBuilder] = []
        for node in generated:
            trained, node.response_trained = not node.response_trained, True
            kind = builders[-1].drift(node.turn) if builders else DriftKind.FORK
            if kind is DriftKind.FORK:
                builders.append(_SampleBuilder(self._fork_threshold))
                kind = DriftKind.CLEAN
            builders[-1].add(node.turn, kind, trained)
        return [b.sample(base, metadata, max_tokens) for b in builders if b.trains_something()]


__all__ = ["TrajectoryManager", "TurnRecord"]
