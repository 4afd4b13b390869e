"""`make report` (agentrl.experiments.report): CI bars, comparison table and example completions with their tool
calls, from headline metrics and predictions; a missing input is an error naming the file and its stage."""

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from agentrl.experiments import report

ROOT = Path(__file__).resolve().parents[1]
# distinctive values, so that each one can only come from its file
EVAL = {
    "base": {"accuracy": 0.021, "accuracy_ci95": [0.011, 0.041], "tool_use_rate": 0.0, "tool_calls_per_problem": 0.0},
    "sft": {"accuracy": 0.347, "accuracy_ci95": [0.303, 0.392], "tool_use_rate": 0.456, "tool_calls_per_problem": 0.87},
    "grpo": {
        "accuracy": 0.613,
        "accuracy_ci95": [0.567, 0.657],
        "tool_use_rate": 0.912,
        "tool_calls_per_problem": 1.93,
    },
}
COMPARE = {"base_accuracy": 0.021, "sft_accuracy": 0.347, "grpo_accuracy": 0.613, "grpo_minus_sft": 0.266}
COMPARE |= {"ci95": [0.214, 0.318], "p_value": 0.000734, "sft_tool_use_rate": 0.456, "grpo_tool_use_rate": 0.912}


def _pred(i, stage, correct, calls):
    return {
        "id": f"t{i}",
        "question": f"Q{i} <script>x</script>: Tom has {i} apples, then 6 times as many.",
        "completion": f"{stage} completion {i}\n#### {i * 6 if correct else 5}",
        "extracted": str(i * 6 if correct else 5),
        "ground_truth": str(i * 6),
        "correct": correct,
        "reward": 1.0,
        "tool_calls": calls,
    }


def write_fixture(root, tools=True):
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    (root / "metrics").mkdir()
    for stage, m in EVAL.items():
        m = m if tools else {k: v for k, v in m.items() if k not in report.TOOL_KEYS}
        (root / f"metrics/eval_{stage}.json").write_text(json.dumps(m))
        (root / f"eval/{stage}").mkdir(parents=True)
        rows = []
        for i in range(1, 9):
            # t1..t4: SFT wrong, GRPO right (GRPO calls the calculator); t5: SFT right, GRPO wrong; others both right
            correct = {"sft": i >= 5, "grpo": i != 5, "base": False}[stage]
            calls = [{"expression": f"{i}*6", "result": str(i * 6), "ok": True}] if stage == "grpo" else []
            if stage == "grpo" and i == 5:
                calls = [{"expression": "5*", "result": "error: bad expression", "ok": False}]
            rows.append(_pred(i, stage, correct, calls))
            if not tools:
                del rows[-1]["tool_calls"]
        (root / f"eval/{stage}/predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    compare = COMPARE if tools else {k: v for k, v in COMPARE.items() if "tool" not in k}
    (root / "metrics/compare.json").write_text(json.dumps(compare))


class _Collect(HTMLParser):
    """Images, table cells and text of the page; unbalanced tags are errors."""

    VOID = {"meta", "img", "br"}

    def __init__(self):
        super().__init__()
        self.imgs, self.stack, self.errors, self.rows, self.text = [], [], [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])
        if tag == "tr":
            self.rows.append([])
        if tag == "td":
            self.rows[-1].append("")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)

    def handle_data(self, data):
        self.text.append(data)
        if self.stack and self.stack[-1] == "td":
            self.rows[-1][-1] += data.strip()


def _page(out):
    parser = _Collect()
    parser.feed((out / "report.html").read_text())
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    return parser


