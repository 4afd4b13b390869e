"""The built-in environments, tasks and tools by name: the tables every other module of `envs/` reads (the
registry resolves params with them, the mixture's members are their tasks). A leaf: it imports the environments,
nothing imports back.

A new built-in environment is its module (envs/contract.py: an episode class and a task module), one line in
ENVIRONMENTS and TASKS, and its `environments.<name>` section in params.yaml.
"""

from __future__ import annotations

from typing import Callable

from . import countdown, gridworld, gymnasium_toytext, reasoning_gym_tasks
from .calculator import Calculator, calculator

TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator}  # agent.tools names (tools.get_tool)

# agent.environment names -> episode classes
ENVIRONMENTS: dict[str, type] = {
    "calculator": Calculator,
    "countdown": countdown.Countdown,
    "gridworld": gridworld.GridWorld,
    "gymnasium": gymnasium_toytext.GymnasiumEnv,
    "reasoning_gym": reasoning_gym_tasks.ReasoningGym,
}
# the environments that generate their own rows (`prepare`): name -> task module (envs/contract.py TaskModule);
# a mixture's members are these (envs/mixture.py)
TASKS = {
    "countdown": countdown,
    "gridworld": gridworld,
    "gymnasium": gymnasium_toytext,
    "reasoning_gym": reasoning_gym_tasks,
}
