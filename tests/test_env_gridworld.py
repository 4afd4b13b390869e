"""Gridworld environment: BFS solver, moves/slips/walls/holes, demos, hostile input, episode isolation, schema."""

from __future__ import annotations

import json
import random
import re
from collections import deque

import pytest

from agentrl.envs import gridworld as gw
from agentrl.envs.gridworld import GridWorld, correct, make_rows, solve

CALL = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
GRID = ["S.O.", "..O.", "....", "O..G"]
ROW = {"id": "g1", "grid": GRID, "start": [0, 0], "goal": [3, 3], "seed": 5, "prompt": "ignored"}
STEP = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def episode(row=ROW, **knobs) -> GridWorld:
    env = GridWorld(**knobs)
    assert env.reset(**row) is None
    return env


def around(grid, r, c) -> list[str]:
    """The cells up, down, left and right of (r, c), '#' past the edge: what a look must answer."""
    at = [(r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)]
    return [grid[x][y] if 0 <= x < len(grid) and 0 <= y < len(grid[0]) else "#" for x, y in at]


def bfs_length(grid, start, goal):
    """An independent shortest-path length (None if unreachable)."""
    seen, queue = {tuple(start): 0}, deque([tuple(start)])
    while queue:
        r, c = queue.popleft()
        if (r, c) == tuple(goal):
            return seen[(r, c)]
        for dr, dc in STEP.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < len(grid) and 0 <= nc < len(grid[0]) and grid[nr][nc] != "O" and (nr, nc) not in seen:
                seen[(nr, nc)] = seen[(r, c)] + 1
                queue.append((nr, nc))
    return None


def walk(grid, start, moves):
    """The cells a slip-free walk visits; asserts it stays on the grid."""
    r, c = start
    cells = []
    for m in moves:
        r, c = r + STEP[m][0], c + STEP[m][1]
        assert 0 <= r < len(grid) and 0 <= c < len(grid[0])
        cells.append((r, c))
    return cells


# ----------------------------------------------------------------------------------- solver
def test_solver_known_grid():
    path = solve(GRID, [0, 0], [3, 3])
    assert len(path) == 6 == bfs_length(GRID, [0, 0], [3, 3])
    cells = walk(GRID, (0, 0), path)
    assert cells[-1] == (3, 3) and all(GRID[r][c] != "O" for r, c in cells)


def test_solver_none_when_walled_in():
    assert solve(["S.O", "OO.", "..G"], [0, 0], [2, 2]) is None
    assert solve(["SO", "OG"], [0, 0], [1, 1]) is None


def test_solver_paths_are_shortest_and_avoid_holes():
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        size = rng.randint(2, 6)
        grid = [[("O" if rng.random() < 0.3 else ".") for _ in range(size)] for _ in range(size)]
        start, goal = rng.sample([(r, c) for r in range(size) for c in range(size)], 2)
        grid[start[0]][start[1]], grid[goal[0]][goal[1]] = "S", "G"
        grid = ["".join(line) for line in grid]
        path, length = solve(grid, start, goal), bfs_length(grid, start, goal)
        assert (path is None) == (length is None)
        if path is not None:
            cells = walk(grid, start, path)
            assert len(path) == length and cells[-1] == goal
            assert all(grid[r][c] != "O" for r, c in cells)
            checked += 1
    assert checked > 100


# ----------------------------------------------------------------------------------- ceiling
def test_success_probability_by_hand():
    corridor = {"grid": ["S.G"], "start": [0, 0], "goal": [0, 2], "seed": 0}
    # a slip on a one-row grid bumps the edge and stays: two clean moves are needed
    assert gw.success_probability(corridor, 0.2, 2) == pytest.approx(0.8**2)
    assert gw.success_probability(corridor, 0.2, 3) == pytest.approx(0.8**2 + 2 * 0.8 * 0.2 * 0.8)
    assert gw.success_probability(corridor, 0.0, 1) == 0.0  # too few moves
    # every move slips: moving right only bumps the edges, but moving up slips left or right half the time each
    assert gw.success_probability(corridor, 1.0, 12, "demo") == 0.0
    assert gw.success_probability(corridor, 1.0, 2) == pytest.approx(0.25)  # two slips to the right in a row
    open_grid = {"grid": ["S...", "....", "....", "...G"], "start": [0, 0], "goal": [3, 3], "seed": 0}
    assert gw.success_probability(open_grid, 0.0, 6) == 1.0 and gw.success_probability(open_grid, 0.0, 5) == 0.0
    assert gw.success_probability(open_grid, 0.0, 6, "demo") == 1.0  # nothing can go wrong: the demo policy gets there
    assert 0.9 < gw.success_probability(open_grid, 0.2, 12) < 1.0  # slips waste moves even with no hole about


