"""make report builds valid HTML with existing images from a small metrics fixture."""

import json
from html.parser import HTMLParser

from agentrl.report import build


def _fixture(root):
    for stage, acc in (("base", 0.0), ("sft", 0.3), ("grpo", 0.4)):
        (root / "metrics").mkdir(exist_ok=True)
        (root / f"metrics/eval_{stage}.json").write_text(
            json.dumps(
                {
                    "accuracy": acc,
                    "accuracy_ci95": [max(0, acc - 0.04), acc + 0.04],
                    "accuracy_by_steps": {"1": acc + 0.1, "2": acc, "3": max(0, acc - 0.1)},
                }
            )
        )
        (root / f"eval/{stage}").mkdir(parents=True)
        rows = [
            {
                "id": f"t{i}",
                "question": f"q{i}",
                "completion": f"{stage} says {i}\n#### {i}",
                "ground_truth": "1",
                "correct": (stage == "grpo" and i < 3) or (stage == "sft" and i == 4),
            }
            for i in range(6)
        ]
        (root / f"eval/{stage}/predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "metrics/compare.json").write_text(
        json.dumps(
            {
                "base_accuracy": 0.0,
                "sft_accuracy": 0.3,
                "grpo_accuracy": 0.4,
                "grpo_minus_sft": 0.1,
                "ci95": [0.05, 0.15],
                "p_value": 0.001,
            }
        )
    )
    for stage, name, col, values in (
        ("sft", "loss", "loss", [3, 2, 1]),
        ("grpo", "reward", "reward", [0.1, 0.3, 0.5]),
        ("grpo", "reward_std", "reward_std", [0.2, 0.2, 0.1]),
        ("grpo", "kl", "kl", [0, 0.01, 0.02]),
        ("grpo", "completions/mean_length", "mean_length", [20, 18, 17]),
    ):
        f = root / f"dvclive/{stage}/plots/metrics/{name}.tsv"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("step\t" + col + "\n" + "".join(f"{i}\t{v}\n" for i, v in enumerate(values)))


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.stack, self.errors = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])
        elif tag not in ("meta",):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def test_report_from_fixture(tmp_path):
    _fixture(tmp_path)
    out = tmp_path / "reports"
    r = build(tmp_path, out)
    assert len(r["figures"]) >= 4 and not r["missing"]
    page = (out / "report.html").read_text()
    parser = _Collect()
    parser.feed(page)
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)
    assert len(parser.imgs) >= 4
    for img in parser.imgs:
        data = (out / img).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    md = (out / "report.md").read_text()
    assert "fixed by GRPO" in md and "broken by GRPO" in md and "30.0%" in md


def test_report_lists_missing_inputs(tmp_path):
    r = build(tmp_path, tmp_path / "reports")
    assert "metrics/eval_grpo.json" in r["missing"]
    assert "Missing inputs" in (tmp_path / "reports/report.md").read_text()
