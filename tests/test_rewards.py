import pytest

from agentrl.agent import rewards
from agentrl.agent.rewards import build_rewards, get_reward
from agentrl.answers import answers_match, extract_answer, normalize_number


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She has 3+4=7.\n#### 72", "72"),
        ("The answer is 72.", "72"),
        ("#### $1,000", "1000"),
        ("so the total is\n#### -3", "-3"),
        ("#### 2.50", "2.5"),
        ("#### 7.00", "7"),
        ("I don't know.", None),
        ("", None),
        ("answer: 12", "12"),
        ("\\boxed{42}", "42"),
        ("#### 1\n#### 5", "5"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "raw, norm",
    [("1,000", "1000"), ("$5", "5"), ("2.50", "2.5"), ("007", "7"), ("-0", "0"), ("abc", None), ("0.5", "0.5")],
)
def test_normalize_number(raw, norm):
    assert normalize_number(raw) == norm


def test_answers_match_compares_huge_numbers_exactly():
    """Issue 56: as floats both overflowed to inf and '9'*310 matched '1'*400."""
    assert not answers_match("9" * 310, "1" * 400)
    assert not answers_match("1" * 400, "2" + "1" * 399) and answers_match("1" * 400, "1" * 399 + "2")  # rel_tol
    assert answers_match("9" * 5000, "9" * 5000)  # past int()'s 4,300-digit limit: equal strings still match
    assert answers_match("1000000", "1000000.5") and not answers_match("1000000", "1000002")  # rel_tol as before


def test_answers_match_numeric_tolerance():
    assert answers_match("2.5", "2.50")
    assert answers_match("1000", "1000.0000000001")
    assert not answers_match("7", "8")
    assert not answers_match(None, "8")


RIGHT = "Tom now has 3+4=7 apples.\n#### 7"
WRONG = "Tom now has 3+4=8 apples.\n#### 8"
UNPARSEABLE = "Tom now has some apples."
MULTI = "Tom now has 3+4=7.\nTom now has 7*2=14.\nTom now has 14-4=10.\nTom now has 10+1=11.\n#### 11"


def test_accuracy_reward():
    assert rewards.accuracy([RIGHT, WRONG, UNPARSEABLE], ground_truth=["7", "7", "7"]) == [1.0, 0.0, 0.0]


def test_accuracy_reward_conversational_completions():
    comp = [[{"role": "assistant", "content": RIGHT}]]
    assert rewards.accuracy(comp, ground_truth=["7"]) == [1.0]


def test_format_reward():
    assert rewards.format_reward([RIGHT, WRONG, UNPARSEABLE]) == [1.0, 1.0, 0.0]


def test_length_penalty():
    short, long = "x" * 10, "x" * 30
    out = rewards.length_penalty([short, long], length_max=20, length_weight=0.5)
    assert out[0] == 0.0
    assert out[1] == pytest.approx(-0.5 * 10 / 20)


def test_step_reward_only_for_correct_and_capped():
    out = rewards.step([RIGHT, WRONG, MULTI], ground_truth=["7", "7", "11"], step_bonus=0.1, step_cap=0.3)
    assert out[0] == pytest.approx(0.1)  # one step, correct
    assert out[1] == 0.0  # wrong answer gets no step bonus
    assert out[2] == pytest.approx(0.3)  # four steps, capped at 0.3


def test_registry_unknown_name_lists_known():
    with pytest.raises(ValueError) as e:
        get_reward("acuracy")
    for name in ("accuracy", "format", "length_penalty", "step"):
        assert name in str(e.value)


def test_registry_custom_import_path():
    fn = get_reward("agentrl.agent.rewards:format_reward")
    assert fn([RIGHT]) == [1.0]
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("no.such.module:fn")


def test_trl_logs_each_builtin_reward_under_its_registry_name():
    """GRPOTrainer names reward i `get_callable_name(reward_funcs[i])` and logs `rewards/<name>/mean`; the names
    are the params keys (grpo.rewards.format -> rewards/format/mean), whatever the functions are called in
    rewards.py (format_reward: a def named `format` would shadow the builtin)."""
    from trl.trainer.utils import get_callable_name

    funcs, _ = build_rewards({"accuracy": 1.0, "format": 0.5, "length_penalty": 0.1, "step": 0.1}, {"length_max": 5})
    assert [f"rewards/{get_callable_name(f)}/mean" for f in funcs] == [
        "rewards/accuracy/mean",
        "rewards/format/mean",
        "rewards/length_penalty/mean",
        "rewards/step/mean",
    ]
    assert get_reward("format")([RIGHT, UNPARSEABLE]) == [1.0, 0.0]  # the renamed function, under its old name


def test_build_rewards_binds_kwargs_and_weights():
    funcs, weights = build_rewards({"accuracy": 1.0, "length_penalty": 0.5}, {"length_max": 5, "length_weight": 1.0})
    assert weights == [1.0, 0.5]
    assert [f.__name__ for f in funcs] == ["accuracy", "length_penalty"]
    assert funcs[1](["x" * 10]) == [pytest.approx(-1.0)]
