"""Gymnasium's discrete environments (FrozenLake, CliffWalking, Taxi, any env with a transition table) as episodes.

`GymnasiumEnv(env_id, env_kwargs, max_steps, look)` wraps `gymnasium.make(env_id, **env_kwargs)` in TRL 1.16's
`environment_factory` shape. The env must have Discrete observation and action spaces and a transition table
`env.unwrapped.P` ({state: {action: [(probability, next state, reward, terminated), ...]}}); anything else is
refused when the class is built (the stage's start), naming `environments.gymnasium.env_id`. Gymnasium does the
stepping, seeding and time limit (`max_episode_steps=max_steps`); this module only turns states into text:

- `reset(**row)` makes the row's env (its own `desc` map for FrozenLake random maps) and calls
  `env.reset(seed=row["seed"])`: the slips of an episode depend on the seed and the actions only.
- the one tool `act(action)` takes an action's name (FrozenLake: left down right up; CliffWalking: up right down
  left; Taxi: south north east west pickup dropoff; other envs: the action's number, which every env accepts too)
  and answers the new state in a few tokens: FrozenLake and CliffWalking `row column` (`1 2`), Taxi
  `row column passenger destination` (`3 1 Y G`, passenger `T` in the taxi), other envs `state 5`; then what
  happened: `slip` (the env took a less likely transition than the action's most likely one), `hole`, `cliff`,
  `illegal` (Taxi's -10), `goal`, `end` (another terminal state), `timeout` (max_steps used).
- with `look: true` (FrozenLake) `act("look")` stays put and answers the position and the cells up, down, left and
  right (`1 2 : F H # G`, `#` past the edge) without stepping the env (no step used, no slip drawn). With
  `show_map: false` the prompt gives only the map's size, S and G: the holes are found by looking.
- `get_reward()` is the episode's return (the sum of the env's rewards); "solved" (`correct`) is the env's own
  verdict: the episode terminated on a goal transition, one whose reward is the best any terminal transition of P
  pays (FrozenLake's goal 1 beats a hole's 0; CliffWalking's and Taxi's only terminal transitions are the goal's).

The teacher solves the MDP from P by finite-horizon value iteration (`value_iteration`: the expected return with k
steps left, the horizon max_steps, discounted by TEACHER_GAMMA so that it takes the shortest of equal plans) and acts
in the seeded env, so slips and the re-planning after them are in the demonstrations (`<<right=0 1>> <<down=0 2
slip>> ... #### goal`). `ceiling` gives the held-out rows' expected success of that teacher and of the best policy
(value iteration on the goal's indicator) from their starts.

Rows carry `env_id`, `seed`, `start` (checked on reset: rows made with other knobs are refused) and, with
`map_size` > 0, `desc`: a random FrozenLake map per row (gymnasium's `generate_random_map`, seeded by the row's seed).
An instance (`instance_key`) is the map, the start and the seed: held-out rows are held-out episodes; a 4x4 map can
recur (few distinct maps are likely), with other slips.
"""

from __future__ import annotations

import json
import random
import zlib
from typing import Iterable, NamedTuple, Optional

import numpy as np

from . import row_text

