"""Countdown environment: checker, solver, generator, demos, hostile input, episode isolation, tool schema."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from fractions import Fraction

import pytest

from agentrl.envs import countdown as cd
from agentrl.envs.countdown import Countdown, correct, evaluate, make_rows, solve

CALL = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
ROW = {"id": "r1", "numbers": [3, 5, 3], "target": 24, "prompt": "ignored", "ground_truth": "24"}


def episode(**knobs) -> Countdown:
    env = Countdown(**knobs)
    assert env.reset(**ROW) is None
    return env


def final_expression(answer: str) -> str:
    last = answer.splitlines()[-1]
    assert last.startswith("#### ")
    return last[5:]


# ----------------------------------------------------------------------------------- checker / tool
@pytest.mark.parametrize(
    "expression, expected",
    [
        ("(3+5)*3", "24 yes"),
        ("3*(5+3)", "24 yes"),
        (" ( 3 + 5 ) * 3 ", "24 yes"),
        ("((((3+5))))*3", "24 yes"),
        ("(" * 40 + "3+5" + ")" * 40 + "*3", "24 yes"),  # deep but within the length cap: parses
        ("3*5+3", "18 low"),
        ("3*5*3", "45 high"),
        ("3/5+3", "18/5 low"),  # exact fractions
        ("3-5-3", "-5 low"),
        ("3-(5-3)", "1 low"),
        ("7+5*3", "error: 7 not given"),
        ("03+5*3", "error: 03 not given"),
        ("3+3", "error: 5 unused"),
        ("3*3*3*5", "error: 3 used 3 times"),
        ("5*5+3+3", "error: 5 used twice"),
        ("5/(3-3)", "error: division by zero"),
        ("", "error: not an expression"),
        ("   ", "error: not an expression"),
        ("3 5 3", "error: not an expression"),
        ("-3+5*3", "error: not an expression"),  # no unary minus
        ("3**5*3", "error: not an expression"),
        ("3//5+3", "error: not an expression"),
        ("(3+5*3", "error: not an expression"),
        ("3+5)*3", "error: not an expression"),
        ("()", "error: not an expression"),
        ("__import__('os').system('true')", "error: not an expression"),
        ("3.0*5+3", "error: not an expression"),
        ("３+5*3", "error: not an expression"),  # full-width digit: isdigit() is True, int() would accept it
        ("٣+5*3", "error: not an expression"),
        ("3+5*3\x00", "error: not an expression"),
        ("9" * 10_000, "error: longer than 100 characters"),
        ("(" * 1000 + "3" + ")" * 1000, "error: longer than 100 characters"),
    ],
)
def test_check_answers(expression, expected):
    env = episode()
    assert env.check(expression) == expected
    assert env.turns == 1
    assert env.failed_tries == (0 if expected.endswith("yes") else 1)
    assert env.solved == expected.endswith("yes")


@pytest.mark.parametrize("arg", [5, 24, None, [1, 2], {"expression": "(3+5)*3"}, 3.5, b"(3+5)*3", True])
def test_non_string_arguments_are_errors_not_raises(arg):
    env = episode()
    out = env.check(arg)
    assert out == "error: expression must be a string"
    assert (env.turns, env.failed_tries, env.solved) == (1, 1, False)


def test_results_fit_the_inline_annotation():
    env = episode()
    for expr in ["(3+5)*3", "3/5+3", "3+3", "9" * 10_000, "<<3=4>>", "a>b", "5/(3-3)"]:
        out = env.check(expr)
        assert "<" not in out and ">" not in out and len(out) <= 40, out


def test_use_all_knob():
    assert episode(use_all=True).check("3*5+3") == "18 low"
    assert episode(use_all=True).check("5*3") == "error: 3 unused"
    assert episode(use_all=False).check("5*3") == "15 low"
    assert episode(use_all=False).check("5+3+3") == "11 low"
    assert episode(use_all=False).check("3*3*5*3") == "error: 3 used 3 times"
    assert episode(use_all=False).check("8*3") == "error: 8 not given"


def test_a_repeated_try_is_flagged_and_counted():
    env = episode()
    tries = ["3*5+3", "3 * 5 + 3", "(3+5)*3", "(3+5)*3", "7+5*3", "7+5*3", "3*5+3" + " " * 100, "5 3*3", "53*3"]
    assert [env.check(e) for e in tries] == [
        "18 low",
        "error: tried before",  # the same tokens, spaces aside
        "24 yes",
        "24 yes",  # on target is always said so
        "error: 7 not given",
        "error: 7 not given",  # an illegal try is not remembered: its error says it again
        "error: longer than 100 characters",
        "error: not an expression",  # "5 3": two numbers side by side ...
        "error: 53 not given",  # ... "53" one: not the same try
    ]
    assert (env.turns, env.failed_tries, env.solved) == (9, 7, True)
    env.reset(numbers=[3, 5, 3], target=24)  # a new episode has tried nothing
    assert env.check("3*5+3") == "18 low"
    off = episode(flag_repeats=False)
    assert [off.check("3*5+3"), off.check("3*5+3")] == ["18 low", "18 low"]
    assert episode(feedback="none").check("3*5+3") == "ok"


def test_feedback_none_answers_ok_to_everything():
    env = episode(feedback="none")
    outs = [env.check(e) for e in ["(3+5)*3", "3*5+3", "7+5*3", "", "9" * 10_000]]
    assert outs == ["ok"] * 5
    # the env still knows the truth: the lead reads these after the episode
    assert (env.turns, env.failed_tries, env.solved) == (5, 4, True)
    assert episode(feedback="full").check("3*5+3") == "18 low"


@pytest.mark.parametrize(
    "knobs, field",
    [
        ({"feedback": "some"}, "feedback"),
        ({"use_all": "yes"}, "use_all"),
        ({"use_all": 1}, "use_all"),
        ({"flag_repeats": "no"}, "flag_repeats"),
    ],
)
def test_bad_env_knobs_name_the_field(knobs, field):
    with pytest.raises(ValueError, match=field):
        Countdown(**knobs)
    with pytest.raises(TypeError, match="colour"):
        Countdown(colour="red")


@pytest.mark.parametrize(
    "row, field",
    [
        ({"numbers": [3, "5"], "target": 24}, "numbers"),
        ({"numbers": [], "target": 24}, "numbers"),
        ({"numbers": 35, "target": 24}, "numbers"),
        ({"numbers": [3, -5], "target": 24}, "numbers"),
        ({"target": 24}, "numbers"),
        ({"numbers": [3, 5], "target": "24"}, "target"),
        ({"numbers": [3, 5], "target": 2.5}, "target"),
        ({"numbers": [3, 5]}, "target"),
    ],
)
def test_bad_rows_name_the_field(row, field):
    with pytest.raises(ValueError, match=f"countdown row 'x7': '{field}'"):
        Countdown().reset(id="x7", **row)
    with pytest.raises(ValueError, match=f"'{field}'"):
        correct(row, "#### 3+5", None)


def test_tool_before_reset_is_an_error():
    env = Countdown()
    assert env.check("3+5") == "error: no episode, call reset first"
    assert (env.turns, env.failed_tries) == (1, 1)


# ----------------------------------------------------------------------------------- isolation
def test_episodes_are_isolated_and_reset_clears_everything():
    a, b = Countdown(), Countdown()
    a.reset(numbers=[3, 5, 3], target=24)
    b.reset(numbers=[1, 2, 4], target=12)
    assert a.check("3*5+3") == "18 low"
    assert b.check("(1+2)*4") == "12 yes"
    assert a.check("(3+5)*3") == "24 yes"
    assert b.check("(3+5)*3") == "error: 3 not given"  # b's numbers, not a's
    assert (a.turns, a.failed_tries, a.solved) == (2, 1, True)
    assert (b.turns, b.failed_tries, b.solved) == (2, 1, True)
    a.reset(numbers=[2, 2], target=5)
    assert (a.turns, a.failed_tries, a.solved) == (0, 0, False)
    assert a.check("2+2") == "4 low"
    assert a.check("(3+5)*3") == "error: 3 not given"  # the old episode's numbers are gone
    assert (b.turns, b.failed_tries, b.solved) == (2, 1, True)  # untouched by a's reset


def test_no_state_shared_between_instances_via_class_attributes():
    a, b = Countdown(), Countdown()
    a.reset(**ROW)
    a.check("(3+5)*3")
    assert b.turns == 0 and b.failed_tries == 0 and b.solved is False


# ----------------------------------------------------------------------------------- correct()
@pytest.mark.parametrize(
    "text, ok",
    [
        ("try (3+5)*3 <<(3+5)*3=24 yes>>\n#### (3+5)*3", True),
        ("#### 3*(5+3)", True),
        ("#### (3+5)*3  ", True),
        ("#### 3*5+3", False),  # off target
        ("try (3+5)*3 <<(3+5)*3=24 yes>>\n#### 3*5+3", False),  # the tool said yes, the answer is another one
        ("#### 8*3", False),  # 8 not given
        ("#### 3*8", False),
        ("#### 24", False),
        ("#### (3+5)*3*1", False),
        ("#### (3+5)*3\n#### 3*5+3", False),  # the last answer line counts
        ("#### 3*5+3\n#### (3+5)*3", True),
        ("(3+5)*3", False),  # no answer line
        ("", False),
        ("#### " + "(" * 1000 + "3" + ")" * 1000, False),
        ("#### __import__('os')", False),
    ],
)
def test_correct(text, ok):
    assert correct(ROW, text, Countdown()) is ok


def test_correct_reads_use_all_from_the_env():
    row = {"numbers": [3, 5, 3], "target": 15}
    assert correct(row, "#### 5*3", Countdown(use_all=False))
    assert not correct(row, "#### 5*3", Countdown(use_all=True))
    assert not correct(row, "#### 5*3", None)  # None: ENV_DEFAULTS, use_all True
    assert correct({"numbers": [1, 3, 4, 6], "target": 24}, "#### 6/(1-3/4)", None)  # fractional intermediates


# ----------------------------------------------------------------------------------- solver
@pytest.mark.parametrize(
    "numbers, target", [([3, 5, 3], 24), ([3, 3, 8, 8], 24), ([1, 3, 4, 6], 24), ([2, 7], 14), ([4, 4, 10, 10], 24)]
)
def test_solver_finds_known_answers(numbers, target):
    expr = solve(numbers, target)
    assert expr is not None
    assert evaluate(expr, numbers, use_all=True) == target


def test_solver_returns_none_when_unsolvable():
    assert solve([1, 1, 1], 100) is None
    assert solve([5, 7], 5) is None  # would need 7 unused
    assert solve([1, 1, 1, 1], 24) is None  # a classic unsolvable 24 game
    five = solve([5, 7], 5, use_all=False)
    assert five == "5" and evaluate(five, [5, 7], use_all=False) == 5


def brute_force_values(numbers: list[int]) -> set[Fraction]:
    """Every value of every fully parenthesised expression using each number once, through the checker."""
    if len(numbers) == 1:
        return {Fraction(numbers[0])}
    texts: set[str] = set()

    def exprs(nums: tuple) -> set[str]:
        if len(nums) == 1:
            return {str(nums[0])}
        out = set()
        for cut in range(1, len(nums)):
            for left in exprs(nums[:cut]):
                for right in exprs(nums[cut:]):
                    out |= {f"({left}){op}({right})" for op in "+-*/"}
        return out

    for perm in itertools.permutations(numbers):
        texts |= exprs(perm)
    values = set()
    for text in texts:
        try:
            values.add(evaluate(text, numbers, use_all=True))
        except cd.IllegalExpression as e:
            assert str(e) == "division by zero"
    return values


def test_solver_is_complete_on_small_cases():
    """solve() finds a target exactly when some expression over the numbers hits it (brute force through the
    checker, independent of the solver's subset table)."""
    rng = random.Random(3)
    for _ in range(12):
        nums = [rng.randint(0, 6) for _ in range(3)]
        reachable = brute_force_values(nums)
        for target in range(-12, 60):
            expr = solve(nums, target)
            assert (expr is not None) == (Fraction(target) in reachable), (nums, target)
            if expr is not None:
                assert evaluate(expr, nums, use_all=True) == target


# ----------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("num_numbers", [2, 3, 4, 5])
def test_generated_instances_are_solvable(num_numbers):
    rows = make_rows(40, random.Random(num_numbers), "train", num_numbers=num_numbers)
    assert len(rows) == 40
    for row in rows:
        assert len(row["numbers"]) == num_numbers
        assert all(1 <= x <= 20 for x in row["numbers"])
        assert 1 <= row["target"] <= 100 and row["ground_truth"] == str(row["target"])
        assert correct(row, row["answer"], Countdown())
        assert evaluate(final_expression(row["answer"]), row["numbers"], True) == row["target"]
        if num_numbers <= 4:  # the exhaustive solver agrees (5 numbers: ~0.5 s each, skipped)
            assert solve(row["numbers"], row["target"]) is not None
        json.dumps(row)


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize("env_knobs", [None, {"feedback": "none"}, {"use_all": False}])
def test_demos_replay_through_a_fresh_env(split, env_knobs):
    rows = make_rows(60, random.Random(7), split, env_knobs=env_knobs)
    for row in rows:
        env = Countdown(**(env_knobs or {}))
        env.reset(**row)
        calls = CALL.findall(row["answer"])
        assert calls, row["answer"]
        assert row["answer"].count("<<") == len(calls) == row["demo_failed_tries"] + 1
        for arg, result in calls:
            assert env.check(arg) == result
        assert env.solved and env.failed_tries == row["demo_failed_tries"]
        assert final_expression(row["answer"]) == calls[-1][0]  # the answer repeats the confirmed expression
        if (env_knobs or {}).get("feedback") != "none":
            assert calls[-1][1] == f"{row['target']} yes"
            assert all(not r.endswith("yes") for _, r in calls[:-1])
        if split == "test":
            assert len(calls) == 1


def test_question_states_the_instance():
    row = make_rows(1, random.Random(0), "test")[0]
    assert row["question"] == f"Make {row['target']} from {' '.join(map(str, row['numbers']))} using + - * / once each."
    loose = make_rows(1, random.Random(0), "test", env_knobs={"use_all": False})[0]
    assert loose["question"].endswith("at most once each.")


def test_hard_share_and_max_failed_tries():
    tries = lambda rows: [r["demo_failed_tries"] for r in rows]  # noqa: E731
    assert set(tries(make_rows(100, random.Random(1), "train", hard_share=0.0))) == {0}
    assert min(tries(make_rows(100, random.Random(1), "train", hard_share=1.0, max_failed_tries=1))) == 1
    assert set(tries(make_rows(100, random.Random(1), "train", hard_share=1.0, max_failed_tries=1))) == {1}
    assert set(tries(make_rows(200, random.Random(1), "train", hard_share=1.0, max_failed_tries=3))) == {1, 2, 3}
    half = tries(make_rows(400, random.Random(1), "train", hard_share=0.5))
    assert 0.4 < sum(t > 0 for t in half) / len(half) < 0.6
    assert set(tries(make_rows(100, random.Random(1), "test", hard_share=1.0))) == {0}


def test_direct_share_demos_answer_without_a_try():
    rows = make_rows(400, random.Random(5), "train", direct_share=0.5)
    direct = [r for r in rows if "<<" not in r["answer"]]
    assert 150 < len(direct) < 250
    for r in direct:
        assert r["answer"].startswith("#### ") and r["demo_failed_tries"] == 0
        assert correct(r, r["answer"], None)
    assert all("\n#### " in r["answer"] for r in rows if r not in direct)
    # test rows always show the one try; direct_share 0 leaves the rows exactly as without the knob
    assert all("<<" in r["answer"] for r in make_rows(50, random.Random(5), "test", direct_share=1.0))
    # direct_share 0 draws nothing more: the rows are the ones the generator made before the knob (sha256 of 200 rows
    # as made by commit b09d852)
    rows = make_rows(200, random.Random(5), "train", direct_share=0.0)
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert digest == "295fac4674549f601db1b8503f35b90ab6f231019c6c583a68ef6a94f32e8574"


def test_number_range_and_target_max_knobs():
    rows = make_rows(50, random.Random(2), "train", number_min=5, number_max=9, target_max=30, num_numbers=4)
    assert all(5 <= x <= 9 for r in rows for x in r["numbers"])
    assert all(1 <= r["target"] <= 30 for r in rows)
    assert {len(r["numbers"]) for r in rows} == {4}


def test_failed_tries_are_near_misses_over_the_same_numbers():
    rows = make_rows(100, random.Random(4), "train", hard_share=1.0)
    for row in rows:
        *failed, _ = CALL.findall(row["answer"])
        for arg, _ in failed:
            value = evaluate(arg, row["numbers"], use_all=True)  # legal: same numbers, each once
            assert value != row["target"] and value.denominator == 1


def test_determinism_and_exclude():
    a = make_rows(30, random.Random(11), "train")
    assert a == make_rows(30, random.Random(11), "train")
    assert a != make_rows(30, random.Random(12), "train")
    keys = {cd.instance_key(r) for r in a}
    assert len(keys) == 30  # no duplicate instances within a call
    b = make_rows(30, random.Random(11), "test", exclude=keys)
    assert not keys & {cd.instance_key(r) for r in b}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_numbers": 6}, "num_numbers"),
        ({"num_numbers": 1}, "num_numbers"),
        ({"number_min": 0}, "number_min"),
        ({"number_min": 9, "number_max": 3}, "number_max"),
        ({"hard_share": 1.5}, "hard_share"),
        ({"direct_share": -0.1}, "direct_share"),
        ({"max_failed_tries": 4}, "max_failed_tries"),
        ({"max_failed_tries": True}, "max_failed_tries"),
        ({"target_max": 0}, "target_max"),
        ({"colour": 3}, "colour"),
        ({"split": "dev"}, "split"),
        ({"env_knobs": {"feedback": "loud"}}, "feedback"),
    ],
)
def test_bad_generation_knobs_name_the_field(kwargs, field):
    kwargs = {"split": "train", **kwargs}
    with pytest.raises(ValueError, match=field):
        make_rows(3, random.Random(0), **kwargs)


