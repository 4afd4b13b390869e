"""reasoning-gym tasks as a built-in environment (issue 42): seeded rows, knob errors, scoring by reasoning-gym's own
score_answer, prepare, a demonstration through the tool loop; and the environment contract (envs/contract.py) that
every registered task module and environment class satisfies."""

from __future__ import annotations

import hashlib
import json
import random
import types

import pytest
import reasoning_gym
from transformers import LogitsProcessor, LogitsProcessorList

from agentrl.envs import contract
from agentrl.envs import reasoning_gym_tasks as rgt
from conftest import make_toolset, mini_params, tiny_lm

CHAIN_SUM = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 3, "max_digits": 2}}


def rows_of(n: int, seed: int, split: str = "train", **knobs) -> list[dict]:
    return rgt.make_rows(n, random.Random(seed), split, **{**CHAIN_SUM, **knobs})


def digest(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def own_score(row: dict, answer: str) -> float:
    """reasoning-gym's score_answer, called here directly on a dataset object of the row's task and config."""
    config = json.loads(row["rg_config"])
    dataset = reasoning_gym.create_dataset(row["rg_task"], seed=1, size=1, **config)
    return dataset.score_answer(answer, json.loads(row["rg_entry"]))


# ----------------------------------------------------------------------------------- rows
def test_the_same_seed_gives_byte_identical_rows_and_another_seed_others():
    a, b = rows_of(30, seed=3), rows_of(30, seed=3)
    assert digest(a) == digest(b) and len(a) == 30
    c = rows_of(30, seed=4)
    assert {r["question"] for r in a} != {r["question"] for r in c}


def test_rows_are_the_recorded_bytes_in_any_process():
    """Seed 3's rows as reasoning-gym 0.1.25 and this generator made them when written (any PYTHONHASHSEED): a change
    of either changes the data, and a version bump must update PINNED_VERSION and this digest together."""
    assert rgt.PINNED_VERSION == "0.1.25"
    assert digest(rows_of(20, seed=3)) == "02feb07cbf7d8c2471068adb9bdcda3435d56490f99f7b8983de734c3c24b8a2"


def test_rows_carry_the_entry_its_answer_and_a_demonstration():
    for r in rows_of(20, seed=1):
        entry = json.loads(r["rg_entry"])
        assert set(entry) == {"question", "answer", "metadata"} and entry["question"] == r["question"]
        assert r["ground_truth"] == entry["answer"] and r["rg_task"] == "chain_sum"
        assert r["reasoning_gym_version"] == rgt.installed_version() == rgt.PINNED_VERSION
        expression = entry["metadata"]["expression"]
        assert r["answer"] == f"<<{expression}={entry['answer']}>>\n#### {entry['answer']}"
    assert all(r["answer"] == f"#### {r['ground_truth']}" for r in rows_of(5, seed=1, tool="none"))


def test_test_instances_are_excluded_from_training():
    rng = random.Random(0)
    knobs = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}  # ~200 instances
    test = rgt.make_rows(40, rng, "test", **knobs)
    seen = {rgt.instance_key(r) for r in test}
    train = rgt.make_rows(40, rng, "train", exclude=seen, **knobs)
    assert len(seen) == 40 and seen.isdisjoint(rgt.instance_key(r) for r in train)
    assert len({rgt.instance_key(r) for r in train}) == 40


def test_too_small_an_instance_space_says_what_to_change():
    knobs = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1, "min_digits": 1}}
    with pytest.raises(ValueError, match=r"only \d+ of 300 distinct chain_sum instances.*widen the config"):
        rgt.make_rows(300, random.Random(0), "train", **knobs)


def test_a_task_whose_answer_spans_lines_is_refused_by_name():
    with pytest.raises(ValueError, match=r"mini_sudoku entry 0 has answer .*must be one non-empty line"):
        rgt.make_rows(1, random.Random(0), "train", task="mini_sudoku")


def test_a_demonstration_calls_the_calculator_only_where_it_agrees_with_the_answer():
    entry = {"question": "q", "answer": "0", "metadata": {"expression": "6 + 10 * 0"}}  # reasoning-gym's left-to-right
    assert rgt.demonstration(entry, "calculator") == "#### 0"
    assert rgt.demonstration({**entry, "answer": "6"}, "calculator") == "<<6 + 10 * 0=6>>\n#### 6"
    assert rgt.demonstration({**entry, "answer": "6"}, "none") == "#### 6"
    assert rgt.demonstration({"question": "q", "answer": "4", "metadata": {}}, "calculator") == "#### 4"