KNOBS = "environments.gymnasium"
GEN_DEFAULTS: dict = {
    "map_size": 0,  # FrozenLake: 0 = the env's own map (env_kwargs); 2-8 = a random size x size map per row
    "map_frozen": 0.8,  # random maps: the probability that a cell is frozen (generate_random_map's p, 0.1-1)
    "demo_explore": 0.0,  # share of the teacher's actions drawn at random among all actions (0-0.9)
    "demo_look": 0.0,  # share of the demonstrations that look before every action (0-1; needs look)
    "show_map": True,  # FrozenLake: the prompt shows the map; false: only its size, S and G (holes seen by looking)
    "train_solved_only": True,  # train rows only where the teacher's run reached the goal; false: every episode
}
ENV_DEFAULTS: dict = {
    "env_id": "FrozenLake-v1",  # any registered Gymnasium env with Discrete spaces and a transition table P
    "env_kwargs": {},  # passed to gymnasium.make, e.g. {map_name: 4x4, is_slippery: true, success_rate: 0.8}
    "max_steps": 12,  # actions per episode (gymnasium.make's max_episode_steps); later calls answer an error
    "look": False,  # FrozenLake: act("look") answers the position and the 4 cells around without stepping
}
SPLITS = ("train", "test")
# the names of the known toy-text envs' actions, by the unwrapped env's class (the index is the action)
ACTION_NAMES = {
    "FrozenLakeEnv": ("left", "down", "right", "up"),
    "CliffWalkingEnv": ("up", "right", "down", "left"),
    "TaxiEnv": ("south", "north", "east", "west", "pickup", "dropoff"),
}
RESERVED_KWARGS = ("render_mode", "max_episode_steps")  # set by the adapter, not by env_kwargs
TAXI_STOPS = "RGYB"  # Taxi's four locations, in the order its state encodes them; "T": the passenger is in the taxi
LOOK_ORDER = ((-1, 0), (1, 0), (0, -1), (0, 1))  # up, down, left, right: the cells a look lists
OUTSIDE = "#"
MAP_CELLS = "SFHG"
HIDDEN_MAP_PROMPT = "lake with holes you cannot see"  # show_map: false (the prompt has no map to read a row from)
MAX_ACTION_CHARS = 20  # longer tool arguments are refused before any string work
MAX_ATTEMPTS_PER_ROW = 200
# the teacher discounts a little: among plans of equal return (FrozenLake's goal in 6 steps or in 12) it takes the
# shortest, instead of idling against a wall while steps are left
TEACHER_GAMMA = 0.99
TIE = 1e-9  # action values this close are equal: the lowest action index wins (a stable teacher)


# ----------------------------------------------------------------------------------- value iteration
class Table(NamedTuple):
    """A transition table P as flat arrays, one entry per (state, action, outcome)."""

    n_states: int
    n_actions: int
    state: np.ndarray
    action: np.ndarray
    prob: np.ndarray
    next_state: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray


def transition_table(P: dict, n_states: int, n_actions: int) -> Table:
    """Gymnasium's `env.unwrapped.P` ({s: {a: [(p, s', r, terminated), ...]}}) as flat arrays.

    Args:
        P: the transition table.
        n_states: the observation space's size.
        n_actions: the action space's size.

    Returns:
        The Table; a state or action P lacks has no outcomes (its value is 0).
    """
    rows = [(s, a, *t[:4]) for s, acts in P.items() for a, outcomes in acts.items() for t in outcomes]
    cols = list(zip(*rows)) if rows else [()] * 6
    return Table(
        n_states,
        n_actions,
        np.asarray(cols[0], dtype=np.int64),
        np.asarray(cols[1], dtype=np.int64),
        np.asarray(cols[2], dtype=np.float64),
        np.asarray(cols[3], dtype=np.int64),
        np.asarray(cols[4], dtype=np.float64),
        np.asarray(cols[5], dtype=bool),
    )


def goal_rewards(table: Table) -> np.ndarray:
    """1.0 on the goal's transitions (terminal, paying the best reward any terminal transition pays), else 0.0."""
    if not table.terminated.any():
        return np.zeros_like(table.reward)
    best = table.reward[table.terminated].max()
    return (table.terminated & (table.reward == best)).astype(np.float64)


def _q_values(table: Table, values: np.ndarray, rewards: np.ndarray, gamma: float) -> np.ndarray:
    """Q[s, a]: the expected reward of one step plus the (discounted) value of where it lands, 0 past a terminal."""
    gain = table.prob * (rewards + gamma * np.where(table.terminated, 0.0, values[table.next_state]))
    q = np.zeros(table.n_states * table.n_actions)
    np.add.at(q, table.state * table.n_actions + table.action, gain)
    return q.reshape(table.n_states, table.n_actions)


def value_iteration(
    table: Table, horizon: int, gamma: float = 1.0, rewards: Optional[np.ndarray] = None
) -> tuple[np.ndarray, np.ndarray]:
    """The best expected return with k steps left, for k = 0..horizon (an episode ends after `horizon` steps).

    Args:
        table: the MDP (`transition_table`).
        horizon: the most steps an episode has.
        gamma: the discount per step (1.0: the plain return the episode's reward adds up).
        rewards: a reward per transition instead of the env's (`goal_rewards`: the chance of reaching the goal).

    Returns:
        (values, actions): values[k, s] the best expected return from s with k steps left, actions[k, s] the action
        that reaches it (lowest index among equals; row 0 is -1: no step left).
    """
    rewards = table.reward if rewards is None else rewards
    values = np.zeros((horizon + 1, table.n_states))
    actions = np.full((horizon + 1, table.n_states), -1, dtype=np.int64)
    for k in range(1, horizon + 1):
        q = _q_values(table, values[k - 1], rewards, gamma)
        values[k] = q.max(axis=1)
        actions[k] = np.argmax(q >= values[k][:, None] - TIE, axis=1)
    return values, actions


