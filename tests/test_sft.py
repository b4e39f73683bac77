"""SFT as upstream's run-qwen3-4B-base-sft.sh runs it (train_async.py, --loss-type sft_loss, --debug-train-only,
--num-epoch, the sft rollout function) on the tiny quick-start checkpoint: the loss mask is exactly the
assistant turns' tokens, and 20 SFT steps on a small chat set lower the loss with no engine started."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from test_e2e import ROOT, assets  # noqa: F401 - the quick start's tiny model

from slime.utils.metrics import read_metrics

pytestmark = pytest.mark.timeout(300)
LETTERS = "abc"


def _chat(rng: random.Random) -> list[dict]:
    word = "".join(rng.choice(LETTERS) for _ in range(3))
    return [{"role": "system", "content": "copy"}, {"role": "user", "content": word},
            {"role": "assistant", "content": word[::-1]}]


def test_loss_mask_is_the_assistant_tokens(assets):  # noqa: F811
    from transformers import AutoTokenizer

    from slime.utils.mask_utils import MultiTurnLossMaskGenerator

    tok = AutoTokenizer.from_pretrained(assets["model"])
    messages = [{"role": "user", "content": "cab"}, {"role": "assistant", "content": "bca"},
                {"role": "user", "content": "a"}, {"role": "assistant", "content": "cc"}]
    ids, mask = MultiTurnLossMaskGenerator(tok, "qwen").get_loss_mask(messages)

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    # the template, by hand: "<|user|> {u} <|assistant|> {a} " per turn; trained: each answer's tokens
    pieces = [("<|user|> cab ", 0), ("<|assistant|>", 0), (" bca ", 1), ("<|user|> a ", 0), ("<|assistant|>", 0),
              (" cc ", 1)]
    assert ids == enc(tok.apply_chat_template(messages, tokenize=False))
    assert ids == [t for text, _ in pieces for t in enc(text)]
    assert mask == [m for text, m in pieces for _ in enc(text)]
    messages[1]["step_loss_mask"] = 0  # upstream's per-message opt-out
    assert MultiTurnLossMaskGenerator(tok).get_loss_mask(messages)[1] == [0] * (len(ids) - len(enc(" cc "))) + [1] * len(enc(" cc "))


def test_sft_run_of_the_upstream_script_flags(assets, tmp_path):  # noqa: F811
    rng = random.Random(0)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": _chat(rng)}) + "\n" for _ in range(40)))
    out = tmp_path / "run"
    argv = [  # run-qwen3-4B-base-sft.sh's SFT, optimizer and batching flags, at tiny sizes
        "--hf-checkpoint", assets["model"], "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--prompt-data", str(data), "--input-key", "messages", "--rollout-shuffle", "--num-epoch", "2",
        "--rollout-batch-size", "4", "--global-batch-size", "4", "--loss-type", "sft_loss",
        "--calculate-per-token-loss", "--disable-compute-advantages-and-returns", "--debug-train-only",
        "--optimizer", "adam", "--lr", "1e-2", "--lr-decay-style", "cosine", "--min-lr", "1e-3",
        "--lr-warmup-fraction", "0.1", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "256", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--num-cpus", "2", "--output-dir", str(out)]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", SLIME_CPU_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train_async.py"), *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout engine(s) up" not in proc.stderr or "0 " in proc.stderr
    records = read_metrics(str(out))
    assert [r["rollout_id"] for r in records] == list(range(20))  # 2 epochs x 40 chats // 4
    losses = [r["train/loss"] for r in records]
    assert sum(losses[-4:]) / 4 < 0.5 * sum(losses[:4]) / 4, losses
    assert all(r["time/weight_sync"] == 0.0 for r in records)
