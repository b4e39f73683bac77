"""slime.utils.exits: Ray errors to one console line, signals to `Interrupted`, deferred signals."""

from __future__ import annotations

import os
import signal

import pytest

from slime.utils import exits


def _ray_task_error(cause: BaseException, pid: int = 4242):
    from ray.exceptions import RayTaskError

    return RayTaskError("RolloutManager.generate", "Traceback (most recent call last):\n  ...\n" * 40, cause,
                        proctitle="ray::RolloutManager.generate", pid=pid, ip="127.0.0.1")


def test_actor_error_is_one_line_with_its_log(tmp_path):
    log = tmp_path / "worker-abc-01000000-4242.err"
    log.write_text("boom\n")
    lines = exits.describe_error(_ray_task_error(ValueError("--prompt-data x.jsonl:3 has no key 'prompt'")),
                                 logs_dir=str(tmp_path))
    assert lines == [f"--prompt-data x.jsonl:3 has no key 'prompt' (actor log: {log})"]


def test_engine_report_keeps_its_log_tail():
    from slime.rollout.generate import RolloutError

    report = "rollout engine 0 (http://x, pid 7) was killed by signal 9; log /l/engine-0.log, last lines:\nA\nB"
    lines = exits.describe_error(_ray_task_error(RolloutError(f"restarts used up; no engine left. {report}")))
    assert lines[0].startswith("restarts used up") and lines[0].endswith("last lines:")
    assert lines[1:] == ["  | A", "  | B"]


def test_nested_ray_errors_unwrap_to_the_cause():
    inner = KeyError("w")
    assert exits.root_cause(_ray_task_error(_ray_task_error(inner))) is inner


def test_sigterm_raises_interrupted_and_deferral_records_signals():
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        exits.install_signal_handlers()
        with pytest.raises(exits.Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.exit_code == 143 and e.value.name == "SIGTERM"
        with exits.signals_deferred() as seen:
            os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised: cleanup goes on
        assert seen == [signal.SIGINT]
        assert exits.Interrupted(signal.SIGINT).exit_code == 130
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def test_actor_creation_failure_is_its_exception_line():
    from ray.exceptions import ActorDiedError, RayTaskError

    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in __init__\n"
          "slime.rollout.data_source.DataSourceError: /d.jsonl:3 is not valid JSON (Expecting value)")
    err = ActorDiedError(RayTaskError("RolloutManager.__init__", tb, RuntimeError("x"), pid=99))
    lines = exits.describe_error(err, logs_dir="/nonexistent")
    assert lines == ["/d.jsonl:3 is not valid JSON (Expecting value) (raised while starting a Ray actor)"]


def test_builtin_exceptions_keep_their_type():
    assert exits._last_exception_line("Traceback\n  File x\nKeyError: 'w'") == "KeyError: 'w'"


def test_main_in_process_gives_back_the_handlers_and_stops_its_watchdog(capsys):
    """train.py's main run inside a longer-lived process (tests, library callers): afterwards a SIGTERM there
    must reach that process's own handler, not a stop watchdog left behind that would end the process."""
    import threading
    import time

    from slime.train import main

    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: seen.append(signum))
    try:
        with pytest.raises(SystemExit) as stop:  # an argument error: argparse's exit, one line
            main(["--no-such-flag"])
        assert stop.value.code == 2
        assert "--no-such-flag" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM).__name__ == "<lambda>"
        assert "fd" not in exits._watch
        time.sleep(0.1)
        assert not [t for t in threading.enumerate() if t.name == "slime-stop-watchdog"]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
