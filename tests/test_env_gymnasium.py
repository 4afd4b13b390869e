"""Gymnasium toy-text adapter: value iteration, the act tool per family, seeded demos that replay, refusals."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from agentrl.envs import gymnasium_toytext as gt
from agentrl.envs.gymnasium_toytext import GymnasiumEnv, correct, make_rows

CALL = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
DETERMINISTIC = {"env_kwargs": {"map_name": "4x4", "is_slippery": False}}
SLIPPERY = {"env_kwargs": {"is_slippery": True, "success_rate": 0.8}}
FOUR_BY_FOUR = ["SFFF", "FHFH", "FFFH", "HFFG"]  # gymnasium's MAPS["4x4"]


def table_of(**knobs) -> gt.Table:
    return GymnasiumEnv(**knobs).table


def replay(row: dict, knobs: dict) -> GymnasiumEnv:
    """A fresh env reset with the row, fed the demonstration's actions; asserts every answer is the recorded one."""
    env = GymnasiumEnv(**knobs)
    env.reset(**row)
    calls = CALL.findall(row["answer"])
    assert calls and row["answer"].count("<<") == len(calls)
    for action, answer in calls:
        assert env.act(action) == answer
    return env


# ----------------------------------------------------------------------------------- value iteration
def test_value_iteration_policy_solves_deterministic_frozenlake():
    env = GymnasiumEnv(**DETERMINISTIC)
    env.reset(seed=0)
    while not env.done:
        env.act(env.action_names[env._teacher_action()])
    assert env.solved and env.steps == 6 and env.get_reward() == 1.0  # the shortest path around the holes


def test_value_iteration_values_match_the_known_case():
    """Deterministic 4x4 FrozenLake: the goal is 6 steps from S, so V(S) = gamma^5 (reward 1 on the 6th step)."""
    table = table_of(**DETERMINISTIC, max_steps=100)
    values, actions = gt.value_iteration(table, 100, gamma=0.9)
    assert values[100, 0] == pytest.approx(0.9**5)
    assert values[100, 14] == pytest.approx(1.0)  # next to G
    assert values[5, 0] == 0.0 and values[6, 0] == pytest.approx(0.9**5)  # 5 steps left: G out of reach
    assert (actions[0] == -1).all() and actions[100, 14] == 2  # right, into G


def test_value_iteration_on_slippery_frozenlake_matches_monte_carlo():
    """The undiscounted value with k steps left is the chance to reach G within k steps: check it by playing."""
    knobs = {**SLIPPERY, "max_steps": 12}
    env = GymnasiumEnv(**knobs)
    goal = gt.goal_rewards(env.table)
    values, actions = gt.value_iteration(env.table, 12, rewards=goal)
    reached = 0
    for seed in range(600):
        env.reset(seed=seed)
        while not env.done:
            env.act(str(int(actions[12 - env.steps, env.state])))
        reached += env.solved
    assert abs(reached / 600 - values[12, 0]) < 0.05
    assert 0.3 < values[12, 0] < 1.0


@pytest.mark.parametrize(
    "knobs,n,steps,total",
    [
        ({"env_id": "CliffWalking-v1", "max_steps": 30}, 1, 13, -13.0),  # up, 11 right along the cliff, down
        ({"env_id": "Taxi-v4", "max_steps": 40}, 5, None, None),
    ],
)
def test_teacher_solves_cliffwalking_and_taxi(knobs, n, steps, total):
    for row in make_rows(n, random.Random(1), "test", env_knobs=knobs):  # CliffWalking has one episode
        env = replay(row, knobs)
        assert env.solved and correct(row, "", env) and row["answer"].endswith("\n#### goal")
        if steps is not None:
            assert env.steps == steps and env.get_reward() == total
        else:
            assert env.get_reward() == 20 - (env.steps - 1)  # Taxi: +20 delivering, -1 per other step, no -10


def test_goal_rewards_pick_the_best_terminal_transition():
    frozen = gt.goal_rewards(table_of(**DETERMINISTIC))
    assert frozen.sum() > 0 and set(table_of(**DETERMINISTIC).next_state[frozen > 0].tolist()) == {15}
    cliff = table_of(env_id="CliffWalking-v1")
    assert (gt.goal_rewards(cliff) == cliff.terminated).all()  # its only terminal transitions enter the goal


