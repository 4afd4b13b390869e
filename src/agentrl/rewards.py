"""Reward functions: one registry, TRL's reward signature.

Answers are parsed by `answers.extract_answer`, the single parser shared with evaluation and the service. Reward
functions take `completions` (strings or chat messages) plus dataset columns as keyword
arguments (`ground_truth`) and return one float per completion, as `GRPOTrainer` expects.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable, Optional

from .answers import answers_match, extract_answer, normalize_number


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
    return [
        float(answers_match(extract_answer(_text(c)), normalize_number(g))) for c, g in zip(completions, ground_truth)
    ]


def format(completions, **kwargs) -> list[float]:  # registry name
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


def build_rewards(
    rewards: dict[str, float], reward_kwargs: Optional[dict] = None
) -> tuple[list[Callable], list[float]]:
    funcs, weights = [], []
    for name, weight in rewards.items():
        funcs.append(get_reward(name, reward_kwargs))
        weights.append(float(weight))
    return funcs, weights
