"""DAPO's math reward (`--rm-type dapo`): the Minerva answer check of Lewkowycz et al. as DAPO uses it.

`compute_score(solution_str, ground_truth)` grades the final 300 characters: the last "Answer: ..." line,
normalized, against the integer label; it returns {"score": 1.0 | -1.0, "acc": bool, "pred": str}, read
through `--reward-key score` (upstream's contract). `strict_box_verify=True` compares the last
`\\boxed{}` of the final 100 characters verbatim instead.
"""

from __future__ import annotations

import re
import signal

_BOX_OPEN = "\\boxed{"


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` with balanced braces (no `\\fbox` here, unlike math_utils)."""
    start = string.rfind(_BOX_OPEN)
    if start < 0:
        return None
    depth = 0
    for pos in range(start, len(string)):
        if string[pos] == "{":
            depth += 1
        elif string[pos] == "}":
            depth -= 1
            if depth == 0:
                return string[start:pos + 1]
    return None


def remove_boxed(s: str) -> str:
    """`\\boxed{X}` -> `X`; anything else is a programming error here (AssertionError 'box error')."""
    assert s.startswith(_BOX_OPEN) and s.endswith("}"), f"box error: {s}"
    return s[len(_BOX_OPEN):-1]


class timeout:
    """`with timeout(seconds):` raises TimeoutError after `seconds` (SIGALRM; main thread only)."""

    def __init__(self, seconds: int = 1, error_message: str = "Timeout") -> None:
        self.seconds, self.error_message = seconds, error_message

    def handle_timeout(self, signum, frame):
        raise TimeoutError(self.error_message)

    def __enter__(self):
        signal.signal(signal.SIGALRM, self.handle_timeout)
        signal.alarm(self.seconds)

    def __exit__(self, exc_type, exc, tb):
        signal.alarm(0)


# Minerva's normalization tables (Lewkowycz et al. 2022, appendix D), plus two chat end markers.
SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
]
_FIRST_DOLLAR_SPAN = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_UNWRAP = [re.compile(r"(\\text\{)(.*?)(\})"), re.compile(r"(\\textbf\{)(.*?)(\})"),
           re.compile(r"(\\overline\{)(.*?)(\})"), re.compile(r"(\\boxed\{)(.*)(\})")]
_FRAC_SHORTHAND = re.compile(r"(frac)([^{])(.)")  # \frac12 -> \frac{1}{2}
_SQRT_SHORTHAND = re.compile(r"(sqrt)([^{])")  # \sqrt2 -> \sqrt{2}


def normalize_final_answer(final_answer: str) -> str:
    """Minerva's normalization of a final answer: right of the last '=', units and articles dropped, the
    first $...$ span kept, \\text/\\boxed unwrapped, TeX shorthand expanded, '1,234' -> '1234'."""
    s = str(final_answer).split("=")[-1]
    for old, new in SUBSTITUTIONS:
        s = s.replace(old, new)
    for unit in REMOVED_EXPRESSIONS:
        s = s.replace(unit, "")
    s = _FIRST_DOLLAR_SPAN.sub(r"$\3$", s)
    for pattern in _UNWRAP:
        s = pattern.sub(r"\2", s)
    s = _FRAC_SHORTHAND.sub(r"frac{\2}{\3}", s)
    s = _SQRT_SHORTHAND.sub(r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)") -> tuple[bool, str]:
    """(the last `answer_pattern` match equals the integer label, that match normalized). A label that is
    not a number raises ValueError: DAPO's labels are all integers."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    truth = remove_boxed(last_boxed_only_string(gt)) if gt_need_extract else gt
    truth = str(int(float(normalize_final_answer(truth))))
    return pred == truth, pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 or -1, the last boxed answer of the final 100 characters, verbatim)."""
    if pause_tokens_index is not None:
        assert len(pause_tokens_index) == 4
        tail = pred[pause_tokens_index[-1] - 100:]
    else:
        tail = pred[-100:]
    boxed = last_boxed_only_string(tail)
    answer = remove_boxed(boxed) if boxed is not None else None
    return (1 if answer == gt else -1), answer


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """{"score": 1.0 or -1.0, "acc": correct?, "pred": the normalized prediction}."""
    tail = solution_str[-300:]  # MATH-500's longest answer has 159 characters
    correct, pred = verify(tail, ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
