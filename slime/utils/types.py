"""The sample type of the whole rollout -> training path, upstream slime's `slime.utils.types.Sample`.

Fields, `Sample.Status`, `Sample.SpecInfo`, `Sample.PrefixCacheInfo`, `to_dict`/`from_dict`,
`get_reward_value` and `append_response_tokens` follow upstream's contract, so plugins written for
upstream build and read samples unchanged. This project adds three bookkeeping fields at the end
(`engine_index`, `attempts`, and `prompt_length` as a property) and `weight_version` (the last of
`weight_versions`).

`tokens` is prompt + response; the response is the last `response_length` tokens, among them tool or
environment output a multi-turn generate function appended with loss mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def _ints(values: Any) -> list[int]:
    if values is None:
        return []
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [int(v) for v in values]


def _floats(values: Any) -> list[float] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


@dataclass
class Sample:
    """One generated response (or a multi-turn trajectory) and what the trainer needs from it."""

    group_index: int | None = None  # one per prompt: its n samples share it (GRPO groups)
    index: int | None = None  # unique over the run
    rollout_id: int | None = None  # samples split from one execution share it (default: index)
    prompt: str | list[dict[str, str]] = ""  # the templated text under --apply-chat-template
    tokens: list[int] = field(default_factory=list)  # prompt + response token ids
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None  # a dict is read through --reward-key
    loss_mask: list[int] | None = None  # per response token: 1 trained, 0 not (tool output)
    weight_versions: list[str] = field(default_factory=list)  # engine weights of each generation turn
    rollout_log_probs: list[float] | None = None  # engine log-probs of the response tokens
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: Any = None
    rollout_indexer_topk: Any = None  # int32 [len - 1, layers, width]: the engine's DSA keys (indexer top-k replay)
    remove_sample: bool = False  # kept in the batch but contributes no loss
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"  # stopped on EOS / a stop string or token
        TRUNCATED = "truncated"  # hit the length limit
        ABORTED = "aborted"  # the engine aborted it (pause for a weight update); generated again
        FAILED = "failed"  # a recoverable failure (tool error, parse error); may hold partial output

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None  # per-sample --custom-generate-function-path (eval configs)
    custom_rm_path: str | None = None  # per-sample --custom-rm-path
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0  # seconds spent outside generation (tools, environment)

    @dataclass
    class SpecInfo:
        """Speculative-decoding counters summed over a sample's turns."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += meta_info.get("spec_accept_token_num", 0)
            self.spec_draft_token_num += meta_info.get("spec_draft_token_num", 0)
            self.spec_verify_ct += meta_info.get("spec_verify_ct", 0)
            self.completion_token_num += meta_info.get("completion_tokens", 0)

        def to_dict(self) -> dict:
            return dict(vars(self))

        @staticmethod
        def from_dict(data: dict) -> "Sample.SpecInfo":
            names = ("spec_accept_token_num", "spec_draft_token_num", "spec_verify_ct", "completion_token_num")
            return Sample.SpecInfo(**{k: data.get(k, 0) for k in names})

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens the engine served from its prefix cache, summed over turns."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += meta_info.get("cached_tokens", 0)
            self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)

        def to_dict(self) -> dict:
            return dict(vars(self))

        @staticmethod
        def from_dict(data: dict) -> "Sample.PrefixCacheInfo":
            return Sample.PrefixCacheInfo(cached_tokens=data.get("cached_tokens", 0),
                                          total_prompt_tokens=data.get("total_prompt_tokens", 0))

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    # this project's bookkeeping
    engine_index: int | None = None  # the engine that generated it
    attempts: int = 0  # requests sent for it (> 1 after an engine failure or abort)

    # ------------------------------------------------------------------ views
    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length:]

    @property
    def effective_response_length(self) -> int:
        """Trained response tokens (tool output excluded)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    @property
    def weight_version(self) -> str | None:
        return self.weight_versions[-1] if self.weight_versions else None

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        self.weight_versions = [] if version is None else [str(version)]

    def get_reward_value(self, args: Any) -> Any:
        key = getattr(args, "reward_key", None)
        return self.reward[key] if key else self.reward

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict:
        out = dict(vars(self))
        out["status"] = self.status.value
        out["spec_info"] = self.spec_info.to_dict()
        out["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return out

    @staticmethod
    def from_dict(data: dict) -> "Sample":
        """Inverse of to_dict; keys that are not fields become attributes."""
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", Sample.Status.PENDING.value))
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info") or {})
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(data.get("prefix_cache_info") or {})
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    # ------------------------------------------------------------------ multi-turn building
    def append_response_tokens(self, args: Any = None, *, tokens: Any = None, log_probs: Any = None,
                               trainable: bool = True, meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Append one turn to the response and keep loss mask and log-probs aligned with it.

        A model turn: `trainable=True` with the engine's `log_probs` (and its `meta_info`: weight version,
        finish reason -> status, cache and speculative counters). Tool or environment output:
        `trainable=False` without log-probs; it gets loss mask 0 and log-prob 0.0 placeholders."""
        tokens, log_probs = _ints(tokens), _floats(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens need the engine's log probabilities (log_probs=...)")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable (tool/environment) tokens take no log probabilities")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens = list(self.tokens) + tokens
            self.response_length += len(tokens)
            self.loss_mask = (list(self.loss_mask) if self.loss_mask is not None else [1] * before) + \
                [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("cannot append trainable log probabilities to a response whose earlier "
                                     "tokens have none (rollout_log_probs is None)")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs = list(self.rollout_log_probs) + log_probs
        if meta_info is not None:
            self._apply_meta_info(args, meta_info, update_terminal_info)
        self._check_lengths()

    def _apply_meta_info(self, args: Any, meta_info: dict, update_terminal_info: bool) -> None:
        self._apply_routed_experts(args, meta_info)
        self._apply_indexer_topk(args, meta_info)
        if not update_terminal_info or "finish_reason" not in meta_info:
            return
        if getattr(args, "sglang_speculative_algorithm", None):
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED,
                  "stop": Sample.Status.COMPLETED}.get((meta_info["finish_reason"] or {}).get("type"))
        if status is not None:
            self.status = status

    def _apply_routed_experts(self, args: Any, meta_info: dict) -> None:
        """SGLang's `meta_info["routed_experts"]` (return_routed_experts): the experts of every token fed to the
        engine from `routed_experts_start_len` on (all of prompt + response but the last token), as int32
        [rows, --num-layers, --moe-router-topk]; rows before the start are kept from the earlier turns."""
        from slime.utils.misc import decode_int32_meta_array

        flat = decode_int32_meta_array(meta_info, "routed_experts")
        if flat is None:
            return
        if (meta_info.get("finish_reason") or {}).get("type") == "abort":
            # an aborted turn (maybe never fed): its continuation feeds the whole sequence and returns every row
            self.rollout_routed_experts = None
            return
        layers, topk = getattr(args, "num_layers", None), getattr(args, "moe_router_topk", None)
        if not layers or not topk:
            raise ValueError("routed experts need args.num_layers and args.moe_router_topk to be reshaped "
                             "(--use-rollout-routing-replay fills them from config.json)")
        start = int(meta_info.get("routed_experts_start_len", 0) or 0)
        rows = max(0, len(self.tokens) - 1 - start)
        if start < 0 or flat.numel() != rows * layers * topk:
            raise ValueError(f"sample {self.index}: routed_experts has {flat.numel()} values, expected {rows} tokens x "
                             f"{layers} layers x top-{topk} (tokens {len(self.tokens)}, routed_experts_start_len {start})")
        routes = flat.reshape(rows, layers, topk)
        if start:
            earlier = self.rollout_routed_experts
            if earlier is None or len(earlier) < start:
                raise ValueError(f"sample {self.index}: routed_experts_start_len {start} but only "
                                 f"{0 if earlier is None else len(earlier)} earlier rows are known")
            import torch

            routes = torch.cat([torch.as_tensor(earlier, dtype=torch.int32)[:start], routes])
        self.rollout_routed_experts = routes

    def _apply_indexer_topk(self, args: Any, meta_info: dict) -> None:
        """SGLang's `meta_info["indexer_topk"]` (return_indexer_topk): the DSA layers' selected key positions of
        every token fed to the engine (prompt + response but the last; SGLang returns them from token 0 on every
        turn), int32 [rows, --num-layers, width] (slime/utils/indexer_replay.py)."""
        from slime.utils.indexer_replay import META_KEY, rows_from_meta
        from slime.utils.misc import decode_int32_meta_array

        flat = decode_int32_meta_array(meta_info, META_KEY)
        if flat is None:
            return
        if (meta_info.get("finish_reason") or {}).get("type") == "abort":
            self.rollout_indexer_topk = None  # its continuation feeds the whole sequence again
            return
        layers = getattr(args, "num_layers", None)
        if not layers:
            raise ValueError("indexer top-k needs args.num_layers to be reshaped (--use-rollout-indexer-replay "
                             "fills it from config.json)")
        self.rollout_indexer_topk = rows_from_meta(flat, max(0, len(self.tokens) - 1), int(layers), self.index)

    def _check_lengths(self) -> None:
        for name in ("loss_mask", "rollout_log_probs"):
            values = getattr(self, name)
            if values is not None and len(values) != self.response_length:
                raise ValueError(f"{name} length {len(values)} != response_length {self.response_length}")


# A dict batch on the rollout -> training path (upstream's name).
RolloutBatch = dict[str, list]


@dataclass(frozen=True)
class ParamInfo:
    """A parameter's description in a weight update (upstream's): name, dtype, shape, attributes, size in bytes
    and the rank holding it."""

    name: str
    dtype: Any
    shape: Any
    attrs: dict
    size: int
    src_rank: int


@dataclass
class MultimodalType:
    name: str  # the content part's type in a chat message ("image")
    placeholder: str  # its placeholder in the conversation text ("<image>")


class MultimodalTypes:
    """The multimodal inputs upstream's chat handling knows, each with its placeholder."""

    IMAGE = MultimodalType(name="image", placeholder="<image>")
    VIDEO = MultimodalType(name="video", placeholder="<video>")
    AUDIO = MultimodalType(name="audio", placeholder="<audio>")

    @classmethod
    def all(cls) -> list[MultimodalType]:
        return [cls.IMAGE, cls.VIDEO, cls.AUDIO]

    @classmethod
    def get(cls, name: str) -> MultimodalType | None:
        return next((t for t in cls.all() if t.name == name), None)
