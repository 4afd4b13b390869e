"""The mixture of tasks (envs/mixture.py): rows drawn by each member's own generator, tagged and interleaved;
episodes in the row's member environment; accuracy and the SFT -> GRPO test per member; members checked."""

from __future__ import annotations

import collections
import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agentrl.agent.tools import Call, split_annotated  # noqa: E402
from agentrl.envs import countdown, gridworld, mixture  # noqa: E402
from agentrl.envs.registry import episode_solved
from conftest import make_toolset, mini_params  # noqa: E402

MEMBERS = {
    "cd": {"environment": "countdown", "share": 0.5, "knobs": {"hard_share": 1.0}},
    "local": {"environment": "gridworld", "share": 0.25, "knobs": {"view": "local", "size": 3, "min_path": 2}},
    "look": {"environment": "gridworld", "share": 0.25, "knobs": {"look": True, "demo_look": 1.0}},
}


def rows(n: int = 12, seed: int = 0, split: str = "test", members=None, exclude=()) -> list[dict]:
    knobs = {"members": MEMBERS if members is None else members}
    return mixture.make_rows(n, random.Random(seed), split, env_knobs=knobs, exclude=exclude)


def test_rows_are_deterministic_tagged_split_by_share_and_interleaved():
    a = rows(12)
    assert a == rows(12) and a != rows(12, seed=1)
    assert collections.Counter(r["environment"] for r in a) == {"cd": 6, "local": 3, "look": 3}
    assert {(r["environment"], r["environment_task"]) for r in a} == {
        ("cd", "countdown"),
        ("local", "gridworld"),
        ("look", "gridworld"),
    }
    names = [r["environment"] for r in a]
    assert names != sorted(names, key=list(MEMBERS).index)  # interleaved, not one member after the other
    assert mixture.split_counts(10, mixture.parse_members(MEMBERS)) == {"cd": 5, "local": 3, "look": 2}


def test_each_members_rows_come_from_its_own_generator_and_knobs():
    a = rows(8)
    base = random.Random(0).getrandbits(64)  # make_rows' one draw from the split's generator
    for name, module in (("cd", countdown), ("look", gridworld)):
        spec = MEMBERS[name]
        gen = {k: v for k, v in spec["knobs"].items() if k in module.GEN_DEFAULTS}
        env = {k: v for k, v in spec["knobs"].items() if k in module.ENV_DEFAULTS}
        mine = [{k: v for k, v in r.items() if k not in mixture.TAG_FIELDS} for r in a if r["environment"] == name]
        expected = module.make_rows(len(mine), random.Random(f"mixture:{base}:{name}"), "test", env_knobs=env, **gen)
        assert sorted(mine, key=module.instance_key) == sorted(expected, key=module.instance_key)
    assert all(len(r["grid"]) == 3 for r in a if r["environment"] == "local")  # size 3 reached its member only
    assert all(len(r["grid"]) == 4 for r in a if r["environment"] == "look")
    # a member's rows do not depend on the other members
    only_cd = {"cd": MEMBERS["cd"], "other": {"environment": "gridworld", "share": 0.5}}
    assert [r for r in rows(8, members=only_cd) if r["environment"] == "cd"] == [
        r for r in a if r["environment"] == "cd"
    ]


def test_train_excludes_the_test_instances_across_members_of_one_task():
    test = rows(16)
    held_out = {mixture.instance_key(r) for r in test}
    train = rows(40, split="train", exclude=held_out)
    assert held_out.isdisjoint(mixture.instance_key(r) for r in train)
    assert len({mixture.instance_key(r) for r in train}) == len(train)  # the two gridworld members never repeat one
    assert any(r["demo_failed_tries"] for r in train if r["environment"] == "cd")  # hard_share 1.0 reached it


