"""`python -m slime.report RUN_DIR`: a PNG of reward and per-phase timings (and eval rewards when the run
evaluated), and a markdown summary, from RUN_DIR/metrics.jsonl. Writes RUN_DIR/report.png and RUN_DIR/report.md."""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from slime.utils.metrics import read_metrics

PHASES = ("time/rollout", "time/log_probs", "time/train", "time/weight_sync", "time/save")


OUTLIER_FACTOR = 3.0  # an iteration taking this many times the median is drawn clipped and marked


def run_name(run_dir: str) -> str:
    """The last two parts of the run dir (the quick start's is RUN_DIR/run: "glm5.3-flash-tiny/run")."""
    parts = os.path.abspath(run_dir).rstrip(os.sep).split(os.sep)
    return "/".join(parts[-2:])


def timing_limits(totals: list[float]) -> tuple[float | None, list[int]]:
    """(y limit of the timing panel, indices of the outliers above it): iterations over OUTLIER_FACTOR x the
    median are clipped so that one slow iteration (a first-step warm-up, a save) does not flatten the rest."""
    if len(totals) < 3:
        return None, []
    med = statistics.median(totals)
    outliers = [i for i, t in enumerate(totals) if med > 0 and t > OUTLIER_FACTOR * med]
    if not outliers:
        return None, []
    rest = [t for i, t in enumerate(totals) if i not in outliers]
    return 1.25 * max(rest), outliers


def eval_names(evals: list[dict]) -> list[str]:
    return sorted({k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.endswith("/reward_mean")})


def reward_levels(records: list[dict], evals: list[dict] | None = None, k: int = 5) -> dict[str, float]:
    """The numbers a reward curve is read by: the prior's reward (rollout 0, before any update), the means of the
    first and last `k` rollouts, and per eval set its reward before training (eval step 0) and at the end."""
    rewards = [r["rollout/reward_mean"] for r in records if "rollout/reward_mean" in r]
    out = {"prior": rewards[0] if rewards else float("nan"),
           "first": statistics.fmean(rewards[:k]) if rewards else float("nan"),
           "last": statistics.fmean(rewards[-k:]) if rewards else float("nan")}
    for name in eval_names(evals or []):
        points = [r for r in evals or [] if f"eval/{name}/reward_mean" in r]
        out[f"{name}/before"] = points[0][f"eval/{name}/reward_mean"]
        out[f"{name}/after"] = points[-1][f"eval/{name}/reward_mean"]
    return out


def _plot_rewards(ax, records: list[dict], evals: list[dict]) -> None:
    """Train reward (mean ± std by rollout), each eval set's held-out reward by rollouts trained, and the
    prior's level (rollout 0's reward, before any update) as a dashed line: how far the updates took it."""
    ids = [r["rollout_id"] for r in records]
    mean = [r.get("rollout/reward_mean", float("nan")) for r in records]
    std = [r.get("rollout/reward_std", 0.0) for r in records]
    ax.plot(ids, mean, marker="o", markersize=3, label="train reward mean")
    ax.fill_between(ids, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2,
                    label="± std")
    for name in eval_names(evals):
        points = [(r["eval_step"], r[f"eval/{name}/reward_mean"]) for r in evals if f"eval/{name}/reward_mean" in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="s", label=f"held-out {name}")
    ax.axhline(reward_levels(records)["prior"], color="gray", linestyle="--", label="prior (rollout 0)")
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward")
    ax.set_title("reward")
    ax.legend(fontsize=8)


def plot(records: list[dict], out_png: str, title: str = "", evals: list[dict] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ids = [r["rollout_id"] for r in records]
    evals = evals or []
    fig, axes = plt.subplots(1, 3 if evals else 2, figsize=(16.5 if evals else 11, 4))
    ax1, ax2 = axes[0], axes[1]
    if title:
        fig.suptitle(title)
    _plot_rewards(ax1, records, evals)
    bottom = [0.0] * len(ids)
    for phase in PHASES:
        values = [r.get(phase, 0.0) for r in records]
        ax2.bar(ids, values, bottom=bottom, label=phase.split("/")[1])
        bottom = [b + v for b, v in zip(bottom, values)]
    top, outliers = timing_limits(bottom)
    panel = "time per phase"
    if top is not None:
        ax2.set_ylim(0, top)
        for i in outliers:  # clipped bar: a marker at the top edge with its real height
            ax2.plot([ids[i]], [top * 0.97], marker="^", color="black", markersize=7, clip_on=False)
            ax2.annotate(f"{bottom[i]:.1f}s", (ids[i], top * 0.97), textcoords="offset points", xytext=(4, -10),
                         fontsize=8)
        panel += f" ({len(outliers)} outlier{'s' if len(outliers) > 1 else ''} clipped, marked ▲)"
    ax2.set_xlabel("rollout")
    ax2.set_ylabel("seconds")
    ax2.set_title(panel)
    ax2.legend(fontsize=8)
    if evals:
        ax3 = axes[2]
        for name in eval_names(evals):
            points = [(r["eval_step"], r[f"eval/{name}/reward_mean"]) for r in evals if f"eval/{name}/reward_mean" in r]
            ax3.plot([p[0] for p in points], [p[1] for p in points], marker="s", label=name)
        ax3.set_xlabel("rollouts trained")
        ax3.set_ylabel("reward")
        ax3.set_title("eval reward")
        ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def _mean(records: list[dict], key: str) -> float:
    values = [r[key] for r in records if key in r]
    return statistics.fmean(values) if values else float("nan")


def summary(records: list[dict], run_dir: str, evals: list[dict] | None = None) -> str:
    first, last = records[0], records[-1]
    lines = [
        f"# Run report: {run_name(run_dir)} ({os.path.abspath(run_dir)})",
        "",
        f"Iterations: {len(records)} (rollout {first['rollout_id']} .. {last['rollout_id']})",
        "",
        "| metric | first | last |",
        "|---|---|---|",
    ]
    for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean", "train/kl",
                "train/entropy", "train/clip_frac", "train/grad_norm", "train_rollout_logprob_abs_diff"):
        if key in first:
            lines.append(f"| {key} | {first[key]:.4g} | {last.get(key, float('nan')):.4g} |")
    levels = reward_levels(records, evals)
    lines += ["", f"Reward: prior (rollout 0) {levels['prior']:.3f}, first 5 rollouts {levels['first']:.3f}, "
              f"last 5 {levels['last']:.3f} ({levels['last'] - levels['first']:+.3f})."]
    lines += [f"Held-out {n[:-7]}: {levels[n]:.3f} before training, {levels[n[:-7] + '/after']:.3f} at the end "
              f"({levels[n[:-7] + '/after'] - levels[n]:+.3f})." for n in levels if n.endswith("/before")]
    lines += ["", "| phase | mean seconds |", "|---|---|"]
    for key in PHASES + ("time/iteration",):
        lines.append(f"| {key.split('/')[1]} | {_mean(records, key):.3f} |")
    lines += [
        "",
        f"Throughput: rollout {_mean(records, 'perf/rollout_tokens_per_s'):.1f} tokens/s, "
        f"train {_mean(records, 'perf/train_tokens_per_s'):.1f} tokens/s.",
        f"Peak trainer memory: {max(r.get('memory/train_peak_bytes', 0) for r in records) / 2**20:.1f} MiB.",
        "",
        "![reward and timings](report.png)",
        "",
    ]
    if evals:
        names = eval_names(evals)
        lines += ["| eval after rollouts | " + " | ".join(f"{n} reward" for n in names) + " |",
                  "|---|" + "---|" * len(names)]
        for r in evals:
            cells = [f"{r[f'eval/{n}/reward_mean']:.4g}" if f"eval/{n}/reward_mean" in r else "" for n in names]
            lines.append(f"| {r['eval_step']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_report(run_dir: str) -> tuple[str, str]:
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no iterations yet; run training first")
    evals = read_metrics(run_dir, kind="eval")
    png, md = os.path.join(run_dir, "report.png"), os.path.join(run_dir, "report.md")
    plot(records, png, title=f"run {run_name(run_dir)}: rollouts {records[0]['rollout_id']}..{records[-1]['rollout_id']}",
         evals=evals)
    with open(md, "w") as f:
        f.write(summary(records, run_dir, evals))
    return png, md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slime.report", description=__doc__)
    ap.add_argument("run_dir", help="the --output-dir of a training run")
    a = ap.parse_args(argv)
    try:
        png, md = write_report(a.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"slime.report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {png} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