def policy_value(table: Table, actions: np.ndarray, rewards: np.ndarray, explore: float = 0.0) -> np.ndarray:
    """The expected return of a teacher that takes `actions[k, s]` with k steps left, or with probability `explore`
    an action drawn uniformly (as `demonstrate` draws them).

    Args:
        table: the MDP.
        actions: the teacher's actions per (steps left, state), as value_iteration returns them.
        rewards: the reward per transition to count (`goal_rewards`: its chance of reaching the goal).
        explore: the share of random actions.

    Returns:
        values[k, s]: the teacher's expected return from s with k steps left.
    """
    horizon = actions.shape[0] - 1
    values = np.zeros((horizon + 1, table.n_states))
    states = np.arange(table.n_states)
    for k in range(1, horizon + 1):
        q = _q_values(table, values[k - 1], rewards, 1.0)
        values[k] = (1 - explore) * q[states, actions[k]] + explore * q.mean(axis=1)
    return values


# ----------------------------------------------------------------------------------- making the env
def _make(env_id: str, env_kwargs: dict, max_steps: int, desc: Optional[tuple[str, ...]] = None):
    """gymnasium.make with the adapter's settings, or ValueError naming the knob that is wrong."""
    import gymnasium

    try:
        gymnasium.spec(env_id)
    except gymnasium.error.Error as e:
        raise ValueError(
            f"{KNOBS}.env_id: {env_id!r} is not a registered Gymnasium environment ({e}); expected a discrete one "
            "with a transition table, e.g. FrozenLake-v1, CliffWalking-v1, Taxi-v4"
        ) from None
    kwargs = {**env_kwargs, **({"desc": list(desc)} if desc is not None else {})}
    try:
        env = gymnasium.make(env_id, max_episode_steps=max_steps, **kwargs)
    except Exception as e:  # noqa: BLE001 - a constructor's TypeError, a missing extra: all name the knobs
        raise ValueError(
            f"{KNOBS}: gymnasium.make({env_id!r}, **env_kwargs) failed with env_kwargs={env_kwargs!r}: "
            f"{type(e).__name__}: {e}"
        ) from None
    spaces = gymnasium.spaces
    unwrapped = env.unwrapped
    if (
        not isinstance(env.observation_space, spaces.Discrete)
        or not isinstance(env.action_space, spaces.Discrete)
        or not isinstance(getattr(unwrapped, "P", None), dict)
    ):
        env.close()
        raise ValueError(
            f"{KNOBS}.env_id: {env_id!r} has observation space {env.observation_space} and action space "
            f"{env.action_space}{'' if isinstance(getattr(unwrapped, 'P', None), dict) else ' and no table P'}; "
            "expected Discrete spaces and a transition table env.unwrapped.P (a toy-text env: FrozenLake-v1, "
            "CliffWalking-v1, Taxi-v4)"
        )
    return env


_PLANS: dict = {}  # (env_id, env_kwargs, max_steps, map) -> (Table, teacher): value iteration once per MDP
MAX_PLANS = 4096


def _plan(env, key: tuple) -> tuple[Table, np.ndarray]:
    """(Table, the teacher's actions per (steps left, state)) of the MDP `env` is, cached under `key`."""
    if key not in _PLANS:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        unwrapped = env.unwrapped
        table = transition_table(unwrapped.P, int(env.observation_space.n), int(env.action_space.n))
        _PLANS[key] = table, value_iteration(table, key[2], gamma=TEACHER_GAMMA)[1]
    return _PLANS[key]


def _map_lines(unwrapped) -> Optional[list[str]]:
    """A FrozenLake-style map (`desc`, one string per row), or None."""
    desc = getattr(unwrapped, "desc", None)
    if desc is None:
        return None
    return ["".join(c.decode() if isinstance(c, bytes) else str(c) for c in line) for line in desc]


