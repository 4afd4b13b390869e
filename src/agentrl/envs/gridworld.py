"""Gridworld (FrozenLake-like): walk from S to G on a small grid without falling into a hole O; moves can slip.

The environment has TRL 1.16's `environment_factory` shape: `GridWorld(**knobs)` makes one instance,
`reset(**row)` starts an episode from a dataset row (`grid`, `start`, `goal`, `seed`; other keys ignored),
and the one tool, `move(direction)`, answers where the agent is now in a few tokens: `1 2` (row, column,
0-based), `1 2 slip` (with probability `slip_prob` the move went to a random perpendicular direction instead),
`1 1 wall` (bumped the edge, position unchanged), `2 2 hole` (episode over, reward 0), `3 3 goal` (reward 1).
With `view: local` the answer goes on with what lies around the new position, up down left right, `#` past the
edge: `1 2 slip : . O # G` (the policy can see a hole next to it without finding its row and column in the grid).
With `look: true` the direction `look` is one more action: it stays put and answers the position and those four
cells, `1 2 : . O # G`, without using a move or drawing a slip; what it costs is a tool call.
Observations depend on every earlier action, and a slip must be read and re-planned from. Slips come from a
`random.Random(row["seed"])` made in `reset` (two draws per move, whatever the moves): same seed, same slips;
two instances never share state. `get_reward()` is 1.0 at the goal, else 0.0.

`make_rows` generates grids with a path from S to G avoiding holes (BFS, length >= min_path) and demonstrations
in the inline annotation syntax, `<<right=0 1>> <<down=1 1 slip>> ...`, made by running the env itself with a
BFS policy that re-plans from the observed position after every move (so slips in the demos show recovery).
With `demo_explore` > 0 the demonstrator explores: each move is, with that probability, one drawn at random among
the moves that stay on the grid and out of a hole (a weaker teacher that GRPO can improve on; drawn from a
generator of the row's seed, so the grids, seeds and slips are those of `demo_explore: 0`). With `demo_look` > 0
(needs `look: true`) that share of the demonstrations look before every move and the rest never look: the moves,
grids, seeds and slips are the same either way, only the looks are added.
"""

from __future__ import annotations

import random
import zlib
from collections import deque
from typing import Iterable, Optional

from . import refuse_beyond_capacity, row_text

GEN_DEFAULTS: dict = {
    "size": 4,  # the grid is size x size (2-8)
    "hole_prob": 0.2,  # each cell other than S and G is a hole with this probability (0-0.6)
    "min_path": 4,  # the shortest S->G path avoiding holes has at least this many moves
    "demo_explore": 0.0,  # share of the demonstrations' moves drawn at random among the safe ones (0-0.9)
    "demo_look": 0.0,  # share of the demonstrations (episodes) that look before every move (0-1; needs look)
}
ENV_DEFAULTS: dict = {
    "slip_prob": 0.2,  # a move goes to a random perpendicular direction instead, with this probability
    "max_moves": 12,  # moves per episode; later calls answer "error: no moves left"
    "view": "position",  # a move answers: position ("1 2 slip") | local (and the 4 cells around: "1 2 slip : . O # G")
    "look": False,  # move("look") stays and answers the position and the 4 cells around ("1 2 : . O # G")
}
VIEWS = ("position", "local")
VIEW_ORDER = ("up", "down", "left", "right")  # the order of the cells a local view lists
OUTSIDE = "#"  # a local view's cell beyond the edge
SPLITS = ("train", "test")
DIRECTIONS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
ALIASES = {"u": "up", "d": "down", "l": "left", "r": "right", **{d: d for d in DIRECTIONS}}
PERPENDICULAR = {"up": ("left", "right"), "down": ("left", "right"), "left": ("up", "down"), "right": ("up", "down")}
POLICY_ORDER = ("right", "down", "left", "up")  # the demo policy's tie-break among equally good moves
CELLS = ".SGO"  # free, start, goal, hole
MAX_SIZE = 16  # a row's grid may be at most this many rows and columns
MAX_DIRECTION_CHARS = 20  # longer tool arguments are refused before any string work
MAX_ATTEMPTS_PER_ROW = 200
MAX_STALL_ATTEMPTS = 10_000  # draws in a row with no new row: the knobs' grids are used up (default's longest: 54)
MAX_ENUMERATED = 5_000  # grid_capacity counts exactly up to this many (hole pattern, goal) pairs, else bounds


