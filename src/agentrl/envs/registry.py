"""Params to environments, in one place: `environment_spec` resolves `agent.environment` + `environments` into
what config validation, `prepare`, the tool loop and the OpenEnv server use (the task module, its generation and
runtime knobs); the checks of names and knobs that params validation runs; the two rules of
calling an environment that the tool loop and the OpenEnv server (serving/openenv_server.py) share: call_tool and
episode_solved. The tables of names are envs/tasks.py's.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

from . import mixture
from .calculator import Calculator, ToolError
from .contract import knob_type_error, split_knobs
from .openenv_client import FOREIGN
from .tasks import ENVIRONMENTS, TASKS, TOOLS

MIXTURE = "mixture"  # agent.environment for several tasks as one run (envs/mixture.py): no episode class of its own


# `module:function` (tools, rewards) or `module:Class` (agent.environment): checked by form when params are
# validated, imported by the stage
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def check_environment_name(name: Optional[str]) -> Optional[str]:
    """agent.environment: None, a registered name or `module:Class` by form (validation imports no module; the stage
    does). ValueError listing the known names."""
    if name is None or name in ENVIRONMENTS or name in (MIXTURE, FOREIGN) or IMPORT_PATH.fullmatch(name):
        return name
    raise ValueError(
        f"unknown environment '{name}'; known: {', '.join(sorted([*ENVIRONMENTS, MIXTURE]))} (or a custom one as "
        f"'module:Class', or {FOREIGN} with agent.environment_url: any OpenEnv server)"
    )


def check_environment_url(name: Optional[str], url: Optional[str]) -> None:
    """agent.environment_url with agent.environment: a URL plays one environment (not a mixture) over OpenEnv, and
    the foreign environment (openenv) is a server's at a URL. ValueError saying which to set."""
    if url and (not name or name == MIXTURE):
        raise ValueError(
            "agent.environment_url plays agent.environment over OpenEnv: set agent.environment (one environment, "
            f"not a mixture; {FOREIGN}: whatever a server that is not ours serves), got {name!r}"
        )
    if name == FOREIGN and url in (None, "serve"):
        raise ValueError(
            f"agent.environment {FOREIGN} is the environment of the OpenEnv server at agent.environment_url: set "
            f"its URL (http://host:port), got {url!r}"
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


def task_module(name: Optional[str]) -> Optional[ModuleType]:
    """The module that generates an environment's rows: a built-in task's (TASKS), the mixture's, or None."""
    return mixture if name == MIXTURE else TASKS.get(name)


def check_environment_knobs(name: str, knobs: dict) -> None:
    """params `environments.<name>`: a task of TASKS or the mixture, num_train and num_test in 1..1,000,000, every
    other knob one of the module's GEN_DEFAULTS / ENV_DEFAULTS with its default's type (contract.knob_type_error),
    then the module's own check_knobs when it has one (envs/contract.py KnobCheckingTask). ValueError naming
    `<name>.<knob>` and what was expected."""
    module = task_module(name)
    if module is None:
        raise ValueError(f"unknown environment '{name}'; built-ins with knobs: {', '.join(sorted([*TASKS, MIXTURE]))}")
    defaults = {"num_train": 1, "num_test": 1, **module.GEN_DEFAULTS, **module.ENV_DEFAULTS}
    missing = sorted({"num_train", "num_test"} - set(knobs))
    if missing:
        raise ValueError(f"{name}: missing {', '.join(missing)} (how many train / held-out instances)")
    for k, val in knobs.items():
        if k not in defaults:
            raise ValueError(f"{name}.{k}: unknown knob; known: {', '.join(sorted(defaults))}")
        if (msg := knob_type_error(defaults[k], val)) is not None:
            raise ValueError(f"{name}.{k}: {msg}")
        if k in ("num_train", "num_test") and not 1 <= val <= 1_000_000:
            raise ValueError(f"{name}.{k}: must be in 1..1000000, got {val}")
    if callable(check_knobs := getattr(module, "check_knobs", None)):
        check_knobs(knobs)


@dataclass(frozen=True)
class EnvironmentSpec:
    """What `agent.environment` and `environments.<name>` make together (environment_spec)."""

    name: Optional[str]  # agent.environment: a built-in, mixture, `module:Class`, openenv, or None (agent.tools)
    task: Optional[ModuleType]  # the module that generates its rows (prepare), or None: the data is data.source's
    knobs: dict  # environments.<name> as written (num_train, num_test, generation and runtime knobs)
    gen: dict  # the generation knobs: task.make_rows(**gen)
    env: dict  # the runtime knobs: the episode class's constructor arguments (a mixture's: {"members": ...})


def environment_spec(name: Optional[str], environments: Optional[dict]) -> EnvironmentSpec:
    """Resolve `agent.environment` with params' `environments` sections: the one place that does (config
    validation, prepare, the tool loop, the OpenEnv server). Imports no user module (a `module:Class` is imported by
    get_environment, when a stage runs it). ValueError when a built-in that generates its rows has no section.

    Args:
        name: agent.environment.
        environments: params.environments (each built-in's knobs).

    Returns:
        The EnvironmentSpec.
    """
    task = task_module(name)
    if task is None:
        return EnvironmentSpec(name, None, {}, {}, {})
    if name not in (environments or {}):
        raise ValueError(f"agent.environment '{name}' generates its rows from environments.{name}: add that section")
    knobs = dict(environments[name] or {})
    gen, env = split_knobs(task, knobs)
    return EnvironmentSpec(name, task, knobs, gen, env)


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


def check_imports(params) -> None:
    """Import every `module:attr` that params name (agent.tools, agent.environment, grpo.rewards): ImportPathError
    naming the key when one does not import. Validation imports nothing (an agent's params are checked without
    running code, docs/security.md); the stages call this first, so a typo stops them before any model or data."""
    named = [("agent.tools: cannot import custom tool", name) for name in params.agent.tools]
    named += [("agent.environment: cannot import", params.agent.environment)]
    named += [("grpo.rewards: cannot import custom reward", name) for name in params.grpo.rewards]
    for what, name in named:
        if isinstance(name, str) and ":" in name:
            import_path(name, what)


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
    if name == MIXTURE:
        raise ValueError(
            f"agent.environment: {MIXTURE} has no episode class of its own: each row runs its member's "
            "(envs/mixture.py)"
        )
    if name == FOREIGN:
        raise ValueError(f"agent.environment: {FOREIGN} is the environment agent.environment_url serves; set that URL")
    if ":" in name:
        cls = import_path(name, "agent.environment: cannot import")
        if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)):
            raise ImportPathError(f"agent.environment: '{name}' is not a class with a reset(**row) method")
        return cls
    raise ValueError(
        f"agent.environment: unknown environment '{name}'; known: {', '.join(sorted([*ENVIRONMENTS, MIXTURE]))} "
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