def test_teacher_value_matches_the_environment_and_optimal_is_not_below():
    knobs = {**SLIPPERY, "max_steps": 10}
    rows = make_rows(40, random.Random(2), "test", env_knobs=knobs, map_size=4, demo_explore=0.3)
    c = gt.ceiling(rows, knobs, {"map_size": 4, "demo_explore": 0.3})
    assert 0 < c["demo_policy"] < c["optimal"] <= 1
    assert abs(c["demo_reached"] - c["demo_policy"]) < 0.2  # 40 draws of the slips vs their expectation
    assert gt.ceiling(rows, knobs, {"map_size": 4})["demo_policy"] > c["demo_policy"]  # exploring costs


# ----------------------------------------------------------------------------------- rows and demos
def test_rows_are_byte_identical_for_a_seed():
    make = lambda: make_rows(20, random.Random(7), "train", env_knobs=SLIPPERY, map_size=4)  # noqa: E731
    a, b = make(), make()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a != make_rows(20, random.Random(8), "train", env_knobs=SLIPPERY, map_size=4)


@pytest.mark.parametrize("split", ["train", "test"])
def test_demos_replay_through_a_fresh_env(split):
    knobs = {**SLIPPERY, "max_steps": 12}
    rows = make_rows(40, random.Random(3), split, env_knobs=knobs, map_size=4)
    for row in rows:
        env = replay(row, knobs)
        assert env.done
        assert row["answer"].endswith("\n#### goal" if env.solved else "\n#### fail")
        assert (row["demo_steps"], row["demo_slips"], row["demo_return"]) == (env.steps, env.slips, env.total)
        assert row["question"].splitlines()[1:] == [" ".join(line) for line in row["desc"]]
        if split == "train":
            assert env.solved
    assert any(r["demo_slips"] for r in rows)  # slips and the re-planning after them are in the data
    if split == "test":
        assert not all(r["answer"].endswith("goal") for r in rows)  # unlucky seeds stay in the test split


def test_exclude_and_instance_key():
    test = make_rows(10, random.Random(4), "test", env_knobs=SLIPPERY, map_size=4)
    keys = {gt.instance_key(r) for r in test}
    assert len(keys) == 10
    train = make_rows(10, random.Random(4), "train", env_knobs=SLIPPERY, map_size=4, exclude=keys)
    assert keys.isdisjoint(gt.instance_key(r) for r in train)


def test_looking_demos_look_before_every_action_on_the_same_slips():
    knobs = {**SLIPPERY, "look": True}
    plain = make_rows(30, random.Random(5), "test", env_knobs=knobs, map_size=4)
    looked = make_rows(30, random.Random(5), "test", env_knobs=knobs, map_size=4, demo_look=1.0)
    for a, b in zip(plain, looked):
        moves = [c for c in CALL.findall(b["answer"]) if c[0] != "look"]
        assert moves == CALL.findall(a["answer"])  # looking draws no slip and uses no step
        assert len(CALL.findall(b["answer"])) == 2 * len(moves)
        replay(b, knobs)


def test_a_hidden_map_prompt_gives_size_start_and_goal_and_changes_nothing_else():
    knobs = {**SLIPPERY, "look": True}
    shown = make_rows(20, random.Random(5), "train", env_knobs=knobs, map_size=4, demo_look=0.5)
    hidden = make_rows(20, random.Random(5), "train", env_knobs=knobs, map_size=4, demo_look=0.5, show_map=False)
    for a, b in zip(shown, hidden):
        assert {k: v for k, v in a.items() if k != "question"} == {k: v for k, v in b.items() if k != "question"}
        goal = next(f"{r} {line.index('G')}" for r, line in enumerate(b["desc"]) if "G" in line)
        assert b["question"] == f"Walk from S to G on a 4x4 lake with holes you cannot see. S: 0 0. G: {goal}."
        replay(b, knobs)
    with pytest.raises(ValueError, match="without its map .*show_map: false.* pass the row's 'seed' and 'desc'"):
        GymnasiumEnv(**knobs).reset(question=hidden[0]["question"])  # a served prompt: nothing to rebuild it from


