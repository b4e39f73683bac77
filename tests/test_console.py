"""The console: the rollout line fits 120 columns with any values and never cuts a number (whole fields are
left out instead); the known-harmless library warnings are filtered, nothing else."""

from __future__ import annotations

import math
import random
import re
import warnings

import pytest

from slime.utils.metrics import CONSOLE_WIDTH, REQUIRED_KEYS, console_line

FIELDS = {"loss": ("train/loss", "{:+.3f}"), "kl": ("train/kl", "{:.0e}"), "ent": ("train/entropy", "{:.2f}"),
          "dlp": ("train_rollout_logprob_abs_diff", "{:.0e}"), "roll": ("time/rollout", "{:.1f}"),
          "train": ("time/train", "{:.1f}"), "save": ("time/save", "{:.1f}"),
          "len": ("rollout/response_len_mean", "{:.1f}"), "restarts": ("rollout/engine_restarts", "{:.0f}")}


def _value(rng: random.Random) -> float:
    kind = rng.random()
    if kind < 0.1:
        return math.nan
    if kind < 0.2:
        return -rng.random() * 10 ** rng.randint(0, 30)
    return rng.random() * 10 ** rng.randint(-300, 12)


@pytest.mark.parametrize("seed", range(40))
def test_rollout_line_fits_and_never_cuts_a_number(seed):
    rng = random.Random(seed)
    r = {k: _value(rng) for k in REQUIRED_KEYS}
    r["rollout/reward_mean"], r["rollout/reward_std"] = rng.random(), rng.random()
    r["rollout_id"] = rng.randint(0, 10 ** rng.randint(0, 7))
    r["rollout/engine_restarts"] = rng.choice([0, 1, 12, 12345])
    r["time/save"] = rng.choice([0.0, 0.3, 123456.789])
    num_rollout = r["rollout_id"] + rng.randint(1, 10 ** 6)
    line = console_line(r, num_rollout)
    assert len(line) <= CONSOLE_WIDTH and "\n" not in line, line
    assert line.startswith(f"[rollout {r['rollout_id']:>{len(str(num_rollout - 1))}}/{num_rollout - 1}] reward "
                           f"{r['rollout/reward_mean']:.3f}±{r['rollout/reward_std']:.3f}")
    tokens = line.replace("|", " ").split()
    for name, value in zip(tokens, tokens[1:]):  # every "name value" pair shows the whole formatted value
        if name in FIELDS:
            key, fmt = FIELDS[name]
            assert value == fmt.format(r[key]), (name, value, line)
    if r["rollout/engine_restarts"]:
        assert line.endswith(f"| restarts {r['rollout/engine_restarts']}")
    m = re.search(r"\| ([\d.e+naninf-]+)s:", line)
    if m:
        assert m.group(1) == f"{r['time/iteration']:.1f}"


def test_ordinary_line_keeps_every_field_and_drops_dlp_first():
    r = {k: 0.5 for k in REQUIRED_KEYS}
    r.update({"rollout_id": 19, "time/save": 1.25})
    line = console_line(r, 60)
    for name in ("len", "loss", "kl", "ent", "dlp", "roll", "train", "save"):
        assert f" {name} " in line, line
    r["rollout/engine_restarts"] = 1  # the quick start's line once an engine restarted: 125 columns in full
    line = console_line(r, 60)
    assert " dlp " not in line and line.endswith(" train 0.5 save 1.2 | restarts 1") and len(line) <= 120, line


def test_known_harmless_warnings_are_filtered_and_others_shown():
    from slime.utils import warning_filters

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warning_filters.install()
        for w in warning_filters.KNOWN_HARMLESS:
            module = w.module.replace("\\.", ".") + "x"
            text = re.sub(r"\(([^|)]+)\|[^)]*\)", r"\1", w.message).replace("\\", "")
            warnings.warn_explicit(text + " (sample)", w.category, "lib.py", 1, module=module)
        warnings.warn_explicit("Transformer Engine and Apex are not installed", UserWarning, "mine.py", 1,
                               module="mypackage.mod")  # same text from another library: shown
        warnings.warn_explicit("something else", UserWarning, "lib.py", 2, module="megatron.core.optimizer")
    assert [str(w.message) for w in seen] == ["Transformer Engine and Apex are not installed", "something else"]
    assert all(w.why for w in warning_filters.KNOWN_HARMLESS)