def test_demo_success_probability_matches_the_environment():
    """The transition model (slips to either side, walls keep the position, holes end the episode, the move
    budget) is GridWorld.move's: the demonstrations' policy, run through the environment over 4,000 seeds,
    reaches the goal as often as computed."""
    env = GridWorld(slip_prob=0.3, max_moves=8)
    n = 4000
    reached = 0
    for seed in range(n):
        gw.demonstrate({**ROW, "seed": seed}, env)
        reached += env.reached
    p = gw.success_probability(ROW, 0.3, 8, "demo")
    assert 0.2 < p < 0.9  # a grid where slips matter
    assert abs(reached / n - p) < 4 * (p * (1 - p) / n) ** 0.5


def test_optimal_is_never_below_the_demo_policy_and_sometimes_above():
    rows = make_rows(40, random.Random(3), "test")
    gaps = [gw.success_probability(r, 0.2, 12) - gw.success_probability(r, 0.2, 12, "demo") for r in rows]
    assert min(gaps) > -1e-12 and max(gaps) > 0.01


def test_ceiling_of_rows():
    rows = make_rows(30, random.Random(4), "test")
    c = gw.ceiling(rows, {"slip_prob": 0.2, "view": "local"})
    assert c["demo_reached"] == round(sum(r["answer"].endswith("#### goal") for r in rows) / 30, 4)
    assert c["demo_policy"] == round(sum(gw.success_probability(r, 0.2, 12, "demo") for r in rows) / 30, 4)
    assert c["demo_policy"] <= c["optimal"] <= 1.0
    assert gw.ceiling(rows, {"slip_prob": 0.0})["optimal"] == 1.0  # generated grids are solvable in max_moves
    with pytest.raises(ValueError, match="policy_name"):
        gw.success_probability(ROW, 0.2, 12, "greedy")
    with pytest.raises(ValueError, match="slip_prob"):
        gw.success_probability(ROW, 1.5, 12)


# ----------------------------------------------------------------------------------- the exploring teacher
def test_safe_moves_stay_on_the_grid_and_out_of_holes():
    assert gw.safe_moves(GRID, (0, 0)) == ["down", "right"]
    assert gw.safe_moves(GRID, (0, 1)) == ["down", "left"]  # right is a hole, up the edge
    assert gw.safe_moves(["SOG"], (0, 0)) == []


def test_demo_explore_zero_leaves_the_rows_as_they_were():
    """The knob's default draws nothing: rows (grids, seeds, demonstrations) are those made without it."""
    assert make_rows(25, random.Random(8), "train") == make_rows(25, random.Random(8), "train", demo_explore=0.0)


def test_exploring_demonstrations_wander_on_the_same_grids_and_slips():
    plain = make_rows(300, random.Random(9), "test", env_knobs={"view": "local"})
    wander = make_rows(300, random.Random(9), "test", env_knobs={"view": "local"}, demo_explore=0.4)
    assert [r["grid"] for r in plain] == [r["grid"] for r in wander]  # the generator's draws are unchanged
    assert [r["seed"] for r in plain] == [r["seed"] for r in wander]
    off_policy = moves = 0
    for row in wander:
        grid, goal = row["grid"], tuple(row["goal"])
        dist, pos = gw.distances(grid, goal), tuple(row["start"])
        for name, obs in CALL.findall(row["answer"]):
            if obs.startswith("error"):
                continue
            assert name in gw.safe_moves(grid, pos)  # the teacher never walks into a hole or the edge on purpose
            moves += 1
            off_policy += name != gw.policy(grid, dist, pos)
            pos = tuple(int(x) for x in obs.split()[:2])
    # a random safe move is the policy's own move about a third of the time: 0.4 * (1 - ~0.4) of moves differ
    assert 0.15 < off_policy / moves < 0.35
    assert sum(len(CALL.findall(r["answer"])) for r in wander) > sum(len(CALL.findall(r["answer"])) for r in plain)
    again = make_rows(300, random.Random(9), "test", env_knobs={"view": "local"}, demo_explore=0.4)
    assert again == wander  # same seed, same wandering


def test_exploring_teacher_success_probability_matches_the_environment():
    """`success_probability(..., "demo", demo_explore)` is the exploring teacher's chance, measured by running
    `demonstrate` through the environment over 4,000 seeds."""
    env = GridWorld(slip_prob=0.2, max_moves=8)
    n = 4000
    reached = 0
    for seed in range(n):
        gw.demonstrate({**ROW, "seed": seed}, env, 0.5)
        reached += env.reached
    p = gw.success_probability(ROW, 0.2, 8, "demo", 0.5)
    assert p < gw.success_probability(ROW, 0.2, 8, "demo") - 0.05  # wandering costs on this grid
    assert abs(reached / n - p) < 4 * (p * (1 - p) / n) ** 0.5


def test_ceiling_reads_the_teacher_from_the_generation_knobs():
    rows = make_rows(30, random.Random(4), "test")
    plain, wander = gw.ceiling(rows, {}), gw.ceiling(rows, {}, {"demo_explore": 0.4})
    assert wander["optimal"] == plain["optimal"] and wander["demo_policy"] < plain["demo_policy"]
    assert wander["demo_policy"] == round(sum(gw.success_probability(r, 0.2, 12, "demo", 0.4) for r in rows) / 30, 4)


@pytest.mark.parametrize("bad", [-0.1, 0.95, "0.4", True])
def test_demo_explore_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="demo_explore must be a number in \\[0, 0.9\\]"):
        make_rows(1, random.Random(0), "train", demo_explore=bad)


# ----------------------------------------------------------------------------------- look
def test_look_is_an_error_unless_the_environment_allows_it():
    env = episode(slip_prob=0.0)
    assert env.move("look") == "error: use up down left right"
    assert (env.failed_tries, env.looks, env.position) == (1, 0, [0, 0])


def test_look_stays_put_uses_no_move_and_draws_no_slip():
    """A look answers the position and the four cells around (up down left right, '#' past the edge), as a local
    view's move does, without moving, without using one of max_moves and without a draw from the slips'
    generator: the moves around it slip exactly as in an episode without looks."""
    plain, looking = episode(slip_prob=0.5, max_moves=6), episode(slip_prob=0.5, max_moves=6, look=True)
    assert looking.move("look") == "0 0 : # . # ."
    assert looking.move(" LOOK ") == "0 0 : # . # ."
    for name in ["down", "right", "down", "right", "down", "right"]:
        answer = plain.move(name)
        assert looking.move(name) == answer  # position view: the same answer, the same slips
        if not looking.done and looking._moves < looking.max_moves:
            assert looking.move("look").split(" : ")[1].split() == around(GRID, *looking.position)
    assert (looking.slips, looking.walls, looking.failed_tries) == (plain.slips, plain.walls, plain.failed_tries)
    assert looking._moves == plain._moves and looking.looks >= 2
    assert looking.move("look").startswith("error:")  # over (or out of moves): a look is refused like a move
    local = episode(slip_prob=0.0, view="local", look=True)
    moved = local.move("right")
    assert local.move("look") == moved  # the same cells a local view's move shows


def test_demo_look_zero_leaves_the_rows_as_they_were():
    knobs = {"env_knobs": {"look": True}}
    assert make_rows(25, random.Random(8), "train") == make_rows(25, random.Random(8), "train", demo_look=0.0, **knobs)


def test_looking_demonstrations_look_before_every_move_and_move_as_before():
    plain = make_rows(400, random.Random(9), "train")
    looking = make_rows(400, random.Random(9), "train", env_knobs={"look": True}, demo_look=0.25)
    assert [r["grid"] for r in plain] == [r["grid"] for r in looking]
    assert [r["seed"] for r in plain] == [r["seed"] for r in looking]
    n_looking = 0
    for p, row in zip(plain, looking):
        calls = CALL.findall(row["answer"])
        moves = [c for c in calls if c[0] != "look"]
        assert moves == CALL.findall(p["answer"])  # the same moves, answers and slips
        looks = [c for c in calls if c[0] == "look"]
        if looks:
            n_looking += 1
            assert [c[0] for c in calls] == [x for m in moves for x in ("look", m[0])]  # a look before every move
            for _, obs in looks:
                position, cells = obs.split(" : ")
                assert cells.split() == around(row["grid"], *map(int, position.split()))
    assert 0.18 < n_looking / 400 < 0.32  # one draw per episode, 0.25
    again = make_rows(400, random.Random(9), "train", env_knobs={"look": True}, demo_look=0.25)
    assert again == looking  # same seed, same looks


def test_demo_look_needs_the_look_action():
    with pytest.raises(ValueError, match="demo_look > 0 needs the look action: set environments.gridworld.look"):
        make_rows(1, random.Random(0), "train", demo_look=0.5)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.4", True])
def test_demo_look_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="demo_look must be a number in \\[0, 1\\]"):
        make_rows(1, random.Random(0), "train", env_knobs={"look": True}, demo_look=bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_look_knob_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="look must be true or false"):
        GridWorld(look=bad)


# ----------------------------------------------------------------------------------- the move tool
def test_moves_walls_holes_and_goal_without_slips():
    env = episode(slip_prob=0.0)
    assert env.move("up") == "0 0 wall"
    assert env.move("right") == "0 1"
    assert env.move("right") == "0 2 hole"
    assert env.done and not env.reached and env.get_reward() == 0.0
    assert env.move("down") == "error: episode over"
    assert (env.turns, env.failed_tries, env.walls, env.slips) == (4, 3, 1, 0)

    env = episode(slip_prob=0.0)
    outs = [env.move(m) for m in ["down", "d", " DOWN ", "Right", "r", "right"]]
    assert outs == ["1 0", "2 0", "3 0 hole", "error: episode over", "error: episode over", "error: episode over"]

    env = episode(slip_prob=0.0)
    outs = [env.move(m) for m in solve(GRID, [0, 0], [3, 3])]
    assert outs[-1] == "3 3 goal" and all(not o.endswith(("wall", "hole", "slip")) for o in outs)
    assert env.reached and env.get_reward() == 1.0
    assert (env.turns, env.failed_tries) == (6, 0)
    assert env.move("left") == "error: episode over"


@pytest.mark.parametrize(
    "arg",
    ["", "upp", "north", "u p", "__import__('os')", "ｕｐ", "up\x00", "up" * 5000, "(" * 1000, "<<up=1>>"],
)
def test_bad_directions_are_errors(arg):
    env = episode()
    assert env.move(arg) == "error: use up down left right"
    assert (env.turns, env.failed_tries, env.position) == (1, 1, [0, 0])
    assert env.move("right") in ("0 1", "1 0 slip", "0 0 slip wall")  # a bad call costs no move, no slip draw


@pytest.mark.parametrize("arg", [5, None, ["up"], {"direction": "up"}, 1.5, b"up", True])
def test_non_string_arguments_are_errors_not_raises(arg):
    env = episode()
    assert env.move(arg) == "error: direction must be a string"
    assert (env.turns, env.failed_tries, env.position) == (1, 1, [0, 0])


def test_results_fit_the_inline_annotation():
    env = episode(slip_prob=0.5)
    for arg in ["down", "right", "x" * 10_000, 7, "down", "right", "down", "right", "up", "left"]:
        out = env.move(arg)
        assert "<" not in out and ">" not in out and "=" not in out and len(out) <= 40, out


def test_max_moves_knob():
    env = episode(slip_prob=0.0, max_moves=2)
    assert env.move("down") == "1 0"
    assert env.move("right") == "1 1"
    assert env.move("down") == "error: no moves left"
    assert env.done and env.get_reward() == 0.0 and env.position == [1, 1]
    assert episode(slip_prob=0.0, max_moves=3).move("down") == "1 0"


def test_slip_prob_knob():
    row = {**ROW, "grid": ["....", ".S..", "....", "...G"], "start": [1, 1]}
    always = episode(row, slip_prob=1.0)
    assert always.move("down") in ("1 0 slip", "1 2 slip")  # perpendicular to down: left or right
    assert always.slips == 1 and always.failed_tries == 1
    never = episode(row, slip_prob=0.0)
    assert [never.move(m) for m in ["down", "up", "right", "left"]] == ["2 1", "1 1", "1 2", "1 1"]
    assert never.slips == 0
    some = episode(row, slip_prob=0.5, max_moves=200)
    for _ in range(200):
        some.move("up" if some.position[0] > 1 else "down")
    assert 60 < some.slips < 140  # about half of 200 moves


def test_local_view_lists_the_cells_around_up_down_left_right():
    env = episode(slip_prob=0.0, view="local")  # GRID: S.O. / ..O. / .... / O..G
    assert env.move("up") == "0 0 wall : # . # ."
    assert env.move("right") == "0 1 : # . S O"
    assert env.move("down") == "1 1 : . . . O"
    assert env.move("right") == "1 2 hole : O . . ."
    assert env.move("left") == "error: episode over"  # errors carry no view
    env = episode(slip_prob=0.0, view="local")
    outs = [env.move(m) for m in solve(GRID, [0, 0], [3, 3])]
    assert outs[-1].startswith("3 3 goal : . # . #")
    # the view adds to the answer and changes nothing else: same moves, same slips, same positions
    for seed in range(20):
        plain, local = episode({**ROW, "seed": seed}), episode({**ROW, "seed": seed}, view="local")
        for m in ["down", "right", "down", "right", "down", "right"]:
            a, b = plain.move(m), local.move(m)
            assert b.startswith(a) and (b == a or b[len(a) :].startswith(" : ")), (a, b)
        assert (plain.position, plain.slips, plain.failed_tries) == (local.position, local.slips, local.failed_tries)


@pytest.mark.parametrize("seed", range(5))
def test_local_view_demos_replay_and_fit_the_annotation(seed):
    knobs = {"view": "local"}
    rows = make_rows(20, random.Random(seed), "train", env_knobs=knobs)
    plain = make_rows(20, random.Random(seed), "train")
    for row, prow in zip(rows, plain):
        assert (row["grid"], row["seed"]) == (prow["grid"], prow["seed"])  # the view draws nothing from the rng
        env = GridWorld(**knobs)
        env.reset(**row)
        for arg, result in CALL.findall(row["answer"]):
            assert env.move(arg) == result
            assert "<" not in result and ">" not in result and "=" not in result
            r, c = env.position
            cells = result.split(" : ")[1].split()
            for name, cell in zip(gw.VIEW_ORDER, cells):
                rr, cc = r + STEP[name][0], c + STEP[name][1]
                inside = 0 <= rr < len(row["grid"]) and 0 <= cc < len(row["grid"][0])
                assert cell == (row["grid"][rr][cc] if inside else "#")
        assert env.reached


def test_slips_go_to_both_perpendicular_sides():
    row = {**ROW, "grid": ["...", ".S.", "..G"], "start": [1, 1], "goal": [2, 2]}
    seen = set()
    for seed in range(40):
        env = episode({**row, "seed": seed}, slip_prob=1.0)
        seen.add(env.move("up"))
    assert seen == {"1 0 slip", "1 2 slip"}


@pytest.mark.parametrize(
    "knobs, field",
    [
        ({"slip_prob": 1.5}, "slip_prob"),
        ({"slip_prob": "0.2"}, "slip_prob"),
        ({"max_moves": 0}, "max_moves"),
        ({"max_moves": 2.5}, "max_moves"),
        ({"view": "global"}, "view"),
        ({"view": None}, "view"),
    ],
)
def test_bad_env_knobs_name_the_field(knobs, field):
    with pytest.raises(ValueError, match=field):
        GridWorld(**knobs)
    with pytest.raises(TypeError, match="colour"):
        GridWorld(colour="red")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"grid": ["S.", "..G"]}, "grid"),
        ({"grid": ["S.X.", "..O.", "....", "O..G"]}, "grid"),
        ({"grid": "S..G"}, "grid"),
        ({"grid": []}, "grid"),
        ({"start": [0, 1]}, "start"),
        ({"start": [9, 0]}, "start"),
        ({"start": "0 0"}, "start"),
        ({"goal": [3, 2]}, "goal"),
        ({"grid": ["S.G.", "..O.", "....", "O..G"]}, "goal"),
        ({"seed": "5"}, "seed"),
        ({"seed": None}, "seed"),
    ],
)
def test_bad_rows_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"gridworld row 'g1': '{field}'"):
        GridWorld().reset(**{**ROW, **change})


def test_tool_before_reset_is_an_error():
    env = GridWorld()
    assert env.move("up") == "error: no episode, call reset first"
    assert (env.turns, env.failed_tries) == (1, 1)
    assert env.get_reward() == 0.0


# ----------------------------------------------------------------------------------- isolation / determinism
MOVES = ["down", "down", "right", "right", "down", "right", "up", "right", "down", "down", "left", "down"]


def run(env, moves=MOVES):
    return [env.move(m) for m in moves]


def test_same_seed_same_slips_and_reset_replays():
    a = run(episode(slip_prob=0.4))
    assert a == run(episode(slip_prob=0.4))
    env = episode(slip_prob=0.4)
    first = run(env)
    env.reset(**ROW)
    assert (env.turns, env.failed_tries, env.slips, env.walls, env.done, env.reached) == (0, 0, 0, 0, False, False)
    assert env.position == [0, 0]
    assert run(env) == first  # reset restarts the episode's random stream too
    outs = {tuple(run(episode({**ROW, "seed": s}, slip_prob=0.4))) for s in range(10)}
    assert len(outs) > 1  # the seed matters


def test_interleaved_episodes_never_share_state():
    alone_a = run(episode(slip_prob=0.4))
    alone_b = run(episode({**ROW, "seed": 99}, slip_prob=0.4))
    a, b = episode(slip_prob=0.4), episode({**ROW, "seed": 99}, slip_prob=0.4)
    inter_a, inter_b = [], []
    for m in MOVES:
        inter_a.append(a.move(m))
        random.random()  # the global random stream is not the env's
        inter_b.append(b.move(m))
    assert (inter_a, inter_b) == (alone_a, alone_b)
    c = episode(slip_prob=0.4)
    c.move("down")
    d = GridWorld(slip_prob=0.4)
    assert (d.turns, d.failed_tries, d.position) == (0, 0, None)


def test_reset_after_the_episode_ended():
    env = episode(slip_prob=0.0)
    env.move("right")
    env.move("right")  # hole
    assert env.done
    env.reset(**{**ROW, "grid": ["S.", ".G"], "goal": [1, 1]})
    assert env.move("right") == "0 1" and env.move("down") == "1 1 goal" and env.get_reward() == 1.0


def test_correct_reads_the_env_not_the_text():
    env = episode(slip_prob=0.0)
    for m in solve(GRID, [0, 0], [3, 3]):
        env.move(m)
    assert correct(ROW, "", env) is True
    lost = episode(slip_prob=0.0)
    lost.move("down")
    assert correct(ROW, "<<down=3 3 goal>>\n#### goal", lost) is False
    with pytest.raises(ValueError, match="GridWorld instance"):
        correct(ROW, "#### goal", None)


# ----------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("knobs", [{}, {"size": 3, "min_path": 2}, {"size": 6, "hole_prob": 0.3, "min_path": 6}])
def test_generated_grids_are_solvable(knobs):
    rows = make_rows(60, random.Random(1), "train", **knobs)
    k = {**gw.GEN_DEFAULTS, **knobs}
    for row in rows:
        grid = row["grid"]
        assert len(grid) == k["size"] and {len(line) for line in grid} == {k["size"]}
        assert grid[row["start"][0]][row["start"][1]] == "S" and grid[row["goal"][0]][row["goal"][1]] == "G"
        length = bfs_length(grid, row["start"], row["goal"])
        assert length is not None and length >= k["min_path"] and row["shortest_path"] == length
        assert row["ground_truth"] == "goal" and row["question"].endswith(gw.render(grid))
        json.dumps(row)


def test_hole_prob_knob():
    def holes(p):
        return sum(line.count("O") for r in make_rows(40, random.Random(2), "test", hole_prob=p) for line in r["grid"])

    assert holes(0.0) == 0  # (an empty 4x4 grid has only 60 S/G placements with a path >= 4: n=40 fits)
    assert holes(0.1) < holes(0.3)


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("env_knobs", [None, {"slip_prob": 0.0}, {"slip_prob": 0.4, "max_moves": 20}])
def test_demos_replay_through_a_fresh_env(split, env_knobs):
    rows = make_rows(60, random.Random(3), split, env_knobs=env_knobs)
    for row in rows:
        env = GridWorld(**(env_knobs or {}))
        env.reset(**row)
        calls = CALL.findall(row["answer"])
        assert calls and row["answer"].count("<<") == len(calls)
        for arg, result in calls:
            assert arg in gw.DIRECTIONS
            assert env.move(arg) == result
        assert env.done or env.turns == env.max_moves
        assert row["answer"].endswith("\n#### goal" if env.reached else "\n#### fail")
        failed = [res for _, res in calls if res.endswith(("slip", "wall", "hole"))]  # 'slip wall' is one call
        assert env.failed_tries == len(failed)
        assert row["demo_slips"] == env.slips
        if split == "train":
            assert env.reached
        if not (env_knobs or {}).get("slip_prob", gw.ENV_DEFAULTS["slip_prob"]):
            assert len(calls) == row["shortest_path"]  # no slips: the clean BFS path


def test_train_demos_show_slips_and_recovery():
    rows = make_rows(200, random.Random(4), "train")
    recovered = [r for r in rows if r["demo_slips"] > 0]
    assert len(recovered) > 50  # ~half at slip_prob 0.2
    for row in recovered[:20]:
        results = [res for _, res in CALL.findall(row["answer"])]
        assert any("slip" in res for res in results[:-1]) and results[-1].endswith("goal")


def test_test_split_keeps_unlucky_seeds():
    rows = make_rows(200, random.Random(5), "test", env_knobs={"slip_prob": 0.3})
    endings = {r["answer"].rsplit("\n", 1)[1] for r in rows}
    assert endings == {"#### goal", "#### fail"}


def test_determinism_and_exclude():
    a = make_rows(30, random.Random(11), "train")
    assert a == make_rows(30, random.Random(11), "train")
    assert a != make_rows(30, random.Random(12), "train")
    keys = {gw.instance_key(r) for r in a}
    assert len(keys) == 30
    b = make_rows(30, random.Random(11), "test", exclude=keys)
    assert not keys & {gw.instance_key(r) for r in b}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"size": 1}, "size"),
        ({"size": 9}, "size"),
        ({"hole_prob": 0.9}, "hole_prob"),
        ({"min_path": 7}, "min_path"),  # 4x4: at most 6
        ({"min_path": 0}, "min_path"),
        ({"colour": 3}, "colour"),
        ({"split": "dev"}, "split"),
        ({"env_knobs": {"slip_prob": 2}}, "slip_prob"),
    ],
)
def test_bad_generation_knobs_name_the_field(kwargs, field):
    kwargs = {"split": "train", **kwargs}
    with pytest.raises(ValueError, match=field):
        make_rows(3, random.Random(0), **kwargs)