# ----------------------------------------------------------------------------------- environment
class GymnasiumEnv:
    """One Gymnasium episode per `reset`; the policy acts with `act` and reads the new state.

    Public attributes read after an episode: `turns` (tool calls), `steps` (env steps), `failed_tries` (calls that
    slipped, hit a hole, cliff or illegal move, or were refused), `slips`, `looks`, `state`, `total` (the return),
    `done`, `solved` (ended on the goal) and `start` (the state reset gave).
    """

    def __init__(
        self,
        env_id: str = ENV_DEFAULTS["env_id"],
        env_kwargs: Optional[dict] = None,
        max_steps: int = ENV_DEFAULTS["max_steps"],
        look: bool = ENV_DEFAULTS["look"],
    ):
        if env_kwargs is not None and not isinstance(env_kwargs, dict):
            raise ValueError(f"{KNOBS}.env_kwargs: expected a mapping of gymnasium.make arguments, got {env_kwargs!r}")
        env_kwargs = dict(env_kwargs or {})
        if not isinstance(env_id, str) or not env_id:
            raise ValueError(f"{KNOBS}.env_id: expected a Gymnasium env id such as 'FrozenLake-v1', got {env_id!r}")
        reserved = sorted(set(env_kwargs) & set(RESERVED_KWARGS))
        if reserved:
            raise ValueError(f"{KNOBS}.env_kwargs: {reserved} are set by the adapter (max_steps sets the time limit)")
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or not 1 <= max_steps <= 1000:
            raise ValueError(f"{KNOBS}.max_steps: expected an integer in 1..1000, got {max_steps!r}")
        if not isinstance(look, bool):
            raise ValueError(f"{KNOBS}.look: expected true or false, got {look!r}")
        self.env_id, self.env_kwargs, self.max_steps, self.look = env_id, env_kwargs, max_steps, look
        self._kwargs_json = json.dumps(env_kwargs, sort_keys=True, default=repr)  # the plans' cache key
        self._env = None
        self._load(None)  # the env's own map; a row's map replaces it in reset
        self.family = type(self._env.unwrapped).__name__
        n_actions = int(self._env.action_space.n)
        names = ACTION_NAMES.get(self.family, ())
        self.action_names = names if len(names) == n_actions else tuple(str(a) for a in range(n_actions))
        if look and self.family != "FrozenLakeEnv":
            raise ValueError(f"{KNOBS}.look: needs a FrozenLake map to look at; {env_id} is a {self.family}")
        self._clear()

    def _clear(self) -> None:
        self.state: Optional[int] = None
        self.start: Optional[int] = None
        self.turns = self.steps = self.failed_tries = self.slips = self.looks = 0
        self.total = 0.0
        self.done = self.solved = False

    def _load(self, desc: Optional[tuple[str, ...]]) -> None:
        """Make the env of a map (None: the env's own) and its plan: the table, the teacher, the goal's reward."""
        if self._env is not None:
            self._env.close()
        self._env = _make(self.env_id, self.env_kwargs, self.max_steps, desc)
        self._desc = desc
        self.table, self._teacher = _plan(self._env, (self.env_id, self._kwargs_json, self.max_steps, desc))
        goal = goal_rewards(self.table)
        self.goal_reward = float(self.table.reward[goal > 0][0]) if goal.any() else None

    @property
    def stochastic(self) -> bool:
        """Whether a step can end in more than one state (FrozenLake's slips): only then does the seed change the
        episode beyond its start."""
        return bool((self.table.prob < 1.0).any())

    def _teacher_action(self) -> int:
        """The value-iteration teacher's action from the current state with the steps that are left."""
        return int(self._teacher[self.max_steps - self.steps, self.state])

    def _map(self) -> Optional[list[str]]:
        """The current map (FrozenLake: `desc`), or None for envs without one."""
        return _map_lines(self._env.unwrapped)

    def reset(self, **row) -> Optional[str]:
        seed, desc = _instance(row, self)
        if desc != self._desc:
            self._load(desc)
        self._clear()
        observation, _ = self._env.reset(seed=seed)
        self.state = self.start = int(observation)
        if "start" in row and row["start"] != self.start:
            raise ValueError(
                f"{_where(row)}: 'start' is {row['start']!r} but {self.env_id} with env_kwargs {self.env_kwargs} "
                f"resets to {self.start} with seed {seed}: the rows were made with other {KNOBS} knobs"
            )
        return None  # the prompt already shows the start

    def act(self, action: str) -> str:
        """Take one action in the environment.

        Args:
            action: the action's name (FrozenLake: left, down, right, up, or look where allowed; CliffWalking: up,
                right, down, left; Taxi: south, north, east, west, pickup, dropoff) or its number.

        Returns:
            The new state and what happened, e.g. "1 2", "1 2 slip", "2 1 hole", "3 3 goal" (row and column);
            Taxi "3 1 Y G" (row, column, passenger or T in the taxi, destination); other envs "state 5".
        """
        self.turns += 1
        refused = self._refusal(action)
        if refused:
            self.failed_tries += 1
            return refused
        word = action.strip().lower()
        if self.look and word == "look":  # no step, no slip drawn
            self.looks += 1
            return self._view(self.state) + self._around()
        index = self.action_names.index(word) if word in self.action_names else int(word)
        expected = self._most_likely_next(index)
        observation, reward, terminated, truncated, _ = self._env.step(index)
        self.state, self.steps, self.total = int(observation), self.steps + 1, self.total + float(reward)
        events = []
        if expected is not None and self.state != expected:
            events.append("slip")
        goal = terminated and self.goal_reward is not None and float(reward) == self.goal_reward
        events += self._events(float(reward), terminated, goal)
        if truncated and not terminated:
            events.append("timeout")
        self.done = terminated or truncated
        self.solved = goal
        self.slips += "slip" in events
        self.failed_tries += bool(set(events) - {"goal", "timeout"})
        return " ".join([self._view(self.state), *events])

    def _refusal(self, action) -> Optional[str]:
        """An error answer for a call that cannot step, or None."""
        if self.state is None:
            return "error: no episode, call reset first"
        if self.done:
            return "error: episode over"
        if not isinstance(action, str) or len(action) > MAX_ACTION_CHARS:
            return f"error: action must be a name of at most {MAX_ACTION_CHARS} characters"
        word = action.strip().lower()
        if word in self.action_names or (self.look and word == "look"):
            return None
        if word.isdigit() and int(word) < len(self.action_names):
            return None
        return "error: use " + " ".join(self.action_names) + (" look" if self.look else "")

    def _most_likely_next(self, action: int) -> Optional[int]:
        """The next state of the action's one most likely transition (None when the likeliest outcomes tie: then no
        outcome is a slip)."""
        outcomes = (self.table.state == self.state) & (self.table.action == action)
        if not outcomes.any():
            return None
        likeliest = outcomes & (self.table.prob >= self.table.prob[outcomes].max() - TIE)
        return int(self.table.next_state[likeliest][0]) if likeliest.sum() == 1 else None

    def _events(self, reward: float, terminated: bool, goal: bool) -> list[str]:
        """The words for what a step did besides moving: the env family's own events."""
        if goal:
            return ["goal"]
        if self.family == "CliffWalkingEnv" and reward <= -100:
            return ["cliff"]
        if self.family == "TaxiEnv" and reward <= -10:
            return ["illegal"]
        if terminated:
            return ["hole" if self.family == "FrozenLakeEnv" else "end"]
        return []

    def _view(self, state: int) -> str:
        """A state as the policy reads it: a grid position, Taxi's position and passenger, else its number."""
        unwrapped = self._env.unwrapped
        if self.family == "FrozenLakeEnv":
            return "{} {}".format(*divmod(state, unwrapped.ncol))
        if self.family == "CliffWalkingEnv":
            return "{} {}".format(*divmod(state, unwrapped.shape[1]))
        if self.family == "TaxiEnv":
            r, c, passenger, destination = unwrapped.decode(state)
            where = "T" if passenger == len(TAXI_STOPS) else TAXI_STOPS[passenger]
            return f"{r} {c} {where} {TAXI_STOPS[destination]}"
        return f"state {state}"

    def _around(self) -> str:
        """' : ' and the map's cells up, down, left and right of the position ('#' past the edge)."""
        grid = self._map()
        r, c = divmod(self.state, len(grid[0]))
        cells = [
            grid[r + dr][c + dc] if 0 <= r + dr < len(grid) and 0 <= c + dc < len(grid[0]) else OUTSIDE
            for dr, dc in LOOK_ORDER
        ]
        return " : " + " ".join(cells)

    def get_reward(self) -> float:
        return float(self.total)


