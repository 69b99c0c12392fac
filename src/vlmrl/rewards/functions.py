"""The built-in reward functions (TRL's signature, see protocol.py) and the text and box helpers they share: accuracy, iou,
format_reward, answer_format, the soft overlong punishment; `BUILTIN_REWARDS` names them for reward specs.

This is the documented import path of the built-ins (``vlmrl.rewards.functions:soft_overlong_punishment(...)`` in a
reward spec). Only the standard library is imported here, so user reward files load fast and anywhere.
"""

from __future__ import annotations

import math
import re
from typing import Any

from vlmrl.rewards.args import completion_text
from vlmrl.rewards.protocol import RewardFn


ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The answer must hold something: an empty <answer></answer> earning the format reward is a known
# reward hack (the demo's tiny model found it: format reward with no attempt at the task).
THINK_ANSWER_RE = re.compile(r"^\s*<think>.*?</think>\s*<answer>\s*\S.*?</answer>\s*$", re.DOTALL)
NONEMPTY_ANSWER_RE = re.compile(r"<answer>\s*\S.*?</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?$")
CHOICE_RE = re.compile(r"^\(?([A-Za-z])\)?[.:]?$")
_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
# Exactly four numbers inside one pair of brackets, separated by commas and/or whitespace.
BOX_RE = re.compile(rf"\[\s*({_NUM})\s*[,\s]\s*({_NUM})\s*[,\s]\s*({_NUM})\s*[,\s]\s*({_NUM})\s*\]")


# ---------------------------------------------------------------------------------------------------
# Text helpers


def extract_answer(text: Any) -> str | None:
    """Content of the LAST ``<answer>...</answer>``, stripped; None when there is none.

    The last one, because models that think out loud often quote the format before the real answer.
    """
    if not isinstance(text, str):
        return None
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


def _solution_text(solution: Any) -> str | None:
    """A solution as text: the content of its <answer> tags if it has them (VLM-R1 style), else itself."""
    if solution is None or isinstance(solution, bool):
        return None
    text = solution if isinstance(solution, str) else str(solution)
    inner = extract_answer(text)
    text = inner if inner is not None else text.strip()
    return text or None


