"""Multiple-choice reward (`--rm-type gpqa`): the option letter the response picks against the correct one.

The correct letter comes from `metadata["correct_letter"]`, a one-letter label, an integer label (option
index) or the label text matched against `metadata["choices"]`. Without a letter in the response, the
correct option's text (or `metadata["correct_answer"]` / `["answer_text"]`, or the label) appearing in the
response counts. The text before the last `</think>` is never graded.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

DEFAULT_VALID_LETTERS = list(string.ascii_uppercase[:10])

_LETTER_PATTERNS = (
    re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
    re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
    re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
)
_STANDALONE_CAPITAL = re.compile(r"\b([A-Z])\b")


def _strip_chain_of_thought(text: str | None) -> str:
    if not text:
        return ""
    return text.rsplit("</think>", 1)[-1]


def _normalize_text(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _extract_letter_from_response(response: str | None, valid_letters: Iterable[str]) -> str | None:
    """The letter of the first pattern that names a valid one, else the last valid standalone capital."""
    if not response:
        return None
    text = _strip_chain_of_thought(response)
    valid = {letter.upper() for letter in valid_letters}
    for pattern in _LETTER_PATTERNS:
        found = pattern.search(text)  # only each pattern's first match is considered
        if found and found.group(1).upper() in valid:
            return found.group(1).upper()
    for letter in reversed(_STANDALONE_CAPITAL.findall(text)):
        if letter.upper() in valid:
            return letter.upper()
    return None


def _choices_list(metadata: dict) -> list | None:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        return list(choices.values())
    return list(choices) if choices is not None else None


def _valid_letters(metadata: dict, choices: list | None) -> list[str]:
    if metadata.get("valid_letters"):
        return [str(letter).upper() for letter in metadata["valid_letters"]]
    if choices:
        return list(string.ascii_uppercase[:len(choices)])
    return DEFAULT_VALID_LETTERS


def compute_gpqa_reward(response: str | None, label, metadata: dict | None = None) -> float:
    if response is None:
        return 0.0
    metadata = metadata or {}
    choices = _choices_list(metadata)
    valid = _valid_letters(metadata, choices)
    given = metadata.get("correct_letter")
    correct = given.strip().upper() if isinstance(given, str) else None

    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in valid and not correct:
            correct = label_text.upper()
    elif isinstance(label, (int, float)):
        position = int(label)
        if 0 <= position < len(valid):
            correct = valid[position]

    if not correct and choices and label_text:
        wanted = _normalize_text(label_text)
        for position, choice in enumerate(choices):
            if _normalize_text(str(choice)) == wanted:
                correct = valid[position]
                metadata.setdefault("correct_answer", choice)  # recorded for the text fallback below
                break

    picked = _extract_letter_from_response(response, valid)
    if picked and correct:
        return 1.0 if picked == correct else 0.0

    targets = []
    if correct and choices and correct in valid and valid.index(correct) < len(choices):
        targets.append(str(choices[valid.index(correct)]))
    targets += [str(metadata[key]) for key in ("correct_answer", "answer_text") if metadata.get(key)]
    if label_text:
        targets.append(label_text)
    graded = _normalize_text(_strip_chain_of_thought(response))
    if any(target and target in graded for target in {_normalize_text(t) for t in targets if t}):
        return 1.0
    if picked and not correct and label_text:
        return 1.0 if picked == label_text.strip().upper() else 0.0
    return 0.0
