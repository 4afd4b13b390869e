"""The environment contract, written down: what an episode class and a built-in task module must provide.

Two `typing.Protocol`s state it for type checkers (a module satisfies a Protocol structurally, PEP 544), and two
checkers (`check_environment_class`, `check_task_module`) test it at run time, where `isinstance` against a
Protocol would only test that the names exist:

- `Environment`: one episode of TRL 1.16's `GRPOTrainer(environment_factory=...)` and of our tool loop
  (`tools.Episode`). Its tools are not Protocol members (their names are the environment's own): every public
  method other than `reset` / `get_reward` / `close` is one, and TRL builds its JSON schema from the type hints and
  the Google docstring (`transformers.utils.get_json_schema`), so each must have both. An optional `close()` ends
  the episode (a session, a process): the loop calls it once the episode is judged (decorate it with `not_a_tool`
  for plain TRL, which would otherwise offer it as a tool). `RewardingEnvironment` adds the
  optional `get_reward`; TRL adds it as one more reward column (weight 1) when the class defines it.
- `TaskModule`: a module under `agentrl.envs` that generates its own rows (`tasks.TASKS`): the knobs under
  params `environments.<name>`, the seeded generator, the instance identity that keeps test instances out of
  training, and the rule that decides "solved" (`registry.episode_solved`). `CeilingTask` and `KnobCheckingTask` add
  the optional hooks that prepare.py and config.py call when present.
"""

from __future__ import annotations

import functools
import inspect
import random
from types import ModuleType
from typing import Any, Iterable, Optional, Protocol, runtime_checkable


class EnvironmentLost(RuntimeError):
    """Raised by a tool when the environment itself is gone (its server or session), not because the call was
    wrong: the loop marks the episode broken (tools.Episode), which stages count apart from wrong answers."""


TRL_RESERVED = ("reset", "get_reward")  # public methods that are not tools (TRL's environment_factory rule)
NOT_TOOLS = (*TRL_RESERVED, "close")  # and the optional teardown: no policy ever gets these as tools


class not_a_tool:  # noqa: N801 - used as a decorator, like staticmethod
    """Marks an environment's method that is no tool, for the optional `close()`: TRL 1.16 offers the policy every
    public *function* of the class but reset and get_reward, and through this descriptor the method is no function
    on the class (inspect.isfunction is false), while `env.close()` is the bound method as usual. The project's own
    loop and its TRL path leave `close` out by name too (NOT_TOOLS); a class given to plain TRL needs this."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, owner=None):
        return self if obj is None else self.fn.__get__(obj, owner)


@functools.lru_cache(maxsize=256)
def tool_names(cls: type) -> tuple[str, ...]:
    """The names of an episode class's tools as TRL 1.16's environment_factory finds them: its public functions
    but reset, get_reward (and close: NOT_TOOLS). Cached per class: one episode per completion makes it hot."""
    return tuple(
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in NOT_TOOLS and not name.startswith("_")
    )


def environment_tools(env) -> dict:
    """An environment instance's tools (tool_names) as bound methods, by name."""
    return {name: getattr(env, name) for name in tool_names(type(env))}


def knob_type_error(default: Any, value: Any) -> Optional[str]:
    """Whether a knob's value has its default's type: None when it does (or the default is None or of no plain
    type: nothing to compare with), else "expected <type>, got <value>". bool is no number, 1.5 no int, 2 a
    float; one rule for every environment knob (`environments.<name>`, mixture members, reasoning-gym config)."""
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "bool"
    elif isinstance(default, int):
        ok, want = isinstance(value, int) and not isinstance(value, bool), "int"
    elif isinstance(default, float):
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "float"
    elif isinstance(default, (str, dict)):
        ok, want = isinstance(value, type(default)), type(default).__name__
    elif isinstance(default, (list, tuple)):
        ok, want = isinstance(value, (list, tuple)), "list"
    else:
        return None
    return None if ok else f"expected {want}, got {value!r}"


def split_knobs(task_module, knobs: dict) -> tuple[dict, dict]:
    """A task's knobs split into (generation knobs, runtime knobs): its GEN_DEFAULTS keys and its ENV_DEFAULTS keys
    (the episode class's constructor arguments); others (num_train, num_test) in neither."""
    gen = {k: v for k, v in knobs.items() if k in task_module.GEN_DEFAULTS}
    return gen, {k: v for k, v in knobs.items() if k in task_module.ENV_DEFAULTS}


MAKE_ROWS_PARAMETERS = ("n", "rng", "split", "env_knobs", "exclude")  # in this order, then **gen_knobs


@runtime_checkable
class Environment(Protocol):
    """One episode: made with the runtime knobs (params `environments.<name>`, the module's ENV_DEFAULTS keys),
    reset with one dataset row, then driven through its tools. Two episodes never share state."""

    def reset(self, **row: Any) -> Optional[str]:
        """Start an episode afresh from a dataset row (its columns as keyword arguments; unknown ones ignored).

        Args:
            **row: the row's fields (`id`, `prompt`, `ground_truth` and the task's own fields).

        Returns:
            None, or an observation that TRL's loop appends to the last user message before generation.
        """
        ...


@runtime_checkable
class RewardingEnvironment(Environment, Protocol):
    """An episode that owns its reward (optional member): "solved" is `get_reward() >= 1` for a custom class."""

    def get_reward(self) -> float:
        """The episode's reward from its state, called with no argument after the rollout.

        Returns:
            The reward; 1.0 or more counts as solved.
        """
        ...