# ----------------------------------------------------------------------------------- rows
def _cell(value, field: str, where: str, rows: int, cols: int) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in value)
        or not (0 <= value[0] < rows and 0 <= value[1] < cols)
    ):
        raise ValueError(f"{where}: '{field}' must be [row, column] inside the {rows}x{cols} grid, got {value!r}")
    return value[0], value[1]


def _from_text(text: str) -> Optional[dict]:
    """A row's fields read back from the question (a served prompt): the grid lines after the first line, S and
    G where they stand, the seed a checksum of the text (the same prompt slips the same way)."""
    lines = [line.replace(" ", "") for line in text.strip().splitlines()[1:]]
    if not lines or any(not line or set(line) - set(CELLS) for line in lines) or len({len(x) for x in lines}) != 1:
        return None
    cells = {ch: [(r, c) for r, line in enumerate(lines) for c, x in enumerate(line) if x == ch] for ch in "SG"}
    if len(cells["S"]) != 1 or len(cells["G"]) != 1:
        return None
    return {"grid": lines, "start": list(cells["S"][0]), "goal": list(cells["G"][0]), "seed": zlib.crc32(text.encode())}


def _instance(row: dict) -> tuple[list[str], tuple[int, int], tuple[int, int], int]:
    """(grid, start, goal, seed) of a row, or ValueError naming the row and the field. A row without a grid but
    with this task's question (a served prompt) is read from the text."""
    where = f"gridworld row {row.get('id')!r}" if "id" in row else "gridworld row"
    if "grid" not in row and (parsed := _from_text(row_text(row) or "")):
        row = parsed
    grid = row.get("grid")
    if (
        not isinstance(grid, (list, tuple))
        or not 1 <= len(grid) <= MAX_SIZE
        or not all(isinstance(line, str) for line in grid)
        or len({len(line) for line in grid}) != 1
        or not 1 <= len(grid[0]) <= MAX_SIZE
        or any(ch not in CELLS for line in grid for ch in line)
    ):
        raise ValueError(
            f"{where}: 'grid' must be 1-{MAX_SIZE} strings of equal length (1-{MAX_SIZE}) over '{CELLS}', "
            f"got {grid!r:.200}"
        )
    grid = list(grid)
    rows, cols = len(grid), len(grid[0])
    start = _cell(row.get("start"), "start", where, rows, cols)
    goal = _cell(row.get("goal"), "goal", where, rows, cols)
    for field, pos, ch in (("start", start, "S"), ("goal", goal, "G")):
        found = [(r, c) for r, line in enumerate(grid) for c, x in enumerate(line) if x == ch]
        if found != [pos]:
            raise ValueError(f"{where}: '{field}' {list(pos)} must be the grid's one '{ch}' cell, found {found}")
    seed = row.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"{where}: 'seed' must be an integer, got {seed!r}")
    return grid, start, goal, seed


def _open(grid: list[str], r: int, c: int) -> bool:
    """On the grid and not a hole: a cell a move can land on without ending the episode."""
    return _inside(grid, r, c) and grid[r][c] != "O"


def _inside(grid: list[str], r: int, c: int) -> bool:
    return 0 <= r < len(grid) and 0 <= c < len(grid[0])


