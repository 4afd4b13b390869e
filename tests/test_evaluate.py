import pytest

from agentrl.stages.compare import mcnemar_exact, paired_test
from agentrl.stages.evaluate import score, wilson_interval
from conftest import tiny_lm

ROWS = [
    {"id": "a", "question": "qa", "ground_truth": "7", "steps": 1},
    {"id": "b", "question": "qb", "ground_truth": "1,000", "steps": 2},
    {"id": "c", "question": "qc", "ground_truth": "3", "steps": 2},
    {"id": "d", "question": "qd", "ground_truth": "-2", "steps": 3},
]


def test_score_greedy_metrics_hand_computed():
    samples = [
        [("3+4=7\n#### 7", 6)],  # correct
        [("The answer is $1,000.", 8)],  # correct, other answer style
        [("#### 4", 2)],  # wrong but formatted
        [("no idea", 4)],  # unparseable
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
        [("#### 1", 1), ("#### 7", 1), ("#### 7", 1)],  # first wrong, any right, majority right
        [("#### 5", 1), ("#### 5", 1), ("#### 1000", 1)],  # majority wrong, pass right
        [("#### 3", 1), ("x", 1), ("y", 1)],  # first right
        [("#### 2", 1), ("#### 2", 1), ("#### 2", 1)],  # all wrong
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


def test_generate_drops_ended_rows_and_matches_one_generate_call():
    """Rows that end leave the batch between `generate` calls; greedy output stays that of one call per batch."""
    import collections

    import torch

    from agentrl.data import generate_synthetic
    from agentrl.stages.evaluate import generate

    train, test = generate_synthetic(1, 300, 40, 1, 19, ["+", "*"], {1: 0.5, 2: 0.5})
    tok, model = tiny_lm([r["question"] + r["answer"] for r in train], 300, num_hidden_layers=2)
    torch.manual_seed(0)
    for p in model.parameters():  # large random weights: completions that differ from prompt to prompt
        p.data.normal_(0, 1.0)
    model.eval()
    prompts = [[{"role": "user", "content": r["question"]}] for r in test]
    max_new = 24

    def one_call(eos: int | None) -> list[list[int]]:
        tok.padding_side = "left"
        texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            seqs = model.generate(
                **enc, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id
            )
        return seqs[:, enc["input_ids"].shape[1] :].tolist()

    # make "eos" the token whose first appearance varies most across prompts, so rows end at different steps
    first = collections.defaultdict(set)
    for row in one_call(None):
        for t in set(row):
            first[t].add(row.index(t))
    eos = max(first, key=lambda t: len(first[t]))
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    assert tok.eos_token_id == eos
    expected = []
    for row in one_call(eos):
        n = row.index(eos) + 1 if eos in row else len(row)
        expected.append([(tok.decode(row[:n], skip_special_tokens=True), n)])
    lengths = [e[0][1] for e in expected]
    assert len(set(lengths)) >= 4 and max(lengths) == max_new and min(lengths) < max_new // 2

    calls = []
    one_generate = model.generate
    model.generate = lambda **kw: calls.append(kw["input_ids"].shape[0]) or one_generate(**kw)
    assert generate(model, tok, prompts, batch_size=len(prompts), max_new_tokens=max_new) == expected
    assert len(calls) > 1 and calls[0] == len(prompts) and all(a > b for a, b in zip(calls, calls[1:]))  # rows left
    assert generate(model, tok, prompts, batch_size=7, max_new_tokens=max_new) == expected
    assert generate(model, tok, prompts[:5], batch_size=1, max_new_tokens=max_new) == expected[:5]
    # sampling with several samples per prompt: the right number, each no longer than the budget
    sampled = generate(
        model, tok, prompts, batch_size=16, max_new_tokens=max_new, temperature=1.0, num_samples=3, seed=1
    )
    assert [len(s) for s in sampled] == [3] * len(prompts)
    assert all(0 < n <= max_new for s in sampled for _, n in s)
    assert sampled == generate(
        model, tok, prompts, batch_size=16, max_new_tokens=max_new, temperature=1.0, num_samples=3, seed=1
    )  # seeded
