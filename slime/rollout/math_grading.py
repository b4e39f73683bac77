"""Answer extraction and comparison for the math rewards (`--rm-type deepscaler|dapo|math`).

Written from the published definitions:
- Hendrycks et al. MATH (`is_equiv` after `strip_string`): LaTeX answer normalization used by
  DeepScaleR's "mathd" check;
- DeepScaleR's rule-based reward: grade the text after the reasoning (`</think>`), last `\\boxed{}`,
  correct when the normalized strings agree or the expressions are equal under sympy;
- DAPO's Minerva-style check: the last "Answer: ..." line in the final 300 characters, normalized, against
  the integer label; +1 correct, -1 otherwise.
"""

from __future__ import annotations

import re
from fractions import Fraction


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}, '\\boxed x'), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed ") :
        return rest[len("\\boxed "):].split("$")[0].strip()
    i = rest.find("{")
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[j], 0)
        if depth == 0:
            return rest[i + 1:j]
    return None


# ------------------------------------------------------------------ MATH (Hendrycks) normalization
def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}."""
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if p.startswith("{") or len(p) < 2:
            out += p
            continue
        a, b, tail = p[0], p[1], p[2:]
        out += "{" + a + "}" + (b + tail if b == "{" else "{" + b + "}" + tail)
    return out


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def strip_math(s: str) -> str:
    """The MATH benchmark's answer normalization (units, spacing, \\left/\\right, dfrac, 0.5 -> \\frac{1}{2}...)."""
    s = str(s).replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}\s*$", "", s)  # trailing units
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if "=" in s and len(s.split("=")[0]) <= 2:  # "x = 5" -> "5"
        s = s.split("=")[1]
    s = _fix_sqrt(s).replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)  # a/b -> \frac{a}{b}
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


# ------------------------------------------------------------------ sympy equality
def _to_sympy_text(s: str) -> str:
    s = s.replace("\\frac", "frac").replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    s = re.sub(r"frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("{", "(").replace("}", ")")
    return s


def sympy_equal(a: str, b: str) -> bool:
    """a == b as numbers/expressions (no free-text). False when either side does not parse."""
    if len(a) > 64 or len(b) > 64 or not a or not b:
        return False
    try:
        import sympy
        from sympy.parsing.sympy_parser import parse_expr, standard_transformations, implicit_multiplication

        tr = standard_transformations + (implicit_multiplication,)
        ea = parse_expr(_to_sympy_text(a), transformations=tr, evaluate=True)
        eb = parse_expr(_to_sympy_text(b), transformations=tr, evaluate=True)
        if ea.free_symbols - {sympy.Symbol("pi")} or eb.free_symbols - {sympy.Symbol("pi")}:
            return False  # symbolic answers: compare as strings only
        return bool(abs(sympy.N(ea - eb)) < 1e-9)
    except Exception:  # any parse or evaluation failure: not provably equal
        return False


def _split_tuple(s: str) -> list[str]:
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and "," in s:
        return [x.strip() for x in s[1:-1].split(",")]
    return [s]


def math_equal(given: str, truth: str) -> bool:
    """MATH-normalized string equality, else element-wise sympy equality (tuples/intervals need matching brackets)."""
    g, t = strip_math(given), strip_math(truth)
    if g == t:
        return True
    if not g or not t:
        return False
    gs, ts = _split_tuple(g), _split_tuple(t)
    if len(gs) != len(ts) or (len(gs) > 1 and (g[0] != t[0] or g[-1] != t[-1])):
        return False
    return all(x == y or sympy_equal(x, y) for x, y in zip(gs, ts))


# ------------------------------------------------------------------ Minerva (DAPO) normalization
_MINERVA_SUBS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_UNITS = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                  "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                  "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                  "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
                  r",\!", "{,}", '"', "\\dots")


def minerva_normalize(answer: str) -> str:
    s = str(answer).split("=")[-1]
    for a, b in _MINERVA_SUBS:
        s = s.replace(a, b)
    for unit in _MINERVA_UNITS:
        s = s.replace(unit, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    for cmd in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + cmd + r"\{)(.*?)(\})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def as_integer_text(label) -> str | None:
    try:
        return str(int(Fraction(str(label).strip())))
    except (ValueError, ZeroDivisionError):
        return None