def correct(row: dict, text: str, env: GymnasiumEnv) -> bool:
    """Solved: the episode's env terminated on the goal (`text` is not read: the env saw every action)."""
    if not isinstance(env, GymnasiumEnv):
        raise ValueError(f"gymnasium: correct() needs the episode's GymnasiumEnv instance, got {type(env).__name__}")
    return env.solved


# ----------------------------------------------------------------------------------- rows
def _where(row: dict) -> str:
    return f"gymnasium row {row.get('id')!r}" if "id" in row else "gymnasium row"


def _from_text(text: str) -> Optional[dict]:
    """A FrozenLake row read back from its question (a served prompt): the map lines after the first line, the seed
    a checksum of the text (the same prompt slips the same way)."""
    lines = [line.replace(" ", "") for line in text.strip().splitlines()[1:]]
    if not lines or any(not line or set(line) - set(MAP_CELLS) for line in lines) or len({len(x) for x in lines}) != 1:
        return None
    return {"desc": lines, "seed": zlib.crc32(text.encode())}


def _instance(row: dict, env: GymnasiumEnv) -> tuple[int, Optional[tuple[str, ...]]]:
    """(seed, the row's own map or None) of a row for `env`, or ValueError naming the row and the field."""
    where = _where(row)
    if "seed" not in row and env.family == "FrozenLakeEnv" and (parsed := _from_text(row_text(row) or "")):
        row = parsed
    if "env_id" in row and row["env_id"] != env.env_id:
        raise ValueError(f"{where}: made for env_id {row['env_id']!r}, but {KNOBS}.env_id is {env.env_id!r}")
    seed = row.get("seed")
    if "seed" not in row and HIDDEN_MAP_PROMPT in (row_text(row) or ""):
        raise ValueError(
            f"{where}: a FrozenLake prompt without its map ({KNOBS}.show_map: false) cannot be played from its text "
            "alone: pass the row's 'seed' and 'desc' (data/prepared/*.jsonl has them)"
        )
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"{where}: 'seed' must be a non-negative integer (env.reset(seed=...)), got {seed!r}")
    desc = row.get("desc")
    if desc is None:
        return seed, None
    if env.family != "FrozenLakeEnv":
        raise ValueError(f"{where}: 'desc' (a map) is for FrozenLake, but {KNOBS}.env_id is {env.env_id!r}")
    if (
        not isinstance(desc, (list, tuple))
        or not 2 <= len(desc) <= 16
        or not all(isinstance(line, str) for line in desc)
        or len({len(line) for line in desc}) != 1
        or any(ch not in MAP_CELLS for line in desc for ch in line)
        or sum(line.count("S") for line in desc) != 1
    ):
        raise ValueError(
            f"{where}: 'desc' must be 2-16 strings of equal length over '{MAP_CELLS}' with one S, got {desc!r:.200}"
        )
    return seed, tuple(desc)


