import json
import re

import pytest

from agentrl.answers import normalize_number
from agentrl.common import read_metrics
from agentrl.data import RawRow, check_rows, generate_synthetic, read_jsonl
from conftest import GSM8K_TRAIN, mini_params, write_params


def _recompute(answer: str) -> int:
    """Independent check: replay the solution's calculator annotations and compare to '#### N'."""
    value = None
    for expr, result in re.findall(r"<<([^=]+)=(-?\d+)>>", answer):
        computed = eval(expr, {"__builtins__": {}})  # digits and + - * only
        assert computed == int(result), (expr, result)
        value = computed
    return value


def test_generator_deterministic_and_correct():
    kw = dict(
        num_train=300, num_test=50, operand_min=1, operand_max=19, operations=["+", "-", "*"], steps={1: 1, 2: 1, 3: 1}
    )
    a = generate_synthetic(7, **kw)
    b = generate_synthetic(7, **kw)
    c = generate_synthetic(8, **kw)
    assert a == b
    assert a != c
    train, test = a
    assert len(train) == 300 and len(test) == 50
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for row in train + test:
        final = int(row["answer"].rsplit("####", 1)[1])
        assert _recompute(row["answer"]) == final
        assert final >= 0
        # the question states the numbers the solution uses: the first step's operands and each later step's
        # second operand (its first is the previous result), no more and no fewer
        steps = re.findall(r"<<(\d+)[+\-*](\d+)=(-?\d+)>>", row["answer"])
        assert len(steps) == row["answer"].count("<<") == row["steps"], row
        assert all(nxt[0] == prev[2] for prev, nxt in zip(steps, steps[1:])), row
        given = [steps[0][0]] + [s[1] for s in steps]
        assert sorted(given) == sorted(re.findall(r"\d+", row["question"])), row


def test_generator_difficulty_mix_respected():
    train, _ = generate_synthetic(1, 600, 1, 1, 9, ["+"], {1: 0.0, 3: 1.0})
    assert {r["steps"] for r in train} == {3}
    assert all(r["answer"].count("<<") == 3 for r in train)


def test_generator_too_narrow_space_fails_clearly():
    with pytest.raises(ValueError, match="unique problems"):
        generate_synthetic(1, 5000, 10, 1, 2, ["+"], {1: 1.0})


def _rows(*dicts):
    return [RawRow("fixture.jsonl", i, d) for i, d in enumerate(dicts, 1)]


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"answer": "#### 3"}, "missing_field"),
        ({"question": "  ", "answer": "#### 3"}, "empty_value"),
        ({"question": "q?", "answer": ""}, "empty_value"),
        ({"question": "q?", "answer": "it is 3"}, "missing_final_answer"),
        ({"question": "q?", "answer": "so\n#### three"}, "non_numeric_answer"),
        (["not", "an", "object"], "not_an_object"),
    ],
)
def test_each_defect_caught(row, reason):
    res = check_rows(_rows(row), "train", True)
    assert not res.examples
    assert res.bad[0].reason == reason
    assert "fixture.jsonl:1" in str(res.bad[0])


def test_duplicates_and_leakage_caught():
    rows = _rows(
        {"question": "How many?", "answer": "#### 1"},
        {"question": "how  many?", "answer": "#### 1"},
        {"question": "In test too", "answer": "#### 2"},
    )
    res = check_rows(rows, "train", True, exclude_questions={"in test too"})
    assert [b.reason for b in res.bad] == ["duplicate_question", "train_test_overlap"]
    assert len(res.examples) == 1


