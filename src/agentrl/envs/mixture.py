"""A mixture of built-in tasks trained and evaluated as one run (`agent.environment: mixture`).

`environments.mixture.members` maps a member name to `{environment: <a registered task>, share: <float>,
knobs: {<that task's knobs>}}`; `num_train` / `num_test` are the mixture's totals, split among the members by
share. Two members may run the same task with different knobs (e.g. gridworld with and without `look`).

Rows: each member's rows come from its own task module's `make_rows`, with a generator seeded for that member
alone (a member's rows do not depend on which other members there are); every row is tagged with
`environment: <member name>` (the column TRL's `GRPOTrainer(environment_factory={name: factory})` routes by)
and `environment_task: <its task>`, and the members' rows are interleaved by a seeded shuffle.

Episodes: `member_factories` gives one environment factory per member (the task's class with the member's
runtime knobs); `tools.Toolset` picks each row's by its `environment`, so "solved" is the member task's own
rule (`registry.episode_solved`). The inline format drives one tool per episode: every member must have exactly
one tool (it may differ between members). The chat format renders one tool description for every prompt in
the project's loop, so there every member must have the same tools.
"""

from __future__ import annotations

import functools
import inspect
import random
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from .contract import environment_tools, knob_type_error, split_knobs
from .tasks import ENVIRONMENTS, TASKS

GEN_DEFAULTS: dict = {}  # a mixture generates nothing itself: each member's task does
ENV_DEFAULTS: dict = {
    "members": {},  # member name -> {environment: <task>, share: <float>, knobs: {...}} (runtime and generation)
}
MEMBER_KEYS = ("environment", "share", "knobs")
# the `environment` column's value, TRL's factory key and a params key path part (`dvc exp run -S` takes no '-')
MEMBER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
TAG_FIELDS = ("environment", "environment_task")  # what the mixture adds to every member row
SHARE_TOLERANCE = 1e-6
WHERE = "environments.mixture.members"


@dataclass(frozen=True)
class Member:
    """One task of the mixture: its name (the rows' `environment`), task, share and the task's knobs split into
    generation knobs (its GEN_DEFAULTS keys) and runtime knobs (its ENV_DEFAULTS keys, the episode class's)."""

    name: str
    task: str
    share: float
    gen: dict
    env: dict


def _check_knobs(where: str, task: str, knobs: dict) -> tuple[dict, dict]:
    """A member's knobs checked as its task's own section would be: names, types, the task's `check_knobs` and the
    runtime values its episode class accepts.

    Args:
        where: `environments.mixture.members.<name>`, what an error names.
        task: the member's task (a TASKS key).
        knobs: the member's knobs as written; ValueError naming `<where>.knobs.<knob>` when one is wrong.

    Returns:
        (generation knobs, runtime knobs), split_knobs' split.
    """
    module = TASKS[task]
    defaults = {**module.GEN_DEFAULTS, **module.ENV_DEFAULTS}
    for key, value in knobs.items():
        if key in ("num_train", "num_test"):
            raise ValueError(f"{where}.knobs.{key}: set environments.mixture.{key} (the total, split by share)")
        if key not in defaults:
            raise ValueError(f"{where}.knobs.{key}: unknown knob of {task}; known: {', '.join(sorted(defaults))}")
        if (msg := knob_type_error(defaults[key], value)) is not None:
            raise ValueError(f"{where}.knobs.{key}: {msg}")
    if callable(check := getattr(module, "check_knobs", None)):  # the task's own deeper checks (reasoning_gym)
        try:
            check(knobs)
        except ValueError as e:  # its message names environments.<task>.<knob>: said here as the member's knob
            msg, own = str(e), f"environments.{task}"
            raise ValueError(
                f"{where}.knobs{msg[len(own) :]}" if msg.startswith(own) else f"{where}.knobs: {msg}"
            ) from None
    gen, env = split_knobs(module, knobs)
    try:  # the runtime knobs' values, as the episode class checks them (an unknown feedback mode, a bad view)
        ENVIRONMENTS[task](**env)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}.knobs: {e}") from None
    return gen, env