def instance_key(row: dict) -> str:
    """The env, the map, the start and the seed: one episode's world and its draws (the seed decides the slips, so
    two rows on the same map with other seeds are other instances; make_rows keys a deterministic env's rows by
    world_key, as its seed draws nothing)."""
    return f"{row.get('env_id')}|{'/'.join(row.get('desc') or [])}|{row.get('start')}|{row.get('seed')}"


def world_key(key: str) -> str:
    """An instance_key without its seed: the episode of a deterministic env (CliffWalking, Taxi, FrozenLake without
    slips), where two seeds with the same map and start play the same episode."""
    return key.rsplit("|", 1)[0]


def question(env: GymnasiumEnv, show_map: bool = True) -> str:
    """The prompt of the episode `env` was just reset to: the map where there is one (FrozenLake with show_map
    false: only its size and where S and G are, so the holes are found by looking), and the start."""
    start = env._view(env.start)
    if env.family == "FrozenLakeEnv":
        grid = env._map()
        if not show_map:
            goal = next(r * len(grid[0]) + line.index("G") for r, line in enumerate(grid) if "G" in line)
            size = f"{len(grid)}x{len(grid[0])}"
            return f"Walk from S to G on a {size} {HIDDEN_MAP_PROMPT}. S: {start}. G: {env._view(goal)}."
        return "Walk from S to G. H is a hole.\n" + "\n".join(" ".join(line) for line in grid)
    if env.family == "CliffWalkingEnv":
        return f"Walk to the goal, row 3 column 11, along the cliff on row 3. Start: {start}"
    if env.family == "TaxiEnv":
        return f"Drive the passenger to the destination (row column passenger destination). Start: {start}"
    return f"Reach the goal. Actions: {' '.join(env.action_names)}. Start: {start}"