def test_invalid_json_line_is_reported(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"question": "a", "answer": "#### 1"}\n{oops\n')
    res = check_rows(read_jsonl(f), "train", True)
    assert len(res.examples) == 1 and res.bad[0].reason == "invalid_json" and res.bad[0].line == 2


def test_gsm8k_answer_parsing():
    row = {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072",
    }
    ex = check_rows(_rows(row), "train", True).examples[0]
    assert ex.final == "1072"
    assert "<<" not in ex.reasoning and "24 clips" in ex.reasoning
    kept = check_rows(_rows(row), "train", False).examples[0]
    assert "<<48/2=24>>" in kept.reasoning


@pytest.mark.skipif(not GSM8K_TRAIN.exists(), reason="../shared/data/gsm8k/train.jsonl is absent")
def test_real_gsm8k_train_parses_completely():
    res = check_rows(read_jsonl(GSM8K_TRAIN), "train", True)
    assert len(res.examples) == 7473, [str(b) for b in res.bad[:5]]
    assert not res.bad
    assert all(normalize_number(e.final) == e.final for e in res.examples)
    assert all("<<" not in e.reasoning for e in res.examples)


def _prepare(workdir, **data_overrides):
    from agentrl.config import load_params
    from agentrl.stages import prepare

    p = mini_params()
    p["data"].update(data_overrides)
    write_params(workdir / "params.yaml", p)
    return prepare.prepare(load_params(workdir / "params.yaml"))


def _read(path):
    return [json.loads(line) for line in open(path)]


def test_prepare_outputs(workdir):
    m = _prepare(workdir, max_samples=50, eval_max_samples=10)
    sft, rl, test = (_read(workdir / "data/prepared" / f) for f in ("sft_train.jsonl", "rl_train.jsonl", "test.jsonl"))
    assert len(sft) == len(rl) == 50 and len(test) == 10
    assert m["written"] == {"sft_train": 50, "rl_train": 50, "test": 10}
    assert sft[0]["prompt"][-1]["role"] == "user" and sft[0]["completion"][0]["role"] == "assistant"
    assert sft[0]["completion"][0]["content"].rstrip().split("####")[-1].strip() == rl[0]["ground_truth"]
    assert [r["id"] for r in sft] == [r["id"] for r in rl]
    assert len({r["id"] for r in sft + test}) == 60
    assert {"id", "question", "ground_truth", "answer"} <= set(test[0])
    assert read_metrics(workdir / "metrics/prepare.json")["dropped"]["total"] == 0


def test_prepare_records_overlap_for_every_source_and_refuses_trained_held_out_instances(workdir, monkeypatch):
    """Issue 56 item 2: nothing measured how far held-out rows are from training. metrics/prepare.json now has an
    `overlap` block for text sources (held-out questions in training: dropped as bad rows and counted) and for
    environments (prompts and instances in both splits, distinct test instances); an environment whose generator
    lets held-out instances into training is refused before anything is written, unless data.allow_test_overlap."""
    from agentrl.config import validate_params
    from agentrl.envs import countdown
    from agentrl.stages import prepare

    _write_gsm8k(workdir / "train.jsonl", GOOD[:20])
    _write_gsm8k(workdir / "test.jsonl", GOOD[15:])  # five held-out questions also in train: dropped and counted
    m = _prepare(
        workdir, source="jsonl", train_file="train.jsonl", test_file="test.jsonl", on_bad_rows="drop",
        eval_max_samples=None,
    )  # fmt: skip
    assert m["overlap"] == {"test_rows": 15, "test_prompts_in_train": 0, "train_rows_dropped_as_test": 5}

    p = mini_params()
    p["agent"].update(tools=[], environment="countdown")
    p["environments"]["countdown"].update(num_train=30, num_test=10)
    m = prepare.prepare(validate_params(p))
    assert m["overlap"] == {
        "test_rows": 10, "test_prompts_in_train": 0, "test_instances_in_train": 0, "distinct_test_instances": 10
    }  # fmt: skip
    real = countdown.make_rows
    monkeypatch.setattr(countdown, "make_rows", lambda *a, exclude=(), **kw: real(*a, **kw))  # ignores exclude
    p["environments"]["countdown"].update(num_train=400, num_test=200)
    (workdir / "data/prepared/test.jsonl").write_text("earlier\n")
    with pytest.raises(prepare.TestOverlapError, match=r"countdown: \d+ of 200 held-out instances are also training"):
        prepare.prepare(validate_params(p))
    assert (workdir / "data/prepared/test.jsonl").read_text() == "earlier\n"  # nothing written
    p["data"]["allow_test_overlap"] = True
    m = prepare.prepare(validate_params(p))
    assert m["overlap"]["test_instances_in_train"] > 0


def test_subset_is_seeded_random_not_first_n(workdir):
    _prepare(workdir, max_samples=20)
    first = [r["id"] for r in _read(workdir / "data/prepared/sft_train.jsonl")]
    _prepare(workdir, max_samples=20)
    assert first == [r["id"] for r in _read(workdir / "data/prepared/sft_train.jsonl")]
    _prepare(workdir, max_samples=None)
    all_ids = [r["id"] for r in _read(workdir / "data/prepared/sft_train.jsonl")]
    assert first != all_ids[:20]


def _write_gsm8k(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


GOOD = [
    {
        "question": f"Sam has {i} pens and buys {i + 1} more. How many pens?",
        "answer": f"Sam has {i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1} pens.\n#### {2 * i + 1}",
    }
    for i in range(30)
]


def test_jsonl_source_keeps_every_valid_row(workdir):
    _write_gsm8k(workdir / "train.jsonl", GOOD[:20])
    _write_gsm8k(workdir / "test.jsonl", GOOD[20:])
    m = _prepare(workdir, source="jsonl", train_file="train.jsonl", test_file="test.jsonl", eval_max_samples=None)
    assert m["written"] == {"sft_train": 20, "rl_train": 20, "test": 10}


def test_bad_rows_error_lists_file_line_reason(workdir):
    from agentrl.stages.prepare import BadRowsError

    _write_gsm8k(workdir / "train.jsonl", GOOD[:5] + [{"question": "x", "answer": "no final"}] + [GOOD[0]])
    _write_gsm8k(workdir / "test.jsonl", GOOD[20:22])
    with pytest.raises(BadRowsError) as e:
        _prepare(workdir, source="jsonl", train_file="train.jsonl", test_file="test.jsonl")
    msg = str(e.value)
    assert "train.jsonl:6: missing_final_answer" in msg and "train.jsonl:7: duplicate_question" in msg
    assert not (workdir / "data").exists()


def test_bad_rows_drop_counts_them(workdir):
    _write_gsm8k(workdir / "train.jsonl", GOOD[:5] + [{"question": "x", "answer": "#### n/a"}, GOOD[20]])
    _write_gsm8k(workdir / "test.jsonl", GOOD[20:22])
    m = _prepare(
        workdir,
        source="jsonl",
        train_file="train.jsonl",
        test_file="test.jsonl",
        on_bad_rows="drop",
        eval_max_samples=None,
    )
    assert m["dropped"]["train"] == {"non_numeric_answer": 1, "train_test_overlap": 1}
    assert m["written"]["sft_train"] == 5


def test_gsm8k_and_jsonl_sources_identical(workdir, monkeypatch):
    """The hub path (datasets.load_dataset patched: no hub here) gives the same rows as local files."""
    import datasets

    _write_gsm8k(workdir / "train.jsonl", GOOD[:20])
    _write_gsm8k(workdir / "test.jsonl", GOOD[20:])
    _prepare(workdir, source="jsonl", train_file="train.jsonl", test_file="test.jsonl", eval_max_samples=None)
    local = {f: _read(workdir / "data/prepared" / f) for f in ("sft_train.jsonl", "rl_train.jsonl", "test.jsonl")}
    calls = []

    def fake_load_dataset(name, config, revision=None):
        calls.append((name, config, revision))
        return {"train": datasets.Dataset.from_list(GOOD[:20]), "test": datasets.Dataset.from_list(GOOD[20:])}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    _prepare(workdir, source="gsm8k", eval_max_samples=None)
    assert calls == [("openai/gsm8k", "main", None)]
    hub = {f: _read(workdir / "data/prepared" / f) for f in local}
    assert hub == local


def test_direct_answer_rate_only_affects_training_solutions():
    kw = dict(
        num_train=400,
        num_test=100,
        operand_min=1,
        operand_max=19,
        operations=["+", "-", "*"],
        steps={1: 1, 2: 1, 3: 1},
        max_value=99,
    )
    train, test = generate_synthetic(3, direct_answer_rate=0.5, **kw)
    direct = [r for r in train if "<<" not in r["answer"]]
    assert 150 < len(direct) < 250
    assert all(re.fullmatch(r"#### \d+", r["answer"]) for r in direct)
    assert all("<<" in r["answer"] for r in test)
    plain_train, plain_test = generate_synthetic(3, direct_answer_rate=0.0, **kw)
    assert [r["question"] for r in plain_train] == [r["question"] for r in train]  # same problems
    assert plain_test == test
    for a, b in zip(plain_train, train):  # same final answers
        assert a["answer"].rsplit("####")[1] == b["answer"].rsplit("####")[1]


def test_max_value_bounds_every_intermediate_value():
    train, _ = generate_synthetic(5, 500, 10, 1, 19, ["+", "*"], {3: 1.0}, max_value=60)
    for r in train:
        assert all(int(v) <= 60 for v in re.findall(r">>(\d+)", r["answer"]))


@pytest.mark.parametrize(
    "x,op,b",
    [
        (19, "+", 7),
        (43, "-", 17),
        (18, "*", 4),
        (7, "*", 3),
        (5, "+", 3),
        (40, "-", 40),
        (99, "-", 9),
        (45, "+", 54),
        (9, "*", 5),
    ],
)
def test_digit_line_is_correct_column_arithmetic(x, op, b):
    from agentrl.data import digit_line

    line = digit_line(x, op, b)
    head, body = line.split(": ")
    assert head == f"{x}{op}{b}"
    *columns, total = body.split(", ")
    for eq in columns + [total]:  # every written equation is true ('13-7=6', '1*4+3=7', ...)
        lhs, rhs = eq.split("=")
        assert eval(lhs) == int(rhs), line  # digits and + - * only
    assert total == f"{x}{op}{b}={eval(f'{x}{op}{b}')}"
    assert len(columns) == (1 if max(x, b, eval(f"{x}{op}{b}")) < 10 else 2)


def test_digit_steps_rate_rewrites_only_training_solutions():
    kw = dict(
        num_train=300,
        num_test=50,
        operand_min=1,
        operand_max=19,
        operations=["+", "-", "*"],
        steps={1: 1, 2: 1, 3: 1},
        max_value=99,
    )
    plain_train, plain_test = generate_synthetic(4, **kw)
    train, test = generate_synthetic(4, digit_steps_rate=0.5, **kw)
    digits = [r for r in train if r.get("style") == "digits"]
    assert 100 < len(digits) < 200 and test == plain_test
    for a, b in zip(plain_train, train):  # same problems and final answers, one digit line per step
        assert a["question"] == b["question"]
        assert a["answer"].rsplit("####")[1] == b["answer"].rsplit("####")[1]
        if b.get("style") == "digits":
            assert len(b["answer"].splitlines()) == b["steps"] + 1 and ": " in b["answer"]
    checked = check_rows([RawRow("synthetic:train", i, r) for i, r in enumerate(train, 1)], "train", True)
    assert len(checked.examples) == len(train) and not checked.bad  # prepare's parser accepts the digit style


# ------------------------------------------------------------------ hostile input lines (issue 45, items 7 and 8)
GOOD_LINE = json.dumps({"question": "Tom has 2 apples and buys 3 more. How many?", "answer": "2+3=5\n#### 5"})
MALFORMED = {
    "deep_nesting": ("[" * 100_000, "invalid_json", "nested too deeply"),
    "huge_integer": ('{"question": "q?", "answer": "#### 1", "steps": ' + "7" * 5000 + "}", "invalid_json", "digits"),
    "bare_huge_integer": ("9" * 5000, "invalid_json", "digits"),
    "lone_surrogate": ('{"question": "q\\ud800?", "answer": "#### 1"}', "invalid_text", "question holds"),
    "long_field": (json.dumps({"question": "q" * 100_001, "answer": "#### 1"}), "field_too_large", "question has"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_every_malformed_line_is_a_bad_row_naming_file_and_line(tmp_path, kind):
    """A `"["*100000` line (RecursionError), a 5,000-digit integer (ValueError naming no line) and a lone surrogate
    (UnicodeEncodeError when the id is hashed) used to escape the row checks and stop prepare."""
    line, reason, detail = MALFORMED[kind]
    f = tmp_path / "in.jsonl"
    f.write_text(GOOD_LINE + "\n" + line + "\n")
    res = check_rows(read_jsonl(f), "train", True)
    assert len(res.examples) == 1 and [b.reason for b in res.bad] == [reason]
    assert str(res.bad[0]).startswith(f"{f}:2: {reason}") and detail in str(res.bad[0]), str(res.bad[0])


def test_oversized_row_is_a_bad_row_read_with_a_bound(tmp_path):
    """A 20 MB line is named and skipped without ever holding it in memory (a 100 MB row once grew `base` to 20 GB)."""
    import tracemalloc

    from agentrl.data import MAX_ROW_BYTES

    f = tmp_path / "in.jsonl"
    with f.open("w") as out:
        out.write(GOOD_LINE + "\n")
        out.write('{"question": "' + "x" * (20 * MAX_ROW_BYTES) + '", "answer": "#### 1"}\n')
        out.write(GOOD_LINE.replace("Tom", "Ann") + "\n")
    tracemalloc.start()
    try:
        res = check_rows(read_jsonl(f), "train", True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(res.examples) == 2 and [(b.line, b.reason) for b in res.bad] == [(2, "row_too_large")]
    assert f"longer than {MAX_ROW_BYTES:,} bytes" in str(res.bad[0])
    assert peak < 4 * MAX_ROW_BYTES, f"peak {peak:,} bytes while reading a {20 * MAX_ROW_BYTES:,}-byte line"


def test_row_limit_is_a_parameter_of_the_reader(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(GOOD_LINE + "\n" + GOOD_LINE.replace("Tom", "Ann") + "\n")
    bad = [r.data for r in read_jsonl(f, max_row_bytes=len(GOOD_LINE))]  # the newline makes each one byte too long
    assert [(b.line, b.reason) for b in bad] == [(1, "row_too_large"), (2, "row_too_large")]
    assert [r.data["question"][:3] for r in read_jsonl(f, max_row_bytes=len(GOOD_LINE) + 1)] == ["Tom", "Ann"]


@pytest.mark.parametrize("on_bad_rows", ["drop", "error"])
def test_prepare_drops_or_names_every_malformed_line(workdir, on_bad_rows):
    from agentrl.stages.prepare import BadRowsError

    lines = [json.dumps(r) for r in GOOD[:5]] + [MALFORMED[k][0] for k in sorted(MALFORMED)]
    (workdir / "train.jsonl").write_text("\n".join(lines) + "\n")
    _write_gsm8k(workdir / "test.jsonl", GOOD[20:22])
    data = dict(source="jsonl", train_file="train.jsonl", test_file="test.jsonl", eval_max_samples=None)
    if on_bad_rows == "error":
        with pytest.raises(BadRowsError) as e:
            _prepare(workdir, on_bad_rows="error", **data)
        named = [f"train.jsonl:{6 + i}: {MALFORMED[k][1]}" for i, k in enumerate(sorted(MALFORMED))]
        assert all(n in str(e.value) for n in named), str(e.value)
        return
    m = _prepare(workdir, on_bad_rows="drop", **data)
    assert m["written"]["sft_train"] == 5
    assert m["dropped"]["train"] == {"field_too_large": 1, "invalid_json": 3, "invalid_text": 1}


def test_synthetic_generator_stops_when_nothing_new_comes():
    """1e7 problems from operands 1..2 used to draw for hours (50 attempts per row) before failing."""
    from agentrl.data import MAX_STALL_ATTEMPTS

    with pytest.raises(ValueError, match=r"unique problems of 10000010 requested .* in (\d+) draws") as e:
        generate_synthetic(1, 10_000_000, 10, 1, 2, ["+"], {1: 1.0})
    draws = int(re.search(r"in (\d+) draws", str(e.value)).group(1))
    made = int(re.search(r"generate (\d+) unique", str(e.value)).group(1))
    assert draws <= 20 * made + MAX_STALL_ATTEMPTS, str(e.value)
