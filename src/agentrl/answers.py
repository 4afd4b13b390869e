"""Numbers and final answers: the one parser of a completion's answer, used by data preparation, rewards,
evaluation and the service.

`extract_answer` finds the final answer (`#### N`, else `answer is N`, else `\\boxed{N}`) and normalises it
(`normalize_number`); `answers_match` compares two normalised answers numerically.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

NUMBER = r"-?\$?\s*-?\d[\d,]*(?:\.\d+)?"
_HASH = re.compile(r"####\s*(" + NUMBER + ")")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(" + NUMBER + ")", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*(" + NUMBER + r")\s*\}")
_CALC = re.compile(r"<<[^<>]*>>")


def normalize_number(text: str) -> Optional[str]:
    """'1,000' -> '1000', '$5' -> '5', '2.50' -> '2.5', '7.00' -> '7'. None if not a number."""
    if text is None:
        return None
    cleaned = str(text).strip().replace(",", "").replace("$", "").replace(" ", "")
    cleaned = cleaned.rstrip(".")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", cleaned):
        return None
    neg = cleaned.startswith("-")
    int_part, _, frac = cleaned.lstrip("-").partition(".")
    frac = frac.rstrip("0")
    out = (int_part.lstrip("0") or "0") + ("." + frac if frac else "")
    return "-" + out if neg and out != "0" else out


def find_answer(text: str) -> tuple[Optional[str], Optional[tuple[int, int]]]:
    """(normalised final answer, its character span in `text`), or (None, None).

    Order: the last `#### N`, then the last `answer is N`, then the last `\\boxed{N}`.
    """
    if not isinstance(text, str):
        return None, None
    for pattern in (_HASH, _ANSWER_IS, _BOXED):
        matches = list(pattern.finditer(text))
        if matches:
            return normalize_number(matches[-1].group(1)), matches[-1].span(1)
    return None, None


def extract_answer(text: str) -> Optional[str]:
    """Final answer of a completion, normalised; None if it has no parseable answer line."""
    return find_answer(text)[0]


def answers_match(pred: Optional[str], truth: Optional[str], rel_tol: float = 1e-6) -> bool:
    """Two normalised answers equal within rel_tol of the larger (or 1e-9), as math.isclose would say, but computed
    exactly on fractions: floats overflow to inf past ~1e308 (then '9'*310 matched '1'*400) and round long numbers."""
    if pred is None or truth is None:
        return False
    if pred == truth:  # also numbers too long for int() (Python's 4,300-digit limit)
        return True
    try:
        predicted, expected = Fraction(pred), Fraction(truth)
    except (ValueError, ZeroDivisionError):
        return False
    tolerance = max(Fraction(rel_tol) * max(abs(predicted), abs(expected)), Fraction(1, 10**9))
    return abs(predicted - expected) <= tolerance


def strip_calculator_annotations(text: str) -> str:
    """The text without its GSM8K `<<a*b=c>>` calculator annotations."""
    return _CALC.sub("", text)
