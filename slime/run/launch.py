"""The process around a run: Ray and the placement before it, the clean-up after it (success, error or signal).

`launch(args, loop)` runs one loop (a strategy over slime.run.session.RunSession, chosen by the entry point)
and returns its per-iteration records.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from slime.run.session import RunSession

logger = logging.getLogger("slime.train")

Loop = Callable[[RunSession], list[dict[str, Any]]]


def launch(args, loop: Loop) -> list[dict[str, Any]]:
    """Ray (started here unless this process already joined a session or a cluster), the placement, the loop, and
    the clean-up; with --async-save the last checkpoint is published before the run ends. `args` carry the
    device policy (slime.config.device_policy, applied by the entry point: e.g. each CPU worker's share of the
    cores, read by the accelerator's worker_env)."""
    from slime.ray.placement_group import create_placement_groups, init_ray
    from slime.utils import exits, run_identity
    from slime.utils.stages import stage

    with stage("starting Ray"), exits.library_signal_handlers_reclaimed():  # ray.init replaces the SIGTERM handler
        init_ray(args.num_cpus)
    raylet = exits.local_ray_node_pids().get("raylet")
    if raylet:  # a SIGKILLed driver leaves its agents behind: the next run of this dir stops them
        run_identity.record_processes(args.output_dir, [raylet], "raylet", node_id=exits.local_ray_node_id())
    session = RunSession(args, create_placement_groups(args))  # its handles filled as they start, so a
    try:  # failure still stops what is running
        records = loop(session)
        if args.async_save and session.actor is not None:  # the last checkpoint's files may still be being written
            session.actor.finish_save()
        return records
    finally:
        cleanup(session)


def cleanup(session: RunSession) -> None:
    """Stop engines and trainer actors, free the placement group and the trainer ranks' shared memory
    (the Ray session may go on). Runs after success, errors and signals alike; a second signal
    meanwhile does not cut it short."""
    import ray
    from ray.util.placement_group import remove_placement_group

    from slime.accelerator import get_accelerator
    from slime.utils import exits

    actor, rollout = session.actor, session.rollout

    def around_ray() -> bool:
        """The signal reached Ray's GCS/raylet too (checked before every Ray call: one would hang for 60 s,
        holding the interpreter): stop the session's processes by pid instead."""
        if not exits.ray_core_dead():
            return False
        exits.kill_session_processes(exits.local_ray_node_pids().get("raylet"))
        if actor is not None:
            get_accelerator().release_ipc_memory(actor.pids)
        return True

    with exits.signals_deferred():
        if around_ray():
            return
        if actor is not None:  # first: a distributed weight sync tells the engines to leave its group
            actor.shutdown()
        if rollout is not None:
            if around_ray():
                return
            try:
                ray.get(rollout.shutdown.remote(), timeout=60)
            except Exception as e:
                logger.warning("rollout shutdown: %s", str(e).splitlines()[0] if str(e) else e)
            ray.kill(rollout)
        if around_ray():
            return
        try:
            remove_placement_group(session.slots["actor"].pg)
        except Exception as e:
            logger.warning("placement group removal: %s", e)
        if actor is not None:
            get_accelerator().release_ipc_memory(actor.pids)
