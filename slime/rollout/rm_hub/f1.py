"""Token-level F1 of a prediction against the label (`--rm-type f1`, SQuAD's answer normalization)."""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_EXACT_ONLY = ("yes", "no", "noanswer")  # answers that are right only when equal


def normalize_answer(s: str) -> str:
    """Lower-cased, punctuation removed, articles dropped, whitespace collapsed."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", s).split())


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """(f1, precision, recall); (0, 0, 0) without overlap, for a None prediction, or when either side is
    yes/no/noanswer and the two differ."""
    zero = (0, 0, 0)
    if prediction is None:
        return zero
    pred, truth = normalize_answer(prediction), normalize_answer(ground_truth)
    if pred != truth and (pred in _EXACT_ONLY or truth in _EXACT_ONLY):
        return zero
    pred_tokens, truth_tokens = pred.split(), truth.split()
    common = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if common == 0:
        return zero
    precision, recall = common / len(pred_tokens), common / len(truth_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall
