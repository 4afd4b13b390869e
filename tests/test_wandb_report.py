"""scripts/wandb_report.py (agentrl.experiments.wandb_report) builds its W&B Report offline (saving needs a key and
the network); its panels are dvc.yaml's plots (mapped to the keys W&B gets) and the report's per-stage columns, not a
list of their own."""

import json
from pathlib import Path

import pytest
import yaml

from agentrl.experiments import wandb_report
from agentrl.experiments.report import STAGE_COLUMNS

ROOT = Path(__file__).resolve().parents[1]


def _grids(report):
    """{runset filter: [(panel type, title, keys)]} of the report's panel grids."""
    out = {}
    for b in report.blocks:
        if hasattr(b, "runsets"):
            ((rs,),) = [b.runsets]
            out.setdefault(rs.filters, []).extend(
                (
                    type(p).__name__,
                    getattr(p, "title", None),
                    list(getattr(p, "y", None) or getattr(p, "metrics", None) or []),
                )
                for p in b.panels
            )
    return out


def test_every_dvc_yaml_plot_is_a_panel_of_its_stage_runs():
    report = wandb_report.build_report("agentic-rl", "my-team", group="exp-1")
    assert (report.project, report.entity) == ("agentic-rl", "my-team")
    grids = _grids(report)
    sft, grpo = grids["Group = 'exp-1' and JobType = 'sft'"], grids["Group = 'exp-1' and JobType = 'grpo'"]
    assert ("LinePlot", "SFT loss", ["train/loss"]) in sft
    assert ("LinePlot", "GRPO reward", ["train/reward", "train/reward_std"]) in grpo
    assert ("LinePlot", "GRPO completion length", ["train/completions/mean_length"]) in grpo
    assert ("LinePlot", "GRPO tool use", ["train/tools/tool_use_rate"]) in grpo
    titles = [t for panels in grids.values() for _, t, _ in panels]
    declared = [next(iter(e)) for e in yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]]
    assert set(declared) <= set(titles) and len(declared) == len(set(declared))
    # evaluation runs: accuracy (dvc.yaml's bar) and the report's other per-stage columns, then the predictions
    evals = grids["Group = 'exp-1' and JobType = 'eval'"]
    assert [keys for kind, _, keys in evals if kind == "BarPlot"] == [[f"eval/{k}"] for k in STAGE_COLUMNS]
    assert [kind for kind, _, _ in evals].count("WeavePanelSummaryTable") == 3
    assert {p.table_name for b in report.blocks for p in getattr(b, "panels", []) if hasattr(p, "table_name")} == {
        "eval/base/predictions",
        "eval/sft/predictions",
        "eval/grpo/predictions",
    }
    assert set(grids) == {f"Group = 'exp-1' and JobType = '{j}'" for j in ("sft", "grpo", "eval")}
    # the curves tests/test_training.py checks the stages really log
    assert ("GRPO tool use", ["train/tools/tool_use_rate"]) in wandb_report.training_panels()


def test_a_plot_added_to_dvc_yaml_becomes_a_panel(tmp_path):
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    dvc["plots"].append({"GRPO KL": {"x": "step", "y": {"dvclive/grpo/plots/metrics/kl.tsv": "kl"}}})
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    grids = _grids(wandb_report.build_report("p", "e", root=tmp_path))
    assert ("LinePlot", "GRPO KL", ["train/kl"]) in grids["JobType = 'grpo'"]
    dvc["plots"].append({"Confusion": {"x": "actual", "y": {"eval/grpo/confusion.csv": "predicted"}}})
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    with pytest.raises(ValueError, match="eval/grpo/confusion.csv: no W&B key known"):
        wandb_report.build_report("p", "e", root=tmp_path)


def test_wandb_key():
    assert wandb_report.wandb_key("dvclive/sft/plots/metrics/loss.tsv", "loss") == ("sft", "train/loss")
    assert wandb_report.wandb_key("dvclive/grpo/plots/metrics/rewards/format/mean.tsv", "mean") == (
        "grpo",
        "train/rewards/format/mean",
    )
    assert wandb_report.wandb_key("metrics/accuracy_by_stage.csv", "accuracy") == ("eval", "eval/accuracy")
    with pytest.raises(ValueError, match="column 'reward', expected 'loss'"):
        wandb_report.wandb_key("dvclive/sft/plots/metrics/loss.tsv", "reward")


def test_report_json_and_cli(capsys, monkeypatch):
    spec = wandb_report.report_json(wandb_report.build_report("p", "e"))
    assert spec["title"] == "Agentic RL pipeline" and len(spec["blocks"]) == 9
    assert wandb_report.main(["--dry-run", "--project", "p", "--group", "g"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["project"] == "p" and "Agentic RL pipeline - g" == out["title"]
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_report.main(["--project", "p"]) == 2
    assert "WANDB_API_KEY is not set" in capsys.readouterr().err
