"""Where a flag's meaning here deliberately differs from upstream slime's: one warning line each at start
(train.py and --dry-run print them with the other start-up warnings)."""

from __future__ import annotations

import argparse


def upstream_difference_warnings(args: argparse.Namespace) -> list[str]:
    out = []
    if args.rollout_top_p < 1:
        out.append(f"warning: --rollout-top-p {args.rollout_top_p}: the trainer recomputes log-probs over the full "
                   "vocabulary (upstream's patched SGLang and trainer renormalise over the engine's top-p set); "
                   "the policy ratio then includes the top-p truncation")
    if args.advantage_estimator.startswith("reinforce_plus_plus") and not args.normalize_advantages:
        out.append(f"warning: --advantage-estimator {args.advantage_estimator} whitens advantages (as with "
                   "--normalize-advantages, which upstream requires for it)")
    if args.get_mismatch_metrics and not args.use_tis:
        out.append("warning: --get-mismatch-metrics reports the mismatch metrics only (upstream's also weights the "
                   "policy loss by the clipped TIS ratio, as --use-tis does here); add --use-tis for that")
    if args.use_stateless_adam:
        out.append("warning: --use-stateless-adam: Adam's moments are zeroed before every step (upstream's update); "
                   "their buffers stay allocated (upstream's optimizer allocates none)")
    if args.use_critic:
        out.append("warning: --advantage-estimator ppo: the critic lives on the trainer's own ranks beside the actor "
                   "(upstream: a second actor group that takes turns with it, --offload-train forced), so each device "
                   "holds both models' weights, grads and optimizer state; the memory plan counts the actor only")
    if args.http_proxy:
        out.append(f"warning: --http-proxy {args.http_proxy}: requests to servers other than the run's router and "
                   "engines (--rm-url rewards, plugins' posts) go through it (upstream parses the flag and, at "
                   "624b824a8, reads it nowhere)")
    return out
