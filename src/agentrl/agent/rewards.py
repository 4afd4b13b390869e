"""Reward functions: one registry, TRL's reward signature.

Answers are parsed by `answers.extract_answer`, the single parser shared with evaluation and the service. Reward
functions take `completions` (strings or chat messages) plus dataset columns as keyword
arguments (`ground_truth`) and return one float per completion, as `GRPOTrainer` expects.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from ..answers import answers_match, extract_answer, normalize_number
from ..envs.registry import ImportPathError, import_path


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        # TRL's tool loop gives assistant, tool, assistant, ... messages: one per line, so a final `####` line of the
        # last assistant turn stays a line of its own (countdown.correct reads lines)
        return "\n".join(m.get("content", "") for m in completion if isinstance(m, dict))
    if isinstance(completion, dict):
        return completion.get("content", "")
    return str(completion)


def count_steps(text: str) -> int:
    """Reasoning steps = lines before the answer line that contain an arithmetic result."""
    body = text.split("####")[0]
    return sum(1 for line in body.splitlines() if re.search(r"=\s*-?\d", line))


# ------------------------------------------------------------------------------------ rewards
def accuracy(completions, ground_truth, solved=None, **kwargs) -> list[float]:
    """1.0 when the extracted answer equals the ground truth numerically, else 0.0. In an environment with its
    own success rule (countdown, gridworld, a custom get_reward), `solved` (one flag per completion, from the
    tool loop: registry.episode_solved) decides instead; a None flag falls back to the answer.

    Args:
        completions: the completions (strings or chat messages).
        ground_truth: the rows' answers, one per completion.
        solved: per completion, its environment's judgement (None: the answer decides).
        **kwargs: dataset columns and TRL's `environments`, for env_solved when `solved` is not given.

    Returns:
        One reward per completion.
    """
    flags = solved if solved is not None else env_solved(completions, ground_truth=ground_truth, **kwargs)
    return [
        float(answers_match(extract_answer(_text(c)), normalize_number(g)) if s is None else bool(s))
        for c, g, s in zip(completions, ground_truth, flags)
    ]


def format_reward(completions, solved=None, **kwargs) -> list[float]:
    """1.0 when the completion has a parseable answer line, else 0.0 (in an environment with its own success
    rule: a `####` line, whatever it holds). Registered, configured (`grpo.rewards.format`) and logged by TRL
    (`rewards/format/mean`) as `format`: get_reward names it after its registry key; the function itself is not
    called `format`, which would shadow the builtin.

    Args:
        completions: the completions (strings or chat messages).
        solved: per completion, whether its environment judged it solved (None: no such rule).
        **kwargs: dataset columns and TRL's `environments`, for env_solved when `solved` is not given.

    Returns:
        One reward per completion.
    """
    flags = solved if solved is not None else env_solved(completions, **kwargs)
    return [
        float(extract_answer(_text(c)) is not None if s is None else "####" in _text(c))
        for c, s in zip(completions, flags)
    ]


def env_solved(completions, environments=None, **columns) -> list:
    """Per completion: solved by its environment's own rule (registry.episode_solved), for TRL's
    GRPOTrainer(environment_factory=...) loop, which passes the rollouts' `environments` and the dataset
    columns (the row reset() saw) to reward functions. None flags where there is no such rule.

    Args:
        completions: the completions (strings or chat messages).
        environments: TRL's environment instance per completion, or None.
        **columns: the dataset columns, one list entry per completion.

    Returns:
        One flag per completion (True, False or None).
    """
    if environments is None:
        return [None] * len(completions)
    from ..envs.registry import episode_solved

    count = len(completions)
    rows = [{k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == count} for i in range(count)]
    return [episode_solved(r, _text(c), e) for c, r, e in zip(completions, rows, environments)]


def length_penalty(completions, length_max: int = 96, length_weight: float = 0.5, **kwargs) -> list[float]:
    """-(weight * excess / max) for completions longer than `length_max` characters, else 0.

    Args:
        completions: the completions (strings or chat messages).
        length_weight: the penalty at twice `length_max`.
        **kwargs: other columns, ignored.

    Returns:
        One reward (<= 0) per completion.
    """
    out = []
    for completion in completions:
        excess = max(0, len(_text(completion)) - length_max)
        out.append(-length_weight * excess / length_max)
    return out


def step(completions, ground_truth, step_bonus: float = 0.1, step_cap: float = 0.3, **kwargs) -> list[float]:
    """A bonus per reasoning step, capped, given only to correct answers.

    Args:
        completions: the completions (strings or chat messages).
        step_bonus: the bonus per reasoning step (rewards.count_steps).
        **kwargs: other columns, ignored.

    Returns:
        One reward per completion.
    """
    correct = accuracy(completions, ground_truth)
    return [min(step_cap, step_bonus * count_steps(_text(c))) if ok else 0.0 for c, ok in zip(completions, correct)]


REGISTRY: dict[str, Callable] = {
    "accuracy": accuracy,
    "format": format_reward,
    "length_penalty": length_penalty,
    "step": step,
}
_KWARGS = {"length_penalty": ("length_max", "length_weight"), "step": ("step_bonus", "step_cap")}


def get_reward(name: str, reward_kwargs: Optional[dict] = None) -> Callable:
    """A reward function by registry name or `module:function` import path.

    The returned callable carries `__name__` (TRL logs rewards under it, `rewards/<__name__>/mean`): a built-in
    reward's registry key (`format`, whatever its function is called), a custom one's own name. It has the
    configured keyword arguments (e.g. length_max) bound.

    Args:
        name: a key of REGISTRY, or `module:function`.
        reward_kwargs: grpo.reward_kwargs; the ones this reward takes are bound.

    Returns:
        The reward function, in TRL's reward signature.
    """
    if name in REGISTRY:
        fn = REGISTRY[name]
    elif ":" in name:
        fn = import_path(name, "grpo.rewards: cannot import custom reward")
        if not callable(fn):
            raise ImportPathError(f"grpo.rewards: '{name}' is not callable")
    else:
        raise ValueError(
            f"grpo.rewards: unknown reward '{name}'; known: {', '.join(sorted(REGISTRY))} "
            "(or a custom one as 'module:function')"
        )
    bound = {k: v for k, v in (reward_kwargs or {}).items() if k in _KWARGS.get(name, ())}
    logged_name = name if name in REGISTRY else getattr(fn, "__name__", name)
    if not bound and (name not in REGISTRY or fn.__name__ == name):
        return fn  # TRL already logs it under the right name

    def wrapped(completions, **kw):
        return fn(completions, **{**kw, **bound})

    wrapped.__name__ = logged_name
    return wrapped


def build_rewards(
    rewards: dict[str, float], reward_kwargs: Optional[dict] = None
) -> tuple[list[Callable], list[float]]:
    """The reward functions and weights that `grpo.rewards` configures, in its order.

    Args:
        rewards: reward name (registry key or `module:function`) -> weight.
        reward_kwargs: grpo.reward_kwargs; each function gets the ones it takes.

    Returns:
        (functions for GRPOTrainer's reward_funcs, their weights).
    """
    funcs, weights = [], []
    for name, weight in rewards.items():
        funcs.append(get_reward(name, reward_kwargs))
        weights.append(float(weight))
    return funcs, weights