# ----------------------------------------------------------------------------------- environment
class GridWorld:
    """One gridworld episode per `reset`; the policy moves with `move` and reads where it landed.

    Public attributes read after an episode: `turns` (tool calls), `failed_tries` (calls that did not take the
    agent where it asked without falling: slips, walls, holes, errors), `slips`, `walls`, `looks`, `position`
    ([row, column]), `done` and `reached` (at the goal).
    """

    def __init__(
        self,
        slip_prob: float = ENV_DEFAULTS["slip_prob"],
        max_moves: int = ENV_DEFAULTS["max_moves"],
        view: str = ENV_DEFAULTS["view"],
        look: bool = ENV_DEFAULTS["look"],
    ):
        if not isinstance(slip_prob, (int, float)) or isinstance(slip_prob, bool) or not 0 <= slip_prob <= 1:
            raise ValueError(f"gridworld: slip_prob must be a number in [0, 1], got {slip_prob!r}")
        if not isinstance(max_moves, int) or isinstance(max_moves, bool) or not 1 <= max_moves <= 1000:
            raise ValueError(f"gridworld: max_moves must be an integer in 1..1000, got {max_moves!r}")
        if view not in VIEWS:
            raise ValueError(f"gridworld: view must be one of {', '.join(VIEWS)}, got {view!r}")
        if not isinstance(look, bool):
            raise ValueError(f"gridworld: look must be true or false, got {look!r}")
        self.slip_prob = float(slip_prob)
        self.max_moves = max_moves
        self.view = view
        self.look = look
        self._grid: Optional[list[str]] = None
        self._goal: Optional[tuple[int, int]] = None
        self._rng: Optional[random.Random] = None
        self._moves = 0
        self.position: Optional[list[int]] = None
        self.turns = 0
        self.failed_tries = 0
        self.slips = 0
        self.walls = 0
        self.looks = 0
        self.done = False
        self.reached = False

    def reset(self, **row) -> Optional[str]:
        grid, start, goal, seed = _instance(row)
        self._grid, self._goal = grid, goal
        self._rng = random.Random(seed)  # per episode: slips depend on the seed and the move count only
        self._moves = 0
        self.position = list(start)
        self.turns = 0
        self.failed_tries = 0
        self.slips = 0
        self.walls = 0
        self.looks = 0
        self.done = False
        self.reached = False
        return None  # the prompt already shows the grid

    def move(self, direction: str) -> str:
        """Move one cell on the grid.

        Args:
            direction: up, down, left or right (or look, where the environment allows it: stay and see around).

        Returns:
            Where you are now, row and column, and what happened, e.g. "1 2", "1 2 slip", "0 2 wall", "2 2 goal";
            with the local view (and after look) then the cells up, down, left and right ('#' past the edge),
            e.g. "1 2 : . O # G".
        """
        self.turns += 1
        if self._grid is None:
            self.failed_tries += 1
            return "error: no episode, call reset first"
        if self.done:
            self.failed_tries += 1
            return "error: episode over"
        if self._moves >= self.max_moves:
            self.failed_tries += 1
            self.done = True
            return "error: no moves left"
        if not isinstance(direction, str):
            self.failed_tries += 1
            return "error: direction must be a string"
        word = direction.strip().lower() if len(direction) <= MAX_DIRECTION_CHARS else ""
        if self.look and word == "look":  # stays put: no move used, no slip drawn
            self.looks += 1
            return f"{self.position[0]} {self.position[1]}" + self._cells()
        name = ALIASES.get(word)
        if name is None:
            self.failed_tries += 1
            return "error: use up down left right" + (" look" if self.look else "")
        self._moves += 1
        slip_draw, side_draw = self._rng.random(), self._rng.random()  # two draws per move, always
        slipped = slip_draw < self.slip_prob
        if slipped:
            name = PERPENDICULAR[name][side_draw < 0.5]
        dr, dc = DIRECTIONS[name]
        r, c = self.position[0] + dr, self.position[1] + dc
        status = [" slip"] if slipped else []
        self.slips += slipped
        failed = slipped
        if not _inside(self._grid, r, c):
            self.walls += 1
            failed = True
            status.append(" wall")
        else:
            self.position = [r, c]
            if self._grid[r][c] == "O":
                self.done = True
                failed = True
                status.append(" hole")
            elif (r, c) == self._goal:
                self.done = self.reached = True
                status.append(" goal")
        self.failed_tries += failed
        return f"{self.position[0]} {self.position[1]}" + "".join(status) + self._surroundings()

    def _surroundings(self) -> str:
        """With view local, what a move answers after the position: `_cells()`."""
        return self._cells() if self.view == "local" else ""

    def _cells(self) -> str:
        """The separator " : " and the cells up, down, left and right of the position ('#' past the edge)."""
        r, c = self.position
        cells = []
        for name in VIEW_ORDER:
            rr, cc = r + DIRECTIONS[name][0], c + DIRECTIONS[name][1]
            cells.append(self._grid[rr][cc] if _inside(self._grid, rr, cc) else OUTSIDE)
        return " : " + " ".join(cells)

    def get_reward(self) -> float:
        return 1.0 if self.reached else 0.0