def test_an_episode_is_the_rows_member_environment_and_its_own_rule_decides():
    ts = make_toolset(None, "inline", environment="mixture", env_kwargs={"members": MEMBERS})
    assert set(ts.factory) == set(MEMBERS)  # the dict of factories TRL's environment_factory takes
    for r in rows(12, split="train"):
        ep = ts.episode(r)
        assert ep.broken is None
        if r["environment"] == "cd":
            assert isinstance(ep.env, countdown.Countdown) and ep.default_tool == "check"
        else:
            assert isinstance(ep.env, gridworld.GridWorld) and ep.default_tool == "move"
            assert (ep.env.view, ep.env.look) == (
                ("local", False) if r["environment"] == "local" else ("position", True)
            )
        for m in re.finditer(r"<<([^<>=]*)=([^<>]*)>>", r["answer"]):  # the demo replays: same answers, same end
            assert ep.run(Call("", {"expression": m.group(1)})) == (m.group(2), True)
        assert episode_solved(r, r["answer"], ep.env) is (r["environment"] == "cd" or r["answer"].endswith("goal"))
        replayed = split_annotated(r["answer"], "inline", episode=ts.episode(r))  # SFT's replay (sft_features)
        demo_results = [f"{m.group(1)}>>" for m in re.finditer(r"<<[^<>=]*=([^<>]*)>>", r["answer"])]
        assert [seg for seg, model_text in replayed if not model_text] == demo_results
    with pytest.raises(ValueError, match=r"mixture row 'x1': 'environment' must name a member \(cd, local, look\)"):
        ts.episode({"id": "x1", "numbers": [1, 2], "target": 3})
    with pytest.raises(ValueError, match="needs its row's 'environment'"):
        ts.run(Call("", {"expression": "1+2"}))


def test_score_reports_accuracy_per_environment_and_the_default_has_none():
    from agentrl.agent.loop import Rollout
    from agentrl.stages.evaluate import accuracy_by_environment, score

    ts = make_toolset(None, "inline", environment="mixture", env_kwargs={"members": MEMBERS})
    cd = {
        "numbers": [3, 5, 3],
        "target": 24,
        "ground_truth": "24",
        "environment": "cd",
        "environment_task": "countdown",
    }
    gw = {"grid": ["SG"], "start": [0, 0], "goal": [0, 1], "seed": 0, "ground_truth": "goal", "environment": "look"}
    cases = [(cd, [], "#### (3+5)*3", True), (cd, [], "#### 3*5+3", False), (cd, [], "#### 24", False)]
    cases += [(gw, ["right"], "#### goal", True), (gw, [], "#### goal", False)]
    test_rows, rollouts = [], []
    for i, (row, calls, text, _) in enumerate(cases):
        row = {**row, "id": f"r{i}", "question": "q"}
        ep = ts.episode(row)
        for arg in calls:
            ep.run(Call("", {"expression": arg}))
        test_rows.append(row)
        rollouts.append([Rollout(prompt_ids=[], text=text, finish_reason="stop", episode=ep)])
    samples = [[(text, 3)] for _, _, text, _ in cases]
    m, preds = score(test_rows, samples, {"accuracy": 1.0}, {}, rollouts)
    assert [p["correct"] for p in preds] == [c[3] for c in cases]
    assert [p["environment"] for p in preds] == ["cd"] * 3 + ["look"] * 2
    by = m["accuracy_by_environment"]
    assert (
        by["cd"]["n"] == 3
        and by["cd"]["accuracy"] == 1 / 3
        and by["look"]
        == {
            "n": 2,
            "accuracy": 0.5,
            "accuracy_ci95": [0.0945, 0.9055],  # Wilson 95% for 1 of 2
        }
    )
    with pytest.raises(ValueError, match="prediction 'z': no 'environment'"):
        accuracy_by_environment([*preds, {"id": "z", "correct": True}])
    plain = [{k: v for k, v in r.items() if k != "environment"} for r in test_rows]
    m, preds = score(plain, samples, {"accuracy": 1.0}, {}, None)
    assert "accuracy_by_environment" not in m and all("environment" not in p for p in preds)


