"""scripts/wandb_report.py builds its W&B Report offline (saving needs a key and the network)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import wandb_report


def _panels(report):
    return [p for b in report.blocks for p in getattr(b, "panels", [])]


def test_report_has_training_accuracy_and_prediction_panels():
    report = wandb_report.build_report("agentic-rl", "my-team", group="exp-1")
    assert (report.project, report.entity) == ("agentic-rl", "my-team")
    panels = _panels(report)
    line_keys = {k for p in panels if type(p).__name__ == "LinePlot" for k in p.y}
    assert {
        "train/loss",
        "train/learning_rate",
        "train/reward",
        "train/reward_std",
        "train/kl",
        "train/completions/mean_length",
    } <= line_keys
    bars = [p for p in panels if type(p).__name__ == "BarPlot"]
    assert ["eval/accuracy"] in [p.metrics for p in bars]
    tables = {p.table_name for p in panels if type(p).__name__ == "WeavePanelSummaryTable"}
    assert tables == {"eval/base/predictions", "eval/sft/predictions", "eval/grpo/predictions"}
    # every panel grid looks at the runs of the one pipeline run (W&B group) asked for
    grids = [b for b in report.blocks if hasattr(b, "runsets")]
    assert len(grids) == 3
    assert all("exp-1" in str(rs.filters) and rs.project == "agentic-rl" for g in grids for rs in g.runsets)


def test_report_json_and_cli(capsys, monkeypatch):
    spec = wandb_report.report_json(wandb_report.build_report("p", "e"))
    assert spec["title"] == "Agentic RL pipeline" and len(spec["blocks"]) == 8
    assert wandb_report.main(["--dry-run", "--project", "p", "--group", "g"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["project"] == "p" and "Agentic RL pipeline - g" == out["title"]
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_report.main(["--project", "p"]) == 2
    assert "WANDB_API_KEY is not set" in capsys.readouterr().err