def _member(name, spec) -> Member:
    """One `members` entry checked: its keys, task, share and knobs (names, types and the task's own checks).

    Args:
        name: the member's name (its rows' `environment`).
        spec: {environment, share, knobs} as written.

    Returns:
        The Member; ValueError naming `environments.mixture.members.<name>.<key>` otherwise.
    """
    where = f"{WHERE}.{name}"
    if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name):
        raise ValueError(
            f"{WHERE}: member name {name!r} must be 1-64 letters, digits or '_', not starting with a digit"
        )
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping with {', '.join(MEMBER_KEYS)}, got {spec!r:.80}")
    for key in spec:
        if key not in MEMBER_KEYS:
            raise ValueError(f"{where}.{key}: unknown key; expected {', '.join(MEMBER_KEYS)}")
    task = spec.get("environment")
    known = sorted(TASKS)
    if task not in known:
        raise ValueError(f"{where}.environment: expected a registered task ({', '.join(known)}), got {task!r}")
    share = spec.get("share")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ValueError(f"{where}.share: expected a number in (0, 1], got {share!r}")
    knobs = spec.get("knobs") or {}
    if not isinstance(knobs, dict):
        raise ValueError(f"{where}.knobs: expected a mapping of {task}'s knobs, got {knobs!r:.80}")
    gen, env = _check_knobs(where, task, knobs)
    return Member(name, task, float(share), gen, env)


def parse_members(members) -> list[Member]:
    """`environments.mixture.members` checked -> its Members, in the order given.

    Args:
        members: the mapping member name -> {environment, share, knobs}.

    Returns:
        One Member per entry; ValueError naming `environments.mixture.members.<name>.<key>` otherwise.
    """
    if not isinstance(members, dict) or not members:
        raise ValueError(f"{WHERE}: expected a mapping of at least one member name -> {{{', '.join(MEMBER_KEYS)}}}")
    parsed = [_member(name, spec) for name, spec in members.items()]
    total = sum(m.share for m in parsed)
    if abs(total - 1) > SHARE_TOLERANCE:
        shares = ", ".join(f"{m.name} {m.share:g}" for m in parsed)
        raise ValueError(f"{WHERE}: the shares must sum to 1, got {total:g} ({shares})")
    return parsed


def check_knobs(knobs: dict) -> None:
    """The params-validation hook (config.py calls it for `environments.mixture`): the members are checked
    before any stage runs.

    Args:
        knobs: `environments.mixture` (num_train, num_test, members).
    """
    parse_members((knobs or {}).get("members"))


def split_counts(n: int, members: list[Member]) -> dict[str, int]:
    """`n` rows split by share, rounded by largest remainder so that the counts sum to `n` (ties: member order).

    Args:
        n: the mixture's rows in one split.
        members: the parsed members.

    Returns:
        member name -> its number of rows.
    """
    exact = [n * m.share for m in members]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(members)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    return {m.name: c for m, c in zip(members, counts)}


def _task_key(task: str, key: str) -> str:
    return f"{task}|{key}"


def instance_key(row: dict) -> str:
    """The row's instance as its task sees it, prefixed with the task: two members of one task share keys, so
    an instance held out for one is not trained on by the other."""
    task = row.get("environment_task")
    if task not in TASKS:
        raise ValueError(f"mixture row {row.get('id')!r}: 'environment_task' must name a member's task, got {task!r}")
    return _task_key(task, TASKS[task].instance_key(row))


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def _check_columns(rows_by_member: dict[str, list[dict]]) -> None:
    """The members' rows become one table (GRPO reads data/prepared/rl_train.jsonl with `datasets`, one type per
    column: a column of 1 and "1" comes back as 1 and 1, silently): a field two members give different kinds of
    values, or a member field named like the tags, is an error naming the field and the members.

    Args:
        rows_by_member: member name -> its rows, before tagging.
    """
    kinds: dict[str, dict[str, str]] = {}
    for name, rows in rows_by_member.items():
        for row in rows:
            for key, value in row.items():
                if key in TAG_FIELDS:
                    raise ValueError(f"{WHERE}.{name}: its rows have a field '{key}', which the mixture sets itself")
                if value is not None:
                    kinds.setdefault(key, {}).setdefault(_json_kind(value), name)
    for key, by_kind in kinds.items():
        if len(by_kind) > 1:
            seen = ", ".join(f"{kind} (member {name})" for kind, name in by_kind.items())
            raise ValueError(f"{WHERE}: the members' rows give field '{key}' values of different kinds: {seen}")