def test_impossible_request_says_what_to_change():
    with pytest.raises(ValueError, match="lower min_path"):
        make_rows(5, random.Random(0), "train", size=2, min_path=2, hole_prob=0.6, env_knobs={"slip_prob": 1.0})


def _grids_by_brute_force(size: int, hole_prob: float, min_path: int) -> int:
    """Every grid of '.', 'O', one 'S' and one 'G' (no holes when hole_prob is 0) with a path of >= min_path."""
    import itertools

    count = 0
    for cells in itertools.product(".O" if hole_prob > 0 else ".", repeat=size * size):
        for s, g in itertools.permutations(range(size * size), 2):
            if cells[s] == "O" or cells[g] == "O":
                continue
            flat = list(cells)
            flat[s], flat[g] = "S", "G"
            grid = ["".join(flat[r * size : (r + 1) * size]) for r in range(size)]
            path = solve(grid, divmod(s, size), divmod(g, size))
            count += path is not None and len(path) >= min_path
    return count


@pytest.mark.parametrize("size, hole_prob, min_path", [(2, 0.2, 1), (2, 0.2, 2), (3, 0.3, 4), (3, 0.0, 3), (4, 0.0, 5)])
def test_grid_capacity_counts_every_drawable_grid(size, hole_prob, min_path):
    assert gw.grid_capacity(size, hole_prob, min_path) == _grids_by_brute_force(size, hole_prob, min_path)


def test_grid_capacity_is_reached_by_the_generator():
    """The count is what make_rows can draw: all 12 grids of size 2 with min_path 2, and not one more."""
    rows = make_rows(12, random.Random(0), "test", size=2, min_path=2)
    assert len({gw.instance_key(r) for r in rows}) == 12 == gw.grid_capacity(2, 0.2, 2)


@pytest.mark.parametrize("n", [45, 1_000_000])
def test_more_rows_than_grids_fails_before_drawing(n, monkeypatch):
    """size 2 with 1e6 rows used to draw for ~2.9 h (200 attempts per row) before failing."""
    monkeypatch.setattr(gw, "_random_grid", lambda *a: pytest.fail("drew a grid"))
    with pytest.raises(
        ValueError, match=rf"gridworld: {n} train grids asked \(num_train\) but size=2, hole_prob=0.2, "
    ):
        make_rows(n, random.Random(0), "train", size=2, min_path=1)
    with pytest.raises(ValueError, match=r"allow at most 44 distinct grids: raise size"):
        make_rows(n, random.Random(0), "test", size=2, min_path=1)


def test_capacity_leaves_out_the_other_splits_grids():
    test = make_rows(10, random.Random(0), "test", size=2, min_path=2)
    seen = {gw.instance_key(r) for r in test} | {"S.O/..G"}  # a grid of another shape takes nothing
    assert (
        len(make_rows(2, random.Random(1), "train", exclude=seen, size=2, min_path=2, env_knobs={"slip_prob": 0})) == 2
    )
    with pytest.raises(ValueError, match="at most 12 distinct grids, 10 of them excluded"):
        make_rows(3, random.Random(1), "train", exclude=seen, size=2, min_path=2)


def test_train_demos_that_cannot_reach_the_goal_fail_before_drawing():
    with pytest.raises(ValueError, match="min_path=6 is more than max_moves=5: no training demonstration"):
        make_rows(1, random.Random(0), "train", size=4, min_path=6, env_knobs={"max_moves": 5})
    assert len(make_rows(1, random.Random(0), "test", size=4, min_path=6, env_knobs={"max_moves": 5})) == 1


def test_a_run_of_draws_with_nothing_new_stops_generation(monkeypatch):
    """Always slipping with 2 moves, no training demo on a 2x2 grid reaches the goal: the run of fruitless draws
    stops it (here after 300), not the budget of 200 draws per row asked."""
    monkeypatch.setattr(gw, "MAX_STALL_ATTEMPTS", 300)
    with pytest.raises(ValueError, match=r"no new grid in 300 draws after 0 of 12 .* slip_prob=1.0, max_moves=2"):
        make_rows(12, random.Random(0), "train", size=2, min_path=2, env_knobs={"slip_prob": 1.0, "max_moves": 2})


def test_defaults_are_the_signature_defaults():
    env = GridWorld()
    knobs = {"slip_prob": env.slip_prob, "max_moves": env.max_moves, "view": env.view, "look": env.look}
    assert knobs == gw.ENV_DEFAULTS
    assert set(gw.GEN_DEFAULTS) == {"size", "hole_prob", "min_path", "demo_explore", "demo_look"}


