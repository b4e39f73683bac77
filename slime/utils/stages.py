"""One line for each slow stage of a run (Ray's, the trainer's and the engines' start-up, the first training
step, a model's download and conversion), then a line every `every_s` (8) seconds while it lasts, so that no
gap reaches 10 s even on a loaded machine, and one with its time when it ends.

    with stage("starting the trainer: 4 ranks build the model and the optimizer"):
        ...
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

logger = logging.getLogger("slime.train")


def _log(line: str) -> None:
    logger.info("%s", line)


@contextmanager
def stage(what: str, every_s: float = 8.0, say: Callable[[str], None] = _log) -> Iterator[None]:
    """`what ...` now, `still what (N s)` every `every_s` seconds meanwhile, `what: done in N s` at the end (not
    after an error, which says for itself what happened)."""
    start = time.perf_counter()
    say(f"{what} ...")
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(every_s):
            say(f"  still {what} ({time.perf_counter() - start:.0f} s)")

    beat = threading.Thread(target=heartbeat, name="slime-stage-heartbeat", daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
    say(f"{what}: done in {time.perf_counter() - start:.1f} s")