def test_impossible_request_says_what_to_change():
    with pytest.raises(ValueError, match="widen the number range"):
        make_rows(100, random.Random(0), "train", num_numbers=2, number_min=1, number_max=3)


def _instances_by_brute_force(num_numbers: int, lo: int, hi: int, target_max: int) -> int:
    """Every (multiset, target) _random_solution can make: all its orders of combining, targets in 1..target_max."""

    def values(items: tuple) -> set:
        if len(items) == 1:
            return {items[0]}
        out = set()
        for i, j in itertools.permutations(range(len(items)), 2):
            a, b = items[i], items[j]
            rest = tuple(x for k, x in enumerate(items) if k not in (i, j))
            made = [a + b, a * b] + ([a - b] if a > b else []) + ([a // b] if b > 1 and a % b == 0 else [])
            for v in made:
                out |= values(rest + (v,))
        return out

    combos = itertools.combinations_with_replacement(range(lo, hi + 1), num_numbers)
    return sum(sum(1 <= v <= target_max for v in values(c)) for c in combos)


@pytest.mark.parametrize(
    "num_numbers, lo, hi, target_max", [(2, 1, 4, 100), (2, 1, 9, 10), (3, 1, 3, 100), (3, 1, 1, 100)]
)
def test_instance_capacity_bounds_what_can_be_drawn(num_numbers, lo, hi, target_max):
    k = cd._gen_knobs(dict(num_numbers=num_numbers, number_min=lo, number_max=hi, target_max=target_max))
    assert cd.instance_capacity(k) >= _instances_by_brute_force(num_numbers, lo, hi, target_max)


@pytest.mark.parametrize("n", [49, 1_000_000])
def test_more_rows_than_instances_fails_before_drawing(n, monkeypatch):
    """1e6 rows from 2 numbers in 1..3 used to draw 1e8 times (100 attempts per row) before failing."""
    monkeypatch.setattr(cd, "_random_solution", lambda *a: pytest.fail("drew an instance"))
    with pytest.raises(ValueError, match=rf"countdown: {n} test instances asked \(num_test\) .* at most 48 distinct"):
        make_rows(n, random.Random(0), "test", num_numbers=2, number_min=1, number_max=3)


def test_capacity_leaves_out_the_other_splits_instances():
    knobs = dict(num_numbers=2, number_min=1, number_max=1, target_max=5)  # 1 1 reaches only 1 and 2: bound 2**2 - 1
    assert cd.instance_capacity(cd._gen_knobs(knobs)) == 3
    test = make_rows(1, random.Random(0), "test", **knobs)
    with pytest.raises(ValueError, match="allow at most 3 distinct instances, 1 of them excluded"):
        make_rows(3, random.Random(0), "train", exclude={cd.instance_key(r) for r in test} | {"3 4 -> 7"}, **knobs)


def test_a_run_of_draws_with_nothing_new_stops_generation(monkeypatch):
    """1 1 makes 1 and 2 only (the bound allows 3): after those two the run of fruitless draws stops generation
    (here after 200), not the budget of 100 draws per row asked."""
    monkeypatch.setattr(cd, "MAX_STALL_ATTEMPTS", 200)
    with pytest.raises(ValueError, match=r"no new instance in 200 draws after 2 of 3 with num_numbers=2"):
        make_rows(3, random.Random(0), "test", num_numbers=2, number_min=1, number_max=1, target_max=3)


def test_defaults_are_the_signature_defaults():
    env = Countdown()
    assert {"feedback": env.feedback, "use_all": env.use_all, "flag_repeats": env.flag_repeats} == cd.ENV_DEFAULTS
    assert set(cd.GEN_DEFAULTS) == {
        "num_numbers",
        "number_min",
        "number_max",
        "target_max",
        "hard_share",
        "direct_share",
        "max_failed_tries",
    }


# ----------------------------------------------------------------------------------- TRL shape
def test_tool_schema_has_one_string_parameter():
    from transformers.utils import get_json_schema

    schema = get_json_schema(Countdown().check)["function"]
    assert schema["name"] == "check"
    assert list(schema["parameters"]["properties"]) == ["expression"]
    prop = schema["parameters"]["properties"]["expression"]
    assert prop["type"] == "string" and prop["description"]
    assert schema["parameters"]["required"] == ["expression"]


def test_one_public_tool_besides_reset():
    import inspect

    public = [n for n, _ in inspect.getmembers(Countdown, predicate=inspect.isfunction) if not n.startswith("_")]
    assert sorted(public) == ["check", "reset"]  # what TRL's environment_factory exposes as tools: check only


def test_no_torch_import():
    import subprocess
    import sys

    code = "import sys, agentrl.envs.countdown; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_reset_reads_the_instance_from_a_served_prompt():
    """The server has a prompt only: reset(prompt=...) reads numbers and target from the question's words."""
    row = make_rows(1, random.Random(3), "test")[0]
    from_fields, from_text = Countdown(), Countdown()
    from_fields.reset(**row)
    from_text.reset(prompt=[{"role": "user", "content": row["question"]}])
    assert from_text._numbers == row["numbers"] and from_text._target == row["target"]
    expr = row["answer"].rsplit("####", 1)[1].strip()
    answer = from_text.check(expr)
    assert answer == from_fields.check(expr) and answer.endswith("yes")
    with pytest.raises(ValueError, match="numbers"):
        Countdown().reset(prompt=[{"role": "user", "content": "What is 2+2?"}])