@runtime_checkable
class TaskModule(Protocol):
    """A built-in task: `tasks.TASKS[name]`, with `tasks.ENVIRONMENTS[name]` its episode class."""

    GEN_DEFAULTS: dict  # generation knobs and their defaults; config.py checks params values against their types
    ENV_DEFAULTS: dict  # the episode class's constructor knobs and their defaults

    def make_rows(
        self,
        n: int,
        rng: random.Random,
        split: str,
        env_knobs: Optional[dict] = None,
        exclude: Iterable[str] = (),
        **gen_knobs: Any,
    ) -> list[dict]:
        """`n` rows drawn from `rng` only (same seed, same rows).

        Args:
            n: how many rows.
            rng: the only source of randomness.
            split: "train" or "test" (a task may teach differently in training demonstrations).
            env_knobs: the episode knobs the demonstrations are run with.
            exclude: instance_key()s not to generate (the other split's).
            **gen_knobs: GEN_DEFAULTS keys.

        Returns:
            Rows with `question`, `answer` (the demonstration, ending in a `#### ...` line), `ground_truth` and the
            fields `reset(**row)` reads.
        """
        ...

    def instance_key(self, row: dict) -> str:
        """The instance a row poses, as a string: rows with equal keys are the same problem.

        Args:
            row: a generated or prepared row.

        Returns:
            The key.
        """
        ...

    def correct(self, row: dict, text: str, env: Any) -> bool:
        """Whether the completion `text` solved the row's instance, by the task's own rule.

        Args:
            row: the row the episode was reset with.
            text: the completion (its final `#### ...` line is the answer).
            env: the episode that ran (None when there was none).

        Returns:
            True when solved.
        """
        ...


@runtime_checkable
class CeilingTask(TaskModule, Protocol):
    """Optional: what any policy can reach on the test rows (prepare writes it to metrics/prepare.json)."""

    def ceiling(self, rows: list[dict], env_knobs: Optional[dict] = None, gen_knobs: Optional[dict] = None) -> dict:
        """Args:
            rows: the test rows.
            env_knobs: the episode knobs.
            gen_knobs: the generation knobs.

        Returns:
            Named shares in [0, 1].
        """
        ...


@runtime_checkable
class KnobCheckingTask(TaskModule, Protocol):
    """Optional: checks of the knobs beyond their types, run when params are validated (config.py)."""

    def check_knobs(self, knobs: dict) -> None:
        """Raise ValueError naming `environments.<name>.<knob>` and what was expected.

        Args:
            knobs: params `environments.<name>` as written.
        """
        ...


def protocol_members(protocol: type) -> list[str]:
    """The public members a Protocol declares, its bases' included (methods and annotated attributes).

    Args:
        protocol: a Protocol class of this module.

    Returns:
        Their names, sorted.
    """
    names: set[str] = set()
    for base in protocol.__mro__:
        if base is not Protocol and getattr(base, "_is_protocol", False):
            names |= set(vars(base)) | set(getattr(base, "__annotations__", {}))
    return sorted(n for n in names if not n.startswith("_"))


def check_environment_class(cls: type) -> None:
    """Raise TypeError naming what `cls` lacks to be an episode class (Environment, with tools TRL can describe).

    Args:
        cls: the class `agent.environment` would name.
    """
    where = getattr(cls, "__qualname__", repr(cls))
    if not isinstance(cls, type):
        raise TypeError(f"{where}: an environment must be a class, got {type(cls).__name__}")
    if not callable(getattr(cls, "reset", None)):
        raise TypeError(f"{where}: no reset(**row) method")
    reset = inspect.signature(cls.reset).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in reset):
        raise TypeError(f"{where}.reset: must take the row as **row (TRL passes every dataset column)")
    if "get_reward" in vars(cls) and not callable(cls.get_reward):
        raise TypeError(f"{where}.get_reward: must be a method")
    tools = [(name, getattr(cls, name)) for name in tool_names(cls)]
    if not tools:
        raise TypeError(f"{where}: no public tool method besides {', '.join(TRL_RESERVED)}")
    for name, fn in tools:
        params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
        untyped = [p.name for p in params if p.annotation is inspect.Parameter.empty]
        if untyped:
            raise TypeError(f"{where}.{name}: tool argument(s) {untyped} have no type hint (TRL's schema needs one)")
        doc = inspect.getdoc(fn) or ""
        if not doc or (params and "Args:" not in doc):
            raise TypeError(f"{where}.{name}: a tool needs a Google docstring with Args: (TRL's schema reads it)")


def check_task_module(module: ModuleType) -> None:
    """Raise TypeError naming the member `module` lacks (or has in the wrong shape) to be a TaskModule.

    Args:
        module: a module registered in tasks.TASKS.
    """
    where = getattr(module, "__name__", repr(module))
    missing = [n for n in protocol_members(TaskModule) if not hasattr(module, n)]
    if missing:
        raise TypeError(f"{where}: missing {', '.join(missing)} (envs/contract.py TaskModule)")
    for name in ("GEN_DEFAULTS", "ENV_DEFAULTS"):
        if not isinstance(getattr(module, name), dict):
            raise TypeError(f"{where}.{name}: must be a dict of knob -> default")
    optional = [n for n in ("ceiling", "check_knobs") if hasattr(module, n)]
    for name in ["make_rows", "instance_key", "correct", *optional]:
        if not callable(getattr(module, name)):
            raise TypeError(f"{where}.{name}: must be a function")
    params = list(inspect.signature(module.make_rows).parameters.values())
    named = tuple(p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)
    if named != MAKE_ROWS_PARAMETERS or not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        want = ", ".join(MAKE_ROWS_PARAMETERS)
        raise TypeError(f"{where}.make_rows: parameters must be ({want}, **gen_knobs), got {[p.name for p in params]}")
    for name, count in (("instance_key", 1), ("correct", 3)):
        n_params = len(inspect.signature(getattr(module, name)).parameters)
        if n_params != count:
            raise TypeError(f"{where}.{name}: takes {count} argument(s), got {n_params}")
