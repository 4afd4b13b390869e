"""The built-in environments and tools by name: `agent.environment` looks a class up in ENVIRONMENTS (or imports
`module:Class`, get_environment), `prepare` a task module (its generator, demonstrations and "solved" rule,
envs/contract.py) in TASKS, and `agent.tools` a function in TOOLS. Below the params schema (config.py checks names
against these dicts) and below the tool loop (agent/tools.py), which share with the OpenEnv server
(envs/openenv_server.py) the two rules of calling an environment: call_tool and episode_solved.

A new built-in environment is a module in this package that follows envs/contract.py, plus one line in each dict.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from typing import Callable, Optional

from . import countdown, gridworld, gymnasium_toytext, mixture, reasoning_gym_tasks
from .calculator import Calculator, ToolError, calculator
from .contract import NOT_TOOLS

TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator}  # agent.tools names (tools.get_tool)

ENVIRONMENTS: dict[str, type] = {
    "calculator": Calculator,
    "countdown": countdown.Countdown,
    "gridworld": gridworld.GridWorld,
    "gymnasium": gymnasium_toytext.GymnasiumEnv,
    "reasoning_gym": reasoning_gym_tasks.ReasoningGym,
    "mixture": mixture.Mixture,  # no episode class of its own: each row runs its member's (Toolset.factory_for)
}
# agent.environment for an OpenEnv server that is not ours (agent.environment_url): whatever it serves, its tools
# listed over MCP or its typed step action (envs/openenv_client.py); no class here, the data is params' data.source
FOREIGN = "openenv"
# built-in environments that generate their own data (prepare)
TASKS = {
    "countdown": countdown,
    "gridworld": gridworld,
    "gymnasium": gymnasium_toytext,
    "mixture": mixture,
    "reasoning_gym": reasoning_gym_tasks,
}


# `module:function` (tools, rewards) or `module:Class` (agent.environment): checked by form when params are
# validated, imported by the stage
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def check_environment_name(name: Optional[str]) -> Optional[str]:
    """agent.environment: None, a registered name or `module:Class` by form (validation imports no module; the stage
    does). ValueError listing the known names."""
    if name is None or name in ENVIRONMENTS or name == FOREIGN or IMPORT_PATH.fullmatch(name):
        return name
    raise ValueError(
        f"unknown environment '{name}'; known: {', '.join(sorted(ENVIRONMENTS))} (or a custom one as 'module:Class', "
        f"or {FOREIGN} with agent.environment_url: any OpenEnv server)"
    )


def check_tool_names(names: list[str]) -> list[str]:
    """agent.tools: each a registered tool or `module:function` by form, none twice. ValueError listing the known."""
    for name in names:
        if name not in TOOLS and not IMPORT_PATH.fullmatch(name):
            raise ValueError(
                f"unknown tool '{name}'; known: {', '.join(sorted(TOOLS))} (or a custom one as 'module:function')"
            )
    if len(set(names)) != len(names):
        raise ValueError("a tool is listed twice")
    return names


def check_environment_knobs(name: str, knobs: dict) -> None:
    """params `environments.<name>`: a task of TASKS, num_train and num_test in 1..1,000,000, every other knob one of
    the module's GEN_DEFAULTS / ENV_DEFAULTS with its default's type, then the module's own check_knobs when it has
    one (envs/contract.py KnobCheckingTask). ValueError naming `<name>.<knob>` and what was expected."""
    if name not in TASKS:
        raise ValueError(f"unknown environment '{name}'; built-ins with knobs: {', '.join(sorted(TASKS))}")
    defaults = {"num_train": 1, "num_test": 1, **TASKS[name].GEN_DEFAULTS, **TASKS[name].ENV_DEFAULTS}
    missing = sorted({"num_train", "num_test"} - set(knobs))
    if missing:
        raise ValueError(f"{name}: missing {', '.join(missing)} (how many train / held-out instances)")
    for k, val in knobs.items():
        if k not in defaults:
            raise ValueError(f"{name}.{k}: unknown knob; known: {', '.join(sorted(defaults))}")
        want = type(defaults[k])
        number = isinstance(val, (int, float)) and not isinstance(val, bool)
        ok = isinstance(val, bool) if want is bool else number if want in (int, float) else isinstance(val, want)
        if not ok or (want is int and not isinstance(val, int)):
            raise ValueError(f"{name}.{k}: expected {want.__name__}, got {val!r}")
        if k in ("num_train", "num_test") and not 1 <= val <= 1_000_000:
            raise ValueError(f"{name}.{k}: must be in 1..1000000, got {val}")
    if callable(check_knobs := getattr(TASKS[name], "check_knobs", None)):
        check_knobs(knobs)


@functools.lru_cache(maxsize=256)
def _tool_names(cls: type) -> tuple[str, ...]:
    return tuple(
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    )


def environment_tools(env) -> dict[str, Callable[..., str]]:
    """An environment's tools exactly as TRL's GRPOTrainer(environment_factory=...) finds them: the public
    functions of its class other than `reset` and `get_reward` (and `close`: contract.NOT_TOOLS), bound to the
    instance (the names are looked up once per class: one episode per completion makes this a hot path).

    Args:
        env: an environment instance.

    Returns:
        Tool name -> bound method.
    """
    return {name: getattr(env, name) for name in _tool_names(type(env))}


class ImportPathError(ValueError):
    """A `module:attr` that params name (agent.tools, agent.environment, grpo.rewards) cannot be imported or is not
    what its key needs: a user's error, which a stage reports in one line (no traceback)."""


