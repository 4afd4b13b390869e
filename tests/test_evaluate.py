import pytest

from agentrl.compare import mcnemar_exact, paired_test
from agentrl.evaluate import score, wilson_interval

ROWS = [
    {"id": "a", "question": "qa", "ground_truth": "7", "steps": 1},
    {"id": "b", "question": "qb", "ground_truth": "1,000", "steps": 2},
    {"id": "c", "question": "qc", "ground_truth": "3", "steps": 2},
    {"id": "d", "question": "qd", "ground_truth": "-2", "steps": 3},
]


def test_score_greedy_metrics_hand_computed():
    samples = [
        [("3+4=7\n#### 7", 6)],          # correct
        [("The answer is $1,000.", 8)],  # correct, other answer style
        [("#### 4", 2)],                 # wrong but formatted
        [("no idea", 4)],                # unparseable
    ]
    m, preds = score(ROWS, samples, {"accuracy": 1.0, "format": 0.5}, {})
    assert m["accuracy"] == pytest.approx(0.5)
    assert m["format_rate"] == pytest.approx(0.75)
    assert m["num_samples"] == 4
    assert m["mean_completion_tokens"] == pytest.approx(5.0)
    assert m["answer_only_rate"] == pytest.approx(0.25)  # '#### 4' shows no worked step
    # rewards: 1.5, 1.5, 0.5, 0.0
    assert m["average_reward"] == pytest.approx(3.5 / 4)
    assert m["accuracy_by_steps"] == {"1": 1.0, "2": 0.5, "3": 0.0}
    assert [p["correct"] for p in preds] == [True, True, False, False]
    assert preds[1]["extracted"] == "1000" and preds[1]["ground_truth"] == "1000"
    assert preds[3]["extracted"] is None
    assert "pass@1" not in m


def test_score_pass_at_k_and_majority():
    samples = [
        [("#### 1", 1), ("#### 7", 1), ("#### 7", 1)],      # first wrong, any right, majority right
        [("#### 5", 1), ("#### 5", 1), ("#### 1000", 1)],   # majority wrong, pass right
        [("#### 3", 1), ("x", 1), ("y", 1)],                # first right
        [("#### 2", 1), ("#### 2", 1), ("#### 2", 1)],      # all wrong
    ]
    m, _ = score(ROWS, samples, {"accuracy": 1.0}, {})
    assert m["accuracy"] == pytest.approx(0.25)
    assert m["pass@3"] == pytest.approx(0.75)
    assert m["majority_vote_accuracy"] == pytest.approx(0.5)
    assert m["format_rate"] == pytest.approx(10 / 12)


def test_wilson_interval():
    lo, hi = wilson_interval(50, 100)
    assert lo < 0.5 < hi and hi - lo == pytest.approx(0.19, abs=0.01)
    assert wilson_interval(0, 0) == (0.0, 0.0)


def test_mcnemar_exact_known_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    # b=1, c=9: 2 * P(X<=1 | n=10) = 2 * 11/1024
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)


def test_paired_test():
    before = {str(i): i < 40 for i in range(100)}
    after = {str(i): i < 60 for i in range(100)}
    r = paired_test(before, after, seed=0)
    assert r["difference"] == pytest.approx(0.2)
    assert r["only_after_correct"] == 20 and r["only_before_correct"] == 0
    assert r["p_value"] < 1e-5
    assert r["ci95"][0] > 0.1 and r["ci95"][1] <= 0.3
    with pytest.raises(ValueError, match="no common"):
        paired_test({"a": True}, {"b": True}, 0)
