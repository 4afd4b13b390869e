"""The built-in environments by name: `agent.environment` looks a class up in ENVIRONMENTS, and `prepare` a task
module (its generator, demonstrations and "solved" rule, envs/contract.py) in TASKS.

A new built-in environment is a module in this package that follows envs/contract.py, plus one line in each dict.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from . import countdown, gridworld, gymnasium_toytext, mixture, reasoning_gym_tasks
from .calculator import Calculator

ENVIRONMENTS: dict[str, type] = {
    "calculator": Calculator,
    "countdown": countdown.Countdown,
    "gridworld": gridworld.GridWorld,
    "gymnasium": gymnasium_toytext.GymnasiumEnv,
    "reasoning_gym": reasoning_gym_tasks.ReasoningGym,
    "mixture": mixture.Mixture,  # no episode class of its own: each row runs its member's (Toolset.factory_for)
}
# built-in environments that generate their own data (prepare)
TASKS = {
    "countdown": countdown,
    "gridworld": gridworld,
    "gymnasium": gymnasium_toytext,
    "mixture": mixture,
    "reasoning_gym": reasoning_gym_tasks,
}


@functools.lru_cache(maxsize=256)
def _tool_names(cls: type) -> tuple[str, ...]:
    return tuple(
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    )


def environment_tools(env) -> dict[str, Callable[..., str]]:
    """An environment's tools exactly as TRL's GRPOTrainer(environment_factory=...) finds them: the public
    functions of its class other than `reset` and `get_reward`, bound to the instance (the names are looked up
    once per class: one episode per completion makes this a hot path).

    Args:
        env: an environment instance.

    Returns:
        Tool name -> bound method.
    """
    return {name: getattr(env, name) for name in _tool_names(type(env))}