def test_report_table_figure_and_examples(tmp_path):
    write_fixture(tmp_path)
    r = report.build(tmp_path, tmp_path / "reports")
    page = _page(tmp_path / "reports")
    # the comparison table: each stage's accuracy, interval and tool use from its metrics file, p from compare.json
    cells = {row[0]: row[1:] for row in page.rows if row}
    assert cells["base"] == ["2.1%", "1.1% – 4.1%", "0.0%", "0.00", ""]
    assert cells["sft"] == ["34.7%", "30.3% – 39.2%", "45.6%", "0.87", ""]
    assert cells["grpo"] == ["61.3%", "56.7% – 65.7%", "91.2%", "1.93", ""]
    assert cells["GRPO − SFT"] == ["+26.6%", "+21.4% – +31.8%", "", "", "0.00073"]
    # the figure is a real PNG the page shows
    assert page.imgs == ["accuracy_by_stage.png"] and r["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 3 problems fixed by GRPO (of 4) and the 1 it broke, with the tool calls the evaluation recorded
    assert r["examples"] == 4
    text = " ".join(page.text)
    assert text.count("fixed by GRPO") == 3 and text.count("broken by GRPO") == 1
    assert "2*6 → 12" in text and "3*6 → 18" in text and "4*6 → 24" not in text  # EXAMPLES caps "fixed" at 3
    assert "5* → error: bad expression (error)" in text
    assert "no tool call" in text  # SFT's side of the examples
    assert "<script>x</script>" in text  # the questions are escaped, not markup


def test_ci_bars_are_the_metrics_intervals(tmp_path):
    write_fixture(tmp_path)
    stages = report.load(tmp_path)["stages"]
    fig = report.accuracy_figure(stages)
    errorbars, bars = fig.axes[0].containers
    assert [b.get_height() for b in bars] == [EVAL[s]["accuracy"] for s in report.STAGES]
    assert bars.errorbar is errorbars
    segments = errorbars.lines[2][0].get_segments()
    assert [(round(s[0][1], 6), round(s[1][1], 6)) for s in segments] == [
        tuple(EVAL[s]["accuracy_ci95"]) for s in report.STAGES
    ]


def test_report_without_tools(tmp_path):
    """tools=[] (the ablation): no tool columns, and the examples say the evaluation ran without tools."""
    write_fixture(tmp_path, tools=False)
    report.build(tmp_path, tmp_path / "reports")
    page = _page(tmp_path / "reports")
    assert {len(row) for row in page.rows if row} == {4}  # stage, accuracy, CI, p
    assert " ".join(page.text).count("evaluated without tools") == 8  # 4 examples x (SFT, GRPO)


def test_missing_inputs_name_the_file_and_stage(tmp_path, monkeypatch, capsys):
    write_fixture(tmp_path)
    (tmp_path / "metrics/eval_grpo.json").unlink()
    (tmp_path / "metrics/compare.json").unlink()
    with pytest.raises(report.MissingInputs) as e:
        report.build(tmp_path, tmp_path / "reports")
    assert "metrics/eval_grpo.json (dvc repro eval_grpo)" in str(e.value)
    assert "metrics/compare.json (dvc repro compare)" in str(e.value)
    assert "eval_sft" not in str(e.value)
    assert not (tmp_path / "reports").exists()
    monkeypatch.chdir(tmp_path)
    assert report.main([]) == 1
    assert "dvc repro eval_grpo" in capsys.readouterr().err


def test_bad_metrics_name_the_file_and_key(tmp_path):
    write_fixture(tmp_path)
    (tmp_path / "metrics/eval_sft.json").write_text(json.dumps({"accuracy": 0.3}))
    with pytest.raises(ValueError, match=r"metrics/eval_sft.json: no 'accuracy_ci95'.*dvc repro eval_sft"):
        report.build(tmp_path, tmp_path / "reports")
    (tmp_path / "metrics/eval_sft.json").write_text(json.dumps(EVAL["sft"]))
    (tmp_path / "metrics/compare.json").write_text(json.dumps({**COMPARE, "ci95": [0.3, 0.2]}))
    with pytest.raises(ValueError, match=r"compare.json: 'ci95' is \[0.3, 0.2\]; expected \[low, high\]"):
        report.build(tmp_path, tmp_path / "reports")
