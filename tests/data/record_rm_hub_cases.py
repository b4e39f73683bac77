"""Records tests/data/rm_hub_cases.json: upstream slime's rm_hub outputs on this file's inputs.

Run against upstream's own code, outside this repository (the project never imports it):
    python tests/data/record_rm_hub_cases.py UPSTREAM_ROOT COMMIT
where UPSTREAM_ROOT holds upstream's slime/rollout/rm_hub/*.py (with stand-ins for the two modules its
__init__ imports, slime.utils.misc.load_function and slime.utils.types.Sample). tests/test_rm_hub.py
checks that this project's slime.rollout.rm_hub gives the same output on every case.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import types

# (answer as the model writes it inside \boxed{}, label)
ANSWERS = [
    ("42", "42"), ("1,012", "1012"), ("012", "12"), ("24/2", "12"), ("1,234,567", "1234567"), ("1{,}000", "1000"),
    ("1\\,000", "1000"), ("1\\!000", "1000"), ("10,00", "1000"), ("3.0", "3"), ("3.00", "3"), ("2.5", "5/2"),
    ("0.5", "\\frac{1}{2}"), (".5", "\\frac12"), ("\\frac{2}{4}", "\\frac{1}{2}"), ("\\dfrac{3}{4}", "3/4"),
    ("\\tfrac34", "0.75"), ("-\\frac{1}{3}", "-1/3"), ("\\frac{-1}{3}", "-\\frac{1}{3}"), ("3/4", "\\frac{3}{4}"),
    ("6/8", "3/4"), ("7 \\frac{1}{2}", "7.5"), ("7\\frac12", "\\frac{15}{2}"), ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\sqrt2", "\\sqrt{2}"), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"), ("2\\pi", "2 \\pi"), ("\\pi/2", "\\frac{\\pi}{2}"),
    ("45^\\circ", "45"), ("45^{\\circ}", "45"), ("45 degrees", "45"), ("5 \\text{ cm}", "5"), ("5 cm", "5"),
    ("5\\text{cm}", "5"), ("12 \\text{ inches}", "12"), ("20\\%", "20"), ("20%", "20"), ("\\$5", "5"), ("$5", "5"),
    ("5 dollars", "5"), ("3 million", "3000000"), ("2 \\times 10^3", "2000"), ("1e3", "1000"), ("x = 5", "5"),
    ("k=5", "5"), ("y = 2x + 1", "2x+1"), ("x+1", "1+x"), ("x^2+2x+1", "(x+1)^2"), ("(1, 2)", "(1,2)"),
    ("(1,2)", "[1,2]"), ("[1, 2)", "[1,2)"), ("(1,2,3)", "(1,2)"), ("\\left(1,2\\right)", "(1,2)"),
    ("(-\\infty, 3)", "(-\\infty,3)"), ("\\{1,2\\}", "\\{1, 2\\}"), ("1 and 2", "1, 2"), ("2 or 3", "2,3"),
    ("\\text{Monday}", "monday"), ("\\text{(A)}", "A"), ("B", "b"), ("yes", "Yes"), ("\\infty", "\\infty"),
    ("-5", "-5"), ("- 5", "-5"), ("5", "-5"), ("0", "0"), ("0.0", "0"), ("", ""), ("", "5"), ("\\frac{1}{2}", "1/2"),
    ("\\frac12", "0.5"), ("50\\%", "0.5"), ("1/3", "0.333"), ("0.333", "1/3"), ("3\\sqrt{3}", "\\sqrt{27}"),
    ("a^{2}", "a^2"), ("2^{10}", "1024"), ("10^{3}", "1000"), ("x \\in [0,1]", "[0,1]"), ("\\boxed{7}", "7"),
    ("\\mathbf{5}", "5"), ("\\textbf{5}", "5"), ("5.", "5"), ("5,", "5"), ("12 ways", "12"), ("n=12", "12"),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"), ("3+2i", "2i+3"), ("i", "\\sqrt{-1}"), ("e", "\\exp(1)"),
    ("\\frac", "1"), ("\\sqrt", "1"), ("\\frac1", "1"), ("5 \\text{ cm} 3 \\text{ m}", "5"), ("1.5\\text{ hours}", "1.5"),
    ("100 \\text{ square units}", "100"), ("8\\text{ ft}^2", "8"), ("0.1", "1/10"), ("\\$1,000", "1000"),
]

RESPONSES = {  # whole responses for the rm types that read more than the box
    "deepscaler": [
        ("Let me reconsider. \\boxed{99}</think>Final: \\boxed{42}", "42"),
        ("Scratch work \\boxed{wrong}###Response\\boxed{42}", "42"),
        ("a###Response\\boxed{1}###Response\\boxed{2}", "2"), ("a###Response\\boxed{1}###Response\\boxed{2}", "1"),
        ("\\boxed{42}", "42"), ("plain</think>no box here", "42"), ("</think>\\boxed{42}", ""),
        ("</think>\\boxed{42}", 42), ("</think>\\boxed{42}", 42.0), ("</think>\\boxed{42}", "\\boxed{42}"),
        ("</think>\\boxed{43}", "42"), ("</think>\\boxed{\\frac{1}{2}}", "0.5"), ("<think>\\boxed{7}</think> the end", "7"),
        ("</think>\\fbox{5}", "5"), ("</think>\\boxed 5", "5"), ("</think>\\boxed{}", ""), ("</think>\\boxed{}", "0"),
        ("</think>\\boxed{5}", "\\boxed 5"), ("</think>\\boxed{5}", "\\fbox{5}"), ("</think>$\\boxed{5}$.", "5"),
        ("</think>\\boxed{1} then \\boxed{2}", "2"), ("</think>\\boxed{\\boxed{3}}", "3"), ("</think>\\boxed{5", "5"),
        ("</think>\\boxed{5}", 0), ("</think>\\boxed{0}", 0), ("</think>\\boxed{0}", "0"),
    ],
    "math": [
        ("so the answer is \\boxed{42}.", "42"), ("The answer is: 1,234.", "1234"), ("we get 3 then 7", "7"),
        ("$\\boxed{-5}$", "-5"), ("no number here", "5"), ("\\boxed{}", ""), ("\\boxed{}", "0"), ("\\fbox{5}", "5"),
        ("\\boxed{5}", 0), ("\\boxed{0}", 0), ("\\boxed{0}", "0"), ("\\boxed{5}", 5), ("\\boxed{5}", "\\boxed{5}"),
        ("\\boxed{5}", "\\boxed 5"), ("answer: \\boxed{42}", "\\boxed{42}"), ("just 42", "42"), ("\\boxed{42}", ""),
    ],
    "dapo": [
        ("long work...\nAnswer: 42", "42"), ("Answer: 1,234 dollars", "1234"), ("Answer: \\boxed{17}", "17"),
        ("Answer: 41", "42"), ("the answer is 42", "42"), ("Answer: 42" + "x" * 400, "42"), ("answer:42", "42"),
        ("Answer: $42$", "42"), ("Answer: x = 42", "42"), ("Answer: 42.", "42"), ("Answer: 42<|im_end|>", "42"),
        ("Answer: 42 square units", "42"), ("Answer: \\text{42}", "42"), ("Answer: 42.0", "42"), ("Answer: 42", "42.0"),
        ("Answer: 1\nAnswer: 2", "2"), ("Answer: 1\nAnswer: 2", "1"), ("Answer: 012", "12"), ("Answer: -3", "-3"),
        ("Answer: \\frac{1}{2}", "0"), ("Answer: 1,000,000", "1000000"), ("Answer: 5", "x"), ("", "5"),
        ("Answer: 7 ways", "7"), ("Answer: The answer is 7", "7"), ("Answer: 7", "\\boxed{7}"), ("Answer: 3", 3),
    ],
    "f1": [
        ("Paris is the capital", "Paris is the capital"), ("the brown fox", "a quick brown fox"),
        ("apple banana", "carrot date"), ("yes", "some other phrase"), ("some other phrase", "no"), ("yes", "yes"),
        ("noanswer", "noanswer"), ("The Quick Brown Fox.", "quick brown fox"), ("An apple, a day", "apple day"),
        ("the cat sat", "cat sat down"), ("", "x"), ("x", ""), ("the", "a"), ("a.b,c!", "abc"), ("cat cat dog", "cat dog dog"),
        ("Yes.", "yes"),
    ],
    "gpqa": [
        ("The answer is B.", "B", None), ("Answer: C", "C", None), ("Answer: C", "D", None), ("My choice is D", "D", None),
        ("A is correct here", "A", None), ("E is the correct option", "E", None), ("Final answer: B", "B", None),
        ("we ruled out A, then B, settled on C", "C", None), ("Answer: A is wrong.</think>The answer is B.", "B", None),
        ("no idea, sorry", "A", None), ("Answer: C, but actually A was right, no wait B.", "B", {"valid_letters": ["A", "B"]}),
        ("Answer: C", 2, {"choices": ["alpha", "beta", "gamma", "delta"]}),
        ("Answer: B", 1, {"choices": {"a": "first", "b": "second", "c": "third"}}),
        ("I think the answer is B.", "capital of france", {"choices": ["London", "Capital of France", "Berlin"]}),
        ("Definitely paris.", "Paris", {"choices": ["London", "Paris", "Berlin"]}),
        ("Answer: A", "anything", {"correct_letter": "a"}), ("random text", "some answer", None),
        ("it is berlin", 2, {"choices": ["London", "Paris", "Berlin"]}), ("", "A", None), ("The answer is z", "Z", None),
    ],
}

CALLS = [  # (module.function, args) for the public helpers plugins call directly
    *[("math_utils._strip_string", [s]) for s in ["\\frac12", "\\tfrac{1}{2}", "\\left(1\\right)", "45^{\\circ}", ".7",
                                                   "0.5", ".5", "3/4", "1 + 1", "x = 3", "5\\text{ cm}", "-3/4", "03/4"]],
    *[("math_utils.mathd_normalize_answer", [s]) for s in ["\\text{42}", " \\frac ", "\\sqrt", "a \\text{ b} \\text{ c}"]],
    *[("math_utils.last_boxed_only_string", [s]) for s in ["first \\boxed{wrong}, final \\boxed{42}", "\\fbox{7}",
                                                            "start \\boxed{never closes", "\\boxed{\\frac{1}{2}}"]],
    *[("math_utils.remove_boxed", [s]) for s in ["\\boxed{x+1}", "not boxed at all", "\\boxed{}"]],
    *[("math_utils.grade_answer_sympy", list(p)) for p in [("x+1", "1+x"), ("\\frac{2}{4}", "\\frac{1}{2}"),
                                                           ("1,000", "1000"), ("(1,2)", "(2,1)")]],
    *[("math_dapo_utils.normalize_final_answer", [s]) for s in ["x = 42", "an answer", "42 square", "100 dollars",
                                                                 "\\text{hello}", "\\boxed{42}", "1,234,567", "a b c",
                                                                 "42<|endoftext|>", "\\frac12", "\\sqrt2", "$x$ and $y$"]],
    *[("math_dapo_utils.compute_score", list(p)) for p in [("\\boxed{42}", "42", True), ("long \\boxed{43}", "42", True),
                                                           ("plain 42", "42", True)]],
    *[("math_utils.grade_answer_verl", list(p)) for p in [("answer: \\boxed{42}", "\\boxed{42}"), ("\\boxed{42}", "")]],
]


def cases() -> list[dict]:
    out = []
    for answer, label in ANSWERS:
        out.append({"rm_type": "math", "response": f"So the result is $\\boxed{{{answer}}}$.", "label": label})
        out.append({"rm_type": "deepscaler", "response": f"<think>work</think>The answer is \\boxed{{{answer}}}",
                    "label": label})
    for answer, label in ANSWERS[:30]:
        out.append({"rm_type": "boxed_f1", "response": f"\\boxed{{{answer}}}", "label": label})
    for rm_type, rows in RESPONSES.items():
        for row in rows:
            case = {"rm_type": rm_type, "response": row[0], "label": row[1]}
            if len(row) > 2 and row[2] is not None:
                case["metadata"] = row[2]
            out.append(case)
    out.append({"rm_type": "math", "response": "Answer: 5", "label": "5", "metadata": {"rm_type": "dapo"}})
    out.append({"rm_type": "boxed_dapo", "response": "work \\boxed{Answer: 5}", "label": "5"})
    out += [{"call": fn, "args": args} for fn, args in CALLS]
    return out


def _run(case: dict, rm_hub, Sample) -> dict:
    try:
        if "call" in case:
            module, fn = case["call"].split(".")
            value = getattr(importlib.import_module(f"{rm_hub.__name__}.{module}"), fn)(*case["args"])
        else:
            args = types.SimpleNamespace(custom_rm_path=None, rm_type=case["rm_type"])
            sample = Sample(prompt="", response=case["response"], label=case["label"],
                            metadata=dict(case.get("metadata") or {}))
            value = asyncio.run(rm_hub.async_rm(args, sample))
        return {"value": json.loads(json.dumps(value))}
    except Exception as e:  # the reference raises on some inputs: the project must raise the same kind
        return {"raises": type(e).__name__}


def main(root: str, commit: str) -> None:
    sys.path.insert(0, root)
    rm_hub = importlib.import_module("slime.rollout.rm_hub")
    from slime.utils.types import Sample

    table = [dict(case, expected=_run(case, rm_hub, Sample)) for case in cases()]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rm_hub_cases.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"upstream": "THUDM/slime", "upstream_commit": commit, "cases": table}, f, indent=0)
        f.write("\n")
    os.replace(tmp, path)
    print(f"{len(table)} cases -> {path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
