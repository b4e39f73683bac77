"""metrics.jsonl logging, the console line, and `python -m slime.report`."""


import pytest

from slime import report
from slime.utils.metrics import REQUIRED_KEYS, MetricsLogger, console_line, read_metrics


def _record(i, reward):
    r = {k: 0.5 for k in REQUIRED_KEYS}
    r.update({"rollout_id": i, "rollout/reward_mean": reward, "rollout/reward_std": 0.1, "time/rollout": 1.0 + i,
              "time/train": 2.0, "memory/train_peak_bytes": 3 * 2**20})
    return r


def test_logger_resume_truncates_and_report(tmp_path):
    log = MetricsLogger(str(tmp_path))
    for i in range(4):
        log.log(_record(i, 0.1 * i))
    MetricsLogger(str(tmp_path), resume_from=2)  # iterations 2, 3 will run again
    assert [r["rollout_id"] for r in read_metrics(str(tmp_path))] == [0, 1]
    MetricsLogger(str(tmp_path), resume_from=2).log(_record(2, 0.9))
    assert report.main([str(tmp_path)]) == 0
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    md = (tmp_path / "report.md").read_text()
    assert "| rollout/reward_mean | 0 | 0.9 |" in md and "Iterations: 3" in md
    assert "Peak trainer memory: 3.0 MiB" in md


def test_console_line_fits_and_counts_from_zero():
    r = _record(4, 0.25)
    r.update({"train/loss": -12345.678, "train/kl": 1.5e-300, "time/iteration": 12345.6, "time/rollout": 9999.9,
              "time/train": 9999.9, "time/weight_sync": 999.9, "time/save": 999.9, "rollout/engine_restarts": 3})
    line = console_line(r, num_rollout=1000)
    assert line.startswith("[rollout   4/999] reward 0.250±0.100") and "\n" not in line
    assert len(line) <= 120 and line.endswith("| restarts 3")
    assert console_line(_record(0, 0.5), num_rollout=1).startswith("[rollout 0/0]")


def test_report_missing_dir(tmp_path, capsys):
    assert report.main([str(tmp_path / "none")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_timing_panel_clips_an_outlier_and_names_the_run(tmp_path):
    top, outliers = report.timing_limits([2.0, 2.5, 17.0, 2.2, 1.9])
    assert outliers == [2] and top == pytest.approx(1.25 * 2.5)
    assert report.timing_limits([2.0, 2.5, 3.0, 2.2]) == (None, [])
    run = tmp_path / "glm5-tiny" / "run"
    log = MetricsLogger(str(run))
    for i in range(5):
        r = _record(i, 0.1 * i)
        r["time/train"] = 17.0 if i == 2 else 2.0
        log.log(r)
    assert report.main([str(run)]) == 0
    assert (run / "report.md").read_text().startswith("# Run report: glm5-tiny/run (")


def test_eval_records_share_the_file_and_get_a_report_panel(tmp_path):
    from slime.rollout.evaluation import eval_steps
    from slime.utils.metrics import eval_console_line

    log = MetricsLogger(str(tmp_path))
    for step in (0, 2, 4):  # --eval-interval 2 over 4 rollouts
        if step:
            log.log(_record(step - 2, 0.1))
            log.log(_record(step - 1, 0.2))
        log.log({"kind": "eval", "eval_step": step, "rollout_id": step - 1, "eval/aime/reward_mean": 0.1 * step,
                 "eval/aime/reward_std": 0.0, "eval/aime/response_len_mean": 5.0, "eval/aime/samples": 8.0})
    assert [r["rollout_id"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    assert [r["eval_step"] for r in read_metrics(str(tmp_path), kind="eval")] == [0, 2, 4]
    png, md = report.write_report(str(tmp_path))
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[:2] == (400, 1650)  # three panels: reward, time, eval reward
    assert "| 4 | 0.4 |" in open(md).read()
    args = type("A", (), {"eval_interval": 2, "num_rollout": 4, "skip_eval_before_train": False})
    assert eval_steps(args, 0) == {0, 2, 4} and eval_steps(args, 3) == {4}
    args.skip_eval_before_train = True
    assert eval_steps(args, 0) == {2, 4}
    line = eval_console_line(read_metrics(str(tmp_path), kind="eval")[-1])
    assert line == "[eval after 4 rollouts] aime reward 0.400±0.000 len 5.0 (8 samples)"
