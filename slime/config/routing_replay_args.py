"""Upstream slime's MoE routing-replay flags, with upstream's names and meaning.

`--use-routing-replay`: the trainer records each MoE router's expert choices in the old-policy log-prob
forward and the training forward routes every token to exactly those experts (the gate weights still
come from the current router, so the router keeps its gradient). `--use-rollout-routing-replay` (implies
the former): the engines return the experts their routers chose for every token they fed
(`return_routed_experts`, SGLang's `meta_info["routed_experts"]`) and both trainer forwards use those.
The reference model's forward routes by itself. See docs/rollout.md ("Routing replay").
"""

from __future__ import annotations

import argparse

from slime.config.parser_helpers import ArgumentError, add_argument_once as _add


def add_routing_replay_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("MoE routing replay")
    _add(g, parser, "--use-routing-replay", action="store_true",
         help="the training forward routes each token to the experts the old-policy log-prob forward chose")
    _add(g, parser, "--use-rollout-routing-replay", action="store_true",
         help="the trainer routes each token to the experts the rollout engine chose for it (implies "
              "--use-routing-replay; the engines return them per token)")


def _route_generation_in_process(args: argparse.Namespace) -> None:
    """sglang-router 0.3 re-serializes /generate bodies through its own request type, which has no
    return_routed_experts: behind it the engines never get the flag (measured: the answers carry no
    routed_experts). With --use-rollout-routing-replay generation requests therefore go to the engines
    directly (--rollout-router in-process); a router of one's own (--sglang-router-ip) is used as given."""
    if args.sglang_router_ip:
        return
    if args.rollout_router == "sglang-router":
        raise ArgumentError("--use-rollout-routing-replay with --rollout-router sglang-router: sglang-router 0.3 drops "
                            "return_routed_experts from /generate requests, so no routes would reach the rollout; use "
                            "--rollout-router in-process (auto picks it with this flag)")
    args.rollout_router = "in-process"


def validate_routing_replay_args(args: argparse.Namespace, hf_config: dict | None) -> None:
    """--use-rollout-routing-replay implies --use-routing-replay (upstream's rule); either needs an MoE model.
    The rollout side reshapes the engines' routes by --num-layers x --moe-router-topk, filled from config.json."""
    if args.use_rollout_routing_replay:
        args.use_routing_replay = True
        _route_generation_in_process(args)
    if not args.use_routing_replay or hf_config is None:
        return
    flag = "--use-rollout-routing-replay" if args.use_rollout_routing_replay else "--use-routing-replay"
    from slime.config.model_args import VALUE_FLAGS, text_model_config

    cfg = text_model_config(hf_config)  # a vision-language config.json (Qwen3.5-MoE): its text model
    # config.json's values as the MODEL_ARGS checks read them (the expert count's key differs by family)
    layers, experts, topk = (VALUE_FLAGS[f][1](cfg) for f in ("--num-layers", "--num-experts", "--moe-router-topk"))
    if not experts or not topk:
        raise ArgumentError(f"{flag} replays MoE routes, but {args.hf_checkpoint}'s config.json describes a dense "
                            f"model (no routed experts / num_experts_per_tok); drop {flag}")
    if args.num_layers is None:
        args.num_layers = int(layers)
    if args.moe_router_topk is None:
        args.moe_router_topk = int(topk)
    if args.num_experts is None:
        args.num_experts = int(experts)
