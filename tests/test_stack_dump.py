"""SLIME_DUMP_STACKS_AFTER_S: a slime process prints its threads' stacks once after the delay and keeps running."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WAITER = """
import threading, time
import slime
def parked_in_a_named_wait():
    time.sleep(3)
t = threading.Thread(target=parked_in_a_named_wait); t.start(); t.join()
print("finished")
"""


def _run(value):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("SLIME_DUMP_STACKS_AFTER_S", None)
    if value is not None:
        env["SLIME_DUMP_STACKS_AFTER_S"] = value
    return subprocess.run([sys.executable, "-c", _WAITER], capture_output=True, text=True, env=env, timeout=120)


def test_stacks_are_printed_once_and_the_process_goes_on():
    r = _run("0.5")
    assert r.returncode == 0 and r.stdout.strip() == "finished", r.stderr[-2000:]
    assert r.stderr.count("parked_in_a_named_wait") == 1  # the waiting thread's frame, once (repeat=False)
    assert "Thread 0x" in r.stderr


def test_unset_prints_nothing_and_a_bad_value_is_one_line():
    r = _run(None)
    assert r.returncode == 0 and "parked_in_a_named_wait" not in r.stderr
    r = _run("soon")
    assert r.returncode == 0 and r.stdout.strip() == "finished"
    lines = [x for x in r.stderr.splitlines() if "SLIME_DUMP_STACKS_AFTER_S" in x]
    assert len(lines) == 1 and "positive number of seconds" in lines[0]
    assert "parked_in_a_named_wait" not in r.stderr