def test_tool_share_keeps_the_rows_and_changes_only_which_demonstrations_call():
    """tool_share: the same rows (questions, answers, entries) in the same order; a share of the demonstrations that
    could call the calculator do, the rest are the answer alone; 1 (the default) is the rows without the knob."""
    every, half, never = (rows_of(400, seed=5, tool_share=s) for s in (1.0, 0.5, 0.0))
    assert digest(every) == digest(rows_of(400, seed=5))
    for rows in (half, never):
        assert [r["rg_entry"] for r in rows] == [r["rg_entry"] for r in every]
    assert all("<<" in r["answer"] for r in every) and not any("<<" in r["answer"] for r in never)
    calling = [r for r in half if "<<" in r["answer"]]
    assert 0.4 < len(calling) / len(half) < 0.6
    assert all(r["answer"] == e["answer"] for r, e in zip(half, every) if "<<" in r["answer"])
    assert all(r["answer"] == f"#### {r['ground_truth']}" for r in half if "<<" not in r["answer"])
    assert digest(half) == digest(rows_of(400, seed=5, tool_share=0.5))  # the draw is seeded


# ----------------------------------------------------------------------------------- knob errors
@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"config": {"min_term": 2}}, r"environments\.reasoning_gym\.config\.min_term: not a config key.*known: "
         r"allow_negation, max_digits, max_terms, min_digits, min_terms"),
        ({"config": {"min_terms": 0}}, r"environments\.reasoning_gym\.config\.min_terms: .*min_terms must be positive"),
        ({"config": {"min_terms": "2"}}, r"config\.min_terms: expected int"),
        ({"config": {"min_terms": 5, "max_terms": 3}}, r"min_terms/max_terms: .*max_terms must be >= min_terms"),
        ({"config": {"seed": 3}}, r"config\.seed: set from the run's seed"),
        ({"tool": "abacus"}, r"environments\.reasoning_gym\.tool: must be one of calculator, none"),
        ({"tool_share": 1.5}, r"environments\.reasoning_gym\.tool_share: a number from 0 to 1, got 1\.5"),
        ({"tool_share": True}, r"environments\.reasoning_gym\.tool_share: a number from 0 to 1, got True"),
        ({"task": "chain_summ"}, r"unknown reasoning-gym task 'chain_summ' \(did you mean chain_sum.*known .*gcd"),
    ],
)  # fmt: skip
def test_bad_knobs_name_the_field(knobs, match):
    with pytest.raises(ValueError, match=match):
        rgt.check_knobs(knobs)
    with pytest.raises(ValueError, match=match):  # make_rows checks the same way
        rgt.make_rows(1, random.Random(0), "train", **knobs)


def test_a_config_valid_only_as_a_whole_is_accepted():
    rgt.check_knobs({"task": "chain_sum", "config": {"min_terms": 1, "max_terms": 1}})  # max_terms 1 alone would fail


def test_params_validation_names_the_config_key():
    from agentrl.config import ParamsError, validate_params

    p = mini_params()
    p["agent"].update(tools=[], environment="reasoning_gym")
    p["environments"]["reasoning_gym"] = {"num_train": 4, "num_test": 2, "task": "gcd", "config": {"max_vlue": 9}}
    with pytest.raises(ParamsError, match=r"environments\.reasoning_gym\.config\.max_vlue: .*known: .*max_value"):
        validate_params(p)
    p["environments"]["reasoning_gym"]["config"] = {"max_value": 50}
    assert validate_params(p).environments["reasoning_gym"]["config"] == {"max_value": 50}


def test_another_installed_version_is_refused(monkeypatch):
    row = rows_of(1, seed=0)[0]
    assert rgt.correct(row, f"#### {row['ground_truth']}", None)
    monkeypatch.setattr(rgt, "installed_version", lambda: "0.0.1")
    with pytest.raises(ValueError, match=r"reasoning-gym 0\.0\.1 is installed, this code is pinned to 0\.1\.25"):
        rgt.check_knobs({})
    with pytest.raises(ValueError, match=r"0\.0\.1 is installed"):
        rgt.correct(row, f"#### {row['ground_truth']}", None)


