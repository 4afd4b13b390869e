"""reasoning-gym tasks (github.com/open-thought/reasoning-gym) as a built-in environment: `reasoning_gym`.

reasoning-gym is a library of ~100 procedural generators (`chain_sum`, `basic_arithmetic`, `gcd`, `countdown`,
`number_sorting`, `leg_counting`, ...), each with its own config dataclass and its own answer checker. This module
configures them rather than re-implementing them; params `environments.reasoning_gym`:

- `task`: the dataset name (`reasoning_gym.create_dataset(task, ...)`);
- `config`: reasoning-gym's own config keys for that task, passed through to its config dataclass (`seed` and
  `size` are set here from the run's seed); checked when params are validated (`check_knobs`: an unknown key or a
  value the dataclass rejects names `environments.reasoning_gym.config.<key>`);
- `tool`: `calculator` (demonstrations of an arithmetic task whose entry states its `expression` call the
  calculator, `<<4 - 1 - 7=-4>>`, then write the answer) or `none` (demonstrations write the answer only);
- `tool_share` (default 1): the share of the demonstrations that could call the calculator and do; the rest write
  the answer only (one draw per instance from its own generator), as `data.calculator_share` does for the default,
  so that SFT sees both and GRPO learns when calling pays;
- `num_train`, `num_test`.

Rows: `make_rows` draws seeds from the run's `rng` and generates with reasoning-gym's own generator, so the same seed
and package version give byte-identical rows; the test split is drawn first and its questions are excluded from
training (`instance_key`). Each row carries what reasoning-gym's `score_answer(answer, entry)` needs: the entry
(question, answer, metadata) as JSON text in `rg_entry` (JSON text, not a nested column: metadata differs between
rows, which a datasets/Arrow column would pad with nulls), `rg_task`, `rg_config` (JSON) and
`reasoning_gym_version`; `ground_truth` is the entry's answer. The demonstration is `#### <answer>` (with the
calculator call first where there is one; a call is written only when the calculator's value is the dataset's
answer, so a demonstration never teaches copying a tool result that scores wrong).

The episode (`ReasoningGym`) offers one tool, the calculator (the loop needs a tool; with `tool: none` the
demonstrations just never call it) and keeps the entry it was reset with. "Solved" is `correct`: the completion's
last `#### ...` line, scored by reasoning-gym's own `score_answer` for the row's task and config, at 1.0 or more.
The raw score (partial credit, e.g. 0.5 for `-4.` against `-4`) is `score(row, text)`, kept on the episode as
`last_score` after `correct`. The class has no `get_reward`: TRL calls it with no argument, before any answer is
known to the episode, and would add it as an extra reward column in its own loop only (the inline loop would then
train on another reward than the chat one).

DVC lineage: the rows depend on reasoning-gym's version, which DVC does not see. The version is pinned twice: in
requirements.txt (what `make setup` installs) and here as `PINNED_VERSION`, which every stage's code depends on
(dvc.yaml lists src/agentrl/envs in the deps of every stage). Changing the package therefore means changing this
file, which re-runs prepare and everything after it. A different installed version is refused, naming both, when
params are validated, when rows are generated, and when a row is scored (`correct` checks the row's
`reasoning_gym_version`): stale rows are never scored silently by another version's checker. Note that
`reasoning_gym.__version__` is not the package's version (it says 0.1.19 in 0.1.25): the installed distribution's
metadata is read instead. prepare records the version with its measurements too (diagnostics/prepare.json).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.metadata
import json
import logging
import random
from typing import Any, Iterable, Iterator, Optional

from .calculator import ToolError, calculator
from .contract import knob_type_error

PINNED_VERSION = "0.1.25"  # = requirements.txt's reasoning-gym pin (see the module docstring: lineage)
GEN_DEFAULTS: dict = {
    "task": "chain_sum",  # a reasoning-gym dataset name
    "config": {},  # reasoning-gym's own config keys for the task (its config dataclass's fields)
    "tool": "calculator",  # calculator: demonstrations call it where the entry states an expression; none: never
    "tool_share": 1.0,  # share of those demonstrations that call it; the rest write the answer only (GRPO learns when)
}
ENV_DEFAULTS: dict = {}  # the episode has no runtime knobs
TOOLS = ("calculator", "none")
SPLITS = ("train", "test")
RESERVED_CONFIG = ("seed", "size")  # set by make_rows from the run's seed, never by params
PARAMS = "environments.reasoning_gym"
MIN_CHUNK = 64  # entries generated per reasoning-gym dataset object (one seed) at least
MAX_DRAWS_PER_ROW = 20  # draws allowed per requested row before a too-small instance space is an error
log = logging.getLogger("agentrl.envs.reasoning_gym")


# ----------------------------------------------------------------------------------- the package and its version
@functools.lru_cache(maxsize=1)
def installed_version() -> str:
    """The installed reasoning-gym distribution's version (its metadata; `reasoning_gym.__version__` is stale)."""
    return importlib.metadata.version("reasoning-gym")