def correct(row: dict, text: str, env: GridWorld) -> bool:
    """Solved: the episode's env reached the goal (`text` is not read: the env saw every move)."""
    if not isinstance(env, GridWorld):
        raise ValueError(f"gridworld: correct() needs the episode's GridWorld instance, got {type(env).__name__}")
    return env.get_reward() == 1.0


# ----------------------------------------------------------------------------------- solver
def distances(grid: list[str], goal: tuple[int, int]) -> dict[tuple[int, int], int]:
    """BFS from the goal over non-hole cells: {cell: moves to the goal} for every cell that can reach it."""
    dist = {tuple(goal): 0}
    queue = deque([tuple(goal)])
    while queue:
        r, c = queue.popleft()
        for dr, dc in DIRECTIONS.values():
            nxt = (r + dr, c + dc)
            if _open(grid, *nxt):
                if nxt not in dist:
                    dist[nxt] = dist[(r, c)] + 1
                    queue.append(nxt)
    return dist


def policy(grid: list[str], dist: dict, position) -> str:
    """The demo policy's move from `position`: one step along a shortest path to the goal, preferring moves
    whose slips (the two perpendicular cells) cannot fall into a hole, then POLICY_ORDER."""

    def hole(r: int, c: int) -> bool:
        return _inside(grid, r, c) and grid[r][c] == "O"

    r, c = position
    best = None
    for name in POLICY_ORDER:
        dr, dc = DIRECTIONS[name]
        if dist.get((r + dr, c + dc), -1) != dist[(r, c)] - 1:
            continue
        risk = sum(hole(r + DIRECTIONS[p][0], c + DIRECTIONS[p][1]) for p in PERPENDICULAR[name])
        if best is None or risk < best[0]:
            best = (risk, name)
    return best[1]


def safe_moves(grid: list[str], position) -> list[str]:
    """The moves from `position` that stay on the grid and out of a hole (slips aside), in DIRECTIONS order:
    what an exploring demonstrator draws from."""
    r, c = position
    return [name for name, (dr, dc) in DIRECTIONS.items() if _open(grid, r + dr, c + dc)]


def solve(grid: list[str], start, goal) -> Optional[list[str]]:
    """A shortest list of moves from start to goal that never enters a hole (no slips), or None if none."""
    dist = distances(grid, goal)
    pos = tuple(start)
    if pos not in dist:
        return None
    path = []
    while pos != tuple(goal):
        name = policy(grid, dist, pos)
        path.append(name)
        pos = (pos[0] + DIRECTIONS[name][0], pos[1] + DIRECTIONS[name][1])
    return path


POLICIES = ("optimal", "demo")


def success_probability(
    row: dict,
    slip_prob: float = ENV_DEFAULTS["slip_prob"],
    max_moves: int = ENV_DEFAULTS["max_moves"],
    policy_name: str = "optimal",
    demo_explore: float = 0.0,
) -> float:
    """The chance, over the slips, that an episode from the row's start reaches the goal within `max_moves` moves:
    `optimal` (the best any policy can do: value iteration over (cell, moves left), the slips as GridWorld.move
    draws them, a wall leaving the agent where it was, a hole ending the episode) or `demo` (the demonstrations'
    re-planning policy, which with `demo_explore` > 0 takes a random safe move with that probability). The ceiling
    a trained policy can approach on these grids, whatever it learned from."""
    if policy_name not in POLICIES:
        raise ValueError(f"gridworld: policy_name must be one of {', '.join(POLICIES)}, got {policy_name!r}")
    GridWorld(slip_prob=slip_prob, max_moves=max_moves)  # the same knob checks as an episode's
    grid, start, goal, _ = _instance(row)
    dist = distances(grid, goal)
    cells = [(r, c) for r in range(len(grid)) for c in range(len(grid[0]))]
    live = [x for x in cells if grid[x[0]][x[1]] != "O" and x != goal]
    outcomes = {}  # (cell, intended move) -> [(probability, cell it lands on)]
    for r, c in live:
        for name in DIRECTIONS:
            sides = PERPENDICULAR[name]
            outcomes[(r, c), name] = [
                (p, (r + dr, c + dc) if _inside(grid, r + dr, c + dc) else (r, c))
                for p, (dr, dc) in (
                    (1 - slip_prob, DIRECTIONS[name]),
                    (slip_prob / 2, DIRECTIONS[sides[0]]),
                    (slip_prob / 2, DIRECTIONS[sides[1]]),
                )
            ]
    # the demonstrations' moves per cell, (the policy's, the safe ones it may wander to): fixed over the iterations
    demo = {x: (policy(grid, dist, x), safe_moves(grid, x)) for x in live if x in dist} if policy_name == "demo" else {}
    value = {x: 0.0 for x in cells}  # moves left 0: only the goal counts
    value[goal] = 1.0

    def q(x, name: str) -> float:  # the value of moving `name` from x, one move more than `value` counts
        return sum(p * value[y] for p, y in outcomes[x, name])

    for _ in range(max_moves):
        nxt = dict(value)
        for x in live:
            if x in demo:
                best, wander = demo[x]
                nxt[x] = (1 - demo_explore) * q(x, best) + demo_explore * sum(q(x, n) for n in wander) / len(wander)
            else:
                nxt[x] = max(q(x, name) for name in DIRECTIONS)
        if nxt == value:  # holes and the goal absorb: later moves change nothing
            break
        value = nxt
    return value[start]