def test_compare_pairs_sft_and_grpo_per_environment():
    from agentrl.stages.compare import mcnemar_exact, paired_by_environment

    def preds(flags: dict[str, list[int]]) -> list[dict]:
        return [
            {"id": f"{e}{i}", "correct": bool(c), "environment": e} for e, cs in flags.items() for i, c in enumerate(cs)
        ]

    sft = preds({"cd": [0, 0, 0, 1, 1], "look": [1, 1, 0]})
    grpo = preds({"cd": [1, 1, 1, 1, 0], "look": [1, 1, 0]})
    by = paired_by_environment(sft, grpo, seed=0)
    assert by["cd"]["sft_accuracy"] == 0.4 and by["cd"]["grpo_accuracy"] == 0.8 and by["cd"]["difference"] == 0.4
    assert (by["cd"]["only_before_correct"], by["cd"]["only_after_correct"]) == (1, 3)
    assert by["cd"]["p_value"] == mcnemar_exact(1, 3) and by["cd"]["n"] == 5
    assert by["look"]["difference"] == 0 and by["look"]["p_value"] == 1.0
    assert paired_by_environment([{"id": "a", "correct": True}], [{"id": "a", "correct": False}], 0) == {}


def _params_error(members) -> str:
    from agentrl.config import ParamsError, validate_params

    p = mini_params()
    p["environments"]["mixture"] = {"num_train": 4, "num_test": 2, "members": members}
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    return str(e.value)


@pytest.mark.parametrize(
    "change,match",
    [
        (("cd", "environment", "sokoban"), r"members\.cd\.environment: expected a registered task \(countdown, "),
        (("cd", "environment", "mixture"), r"members\.cd\.environment: expected a registered task"),
        (("cd", "knobs", {"num_numbrs": 4}), r"members\.cd\.knobs\.num_numbrs: unknown knob of countdown; known: "),
        (("cd", "knobs", {"use_all": 1}), r"members\.cd\.knobs\.use_all: expected bool, got 1"),
        (("cd", "knobs", {"num_train": 9}), r"members\.cd\.knobs\.num_train: set environments\.mixture\.num_train"),
        (("cd", "knobs", {"feedback": "loud"}), r"members\.cd\.knobs: countdown: feedback must be one of full, none"),
        (("cd", "share", 0.6), r"members: the shares must sum to 1, got 1\.1 \(cd 0\.6, local 0\.25, look 0\.25\)"),
        (("cd", "share", True), r"members\.cd\.share: expected a number in \(0, 1\], got True"),
        (("cd", "weight", 1), r"members\.cd\.weight: unknown key; expected environment, share, knobs"),
    ],
)
def test_bad_members_are_refused_naming_the_key(change, match):
    name, key, value = change
    members = {**MEMBERS, name: {**MEMBERS[name], key: value}}
    msg = _params_error(members)
    assert re.search(r"environments\.mixture\." + match, msg), msg


def test_bad_member_names_and_empty_mixtures_are_refused():
    from agentrl.config import ParamsError, validate_params

    p = mini_params()
    p["agent"].update(tools=[], environment="mixture")  # and no environments.mixture section
    with pytest.raises(ParamsError, match=r"agent.environment 'mixture' generates its rows from environments.mixture"):
        validate_params(p)
    assert "environments.mixture.members: member name 'grid-look' must be" in _params_error(
        {"grid-look": {"environment": "gridworld", "share": 1.0}}
    )
    assert "environments.mixture.members: expected a mapping of at least one member" in _params_error({})
    sums = {"environment": "reasoning_gym", "share": 1.0, "knobs": {"task": "chain_sum", "config": {"bogus": 1}}}
    assert "environments.mixture.members.sums.knobs.config.bogus: not a config key" in _params_error({"sums": sums})


def test_call_formats_refuse_what_they_cannot_drive():
    from agentrl.envs.mixture import member_factories

    with pytest.raises(
        ValueError, match=r"agent.format 'chat' renders one tool description .* \(cd: check; local: move"
    ):
        member_factories(MEMBERS, "chat")
    looks = {k: MEMBERS[k] for k in ("local", "look")}
    looks = {"local": {**looks["local"], "share": 0.5}, "look": {**looks["look"], "share": 0.5}}
    assert set(member_factories(looks, "chat")) == {"local", "look"}  # the same tool: one description serves all

    class TwoTools:
        def reset(self, **row):
            return None

        def a(self, x: str) -> str:
            """A.

            Args:
                x: x.
            """
            return x

        def b(self, x: str) -> str:
            """B.

            Args:
                x: x.
            """
            return x

    from agentrl.envs.tasks import ENVIRONMENTS

    two = {"two": {"environment": "countdown", "share": 1.0}}
    original = ENVIRONMENTS["countdown"]
    ENVIRONMENTS["countdown"] = TwoTools
    try:
        with pytest.raises(
            ValueError, match=r"members\.two: agent.format 'inline' .* drives one tool .* has 2 \(a, b\)"
        ):
            member_factories(two, "inline")
    finally:
        ENVIRONMENTS["countdown"] = original