# ----------------------------------------------------------------------------------- scoring
@pytest.mark.parametrize(
    "task, config",
    [("chain_sum", {}), ("gcd", {"max_value": 100}), ("number_sorting", {"max_numbers": 4}), ("leg_counting", {})],
)
def test_correct_agrees_with_score_answer(task, config):
    env = rgt.ReasoningGym()
    for row in rgt.make_rows(4, random.Random(2), "test", task=task, config=config, tool="none"):
        env.reset(**row)
        truth = row["ground_truth"]
        for answer in (truth, f"{truth}.", "7 7 7", f"it is {truth}"):
            expected = own_score(row, answer)
            assert rgt.score(row, f"some work\n#### {answer}") == expected
            assert rgt.correct(row, f"#### {answer}", env) == (expected >= 1.0) and env.last_score == expected
        assert rgt.correct(row, f"#### {truth}", env) and env.last_score == 1.0
        assert not rgt.correct(row, truth, env) and env.last_score == 0.0  # no #### line: the project's format


def test_bad_rows_name_the_field():
    row = rows_of(1, seed=0)[0]
    with pytest.raises(ValueError, match=r"row 'x': no 'rg_entry' field"):
        rgt.correct({"id": "x", **{k: v for k, v in row.items() if k != "rg_entry"}}, "#### 1", None)
    with pytest.raises(ValueError, match=r"row 'y': 'rg_entry' must be JSON text"):
        rgt.ReasoningGym().reset(**{**row, "id": "y", "rg_entry": "{oops"})


def test_episodes_solve_by_the_module_rule_through_the_registry():
    from agentrl.agent.tools import toolset_from_params
    from agentrl.envs.registry import episode_solved
    from agentrl.envs.tasks import ENVIRONMENTS, TASKS

    assert TASKS["reasoning_gym"] is rgt and ENVIRONMENTS["reasoning_gym"] is rgt.ReasoningGym
    row = rows_of(1, seed=0)[0]
    env = rgt.ReasoningGym()
    env.reset(**row)
    assert episode_solved(row, f"#### {row['ground_truth']}", env) is True
    assert episode_solved(row, "#### 123456", env) is False
    agent = types.SimpleNamespace(
        tools=[], environment="reasoning_gym", format="inline", max_tool_calls=2, max_expression_chars=200,
        tool_timeout_s=None,
    )  # fmt: skip
    assert toolset_from_params(agent, env_params={"reasoning_gym": CHAIN_SUM}).default_tool == "calculator"


# ----------------------------------------------------------------------------------- prepare and the loop
def test_prepare_writes_rows_that_reset_and_score(workdir):
    from agentrl.config import validate_params
    from agentrl.data import load_jsonl
    from agentrl.stages import prepare

    p = mini_params()
    p["agent"].update(tools=[], environment="reasoning_gym")
    p["environments"]["reasoning_gym"] = {"num_train": 12, "num_test": 4, **CHAIN_SUM}
    m = prepare.prepare(validate_params(p))
    sft, rl, test = (load_jsonl(f"data/prepared/{s}.jsonl") for s in ("sft_train", "rl_train", "test"))
    assert m["written"] == {"sft_train": 12, "rl_train": 12, "test": 4} and m["source"] == "environment:reasoning_gym"
    assert m["reasoning_gym_version"] == rgt.PINNED_VERSION and m["demo_calls_per_example"] == 1.0
    assert {rgt.instance_key(r) for r in test}.isdisjoint(rgt.instance_key(r) for r in sft)
    ts = make_toolset(None, "inline", environment="reasoning_gym")
    for r in sft:
        ep = ts.episode(r)
        assert ep.broken is None and ep.env.entry == json.loads(r["rg_entry"])
        assert rgt.correct(r, r["completion"][0]["content"], ep.env)
    assert all(rgt.correct(r, f"#### {r['ground_truth']}", None) for r in rl + test)