def ceiling(rows: list[dict], env_knobs: Optional[dict] = None, gen_knobs: Optional[dict] = None) -> dict:
    """How well policies can do on these rows (prepare's metrics, for the test split): the share whose reference
    demonstration reached the goal (`demo_reached`: one draw of the slips, the seeds the rows carry) and the
    expected success over the slips of the demonstrations' policy (`demo_policy`, exploring as the generation
    knob `demo_explore` says) and of the best policy (`optimal`), averaged over the rows."""
    k = {**ENV_DEFAULTS, **(env_knobs or {})}
    explore = _gen_knobs(gen_knobs or {})["demo_explore"]
    n = len(rows) or 1

    def mean(name: str) -> float:
        return round(sum(success_probability(r, k["slip_prob"], k["max_moves"], name, explore) for r in rows) / n, 4)

    return {
        "demo_reached": round(sum(r["answer"].endswith("#### goal") for r in rows) / n, 4),
        "demo_policy": mean("demo"),
        "optimal": mean("optimal"),
    }


# ----------------------------------------------------------------------------------- generation
def _gen_knobs(knobs: dict) -> dict:
    unknown = sorted(set(knobs) - set(GEN_DEFAULTS))
    if unknown:
        raise ValueError(f"gridworld: unknown generation knob(s) {unknown}; known: {sorted(GEN_DEFAULTS)}")
    k = {**GEN_DEFAULTS, **knobs}
    if not isinstance(k["size"], int) or isinstance(k["size"], bool) or not 2 <= k["size"] <= 8:
        raise ValueError(f"gridworld: size must be an integer in 2..8, got {k['size']!r}")
    de = k["demo_explore"]
    if not isinstance(de, (int, float)) or isinstance(de, bool) or not 0 <= de <= 0.9:
        raise ValueError(f"gridworld: demo_explore must be a number in [0, 0.9], got {de!r}")
    dl = k["demo_look"]
    if not isinstance(dl, (int, float)) or isinstance(dl, bool) or not 0 <= dl <= 1:
        raise ValueError(f"gridworld: demo_look must be a number in [0, 1], got {dl!r}")
    hp = k["hole_prob"]
    if not isinstance(hp, (int, float)) or isinstance(hp, bool) or not 0 <= hp <= 0.6:
        raise ValueError(f"gridworld: hole_prob must be a number in [0, 0.6], got {hp!r}")
    longest = 2 * (k["size"] - 1)  # the farthest two cells of an empty grid
    mp = k["min_path"]
    if not isinstance(mp, int) or isinstance(mp, bool) or not 1 <= mp <= longest:
        raise ValueError(f"gridworld: min_path must be an integer in 1..{longest} (2*(size-1)), got {mp!r}")
    return k


def render(grid: list[str]) -> str:
    """The grid as the prompt shows it: one line per row, cells separated by spaces (one token per cell)."""
    return "\n".join(" ".join(line) for line in grid)


