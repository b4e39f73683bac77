"""HCCL_BUFFSIZE for a run: the communication buffer every HCCL communicator of a process allocates.

What CANN documents (HCCL_BUFFSIZE, CANN 8.0.0 / 8.5.0 environment-variable pages): the size in MB (integer >= 1,
default 200) of the buffer a communicator uses to exchange data between two NPUs; each communicator holds
2 x HCCL_BUFFSIZE of device memory (send and receive) for its whole life, exclusively; a collective whose data
exceeds the buffer is split into rounds and gets slower, so the buffer should be at least the largest message. The
recommendation for LLMs is micro-batch x sequence length x hidden size x dtype bytes, in MB, rounded up.

What others set: MindSpeed sizes its expert-parallel group's buffer to the all-to-all of one micro-batch,
2 x ceil(S / CP / TP x B x H x top-k / MiB) MB (bf16 tokens, top-k copies per token); SGLang's Ascend DeepEP docs
raise it for the MoE dispatch. The variable is per process, so one value serves every communicator of a worker:

- it is sized for the EP all-to-all of one micro-batch on one rank: its tokens (--max-tokens-per-gpu, split over TP
  by sequence parallelism) x top-k x hidden x 2 bytes (bf16), dispatch and combine alike; never below CANN's
  default (200 MB), never above CAP_MB;
- the weight-sync bucket (--update-weight-buffer-size, 512 MB by default, 1 GB in the GLM-5.3-Flash run script) does
  not set it: every communicator holds twice the value for the whole run and a trainer rank belongs to about ten
  (DP, TP, PP, EP, CP, their products, the weight-sync group), so a 1 GB buffer would cost some 20 GB of a 112-144 GB
  device; a bucket larger than the buffer is broadcast in ceil(bucket / buffer) rounds instead, which costs
  bandwidth per round, not memory (`HcclTraffic.bucket_rounds`).
A value the user exported is kept as it is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

ENV = "HCCL_BUFFSIZE"
DEFAULT_MB = 200  # CANN's default
CAP_MB = 1024  # 2 GB per communicator
MIB = 1 << 20
TOKEN_BYTES = 2  # bf16 activations on the wire


@dataclass(frozen=True)
class HcclTraffic:
    """The largest messages of a run, in bytes."""

    moe_all_to_all: int  # one micro-batch's routed token copies leaving one rank (0 without expert parallelism)
    weight_bucket: int  # one weight-sync bucket

    def buffsize_mb(self) -> int:
        return min(CAP_MB, max(DEFAULT_MB, math.ceil(self.moe_all_to_all / MIB)))

    def bucket_rounds(self, buffsize_mb: int | None = None) -> int:
        """Rounds HCCL splits one weight-sync bucket's broadcast into (1: it fits the buffer)."""
        return max(1, math.ceil(self.weight_bucket / ((buffsize_mb or self.buffsize_mb()) * MIB)))


def traffic_of(args: Any) -> HcclTraffic:
    """The run's messages from its parsed arguments and config.json (args.hf_config, as validation read it)."""
    cfg = args.hf_config or {}
    if isinstance(cfg.get("text_config"), dict):  # a vision-language checkpoint: its text model's sizes
        cfg = cfg["text_config"]
    a2a = 0
    if args.expert_model_parallel_size > 1 and cfg.get("num_experts_per_tok") and args.max_tokens_per_gpu:
        tokens = args.max_tokens_per_gpu
        if args.sequence_parallel:
            tokens = math.ceil(tokens / args.tensor_model_parallel_size)
        a2a = tokens * int(cfg["num_experts_per_tok"]) * int(cfg.get("hidden_size") or 0) * TOKEN_BYTES
    return HcclTraffic(moe_all_to_all=a2a, weight_bucket=int(args.update_weight_buffer_size))


def buffsize_env(args: Any) -> dict[str, str]:
    """{HCCL_BUFFSIZE: MB} sized for the run, or {} when the user set it (their value stays in the environment)."""
    if os.environ.get(ENV):
        return {}
    return {ENV: str(traffic_of(args).buffsize_mb())}