class Forced(LogitsProcessor):
    """Forces each row to write its trace's completion (tool tokens come from the loop, so a result that differs
    from the demonstration's would shift the script)."""

    def __init__(self, tok, traces: list[dict]):
        self.tok, self.traces = tok, traces

    def __call__(self, input_ids, scores):
        for r in range(input_ids.shape[0]):
            row = [t for t in input_ids[r].tolist() if t != self.tok.pad_token_id]
            t = next(t for t in self.traces if row[: len(t["prompt_ids"])] == t["prompt_ids"])
            pos = len(row) - len(t["prompt_ids"])
            want = t["completion_ids"][pos] if pos < len(t["completion_ids"]) else self.tok.eos_token_id
            scores[r, :] = -1e9
            scores[r, want] = 0
        return scores


def test_a_demonstration_replayed_through_the_loop_is_solved():
    import torch

    from agentrl.agent.loop import generate_with_tools, tokenize_trace
    from agentrl.agent.tools import split_annotated
    from agentrl.data import messages

    rows = [{**r, "id": f"rg-{i}"} for i, r in enumerate(rows_of(3, seed=9, task="basic_arithmetic", config={}))]
    tok, model = tiny_lm([r["question"] + r["answer"] for r in rows] * 3, 300)
    ts = make_toolset(None, "inline", max_calls=2, environment="reasoning_gym", eos_token=tok.eos_token)
    prompts = [messages("", r["question"]) for r in rows]
    traces = [tokenize_trace(tok, p, split_annotated(r["answer"], "inline", tok.eos_token, ts.episode(r)))
              for p, r in zip(prompts, rows)]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = generate_with_tools(model.eval(), tok, prompts, ts, 200, rows=rows,
                                  logits_processor=LogitsProcessorList([Forced(tok, traces)]))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert any("<<" in r["answer"] for r in rows)
    for (roll,), r in zip(out, rows):
        assert roll.text == r["answer"] and roll.finish_reason == "stop"
        assert len(roll.calls) == r["answer"].count("<<") and all(c["ok"] for c in roll.calls)
        assert rgt.correct(r, roll.text, roll.episode.env) and roll.episode.env.last_score == 1.0


# ----------------------------------------------------------------------------------- the contract
def test_every_registered_task_and_environment_satisfies_the_contract():
    from agentrl.envs import mixture
    from agentrl.envs.tasks import ENVIRONMENTS, TASKS

    for name, module in [*TASKS.items(), ("mixture", mixture)]:  # the mixture generates rows as a task does
        contract.check_task_module(module)
        assert isinstance(module, contract.TaskModule), name
    assert isinstance(rgt, contract.KnobCheckingTask)
    for cls in ENVIRONMENTS.values():
        contract.check_environment_class(cls)


def test_a_module_missing_a_member_fails_the_contract():
    fake = types.ModuleType("fake_task")
    for name in ("GEN_DEFAULTS", "ENV_DEFAULTS", "make_rows", "instance_key", "correct"):
        setattr(fake, name, getattr(rgt, name))
    contract.check_task_module(fake)
    del fake.instance_key
    assert not isinstance(fake, contract.TaskModule)
    with pytest.raises(TypeError, match=r"fake_task: missing instance_key"):
        contract.check_task_module(fake)
    fake.instance_key = lambda row, extra: ""
    with pytest.raises(TypeError, match=r"fake_task\.instance_key: takes 1 argument"):
        contract.check_task_module(fake)
    fake.instance_key, fake.make_rows = rgt.instance_key, lambda n, rng: []
    with pytest.raises(TypeError, match=r"fake_task\.make_rows: parameters must be"):
        contract.check_task_module(fake)


def test_an_environment_without_typed_documented_tools_fails_the_contract():
    class NoTools:
        def reset(self, **row):
            return None

    class Untyped(NoTools):
        def act(self, x):
            """Act.

            Args:
                x: what.
            """

    class Undocumented(NoTools):
        def act(self, x: str) -> str:
            return x

    class RowByName:
        def reset(self, row):
            return None

    cases = [
        (NoTools, "no public tool"),
        (Untyped, r"act: tool argument\(s\) \['x'\] have no type hint"),
        (Undocumented, "act: a tool needs a Google docstring"),
        (RowByName, r"reset: must take the row"),
    ]
    for cls, match in cases:
        with pytest.raises(TypeError, match=match):
            contract.check_environment_class(cls)
