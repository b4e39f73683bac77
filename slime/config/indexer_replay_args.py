"""`--use-rollout-indexer-replay`: the trainer's GLM-5.3-Flash (glm5_next) DSA layers attend over the keys the
rollout engine's lightning indexer selected for each token (SGLang 0.5.23's `return_indexer_topk` /
`meta_info["indexer_topk"]`), in the old-policy and training forwards, instead of selecting themselves; "shared"
indexer layers reuse their full layer's (replayed) selection as before. Off by default. Named after upstream's
`--use-rollout-routing-replay` (upstream has no indexer replay flag). See docs/rollout.md ("Indexer top-k
replay") and slime/utils/indexer_replay.py for the payload.

Refused before Ray: a model without DSA layers or other than glm5_next (the only family whose trainer and
engine record and replay it), and the SGLang engine: SGLang 0.5.23 captures top-k only in its plain DSA indexer;
the k-pool indexer GLM-5.3-Flash runs (`IndexerKPool`) never writes to the capturer, and its captured indices
are KV-cache slots after `topk_transform`, not sequence positions (read statically from the 0.5.23 wheel:
srt/layers/attention/dsa/dsa_indexer_kpool.py, srt/state_capturer/indexer_topk.py). The embedded engine records it.
"""

from __future__ import annotations

import argparse

from slime.config.parser_helpers import ArgumentError, add_argument_once as _add

FLAG = "--use-rollout-indexer-replay"
MODEL_TYPES = ("glm5_next", "glm5_next_text")


def add_indexer_replay_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("DSA indexer top-k replay")
    _add(g, parser, FLAG, action="store_true",
         help="the trainer's DSA layers (glm5_next) attend over the keys the rollout engine's indexer selected for "
              "each token (the engines return them per token: return_indexer_topk)")


def validate_indexer_replay_args(args: argparse.Namespace) -> None:
    """One line and exit 2 for a combination that cannot replay; fills --num-layers (the payload's layer count)."""
    if not args.use_rollout_indexer_replay:
        return
    from slime.config.model_args import text_model_config
    from slime.config.rollout_flags import resolve_engine_kind

    if args.hf_config is None:
        raise ArgumentError(f"{FLAG} needs the model's config.json (its DSA layers and top-k): {args.hf_checkpoint} "
                            "has none; pass --hf-checkpoint with the checkpoint's directory")
    cfg = text_model_config(args.hf_config)
    model_type = cfg.get("model_type")
    layers = list(cfg.get("layer_types") or [])
    if model_type not in MODEL_TYPES:
        raise ArgumentError(f"{FLAG} replays GLM-5.3-Flash's DSA indexer, but {args.hf_checkpoint}'s config.json "
                            f"has model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)}); drop {FLAG}")
    if "indexed_attention" not in layers or not int(cfg.get("index_topk") or 0):
        raise ArgumentError(f"{FLAG}: {args.hf_checkpoint}'s config.json has no DSA layer (layer_types has no "
                            f"'indexed_attention' or index_topk is 0), so there is no selection to replay; drop {FLAG}")
    if resolve_engine_kind(args.rollout_engine) == "sglang":
        raise ArgumentError(f"{FLAG} with the SGLang engine: SGLang 0.5.23 does not capture the top-k of "
                            "GLM-5.3-Flash's k-pool indexer (and returns KV-cache slots, not positions); use "
                            f"--rollout-engine embedded or drop {FLAG}")
    if not args.sglang_router_ip:  # sglang-router re-serializes /generate bodies and drops the request field
        if args.rollout_router == "sglang-router":
            raise ArgumentError(f"{FLAG} with --rollout-router sglang-router: the router drops return_indexer_topk "
                                "from /generate requests; use --rollout-router in-process (auto picks it)")
        args.rollout_router = "in-process"
    if args.num_layers is None:
        args.num_layers = int(cfg.get("num_hidden_layers") or len(layers))