def test_trls_loop_gets_a_dict_of_factories_in_the_chat_format():
    from types import SimpleNamespace

    from agentrl.config import validate_params
    from agentrl.stages.grpo import rollout_plan

    p = mini_params()
    grids = {"plain": {"environment": "gridworld", "share": 0.5}, "look": {**MEMBERS["look"], "share": 0.5}}
    p["agent"].update(tools=[], environment="mixture", format="chat")
    p["environments"]["mixture"] = {"num_train": 4, "num_test": 2, "members": grids}
    rollout, factory = rollout_plan(validate_params(p), SimpleNamespace(use_vllm=False), SimpleNamespace(eos_token="e"))
    assert rollout is None and set(factory) == {"plain", "look"}  # GRPOTrainer(environment_factory={name: factory})
    assert factory["look"]().look is True and factory["plain"]().look is False


def test_prepare_writes_tagged_rows_that_grpo_reads_as_one_table(workdir):
    from datasets import load_dataset

    from agentrl.config import validate_params
    from agentrl.data import load_jsonl
    from agentrl.stages import prepare

    p = mini_params()
    p["agent"].update(tools=[], environment="mixture", max_tool_calls=24)
    p["environments"]["mixture"] = {"num_train": 16, "num_test": 8, "members": MEMBERS}
    m = prepare.prepare(validate_params(p))
    assert m["written"] == {"sft_train": 16, "rl_train": 16, "test": 8} and m["source"] == "environment:mixture"
    test = load_jsonl("data/prepared/test.jsonl")
    assert collections.Counter(r["environment"] for r in test) == {"cd": 4, "local": 2, "look": 2}
    assert set(m["test_ceiling"]) == {"local", "look"}  # gridworld's ceiling per member; countdown has none
    look = [r for r in test if r["environment"] == "look"]
    assert m["test_ceiling"]["look"] == gridworld.ceiling(look, {"look": True}, {"demo_look": 1.0})
    rl = load_dataset("json", data_files="data/prepared/rl_train.jsonl", split="train")  # as grpo.train reads it
    assert sorted(collections.Counter(rl["environment"]).values()) == [4, 4, 8]
    ts = make_toolset(None, "inline", environment="mixture", env_kwargs={"members": MEMBERS})
    assert all(ts.episode(r).broken is None for r in rl)  # the other members' columns (None) do not disturb reset

    sums = {"environment": "reasoning_gym", "share": 0.5, "knobs": {"task": "chain_sum", "tool": "calculator"}}
    p["environments"]["mixture"]["members"] = {"cd": {**MEMBERS["cd"], "share": 0.5}, "sums": sums}
    m = prepare.prepare(validate_params(p))  # the reasoning-gym member's version is on record, wherever its rows are
    versions = {r.get("reasoning_gym_version") for r in load_jsonl("data/prepared/test.jsonl")}
    assert len(versions) == 2 and m["reasoning_gym_version"] in versions - {None}
    rl = load_dataset("json", data_files="data/prepared/rl_train.jsonl", split="train")
    ts = make_toolset(
        None, "inline", environment="mixture", env_kwargs={"members": p["environments"]["mixture"]["members"]}
    )
    assert all(ts.episode(r).broken is None for r in rl) and set(rl["environment"]) == {"cd", "sums"}


def test_member_fields_that_would_not_make_one_table_are_refused():
    mixture._check_columns({"a": [{"x": 1, "y": None}], "b": [{"x": 2.5, "y": "s"}]})  # int/float, None: one column
    with pytest.raises(ValueError, match=r"field 'x' values of different kinds: number \(member a\), str \(member b\)"):
        mixture._check_columns({"a": [{"x": 1}], "b": [{"x": "1"}]})
    with pytest.raises(ValueError, match=r"members\.a: its rows have a field 'environment', which the mixture sets"):
        mixture._check_columns({"a": [{"environment": "z"}]})