def make_rows(
    n: int,
    rng: random.Random,
    split: str,
    env_knobs: Optional[dict] = None,
    exclude: Iterable[str] = (),
    **gen_knobs,
) -> list[dict]:
    """`n` rows of the members, each member's share of them made by its own task's `make_rows`, tagged and
    interleaved. Only `rng` is drawn from (once): same seed, same rows.

    Args:
        n: rows in all (split by share, split_counts).
        rng: the split's generator; each member gets its own generator seeded from one draw and its name.
        split: "train" or "test", passed to each member.
        env_knobs: {"members": ...} (environments.mixture.members).
        exclude: instance_key()s not to generate (the other split's).
        **gen_knobs: none (a mixture has no generation knobs of its own; the members' are under their knobs).

    Returns:
        The rows, each with `environment` (member name) and `environment_task` (its task) added.
    """
    if gen_knobs:
        raise ValueError(f"mixture: unknown generation knob(s) {sorted(gen_knobs)}; the members' go under their knobs")
    members = parse_members((env_knobs or {}).get("members"))
    counts = split_counts(n, members)
    base = rng.getrandbits(64)
    taken = {k for k in exclude}  # task-prefixed keys: the other split's, then each member's as it is made
    rows_by_member: dict[str, list[dict]] = {}
    for m in members:
        prefix = _task_key(m.task, "")
        member_exclude = {k[len(prefix) :] for k in taken if k.startswith(prefix)}
        member_rng = random.Random(f"mixture:{base}:{m.name}")  # str seeds hash with sha512: stable across runs
        try:
            rows = TASKS[m.task].make_rows(
                counts[m.name], member_rng, split, env_knobs=m.env, exclude=member_exclude, **m.gen
            )
        except ValueError as e:
            raise ValueError(f"{WHERE}.{m.name}: {e}") from None
        rows_by_member[m.name] = rows
        taken |= {_task_key(m.task, TASKS[m.task].instance_key(r)) for r in rows}
    _check_columns(rows_by_member)
    out = [{**r, "environment": m.name, "environment_task": m.task} for m in members for r in rows_by_member[m.name]]
    random.Random(f"mixture:{base}:interleave").shuffle(out)
    return out


def correct(row: dict, text: str, env) -> bool:
    """Solved by the row's member task's own rule (`<task>.correct`)."""
    task = row.get("environment_task")
    if task not in TASKS:
        raise ValueError(f"mixture row {row.get('id')!r}: 'environment_task' must name a member's task, got {task!r}")
    return bool(TASKS[task].correct(row, text, env))


def ceiling(rows: list[dict], env_knobs: Optional[dict] = None, gen_knobs: Optional[dict] = None) -> dict:
    """Each member's ceiling on its own rows, for the members whose task has one (gridworld's).

    Args:
        rows: the mixture's (test) rows.
        env_knobs: {"members": ...}.
        gen_knobs: unused (the members' are under their knobs).

    Returns:
        member name -> its task's `ceiling(member rows, member runtime knobs, member generation knobs)`.
    """
    out = {}
    for m in parse_members((env_knobs or {}).get("members")):
        mine = [r for r in rows if r.get("environment") == m.name]
        if mine and hasattr(TASKS[m.task], "ceiling"):
            out[m.name] = TASKS[m.task].ceiling(mine, m.env, m.gen)
    return out


# ----------------------------------------------------------------------------------- episodes
def _tool_signatures(factory: Callable) -> dict[str, str]:
    tools = environment_tools(factory())
    return {name: f"{inspect.signature(fn)} {inspect.getdoc(fn)}" for name, fn in tools.items()}


def member_factories(members, fmt: str) -> dict[str, Callable]:
    """One environment factory per member (its task's class with the member's runtime knobs), as TRL's
    `GRPOTrainer(environment_factory={name: factory})` takes them; tools checked against the call format.

    Args:
        members: `environments.mixture.members`.
        fmt: agent.format, "inline" or "chat".

    Returns:
        member name -> factory. ValueError when a member has more than one tool in the inline format, or when
        members' tools differ in the chat format.
    """
    factories = {m.name: functools.partial(ENVIRONMENTS[m.task], **m.env) for m in parse_members(members)}
    signatures = {name: _tool_signatures(f) for name, f in factories.items()}
    for name, sig in signatures.items():
        if fmt == "inline" and len(sig) != 1:
            raise ValueError(
                f"{WHERE}.{name}: agent.format 'inline' (<<arg=) drives one tool per episode; this member has "
                f"{len(sig)} ({', '.join(sig) or 'none'})"
            )
    if fmt == "chat" and len({tuple(sorted(s.items())) for s in signatures.values()}) > 1:
        shown = "; ".join(f"{name}: {', '.join(sig)}" for name, sig in signatures.items())
        raise ValueError(
            f"{WHERE}: agent.format 'chat' renders one tool description for every prompt in the project's loop, "
            f"so every member must have the same tools; these differ ({shown}): use agent.format 'inline'"
        )
    return factories


def member_factory(factories: dict[str, Callable], row: Optional[dict]) -> Callable:
    """The factory of the row's member (its `environment`); ValueError naming the row and the members otherwise.

    Args:
        factories: member_factories' result.
        row: one mixture row.

    Returns:
        The factory that makes the row's episode.
    """
    name = (row or {}).get("environment")
    if name not in factories:
        rid = (row or {}).get("id")
        raise ValueError(
            f"mixture row {rid!r}: 'environment' must name a member ({', '.join(factories)}), got {name!r}"
        )
    return factories[name]
