"""train.py's loop: rollout -> rewards -> old/ref log-probs -> advantages -> train -> weight sync -> save,
one rollout after the other, every rollout generated on the weights trained on all rollouts before it."""

from __future__ import annotations

import time
from typing import Any

from slime.run.session import RunSession


def run(session: RunSession) -> list[dict[str, Any]]:
    import ray

    args, engines = session.args, session.engines
    session.start_trainer()
    session.start_rollout()
    # The engine check before each sync runs during training where it gives the engines no memory back (no
    # --offload-rollout, or the engines' memory is the host's): its Ray round trips then cost no time. An
    # engine that dies after it fails the sync, which checks again and syncs once more (RunSession.sync_weights).
    early_check = False
    if engines:  # --debug-train-only: no engine to connect to, route to or sync
        session.connect_engines()
        early_check = not args.offload_rollout or ray.get(session.rollout.engines_memory_is_host.remote())
        if args.load:  # engines start from --hf-checkpoint; weights from --load (resume, --finetune, HF) may differ
            session.push_weights(session.start)
    session.open_metrics()
    for rollout_id in session.rollout_ids():
        metrics = session.begin_iteration(rollout_id)
        # --offload-rollout: the manager releases the engines' memory at the end of the same call
        result, elapsed = session.generate(rollout_id, **({"offload": True} if args.offload_rollout else {}))
        session.add_rollout_metrics(metrics, result, elapsed)
        check = session.train(rollout_id, result, metrics, check_engines=early_check)
        if args.offload_rollout and not engines:
            ray.get(session.rollout.onload.remote())
        # Engines that died since the rollout are restarted now (this sync gives them the weights); the list may
        # differ from the rollout's (a restarted engine may have a new port). --offload-rollout: the engines get
        # their memory back in the same call.
        t_call = time.perf_counter()
        if engines:
            session.sync_weights(rollout_id + 1, metrics, onload=bool(args.offload_rollout) and check is None,
                                 check=check)
        else:
            metrics["time/weight_sync"] = 0.0  # as the one-step-off loop's records without a sync
        metrics["time/weight_sync_call"] = time.perf_counter() - t_call
        if args.offload_train:
            session.actor.offload()
        session.save(session.save_point(rollout_id), metrics)
        session.close_iteration(metrics)
        session.evaluate_if_due(rollout_id + 1)  # on the weights just synced to the engines
    return session.finish()