def demonstrate(row: dict, env: GymnasiumEnv, demo_explore: float = 0.0, demo_look: float = 0.0) -> str:
    """Run the value-iteration teacher through `env` from the row's reset: the annotated actions and the final line.

    Args:
        row: the episode's row (seed, and map where it has one).
        env: the environment to act in (reset here).
        demo_explore: the share of actions drawn at random among all actions, from a generator of the row's seed
            (not the env's: the same slips whatever this knob).
        demo_look: the chance (one draw per episode, its own generator) that the episode looks before every action.

    Returns:
        `<<name=answer>> ...` and `#### goal` or `#### fail` on a line of its own.
    """
    if demo_look > 0 and not env.look:
        raise ValueError(f"{KNOBS}.demo_look > 0 needs the look action: set {KNOBS}.look: true")
    env.reset(**row)
    seed = row["seed"]
    explore = random.Random(f"demo-explore-{seed}") if demo_explore > 0 else None
    looks = demo_look > 0 and random.Random(f"demo-look-{seed}").random() < demo_look
    calls = []
    while not env.done:
        if looks:
            calls.append(f"<<look={env.act('look')}>>")
        if explore is not None and explore.random() < demo_explore:
            name = env.action_names[explore.randrange(len(env.action_names))]
        else:
            name = env.action_names[env._teacher_action()]
        calls.append(f"<<{name}={env.act(name)}>>")
    return " ".join(calls) + ("\n#### goal" if env.solved else "\n#### fail")


def _gen_knobs(knobs: dict) -> dict:
    unknown = sorted(set(knobs) - set(GEN_DEFAULTS))
    if unknown:
        raise ValueError(f"{KNOBS}: unknown generation knob(s) {unknown}; known: {sorted(GEN_DEFAULTS)}")
    k = {**GEN_DEFAULTS, **knobs}
    size = k["map_size"]
    if not isinstance(size, int) or isinstance(size, bool) or not (size == 0 or 2 <= size <= 8):
        raise ValueError(f"{KNOBS}.map_size: expected 0 (the env's own map) or an integer in 2..8, got {size!r}")
    for name in ("show_map", "train_solved_only"):
        if not isinstance(k[name], bool):
            raise ValueError(f"{KNOBS}.{name}: expected true or false, got {k[name]!r}")
    for name, low, high in (("map_frozen", 0.1, 1.0), ("demo_explore", 0.0, 0.9), ("demo_look", 0.0, 1.0)):
        v = k[name]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
            raise ValueError(f"{KNOBS}.{name}: expected a number in [{low}, {high}], got {v!r}")
    return k


