"""Environments: stateful, multi-turn episodes in the shape of TRL's `environment_factory` (issue 29)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional


def row_text(row: dict) -> Optional[str]:
    """The task's text in a row: `question`, else the last message of `prompt` (what the server has)."""
    if isinstance(row.get("question"), str):
        return row["question"]
    prompt = row.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        content = prompt[-1].get("content")
        return content if isinstance(content, str) else None
    return None


def refuse_beyond_capacity(
    n: int, capacity: int, exclude: Iterable[str], drawable: Callable[[str], bool], limits: str
) -> None:
    """ValueError when `n` distinct instances cannot be drawn from `capacity` once the drawable keys of `exclude`
    (the other split's) are left out: the one room check of the generators (countdown, gridworld), before any draw.

    Args:
        n: rows asked.
        capacity: how many distinct instances the knobs allow.
        exclude: instance keys that may not be drawn.
        drawable: whether an excluded key is one the knobs could draw (only those take room).
        limits: the message naming the knobs and what to change, with `{capacity}` (the count) and `{other}` (how
            many the other split takes, when any) left to fill in.

    Raises:
        ValueError: naming the knobs and what to change.
    """
    exclude = list(exclude)
    taken = sum(drawable(key) for key in exclude) if n > capacity - len(exclude) else 0
    if n > capacity - taken:
        other = f", {taken} of them excluded (the other split's)" if taken else ""
        raise ValueError(limits.format(capacity=capacity, other=other))