def question(grid: list[str]) -> str:
    """The task's text for this grid."""
    return "Walk from S to G. O is a hole.\n" + render(grid)


def instance_key(row: dict) -> str:
    """The grid as one string: rows with the same key are the same puzzle (the seed aside)."""
    return "/".join(_instance(row)[0])


def grid_capacity(size: int, hole_prob: float, min_path: int) -> int:
    """How many distinct grids `make_rows` can draw with these knobs: exact (every hole pattern and S, G pair whose
    shortest path is at least min_path) for grids of up to 3x3 or without holes, else the upper bound
    cells * (cells - 1) * 2**(cells - 2) (S and G anywhere, each other cell a hole or not).

    Args:
        size: the grid is size x size.
        hole_prob: > 0 lets any other cell be a hole; 0 gives the one empty grid per S, G pair.
        min_path: the shortest S -> G path's least length.

    Returns:
        The number of distinct grids (an upper bound for large grids with holes).
    """
    cells = [(r, c) for r in range(size) for c in range(size)]
    hole_patterns = 2 ** len(cells) if hole_prob > 0 else 1
    if hole_patterns * len(cells) > MAX_ENUMERATED:
        return len(cells) * (len(cells) - 1) * 2 ** (len(cells) - 2)
    count = 0
    for mask in range(hole_patterns):
        grid = ["".join("O" if mask >> (r * size + c) & 1 else "." for c in range(size)) for r in range(size)]
        for goal in cells:
            if grid[goal[0]][goal[1]] != "O":  # every start that reaches this goal far enough away is one grid
                count += sum(d >= min_path for d in distances(grid, goal).values())
    return count


def _drawable(key: str, k: dict) -> bool:
    """Whether an instance_key is a grid these generation knobs can draw (so excluding it leaves one fewer)."""
    grid = key.split("/")
    if len(grid) != k["size"] or any(len(line) != k["size"] for line in grid) or (k["hole_prob"] == 0 and "O" in key):
        return False
    ends = {ch: [(r, c) for r, line in enumerate(grid) for c, x in enumerate(line) if x == ch] for ch in "SG"}
    if len(ends["S"]) != 1 or len(ends["G"]) != 1:
        return False
    path = solve(grid, ends["S"][0], ends["G"][0])
    return path is not None and len(path) >= k["min_path"]


def check_capacity(n: int, split: str, k: dict, exclude: set) -> None:
    """ValueError, before any draw, when `n` distinct grids cannot exist with the knobs `k` once `exclude` is left
    out (size 2 allows at most 12 grids with min_path 2: asking 1e6 used to draw for hours before failing).

    Args:
        n: rows asked.
        split: "train" or "test" (named in the message: environments.gridworld.num_<split>).
        k: the generation knobs (checked by _gen_knobs).
        exclude: instance_key()s that may not be drawn.
    """
    refuse_beyond_capacity(
        n,
        grid_capacity(k["size"], k["hole_prob"], k["min_path"]),
        exclude,
        lambda key: _drawable(key, k),
        f"gridworld: {n} {split} grids asked (num_{split}) but size={k['size']}, hole_prob={k['hole_prob']}, "
        f"min_path={k['min_path']} allow at most {{capacity}} distinct grids{{other}}: raise size or hole_prob, "
        "lower min_path, or ask for fewer",
    )


def _random_grid(k: dict, rng: random.Random) -> Optional[tuple[list[str], tuple, tuple]]:
    size = k["size"]
    cells = [(r, c) for r in range(size) for c in range(size)]
    start, goal = rng.sample(cells, 2)
    rows = [["O" if rng.random() < k["hole_prob"] else "." for _ in range(size)] for _ in range(size)]
    rows[start[0]][start[1]], rows[goal[0]][goal[1]] = "S", "G"
    grid = ["".join(line) for line in rows]
    path = solve(grid, start, goal)
    if path is None or len(path) < k["min_path"]:
        return None
    return grid, start, goal