# ----------------------------------------------------------------------------------- TRL shape
def test_tool_schema_has_one_string_parameter():
    from transformers.utils import get_json_schema

    schema = get_json_schema(GridWorld().move)["function"]
    assert schema["name"] == "move"
    assert list(schema["parameters"]["properties"]) == ["direction"]
    prop = schema["parameters"]["properties"]["direction"]
    assert prop["type"] == "string" and prop["description"]
    assert schema["parameters"]["required"] == ["direction"]


def test_one_public_tool_besides_reset_and_get_reward():
    import inspect

    public = [n for n, _ in inspect.getmembers(GridWorld, predicate=inspect.isfunction) if not n.startswith("_")]
    assert sorted(public) == ["get_reward", "move", "reset"]


def test_no_torch_import():
    import subprocess
    import sys

    code = "import sys, agentrl.envs.gridworld; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reset_reads_the_grid_from_a_served_prompt():
    """The server has a prompt only: reset(question=...) reads the grid, S and G from the text, and the same
    text always slips the same way."""
    row = make_rows(1, random.Random(5), "test")[0]
    a, b = GridWorld(), GridWorld()
    a.reset(prompt=[{"role": "user", "content": row["question"]}])
    b.reset(question=row["question"])
    assert a._grid == row["grid"] and a.position == list(row["start"]) and a._goal == tuple(row["goal"])
    assert [a.move(d) for d in ("up", "left", "down")] == [b.move(d) for d in ("up", "left", "down")]
    with pytest.raises(ValueError, match="grid"):
        GridWorld().reset(question="Walk somewhere.\nno grid here")


# ----------------------------------------------------------------------------------- scripts/gridworld_failures.py
def _played(grid, moves, seed=0, **knobs) -> dict:
    """A predictions row of a real episode: the moves and what the environment answered."""
    start = next([r, c] for r, line in enumerate(grid) for c, x in enumerate(line) if x == "S")
    goal = next([r, c] for r, line in enumerate(grid) for c, x in enumerate(line) if x == "G")
    env = GridWorld(**knobs)
    env.reset(grid=grid, start=start, goal=goal, seed=seed)
    calls = [{"expression": m, "result": env.move(m), "ok": True} for m in moves]
    return {"id": f"g{len(moves)}-{seed}", "correct": env.reached, "tool_calls": calls}


def test_failure_breakdown_script(tmp_path):
    import gzip
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts/gridworld_failures.py"
    first = {s: _played(["O..", "S.G"], ["right"], s, slip_prob=1.0)["tool_calls"][0]["result"] for s in range(100)}
    slip_seed = next(s for s, result in first.items() if result.startswith("0 0 slip hole"))  # slipped up into the O
    cases = {
        "solved": _played(["SG"], ["right"], slip_prob=0.0),
        "walked into a hole, first move": _played(["SO", ".G"], ["right", "down"], slip_prob=0.0),
        "walked into a visible hole": _played(["S.O", "..G"], ["right", "right", "up"], slip_prob=0.0, view="local"),
        "walked into a hole": _played(["S.O", "..G"], ["right", "right"], slip_prob=0.0),
        "slipped into a hole": _played(["O..", "S.G"], ["right", "right"], slip_seed, slip_prob=1.0),
        "out of moves or stopped": _played(["S.G"], ["right", "right"], slip_prob=0.0, max_moves=1),
    }
    assert cases["walked into a visible hole"]["tool_calls"][-1]["result"] == "error: episode over"
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in cases.values())
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for kind in cases:
        assert re.search(rf"{re.escape(kind)}\s+1$", r.stdout, re.M), (kind, r.stdout)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"correct": true}\n{"id": 2}\n')
    r = subprocess.run([sys.executable, str(script), str(bad)], capture_output=True, text=True)
    assert r.returncode != 0 and "bad.jsonl:2" in r.stderr


def test_failure_breakdown_counts_looks(tmp_path):
    """A look is the observation before the move after it; episodes that looked are counted apart."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts/gridworld_failures.py"
    rows = [
        _played(["S.O", "..G"], ["right", "look", "right"], slip_prob=0.0, look=True),  # the look showed the O
        _played(["SG"], ["look", "right"], slip_prob=0.0, look=True),
        _played(["SG"], ["right"], slip_prob=0.0, look=True),
    ]
    assert rows[0]["tool_calls"][1]["result"] == "0 1 : # . S O"
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert re.search(r"walked into a visible hole\s+1$", r.stdout, re.M), r.stdout
    assert "looked at least once: 2 episodes, 1 solved; never looked: 1, 1 solved" in r.stdout