def test_train_rows_of_every_episode_are_drawn_as_the_held_out_rows_are():
    """train_solved_only: false: the train split keeps the teacher's failed runs too (they end `#### fail`), so
    its rows come from the held-out rows' distribution; the default keeps only the wins."""
    every = make_rows(40, random.Random(9), "train", env_knobs=SLIPPERY, map_size=4, train_solved_only=False)
    held_out = make_rows(40, random.Random(9), "test", env_knobs=SLIPPERY, map_size=4)
    assert every == held_out
    assert any(r["answer"].endswith("#### fail") for r in every)
    wins = make_rows(40, random.Random(9), "train", env_knobs=SLIPPERY, map_size=4)
    assert all(r["answer"].endswith("#### goal") for r in wins)
    with pytest.raises(ValueError, match=r"environments\.gymnasium\.train_solved_only: expected true or false"):
        make_rows(1, random.Random(0), "train", train_solved_only=1)


def test_look_answers_the_cells_around_without_a_step():
    env = GymnasiumEnv(**DETERMINISTIC, look=True)
    env.reset(seed=0)
    assert env.act("look") == "0 0 : # F # F"  # up, down, left, right
    assert env.steps == 0 and env.act("down") == "1 0"
    assert env.act("look") == "1 0 : S F # H"
    with pytest.raises(ValueError, match="environments.gymnasium.look"):
        GymnasiumEnv(env_id="Taxi-v4", look=True)


# ----------------------------------------------------------------------------------- the act tool
def test_frozenlake_answers_positions_holes_goal_and_refuses_after_the_end():
    env = GymnasiumEnv(**DETERMINISTIC)
    env.reset(seed=0)
    assert env.act("right") == "0 1" and env.act("down") == "1 1 hole"
    assert env.done and not env.solved and env.get_reward() == 0.0 and env.failed_tries == 1
    assert env.act("down") == "error: episode over"
    env.reset(seed=0)
    assert [env.act(a) for a in ("down", "1", "right", "down", "right", "right")][-1] == "3 3 goal"
    assert env.solved and correct({}, "#### fail", env)  # the env decides, not the text


def test_max_steps_is_the_time_limit():
    env = GymnasiumEnv(**DETERMINISTIC, max_steps=3)
    env.reset(seed=0)
    assert [env.act("left") for _ in range(3)] == ["0 0", "0 0", "0 0 timeout"]
    assert env.done and not env.solved and env.act("left") == "error: episode over"


@pytest.mark.parametrize("bad", ["jump", "", "4", "-1", "x" * 50, None, 3])
def test_bad_actions_are_errors_not_raises(bad):
    env = GymnasiumEnv(**DETERMINISTIC)
    env.reset(seed=0)
    assert env.act(bad).startswith("error:") and env.steps == 0 and env.failed_tries == 1


def test_act_before_reset_is_an_error():
    assert GymnasiumEnv().act("left") == "error: no episode, call reset first"


def test_cliffwalking_episode_reports_the_cliff():
    env = GymnasiumEnv(env_id="CliffWalking-v1", max_steps=20)
    env.reset(seed=0)
    assert env.act("right") == "3 0 cliff"  # back to the start, -100
    assert env.get_reward() == -100.0 and not env.done
    answers = [env.act(a) for a in ["up"] + ["right"] * 11 + ["down"]]
    assert answers[-1] == "3 11 goal" and env.solved and env.get_reward() == -113.0


def test_taxi_episode_reports_passenger_destination_and_illegal_moves():
    env = GymnasiumEnv(env_id="Taxi-v4", max_steps=50)
    env.reset(seed=3)
    r, c, passenger, destination = env._env.unwrapped.decode(env.state)
    assert env.act("dropoff") == f"{r} {c} {'RGYB'[passenger]} {'RGYB'[destination]} illegal"
    assert env.get_reward() == -10.0 and not env.done


def test_slippery_frozenlake_says_slip_when_the_likely_outcome_did_not_happen():
    env = GymnasiumEnv(**SLIPPERY)
    slips = 0
    for seed in range(50):
        env.reset(seed=seed)
        answer = env.act("down")  # from S: intended (1, 0); a slip goes left (wall: stays) or right (0, 1)
        assert answer in ("1 0", "0 0 slip", "0 1 slip")
        slips += answer.endswith("slip")
    assert 0 < slips < 25


def test_other_discrete_envs_fall_back_to_numbered_actions_and_states():
    """An env outside the known families: actions by number, states as 'state N' (a FrozenLake subclass
    registered under its own name stands in for one)."""
    import gymnasium
    from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv

    class Lake(FrozenLakeEnv):
        pass

    gymnasium.register("agentrl-test/Lake-v0", entry_point=Lake, kwargs={"is_slippery": False})
    env = GymnasiumEnv(env_id="agentrl-test/Lake-v0")
    assert env.action_names == ("0", "1", "2", "3")
    env.reset(seed=0)
    assert env.act("2") == "state 1" and env.act("1") == "state 5 end"
    row = make_rows(1, random.Random(0), "train", env_knobs={"env_id": "agentrl-test/Lake-v0"})[0]
    assert row["answer"].endswith("=state 15 goal>>\n#### goal")