def _as_number(text: str) -> float | None:
    text = text.strip()
    if not NUMBER_RE.match(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _as_choice(text: str) -> str | None:
    m = CHOICE_RE.match(text.strip())
    return m.group(1).upper() if m else None


def _normalise(text: str) -> str:
    return " ".join(text.split()).rstrip(".").casefold()


# LaTeX wrappers around a whole answer: $4$, $$4$$, \(4\), \[4\], \boxed{4}.
MATH_WRAPPER_RE = re.compile(r"^\s*(?:\$\$(.*)\$\$|\$(.*)\$|\\\((.*)\\\)|\\\[(.*)\\\]|\\boxed\{(.*)\})\s*$", re.DOTALL)


def strip_math(text: str) -> str:
    """The inside of LaTeX math wrappers around a whole answer (nested ones too): '$\\boxed{4}$' -> '4'."""
    while (m := MATH_WRAPPER_RE.match(text)) is not None:
        text = next(g for g in m.groups() if g is not None)
    return text.strip()


def answers_match(answer: str, solution: str) -> bool:
    """Whether an extracted answer equals a solution.

    LaTeX math wrappers are ignored ("$4$" == "\\boxed{4}" == "4"). Numeric solutions compare numerically
    ("3" == "3.0" == " 3 "; "three" != "3"); single-letter choices compare case-insensitively with optional
    parentheses/period ("B" == "(b)" == "b."); anything else compares as text, case-insensitive with whitespace
    collapsed and a trailing period ignored, and then, when the optional `math-verify` package is installed
    (``pip install vlmrl[math]``), as mathematics ("\\frac{1}{2}" == "0.5", "x+1" == "1+x").
    """
    answer, solution = strip_math(answer), strip_math(solution)
    if _plain_match(answer, solution):
        return True
    if (_as_number(solution) is not None or _as_choice(solution) is not None) and not MATH_MARKUP_RE.search(answer):
        return False  # a number or a choice written as text has its plain rules: math-verify would read "4 apples" as 4
    return _math_verify_match(answer, solution)


# What makes an answer mathematics rather than text: LaTeX commands, braces, powers, subscripts, a fraction a/b.
MATH_MARKUP_RE = re.compile(r"[\\^{}_]|\d\s*/\s*\d")


def _math_verify_match(answer: str, solution: str) -> bool:
    try:
        from math_verify import parse, verify
    except ImportError:
        return False
    try:
        gold, guess = parse(f"${solution}$"), parse(f"${answer}$")
        return bool(gold) and bool(guess) and bool(verify(gold, guess))
    except Exception:  # a parser failure is a non-match, never a crashed step
        return False


def _plain_match(answer: str, solution: str) -> bool:
    sol_num = _as_number(solution)
    if sol_num is not None:
        ans_num = _as_number(answer)
        return ans_num is not None and math.isclose(ans_num, sol_num, rel_tol=1e-9, abs_tol=1e-9)
    sol_choice = _as_choice(solution)
    if sol_choice is not None:
        return _as_choice(answer) == sol_choice
    return _normalise(answer) == _normalise(solution)


# ---------------------------------------------------------------------------------------------------
# Boxes


def parse_box(text: Any) -> list[float] | None:
    """``[x1, y1, x2, y2]`` from a completion or solution; None when there is no valid box.

    The box is the first ``[a, b, c, d]`` (exactly four numbers, commas and/or spaces) inside the last
    ``<answer>`` if there is one, otherwise in the whole text. Boxes with x2 <= x1 or y2 <= y1 (empty or
    flipped) are rejected rather than repaired: a model should not be paid for them.
    """
    if not isinstance(text, str):
        return None
    answer = extract_answer(text)
    m = BOX_RE.search(answer if answer is not None else text)
    if not m:
        return None
    box = [float(v) for v in m.groups()]
    if not all(math.isfinite(v) for v in box) or box[2] <= box[0] or box[3] <= box[1]:
        return None
    return box


def box_iou(a: list[float], b: list[float]) -> float:
    """Intersection over union of two ``[x1, y1, x2, y2]`` boxes (continuous coordinates)."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0.0, iw) * max(0.0, ih)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


# ---------------------------------------------------------------------------------------------------
# Built-in rewards (TRL signature)


def accuracy(prompts: list, completions: list, solution: list, **kwargs) -> list[float | None]:
    """1.0 when the completion's last <answer> matches the solution (see `answers_match`), else 0.0.

    A completion without <answer> tags scores 0.0. None when the solution itself is missing or empty.
    """
    out: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        sol_text = _solution_text(sol)
        if sol_text is None:
            out.append(None)
            continue
        answer = extract_answer(completion_text(completion))
        out.append(1.0 if answer is not None and answers_match(answer, sol_text) else 0.0)
    return out


def iou(prompts: list, completions: list, solution: list, **kwargs) -> list[float | None]:
    """IoU in [0, 1] between the completion's box and the solution's box (see `parse_box`).

    0.0 when the completion has no valid box; None when the solution has none.
    """
    out: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        target = parse_box(sol if isinstance(sol, str) else str(sol) if sol is not None else None)
        if target is None:
            out.append(None)
            continue
        box = parse_box(completion_text(completion))
        out.append(box_iou(box, target) if box is not None else 0.0)
    return out


def format_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 when the completion is exactly ``<think>...</think><answer>...</answer>`` (whitespace around ok)
    with a non-empty answer."""
    return [1.0 if THINK_ANSWER_RE.match(completion_text(c)) else 0.0 for c in completions]


def answer_format(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 when the completion has exactly one ``<answer>...</answer>``, not empty (tasks without thinking)."""
    out = []
    for c in completions:
        text = completion_text(c)
        one = text.count("<answer>") == 1 and text.count("</answer>") == 1 and NONEMPTY_ANSWER_RE.search(text) is not None
        out.append(1.0 if one else 0.0)
    return out


def overlong_penalty(length: int, max_len: int, buffer_len: int) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) of a completion of `length` tokens: 0 up to
    max_len - buffer_len, then (max_len - buffer_len - length) / buffer_len down to -1 at max_len, -1 beyond."""
    expected = max_len - buffer_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / buffer_len
    return -1.0


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> RewardFn:
    """The soft overlong punishment as a reward over ``completion_ids`` (TRL's get_soft_overlong_punishment arguments:
    L_max and L_cache); algorithm.overlong_shaping adds it as the term ``overlong``. None where no ids are given."""
    if not 1 <= soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache={soft_punish_cache} must be in [1, max_completion_len={max_completion_len}]")

    def overlong(prompts: list, completions: list, completion_ids: list | None = None, **kwargs) -> list[float | None]:
        if completion_ids is None:
            return [None] * len(completions)
        return [overlong_penalty(len(ids), max_completion_len, soft_punish_cache) for ids in completion_ids]

    return overlong


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "accuracy": accuracy,
    "iou": iou,
    "format": format_reward,
    "answer_format": answer_format,
}
# Built-in rewards that are built from a config section rather than called as they are (rewards/scoring.py builds them).
CONFIGURED_REWARDS = {"judge": "a model grading each completion (rewards/judge.py; the judge section)"}