def demonstrate(row: dict, env: GridWorld, demo_explore: float = 0.0, demo_look: float = 0.0) -> str:
    """Run the demo policy through `env` from the row's start: the annotated moves and the final line. With
    `demo_explore` > 0, each move is a random safe one (`safe_moves`) with that probability, drawn from a generator
    seeded by the row's seed (not the slips' one: the same slips whatever the knob). With `demo_look` > 0, the
    episode looks before every move with that probability (one draw per episode, from its own generator of the
    seed); looking changes no move: the grid is in the prompt and the policy already knows it."""
    if demo_look > 0 and not env.look:
        raise ValueError("gridworld: demo_look > 0 needs the look action: set environments.gridworld.look: true")
    env.reset(**row)
    grid, _, goal, seed = _instance(row)
    dist = distances(grid, goal)
    explore = random.Random(f"demo-explore-{seed}") if demo_explore > 0 else None
    looks = demo_look > 0 and random.Random(f"demo-look-{seed}").random() < demo_look
    calls = []
    while not env.done and env._moves < env.max_moves:
        if looks:
            calls.append(f"<<look={env.move('look')}>>")
        if explore is not None and explore.random() < demo_explore:
            name = explore.choice(safe_moves(grid, env.position))
        else:
            name = policy(grid, dist, env.position)
        calls.append(f"<<{name}={env.move(name)}>>")
    return " ".join(calls) + ("\n#### goal" if env.reached else "\n#### fail")


def make_rows(
    n: int,
    rng: random.Random,
    split: str,
    env_knobs: Optional[dict] = None,
    exclude: Iterable[str] = (),
    **gen_knobs,
) -> list[dict]:
    """`n` solvable grids with demonstrations. `split`: "train" (seeds whose demo reaches the goal; slips and
    re-plans included as they come) or "test" (any seed; the demo is the reference policy's run, which may end
    "#### fail" when a slip drops it into a hole or the moves run out). `env_knobs`: the GridWorld knobs the
    demos are run with (default ENV_DEFAULTS). `exclude`: instance_key()s not to generate. Only `rng` is drawn
    from: same seed, same rows."""
    if split not in SPLITS:
        raise ValueError(f"gridworld: split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"gridworld: n must be a non-negative integer, got {n!r}")
    k = _gen_knobs(gen_knobs)
    env = GridWorld(**{**ENV_DEFAULTS, **(env_knobs or {})})
    if split == "train" and k["min_path"] > env.max_moves:
        raise ValueError(
            f"gridworld: min_path={k['min_path']} is more than max_moves={env.max_moves}: no training demonstration "
            "can reach the goal; raise max_moves or lower min_path"
        )
    seen = set(exclude)
    check_capacity(n, split, k, seen)
    rows: list[dict] = []
    attempts, max_attempts, last_new = 0, 1000 + MAX_ATTEMPTS_PER_ROW * n, 0
    while len(rows) < n:
        attempts += 1
        if attempts - last_new > MAX_STALL_ATTEMPTS:
            raise ValueError(
                f"gridworld: no new grid in {MAX_STALL_ATTEMPTS} draws after {len(rows)} of {n} with size={k['size']}, "
                f"hole_prob={k['hole_prob']}, min_path={k['min_path']}, slip_prob={env.slip_prob}, "
                f"max_moves={env.max_moves}: the grids these knobs draw are used up (or their demos cannot reach the "
                "goal); raise size, lower min_path or slip_prob, or ask for fewer"
            )
        if attempts > max_attempts:
            raise ValueError(
                f"gridworld: only {len(rows)} of {n} grids found in {max_attempts} attempts with size={k['size']}, "
                f"hole_prob={k['hole_prob']}, min_path={k['min_path']}, slip_prob={env.slip_prob}, "
                f"max_moves={env.max_moves}: lower min_path, hole_prob or slip_prob, or raise max_moves or size"
            )
        made = _random_grid(k, rng)
        if made is None:
            continue
        grid, start, goal = made
        row = {"grid": grid, "start": list(start), "goal": list(goal), "seed": rng.randrange(2**31)}
        key = instance_key(row)
        if key in seen:
            continue
        answer = demonstrate(row, env, k["demo_explore"], k["demo_look"])
        if split == "train" and not env.reached:
            continue  # the reference policy fell or ran out of moves with this seed: no demo to learn from
        seen.add(key)
        last_new = attempts
        rows.append(
            {
                "question": question(grid),
                "answer": answer,
                "ground_truth": "goal",
                **row,
                "demo_slips": env.slips,
                "shortest_path": len(solve(grid, start, goal)),
            }
        )
    return rows