def make_rows(
    n: int,
    rng: random.Random,
    split: str,
    env_knobs: Optional[dict] = None,
    exclude: Iterable[str] = (),
    **gen_knobs,
) -> list[dict]:
    """`n` episodes with the teacher's demonstrations.

    Args:
        n: how many rows.
        rng: the only source drawn from (seeds, through them the maps): same state, same rows.
        split: "train" (with train_solved_only, the default: only seeds whose demonstration reached the goal) or
            "test" (any seed; the demonstration is the teacher's run, which may end "#### fail"). Without
            train_solved_only the train rows are drawn as the test rows are: the teacher's moves are the best
            policy's whatever the slips, and its failed runs show what a hole looks like.
        env_knobs: the GymnasiumEnv knobs (default ENV_DEFAULTS).
        exclude: instance_key()s not to generate.
        **gen_knobs: GEN_DEFAULTS' knobs.

    Returns:
        Rows with question, answer, ground_truth ("goal"), env_id, seed, start, desc (random maps), demo_steps,
        demo_slips and demo_return.
    """
    if split not in SPLITS:
        raise ValueError(f"gymnasium: split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"gymnasium: n must be a non-negative integer, got {n!r}")
    k = _gen_knobs(gen_knobs)
    env = GymnasiumEnv(**{**ENV_DEFAULTS, **(env_knobs or {})})
    if k["map_size"] and env.family != "FrozenLakeEnv":
        raise ValueError(f"{KNOBS}.map_size: random maps are FrozenLake's; {env.env_id} is a {env.family}")
    if not k["show_map"] and env.family != "FrozenLakeEnv":
        raise ValueError(f"{KNOBS}.show_map: only FrozenLake's prompt shows a map; {env.env_id} is a {env.family}")
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    seen = set(exclude) | {world_key(k) for k in exclude}  # either form: a deterministic env is keyed by its world
    rows: list[dict] = []
    attempts, max_attempts, repeats = 0, 1000 + MAX_ATTEMPTS_PER_ROW * n, 0
    while len(rows) < n:
        attempts += 1
        if attempts > max_attempts and repeats > attempts // 2:
            raise ValueError(
                f"{KNOBS}: only {len(rows)} distinct {split} episodes of {env.env_id} (env_kwargs={env.env_kwargs}) "
                f"exist beside the {len(set(exclude))} excluded ones, {n} asked for: it is deterministic, so an "
                "episode is its map and start whatever the seed; lower num_train/num_test, or use random maps "
                "(map_size) or a stochastic env"
            )
        if attempts > max_attempts:
            raise ValueError(
                f"{KNOBS}: only {len(rows)} of {n} {split} episodes found in {max_attempts} attempts with "
                f"env_id={env.env_id}, env_kwargs={env.env_kwargs}, max_steps={env.max_steps}: the teacher rarely "
                "reaches the goal; raise max_steps or make the env less slippery"
            )
        seed = rng.randrange(2**31)
        row: dict = {"env_id": env.env_id, "seed": seed}
        if k["map_size"]:
            row["desc"] = generate_random_map(size=k["map_size"], p=k["map_frozen"], seed=seed)
        answer = demonstrate(row, env, k["demo_explore"], k["demo_look"])
        row["start"] = env.start
        key = instance_key(row) if env.stochastic else world_key(instance_key(row))  # the seed draws nothing there
        repeats += key in seen
        if key in seen or (split == "train" and k["train_solved_only"] and not env.solved):
            continue  # a held-out episode, or a teacher that fell or ran out of steps (when only wins are kept)
        seen.add(key)
        rows.append(
            {
                "question": question(env, k["show_map"]),
                "answer": answer,
                "ground_truth": "goal",
                **row,
                "demo_steps": env.steps,
                "demo_slips": env.slips,
                "demo_return": round(env.total, 6),
            }
        )
    return rows


def ceiling(rows: list[dict], env_knobs: Optional[dict] = None, gen_knobs: Optional[dict] = None) -> dict:
    """How well policies can do on these rows (prepare's metrics, for the test split).

    Args:
        rows: the held-out rows.
        env_knobs: the GymnasiumEnv knobs they were made with.
        gen_knobs: the generation knobs (demo_explore: the teacher's random share).

    Returns:
        `demo_reached` (the share whose demonstration reached the goal: one draw of the slips, the rows' seeds),
        `demo_policy` (the teacher's expected success over the slips, exploring as demo_explore says) and
        `optimal` (the best policy's: value iteration on the goal's indicator), averaged over the rows.
    """
    env = GymnasiumEnv(**{**ENV_DEFAULTS, **(env_knobs or {})})
    explore = _gen_knobs(gen_knobs or {})["demo_explore"]
    n = len(rows) or 1
    demo = optimal = 0.0
    for row in rows:
        env.reset(**row)
        goal = goal_rewards(env.table)
        optimal += value_iteration(env.table, env.max_steps, rewards=goal)[0][env.max_steps, env.start]
        demo += policy_value(env.table, env._teacher, goal, explore)[env.max_steps, env.start]
    return {
        "demo_reached": round(sum(r["answer"].endswith("#### goal") for r in rows) / n, 4),
        "demo_policy": round(float(demo) / n, 4),
        "optimal": round(float(optimal) / n, 4),
    }
