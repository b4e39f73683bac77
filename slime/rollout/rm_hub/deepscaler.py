"""DeepScaleR's rule-based reward (`--rm-type deepscaler`): 1 when the boxed answer after the reasoning
equals the label under either math check, else 0.

The graded text is what follows the last `</think>`; without one, the part after the first
`###Response` (up to a second one); with neither marker the reasoning never finished and the reward is 0.
"""

from __future__ import annotations

from .math_utils import extract_answer, grade_answer_mathd, grade_answer_sympy


def _solution_part(response: str) -> str | None:
    if "</think>" in response:
        return response.split("</think>")[-1]
    if "###Response" in response:
        return response.split("###Response")[1]
    return None


def get_deepscaler_rule_based_reward(response: str, label) -> int:
    solution = _solution_part(response)
    if solution is None:
        return 0
    answer = extract_answer(solution)
    if answer is None or label == "":
        return 0
    assert isinstance(label, (str, float, int)), f"deepscaler labels are strings or numbers, got {type(label).__name__}"
    truth = str(label)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
        if truth is None:
            return 0
    return int(grade_answer_mathd(answer, truth) or grade_answer_sympy(answer, truth))