# ----------------------------------------------------------------------------------- refusals
def test_unknown_env_id_names_the_knob():
    with pytest.raises(ValueError, match=r"environments\.gymnasium\.env_id: 'NoSuchEnv-v0' is not a registered"):
        GymnasiumEnv(env_id="NoSuchEnv-v0")
    with pytest.raises(ValueError, match="environments.gymnasium.env_id: 'Taxi-v3'.*Taxi-v4"):
        GymnasiumEnv(env_id="Taxi-v3")  # gymnasium 1.4 says which version to use


def test_non_discrete_env_is_refused():
    with pytest.raises(ValueError, match=r"environments\.gymnasium\.env_id: 'CartPole-v1' has observation space Box"):
        GymnasiumEnv(env_id="CartPole-v1")


@pytest.mark.parametrize(
    "knobs,field",
    [
        ({"env_kwargs": {"no_such_kwarg": 1}}, "env_kwargs"),
        ({"env_kwargs": {"render_mode": "ansi"}}, "env_kwargs"),
        ({"env_kwargs": "is_slippery"}, "env_kwargs"),
        ({"max_steps": 0}, "max_steps"),
        ({"look": "yes"}, "look"),
        ({"env_id": ""}, "env_id"),
    ],
)
def test_bad_env_knobs_name_the_field(knobs, field):
    with pytest.raises(ValueError, match=rf"environments\.gymnasium[.:] ?{field}|environments\.gymnasium: .*{field}"):
        GymnasiumEnv(**knobs)


@pytest.mark.parametrize(
    "gen,field",
    [({"map_size": 1}, "map_size"), ({"map_frozen": 0.0}, "map_frozen"), ({"demo_explore": 1.0}, "demo_explore")],
)
def test_bad_generation_knobs_name_the_field(gen, field):
    with pytest.raises(ValueError, match=rf"environments\.gymnasium\.{field}"):
        make_rows(1, random.Random(0), "test", **gen)


def test_random_maps_and_looks_need_frozenlake():
    with pytest.raises(ValueError, match="map_size: random maps are FrozenLake's"):
        make_rows(1, random.Random(0), "test", env_knobs={"env_id": "Taxi-v4"}, map_size=4)
    with pytest.raises(ValueError, match="demo_look > 0 needs the look action"):
        make_rows(1, random.Random(0), "test", demo_look=0.5)
    with pytest.raises(ValueError, match="show_map: only FrozenLake's prompt shows a map; Taxi-v4"):
        make_rows(1, random.Random(0), "test", env_knobs={"env_id": "Taxi-v4"}, show_map=False)
    with pytest.raises(ValueError, match=r"environments\.gymnasium\.show_map: expected true or false, got 'no'"):
        make_rows(1, random.Random(0), "test", show_map="no")


@pytest.mark.parametrize(
    "row,field",
    [
        ({}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"seed": 1, "desc": ["SFX", "FFG"]}, "desc"),
        ({"seed": 1, "env_id": "Taxi-v4"}, "env_id"),
        ({"seed": 1, "start": 5}, "start"),
    ],
)
def test_bad_rows_name_the_field(row, field):
    with pytest.raises(ValueError, match=field):
        GymnasiumEnv().reset(id="r1", **row)


def test_a_deterministic_env_draws_distinct_episodes_or_says_it_cannot():
    """Issue 56 item 2: CliffWalking-v1 gave one distinct episode across 224 rows, and 9 of 24 Taxi-v4 test prompts
    were training prompts: rows were told apart by their seed, which draws nothing in a deterministic env. Now such
    an env's episodes are keyed by their map and start: Taxi's held-out episodes are distinct and never trained
    on, and CliffWalking (one start) refuses to make a second episode, saying why."""
    taxi = {"env_id": "Taxi-v4", "env_kwargs": {}, "max_steps": 40}
    test = make_rows(24, random.Random(0), "test", env_knobs=taxi)
    train = make_rows(150, random.Random(1), "train", env_knobs=taxi, exclude={gt.instance_key(r) for r in test})
    assert len({r["question"] for r in test}) == 24
    assert not {r["question"] for r in test} & {r["question"] for r in train}
    with pytest.raises(ValueError, match=r"only 1 distinct test episodes of CliffWalking-v1 .* it is deterministic"):
        make_rows(2, random.Random(0), "test", env_knobs={"env_id": "CliffWalking-v1", "env_kwargs": {}})
    slippery = make_rows(5, random.Random(0), "test", env_knobs=SLIPPERY)  # one map, but the seed draws the slips
    assert len({gt.instance_key(r) for r in slippery}) == 5