def check_version(where: str = PARAMS) -> str:
    """The installed version, or ValueError when it is not PINNED_VERSION.

    Args:
        where: what needs the package (named in the error).

    Returns:
        The installed version.
    """
    version = installed_version()
    if version != PINNED_VERSION:
        raise ValueError(
            f"{where}: reasoning-gym {version} is installed, this code is pinned to {PINNED_VERSION} (rows, demos "
            "and scores depend on it): install requirements.txt's pin, or change PINNED_VERSION and the pin together"
        )
    return version


def _datasets() -> dict:
    """reasoning-gym's registry {task name: (dataset class, config dataclass)}, imported on first use (1-2 s)."""
    import reasoning_gym  # noqa: F401 - importing registers every dataset
    from reasoning_gym.factory import DATASETS

    return DATASETS


def config_fields(task: str) -> dict[str, dataclasses.Field]:
    """The config keys params may set for `task`: its config dataclass's fields but seed and size.

    Args:
        task: a reasoning-gym dataset name (checked).

    Returns:
        {name: dataclass field}.
    """
    check_task(task)
    config_cls = _datasets()[task][1]
    return {f.name: f for f in dataclasses.fields(config_cls) if f.name not in RESERVED_CONFIG}


# ----------------------------------------------------------------------------------- knobs
def check_task(task: Any) -> None:
    """ValueError naming `environments.reasoning_gym.task` unless `task` is a reasoning-gym dataset name.

    Args:
        task: the knob's value.
    """
    known = sorted(_datasets())
    if task in known:
        return
    close = difflib.get_close_matches(str(task), known, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise ValueError(
        f"{PARAMS}.task: unknown reasoning-gym task {task!r}{hint}; known (reasoning-gym {installed_version()}): "
        + ", ".join(known)
    )


def _validate(task: str, config: dict) -> Optional[str]:
    """reasoning-gym's own verdict on `config` for `task`: None if its config dataclass accepts it, else why not."""
    config_cls = _datasets()[task][1]
    try:
        validate = getattr(config_cls(**config), "validate", None)  # a few configs have none (power_function)
        if callable(validate):
            validate()
    except (AssertionError, ValueError, TypeError) as e:  # reasoning-gym validates with assert
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return None


def check_config(task: str, config: Any) -> None:
    """ValueError naming `environments.reasoning_gym.config.<key>` and the known keys unless reasoning-gym's config
    dataclass for `task` accepts `config` (names, the types of plain defaults, then its own validate()).

    Args:
        task: a reasoning-gym dataset name.
        config: the `config` knob.
    """
    where = f"{PARAMS}.config"
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a mapping of {task}'s config keys, got {config!r}")
    fields = config_fields(task)
    known = ", ".join(sorted(fields))
    for key, value in config.items():
        if key in RESERVED_CONFIG:
            raise ValueError(f"{where}.{key}: set from the run's seed and num_train/num_test, not here; known: {known}")
        if key not in fields:
            raise ValueError(f"{where}.{key}: not a config key of reasoning-gym's {task}; known: {known}")
        default = fields[key].default  # a field with no plain default: reasoning-gym's own validate() decides
        problem = None if default is dataclasses.MISSING else knob_type_error(default, value)
        if problem:
            raise ValueError(f"{where}.{key}: {problem}")
    problem = _validate(task, config)
    if problem is None:
        return
    # name the key(s) at fault: those rejected alone (with the other keys at their defaults), else all given
    if not config:
        raise ValueError(f"{where}: reasoning-gym's {task} rejects its default config ({problem}); known keys: {known}")
    alone = [k for k in config if _validate(task, {k: config[k]}) is not None]
    keys = alone or list(config)
    raise ValueError(
        f"{where}.{'/'.join(keys)}: {config!r} rejected by reasoning-gym's {task} config ({problem}); known: {known}"
    )


def check_knobs(knobs: dict) -> None:
    """The params-time check (config.py calls it for `environments.reasoning_gym`): the installed version, the task,
    the tool and reasoning-gym's verdict on the config. ValueError naming the knob and what was expected.

    Args:
        knobs: params `environments.reasoning_gym` as written (defaults fill what it leaves out).
    """
    _gen_knobs({k: v for k, v in knobs.items() if k in GEN_DEFAULTS})


def _gen_knobs(knobs: dict) -> dict:
    unknown = sorted(set(knobs) - set(GEN_DEFAULTS))
    if unknown:
        raise ValueError(f"{PARAMS}: unknown generation knob(s) {unknown}; known: {sorted(GEN_DEFAULTS)}")
    k = {**GEN_DEFAULTS, **knobs}
    check_version()
    check_task(k["task"])
    if k["tool"] not in TOOLS:
        raise ValueError(f"{PARAMS}.tool: must be one of {', '.join(TOOLS)}, got {k['tool']!r}")
    share = k["tool_share"]
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
        raise ValueError(f"{PARAMS}.tool_share: a number from 0 to 1, got {share!r}")
    check_config(k["task"], k["config"])
    return k


# ----------------------------------------------------------------------------------- rows
def _field(row: dict, name: str) -> Any:
    where = f"reasoning_gym row {row.get('id')!r}" if "id" in row else "reasoning_gym row"
    if name not in row:
        raise ValueError(f"{where}: no '{name}' field (rows come from reasoning_gym_tasks.make_rows via prepare)")
    value = row[name]
    if name in ("rg_entry", "rg_config"):
        try:
            value = json.loads(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: '{name}' must be JSON text of an object, got {str(value)[:80]!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: '{name}' must be JSON text of an object, got {str(row[name])[:80]!r}")
    if name == "rg_entry" and not {"question", "answer", "metadata"} <= set(value):
        raise ValueError(f"{where}: 'rg_entry' must hold question, answer and metadata, got keys {sorted(value)}")
    return value


def _key(question: str) -> str:
    return " ".join(question.split())


def instance_key(row: dict) -> str:
    """The instance a row poses: its task and question, whitespace-normalised (the question determines it).

    Args:
        row: a generated or prepared row (its `rg_entry` and `rg_task`).

    Returns:
        The key.
    """
    return f"{_field(row, 'rg_task')}: {_key(_field(row, 'rg_entry')['question'])}"


def _calculated(expression: str) -> Optional[str]:
    """What the calculator tool answers for `expression`, or None if it refuses it (no call is written then)."""
    if any(ch in expression for ch in "<>=\n"):  # would not survive the inline annotation <<expr=result>>
        return None
    try:
        return calculator(expression)
    except ToolError:
        return None


def demonstration(entry: dict, tool: str, calls: bool = True) -> str:
    """The SFT answer for an entry: `#### <answer>`, after a calculator call when `tool` is calculator, `calls` is
    true, the entry's metadata states an `expression` and the calculator's value is the dataset's answer.

    Args:
        entry: a reasoning-gym entry (question, answer, metadata).
        tool: "calculator" or "none".
        calls: false writes the answer only even where the calculator could be called (tool_share's draw).

    Returns:
        The demonstration text.
    """
    answer = entry["answer"]
    expression = entry["metadata"].get("expression")
    if tool == "calculator" and calls and isinstance(expression, str) and _calculated(expression) == answer:
        return f"<<{expression}={answer}>>\n#### {answer}"
    return f"#### {answer}"


def _stored_entry(entry: dict, task: str, index: int) -> str:
    """The entry as JSON text, or ValueError naming the task and index when it cannot be stored in a row."""
    answer = entry.get("answer")
    if not isinstance(answer, str) or not answer.strip() or "\n" in answer:
        raise ValueError(
            f"{PARAMS}: reasoning-gym's {task} entry {index} has answer {answer!r}: a row's answer must be one "
            "non-empty line (the demonstration's final `#### <answer>` line); this task is not supported"
        )
    try:
        return json.dumps({k: entry[k] for k in ("question", "answer", "metadata")}, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"{PARAMS}: reasoning-gym's {task} entry {index} is not JSON-serialisable ({e})") from None


def make_rows(
    n: int,
    rng: random.Random,
    split: str,
    env_knobs: Optional[dict] = None,
    exclude: Iterable[str] = (),
    **gen_knobs,
) -> list[dict]:
    """`n` distinct reasoning-gym entries of the task as rows with demonstrations (module docstring).

    Args:
        n: how many rows.
        rng: the only source of randomness: reasoning-gym seeds are drawn from it (same seed, same rows).
        split: "train" or "test" (the demonstrations are the same for both).
        env_knobs: the episode's knobs (it has none: must be empty).
        exclude: instance_key()s not to generate (the other split's).
        **gen_knobs: task, config, tool, tool_share (GEN_DEFAULTS).

    Returns:
        Rows: question, answer (the demonstration), ground_truth, rg_task, rg_config, rg_entry, reasoning_gym_version.
    """
    if split not in SPLITS:
        raise ValueError(f"reasoning_gym: split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"reasoning_gym: n must be a non-negative integer, got {n!r}")
    if env_knobs:
        raise ValueError(f"{PARAMS}: the episode has no runtime knobs, got {sorted(env_knobs)}")
    k = _gen_knobs(gen_knobs)
    if n == 0:
        return []
    task, config, version = k["task"], dict(k["config"]), installed_version()
    stored_config = json.dumps(config, sort_keys=True)
    score_answer = _scorer(task, stored_config)
    seen, rows, max_draws = set(exclude), [], MAX_DRAWS_PER_ROW * n + 1000
    for draws, (seed, index, entry) in enumerate(_draws(task, config, rng, max(n, MIN_CHUNK)), 1):
        if len(rows) == n:
            break
        if draws > max_draws:
            raise ValueError(
                f"{PARAMS}: only {len(rows)} of {n} distinct {task} instances in {max_draws} draws with config "
                f"{config}: widen the config (more terms, digits or a larger value range) or lower num_train/num_test"
            )
        row = {"rg_task": task, "rg_entry": _stored_entry(entry, task, index)}
        if instance_key(row) in seen:
            continue
        seen.add(instance_key(row))
        stored = json.loads(row["rg_entry"])
        if score_answer(stored["answer"], stored) < 1.0:  # the stored entry must be enough to score it
            raise ValueError(
                f"{PARAMS}: reasoning-gym's {task} scores its own answer below 1 after storing the entry as JSON "
                f"(entry {index} of seed {seed}); this task is not supported"
            )
        # tool_share's draw: its own generator per instance, so rows (and the other demonstrations) stay as they are
        calls = k["tool_share"] >= 1.0 or random.Random(f"tool-share-{instance_key(row)}").random() < k["tool_share"]
        demo = demonstration(entry, k["tool"], calls)
        rows.append({"question": entry["question"], "answer": demo, "ground_truth": entry["answer"], **row})
        rows[-1].update(rg_config=stored_config, reasoning_gym_version=version)
    return rows


def _draws(task: str, config: dict, rng: random.Random, chunk: int) -> Iterator[tuple[int, int, dict]]:
    """(seed, index, entry) without end: `chunk` entries of one reasoning-gym dataset object per seed drawn from
    `rng` (reasoning-gym derives entry i of a seed from a Random(seed + i) of its own)."""
    while True:
        seed = rng.randrange(2**32)
        dataset = _create(task, config, seed, chunk)
        for index in range(chunk):
            yield seed, index, _generate(dataset, task, seed, index)


def _create(task: str, config: dict, seed: int, size: int):
    """reasoning-gym's dataset object for one seed (ValueError naming the task and config if it refuses)."""
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"{PARAMS}: reasoning-gym's {task} refused config {config}: {e}") from None


def _generate(dataset, task: str, seed: int, index: int) -> dict:
    try:
        return dataset[index]
    except Exception as e:  # noqa: BLE001 - named and re-raised: a generator's failure stops prepare
        raise ValueError(f"{PARAMS}: reasoning-gym's {task} failed on entry {index} of seed {seed}: {e!r}") from e


# ----------------------------------------------------------------------------------- scoring
@functools.lru_cache(maxsize=32)
def _scorer(task: str, stored_config: str):
    """reasoning-gym's own score_answer for the task under the row's config (one dataset object per config)."""
    return _create(task, json.loads(stored_config), seed=0, size=1).score_answer


def final_answer(text: Any) -> Optional[str]:
    """The text of the completion's last `####` line, stripped (None without one: the project's answer format).

    Args:
        text: a completion.

    Returns:
        The answer text, or None.
    """
    if not isinstance(text, str):
        return None
    answers = [line[4:].strip() for line in text.splitlines() if line.startswith("####")]
    return answers[-1] if answers else None


def score(row: dict, text: str) -> float:
    """reasoning-gym's score of the completion's final answer for the row's entry (0.0 without a `####` line).

    Args:
        row: a row from make_rows (via prepare): rg_task, rg_config, rg_entry, reasoning_gym_version.
        text: the completion.

    Returns:
        The score in [0, 1]; partial credit below 1.
    """
    entry, task = _field(row, "rg_entry"), _field(row, "rg_task")
    stored_config = json.dumps(_field(row, "rg_config"), sort_keys=True)
    made_with = _field(row, "reasoning_gym_version")
    installed = check_version(f"reasoning_gym row {row.get('id')!r}")
    if made_with != installed:
        raise ValueError(
            f"reasoning_gym row {row.get('id')!r}: generated with reasoning-gym {made_with}, {installed} is installed: "
            "re-run prepare (dvc repro) so rows and checker are the same version"
        )
    answer = final_answer(text)
    if answer is None:
        return 0.0
    try:
        return float(_scorer(task, stored_config)(answer, entry))
    except Exception as e:  # noqa: BLE001 - the policy's junk answer is an unsolved episode, never a crash
        log.warning(
            "reasoning-gym %s could not score %r for row %r (%r): counted 0", task, answer[:40], row.get("id"), e
        )
        return 0.0


def correct(row: dict, text: str, env: Optional["ReasoningGym"]) -> bool:
    """Solved: reasoning-gym's score_answer gives the final `#### ...` answer 1.0 (or more). The score is kept on
    `env.last_score` (partial credit stays visible).

    Args:
        row: the row the episode was reset with.
        text: the completion.
        env: the episode (None: scored all the same).

    Returns:
        True when solved.
    """
    value = score(row, text)
    if env is not None:
        env.last_score = value
    return value >= 1.0


# ----------------------------------------------------------------------------------- environment
class ReasoningGym:
    """One reasoning-gym episode: `reset(**row)` keeps the row's entry (a served prompt without one still gets the
    calculator), the one tool is the calculator. Attributes read after an episode: `turns` (tool calls),
    `entry` (None without one) and `last_score` (set by `correct`; None before)."""

    def __init__(self):
        self.entry: Optional[dict] = None
        self.turns = 0
        self.last_score: Optional[float] = None

    def reset(self, **row) -> None:
        self.entry = _field(row, "rg_entry") if "rg_entry" in row else None
        self.turns = 0
        self.last_score = None
        return None  # the prompt states the question

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: numbers with + - * / and parentheses, e.g. "48/2" or "(3+4)*12".

        Returns:
            The value, e.g. "24".
        """
        self.turns += 1
        try:
            return calculator(expression)
        except ToolError as e:  # answered, not raised: TRL's loop would render a raise as "{'error': ...}"
            return f"error: {str(e)[:120]}"
