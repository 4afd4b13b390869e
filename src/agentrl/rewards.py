"""Answer extraction and reward functions: one registry, TRL's reward signature.

`extract_answer` is the single parser used by evaluation, rewards and the service. Reward
functions take `completions` (strings or chat messages) plus dataset columns as keyword
arguments (`ground_truth`) and return one float per completion, as `GRPOTrainer` expects.
"""
from __future__ import annotations

import importlib
import math
import re
from typing import Callable, Optional

NUMBER = r"-?\$?\s*-?\d[\d,]*(?:\.\d+)?"
_HASH = re.compile(r"####\s*(" + NUMBER + ")")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(" + NUMBER + ")", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*(" + NUMBER + r")\s*\}")
_CALC = re.compile(r"<<[^<>]*>>")


def normalize_number(text: str) -> Optional[str]:
    """'1,000' -> '1000', '$5' -> '5', '2.50' -> '2.5', '7.00' -> '7'. None if not a number."""
    if text is None:
        return None
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")
    if not re.fullmatch(r"-?\d+(?:\.\d+)?", s):
        return None
    neg = s.startswith("-")
    int_part, _, frac = s.lstrip("-").partition(".")
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
    if pred is None or truth is None:
        return False
    try:
        a, b = float(pred), float(truth)
    except ValueError:
        return False
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)


def strip_calculator_annotations(text: str) -> str:
    return _CALC.sub("", text)


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    if isinstance(completion, dict):
        return completion.get("content", "")
    return str(completion)


def count_steps(text: str) -> int:
    """Reasoning steps = lines before the answer line that contain an arithmetic result."""
    body = text.split("####")[0]
    return sum(1 for line in body.splitlines() if re.search(r"=\s*-?\d", line))


# ------------------------------------------------------------------------------------ rewards
def accuracy(completions, ground_truth, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the ground truth numerically, else 0.0."""
    return [float(answers_match(extract_answer(_text(c)), normalize_number(g))) for c, g in zip(completions, ground_truth)]


def format(completions, **kwargs) -> list[float]:  # noqa: A001 - registry name
    """1.0 when the completion has a parseable answer line, else 0.0."""
    return [float(extract_answer(_text(c)) is not None) for c in completions]


def length_penalty(completions, length_max: int = 96, length_weight: float = 0.5, **kwargs) -> list[float]:
    """-(weight * excess / max) for completions longer than `length_max` characters, else 0."""
    out = []
    for c in completions:
        excess = max(0, len(_text(c)) - length_max)
        out.append(-length_weight * excess / length_max)
    return out


def step(completions, ground_truth, step_bonus: float = 0.1, step_cap: float = 0.3, **kwargs) -> list[float]:
    """A bonus per reasoning step, capped, given only to correct answers."""
    correct = accuracy(completions, ground_truth)
    return [min(step_cap, step_bonus * count_steps(_text(c))) if ok else 0.0 for c, ok in zip(completions, correct)]


REGISTRY: dict[str, Callable] = {
    "accuracy": accuracy,
    "format": format,
    "length_penalty": length_penalty,
    "step": step,
}
_KWARGS = {"length_penalty": ("length_max", "length_weight"), "step": ("step_bonus", "step_cap")}


def get_reward(name: str, reward_kwargs: Optional[dict] = None) -> Callable:
    """A reward function by registry name or `module:function` import path.

    The returned callable carries `__name__` (TRL logs rewards under it) and has the
    configured keyword arguments (e.g. length_max) bound.
    """
    if name in REGISTRY:
        fn = REGISTRY[name]
    elif ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"grpo.rewards: cannot import custom reward '{name}': {e}") from None
        if not callable(fn):
            raise ValueError(f"grpo.rewards: '{name}' is not callable")
    else:
        raise ValueError(
            f"grpo.rewards: unknown reward '{name}'; known: {', '.join(sorted(REGISTRY))} "
            "(or a custom one as 'module:function')"
        )
    bound = {k: v for k, v in (reward_kwargs or {}).items() if k in _KWARGS.get(name, ())}
    if not bound:
        return fn

    def wrapped(completions, **kw):
        return fn(completions, **{**kw, **bound})

    wrapped.__name__ = getattr(fn, "__name__", name)
    return wrapped


def build_rewards(rewards: dict[str, float], reward_kwargs: Optional[dict] = None) -> tuple[list[Callable], list[float]]:
    funcs, weights = [], []
    for name, weight in rewards.items():
        funcs.append(get_reward(name, reward_kwargs))
        weights.append(float(weight))
    return funcs, weights
