"""Boxed-answer extraction and the two equivalence checks behind `--rm-type math` and `deepscaler`.

The grading rules are those of the published graders (Hendrycks et al.'s MATH normalization, and the
sympy-based checker that DeepScaleR and verl use), with upstream slime's names as the public API:

    grade_answer_verl(solution_str, ground_truth)  the last \\boxed{} of the solution against the label
    grade_answer_mathd(given, truth)              equal after MATH string normalization
    grade_answer_sympy(given, truth)              equal after a looser normalization, element-wise, sympy

Quirks kept on purpose because rewards must equal upstream's (tests/data/rm_hub_cases.json):
only `\\boxed{...}` counts as an answer (a lone `\\fbox{}` is found but not unwrapped); fractions that are
not reduced are not equal to reduced ones; an integer label needs an integer answer.
"""

from __future__ import annotations

import logging
import re

from pylatexenc import latex2text

# pylatexenc logs a warning for every \frac it cannot expand (e.g. "\frac" at the end); the grade is the same
logging.getLogger("pylatexenc").setLevel(logging.ERROR)

# ------------------------------------------------------------------ boxed answers
_BOX_OPEN = "\\boxed{"


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed...` (else `\\fbox...`) up to the brace that closes its first group, command included."""
    start = string.rfind("\\boxed")
    if start < 0:
        start = string.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for pos in range(start, len(string)):
        ch = string[pos]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return string[start:pos + 1]
    return None


def remove_boxed(s: str | None) -> str | None:
    """`\\boxed{X}` -> `X`; None for anything else (an `\\fbox{}`, None)."""
    if not isinstance(s, str) or not s.startswith(_BOX_OPEN) or not s.endswith("}"):
        return None
    return s[len(_BOX_OPEN):-1]


def extract_boxed_answer(solution: str) -> str | None:
    return remove_boxed(last_boxed_only_string(solution))


def extract_answer(passage: str) -> str | None:
    """The last boxed answer of a passage that mentions `\\boxed`; None otherwise."""
    return extract_boxed_answer(passage) if "\\boxed" in passage else None


# ------------------------------------------------------------------ MATH (Hendrycks) normalization
class _Unnormalizable(Exception):
    """A malformed answer the MATH normalization cannot rewrite; the caller keeps the answer as it was."""


def _expand_frac_shorthand(s: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}; a \frac with fewer than two characters after it
    leaves the whole string unchanged, a \frac at the very end is malformed."""
    head, *rest = s.split("\\frac")
    pieces = [head]
    for part in rest:
        if not part:
            raise _Unnormalizable(s)
        if part[0] == "{":
            pieces.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s
        num, second, tail = part[0], part[1], part[2:]
        pieces.append("\\frac{" + num + "}" + (second + tail if second == "{" else "{" + second + "}" + tail))
    return "".join(pieces)


def _expand_sqrt_shorthand(s: str) -> str:
    r"""\sqrt3 -> \sqrt{3}; a \sqrt at the very end is malformed."""
    head, *rest = s.split("\\sqrt")
    pieces = [head]
    for part in rest:
        if not part:
            raise _Unnormalizable(s)
        pieces.append("\\sqrt" + part if part[0] == "{" else "\\sqrt{" + part[0] + "}" + part[1:])
    return "".join(pieces)


def _slash_to_frac(s: str) -> str:
    """'3/4' -> '\\frac{3}{4}' when both sides are integers written plainly (no leading zeros, no '+')."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(num) + "}{" + str(den) + "}" if f"{num}/{den}" == s else s


_MATHD_DELETE = ("\n", "\\!")
_MATHD_AFTER_SLASHES = (("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""), ("\\right", ""),
                        ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""))


def _strip_string(string: str) -> str:
    """The MATH benchmark's answer normalization. Raises _Unnormalizable on malformed input."""
    s = string
    for token in _MATHD_DELETE:
        s = s.replace(token, "")
    s = s.replace("\\\\", "\\")
    for old, new in _MATHD_AFTER_SLASHES:
        s = s.replace(old, new)
    if "\\text{ " in s:  # a unit on the right: "5 \text{ cm}"
        before, *after = s.split("\\text{ ")
        if len(after) != 1:
            raise _Unnormalizable(s)
        s = before
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> " 5"
        s = sides[1]
    s = _expand_sqrt_shorthand(s).replace(" ", "")
    s = _expand_frac_shorthand(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def mathd_normalize_answer(answer: str | None) -> str | None:
    if answer is None:
        return None
    answer = answer.strip()
    wrapped = _WHOLE_TEXT.search(answer)
    if wrapped is not None:
        answer = wrapped.group("text").strip()
    try:
        return _strip_string(answer)
    except _Unnormalizable:
        return answer


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    return mathd_normalize_answer(ground_truth) == mathd_normalize_answer(given_answer)


# ------------------------------------------------------------------ looser normalization + sympy
_UNIT_WORDS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
               "year", "foot", "feet", "inch", "yard")
_UNIT_PATTERNS = [re.compile(rf"{word}(es)?(s)? *(\^[0-9]+)?") for word in _UNIT_WORDS]
_SCALE_WORDS = (("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile("([0-9]) +([0-9])")  # "7 3/4" -> "7+3/4"
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
# sympy may hang on these; such answers are not compared under sympy
_UNSAFE_SUBSTRINGS = ("^{", "^(")
_UNSAFE_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
TUPLE_CHARS = "()[]"


def _strip_properly_formatted_commas(expr: str) -> str:
    """'1,234,567' -> '1234567' but '(1,2)' unchanged."""
    while True:
        shorter = _THOUSANDS_COMMA.sub(r"\1\3\4", expr)
        if shorter == expr:
            return expr
        expr = shorter


def _parse_latex(expr: str) -> str:
    for variant in ("\\tfrac", "\\dfrac"):
        expr = expr.replace(variant, "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # keeps mixed numbers apart: 1\frac{1}{2}
    text = latex2text.LatexNodes2Text().latex_to_text(expr)
    for symbol, name in _LATEX_SYMBOLS:
        text = text.replace(symbol, name)
    return text.strip()


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _is_integral(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _str_is_int(x: str) -> bool:
    value = _float_or_none(_strip_properly_formatted_commas(x))
    return value is not None and _is_integral(value)


def _str_to_int(x: str) -> int:
    return int(float(x.replace(",", "")))  # truncates, as the reference grader does


def _is_frac(expr: str) -> bool:
    return _FRACTION.search(expr) is not None


def _normalize(expr: str | None) -> str | None:
    """The sympy grader's normalization: units, scale words, latex to text, case-folded."""
    if expr is None:
        return None
    wrapped = _WHOLE_TEXT.search(expr)
    if wrapped is not None:
        expr = wrapped.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in _SCALE_WORDS:
        expr = expr.replace(word, power)
    for pattern in _UNIT_PATTERNS:
        expr = pattern.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    value = _float_or_none(expr)
    if value is not None and _is_integral(value):
        expr = str(int(round(value)))
    if "\\" in expr:
        try:
            expr = _parse_latex(expr)
        except Exception:  # pylatexenc gives up on some inputs: keep the latex as it is
            pass
    expr = re.sub("- *", "-", expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(_str_to_int(expr))
    return expr


def count_unknown_letters_in_expr(expr: str) -> int:
    return len({ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()})


def should_allow_eval(expr: str) -> bool:
    """Only short expressions in at most two unknowns, without towers of powers, go to sympy."""
    return (count_unknown_letters_in_expr(expr) <= 2
            and not any(bad in expr for bad in _UNSAFE_SUBSTRINGS)
            and not any(p.search(expr) for p in _UNSAFE_PATTERNS))


def _sympy_names() -> dict:
    import sympy

    # sympy's public names and no builtins, so parsing cannot call arbitrary Python
    return {"__builtins__": {}, **{k: v for k, v in vars(sympy).items() if not k.startswith("_")}}


def _sympy_parse(expr: str):
    # sympy is imported at the first expression graded this way (0.5 s per process that imports the graders)
    from sympy.parsing import sympy_parser

    transforms = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    return sympy_parser.parse_expr(expr.replace("^", "**"), local_dict={}, global_dict=_sympy_names(),
                                   transformations=transforms)


def are_equal_under_sympy(ground_truth_normalized: str, given_normalized: str) -> bool:
    difference = f"({ground_truth_normalized})-({given_normalized})"
    if not should_allow_eval(difference):
        return False
    import sympy

    try:
        return sympy.simplify(_sympy_parse(difference)) == 0
    except Exception:  # unparsable or unsimplifiable text is not provably equal
        return False


def split_tuple(expr: str) -> list[str]:
    """Elements of '(a,b)' / '[a,b)' (no nested brackets); [expr] otherwise; [] for ''."""
    expr = _strip_properly_formatted_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if len(expr) > 2 and expr[0] in TUPLE_CHARS and expr[-1] in TUPLE_CHARS and not any(c in inner for c in TUPLE_CHARS):
        return [e.strip() for e in inner.split(",")]
    return [expr]


def _elements_equal(truth: str, given: str) -> bool:
    if _is_frac(truth) and _is_frac(given):
        return truth == given  # an unreduced fraction is not the reduced one
    if _str_is_int(truth) != _str_is_int(given):
        return False  # an integer answer must be written as one
    return are_equal_under_sympy(truth, given)


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    truth, given = _normalize(ground_truth), _normalize(given_answer)
    if truth is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truth_elems, given_elems = split_tuple(truth), split_tuple(given)
    if len(truth_elems) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]):
        return False  # (a,b) is not [a,b]
    if len(truth_elems) != len(given_elems):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truth_elems, given_elems))


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    """The solution's last boxed answer equals the label (itself unboxed when boxed), by either check."""
    if not ground_truth:
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
    given = extract_answer(solution_str)
    if given is None:
        return False
    return grade_answer_mathd(given, truth) or grade_answer_sympy(given, truth)