def import_path(name: str, what: str):
    """The object a `module:attr` path names, or ImportPathError '<what> '<name>': <why>'.

    Args:
        name: a `module:attr` path.
        what: how the error names what was imported.

    Returns:
        The object.
    """
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as error:
        raise ImportPathError(f"{what} '{name}': {error}") from None


def call_tool(fn: Callable[..., str], *args, **kwargs) -> tuple[str, bool]:
    """(result text, ok). Any exception becomes 'error: ...' (ok False); never raises.

    Args:
        fn: the tool.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        (the result as text or 'error: ...', whether the call succeeded).
    """
    try:
        out = fn(*args, **kwargs)
        return str(out), True
    except Exception as error:  # a tool's failure is data for the policy, not a crash
        msg = str(error) if isinstance(error, ToolError) else f"{type(error).__name__}: {error}"
        return f"error: {msg[:120]}", False


def get_environment(name: str) -> type:
    """An environment class by registry name or `module:Class` import path (agent.environment).

    Args:
        name: a registry name or `module:Class`.

    Returns:
        The environment class. ValueError naming an unknown name or an import that fails.
    """
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if name == FOREIGN:
        raise ValueError(f"agent.environment: {FOREIGN} is the environment agent.environment_url serves; set that URL")
    if ":" in name:
        cls = import_path(name, "agent.environment: cannot import")
        if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
            raise ImportPathError(f"agent.environment: '{name}' is not a class with a reset(**row) method")
        return cls
    raise ValueError(
        f"agent.environment: unknown environment '{name}'; known: {', '.join(sorted(ENVIRONMENTS))} "
        "(or a custom one as 'module:Class')"
    )


def task_of(env) -> Optional[str]:
    """The built-in task (TASKS key) an environment instance belongs to, or None.

    Args:
        env: an environment instance.

    Returns:
        The task's name, or None for a custom environment.
    """
    return next((name for name in TASKS if isinstance(env, ENVIRONMENTS[name])), None)


def episode_solved(row: dict, text: str, env) -> Optional[bool]:
    """Whether an episode was solved, by its environment's own rule: a built-in task's `correct(row, text,
    env)`; a custom environment's `get_reward() >= 1`; None when the environment has neither (the final
    answer is then matched against the row's ground truth, as for the calculator).

    Args:
        row: the dataset row the episode was reset with.
        text: the completion.
        env: the episode's environment instance, or None.

    Returns:
        True or False by the environment's rule, or None when it has none.
    """
    if env is None:
        return None
    if callable(getattr(env, "_episode_solved", None)):  # an environment over OpenEnv: its server applies the rule
        return env._episode_solved(row, text)
    task = task_of(env)
    if task is not None:
        return bool(TASKS[task].correct(row, text, env))
    if isinstance(env, Calculator) or not callable(getattr(env, "get_reward", None)):
        return None
    try:
        return float(env.get_reward()) >= 1.0
    except Exception:  # noqa: BLE001 - a broken reward is an unsolved episode, never a crash
        return False