def test_impossible_request_says_what_to_change():
    with pytest.raises(ValueError, match="raise max_steps"):
        make_rows(2, random.Random(0), "train", env_knobs={"max_steps": 3})


def test_reset_reads_the_map_from_a_served_prompt():
    row = make_rows(1, random.Random(6), "test", env_knobs=SLIPPERY, map_size=4)[0]
    a, b = GymnasiumEnv(**SLIPPERY), GymnasiumEnv(**SLIPPERY)
    a.reset(prompt=[{"role": "user", "content": row["question"]}])
    b.reset(question=row["question"])
    assert a._map() == row["desc"]
    assert [a.act(x) for x in ("down", "right", "down")] == [b.act(x) for x in ("down", "right", "down")]


# ----------------------------------------------------------------------------------- TRL shape and registry
def test_one_public_tool_with_one_string_parameter():
    import inspect

    from transformers.utils import get_json_schema

    public = [n for n, _ in inspect.getmembers(GymnasiumEnv, predicate=inspect.isfunction) if not n.startswith("_")]
    assert sorted(public) == ["act", "get_reward", "reset"]
    schema = get_json_schema(GymnasiumEnv().act)["function"]
    assert list(schema["parameters"]["properties"]) == ["action"]
    assert schema["parameters"]["properties"]["action"]["type"] == "string"


def test_defaults_are_the_signature_defaults_and_the_config_validates_them():
    from agentrl.config import Params

    env = GymnasiumEnv()
    assert {"env_id": env.env_id, "env_kwargs": env.env_kwargs, "max_steps": env.max_steps, "look": env.look} == (
        gt.ENV_DEFAULTS
    )
    validate = Params._environments.__func__
    knobs = {"num_train": 2, "num_test": 2, "env_kwargs": {"is_slippery": True}, "map_size": 4}
    assert validate(Params, {"gymnasium": knobs})["gymnasium"] == knobs
    with pytest.raises(ValueError, match="gymnasium.env_kwargs: expected dict"):
        validate(Params, {"gymnasium": {**knobs, "env_kwargs": "is_slippery"}})


def test_registered_and_solved_by_the_environment():
    from agentrl.envs import registry as tools
    from agentrl.envs.tasks import ENVIRONMENTS, TASKS

    assert ENVIRONMENTS["gymnasium"] is GymnasiumEnv and TASKS["gymnasium"] is gt
    row = make_rows(1, random.Random(0), "train", env_knobs=DETERMINISTIC)[0]
    env = replay(row, DETERMINISTIC)
    assert tools.episode_solved(row, "", env) is True
    env.reset(**row)
    env.act("right"), env.act("down")  # into the hole at (1, 1)
    assert tools.episode_solved(row, "#### goal", env) is False


def test_demos_replay_through_the_inline_tool_loop():
    """SFT replays a demonstration's calls in a fresh episode of the Toolset: the results are the recorded ones."""
    from agentrl.agent.tools import Toolset, split_annotated

    row = make_rows(1, random.Random(9), "train", env_knobs=SLIPPERY, map_size=4)[0]
    ts = Toolset(
        None, "inline", max_calls=20, max_expression_chars=64, timeout_s=None, environment="gymnasium",
        env_kwargs=SLIPPERY,
    )  # fmt: skip
    segments = split_annotated(row["answer"], "inline", episode=ts.episode(row))
    results = [text[:-2] for text, by_model in segments if not by_model]
    assert results == [answer for _, answer in CALL.findall(row["answer"])]


def test_table_is_flat_and_complete():
    table = table_of(env_id="Taxi-v4")
    assert table.n_states == 500 and table.n_actions == 6
    per_pair = np.zeros((500, 6))
    np.add.at(per_pair, (table.state, table.action), table.prob)
    assert np.allclose(per_pair, 1.0)
