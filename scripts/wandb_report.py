"""Build a W&B Report (wandb-workspaces) with the panels of `make report`: SFT loss and learning rate,
GRPO reward / reward std / KL / completion length, accuracy per stage (base -> SFT -> GRPO) and the
per-sample prediction tables of the evaluations.

    python scripts/wandb_report.py                      # save to W&B (needs WANDB_API_KEY, online)
    python scripts/wandb_report.py --group exp-1234     # only the runs of one pipeline run / DVC experiment
    python scripts/wandb_report.py --dry-run            # build offline and print the report's JSON

Keys are the ones the stages log: TRL/transformers' WandbCallback prefixes training metrics with
"train/", evaluation runs (job_type "eval") put "eval/<metric>" in their summary and log
"eval/<stage>/predictions" tables (src/agentrl/tracking.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

STAGES = ("base", "sft", "grpo")
TRAINING_PANELS = [  # (title, y keys)
    ("SFT training loss", ["train/loss"]),
    ("Learning rate", ["train/learning_rate"]),
    ("GRPO reward (mean and std)", ["train/reward", "train/reward_std"]),
    ("GRPO KL to the reference", ["train/kl"]),
    ("GRPO completion length", ["train/completions/mean_length"]),
]


def build_report(project: str, entity: str, group: str | None = None, title: str | None = None):
    import wandb_workspaces.reports.v2 as wr

    runset = wr.Runset(
        entity=entity, project=project, name=group or "all runs", **({"filters": f"Group = '{group}'"} if group else {})
    )
    train_panels = [wr.LinePlot(title=t, x="Step", y=y) for t, y in TRAINING_PANELS]
    eval_panels = [
        wr.BarPlot(title="Held-out accuracy per stage", metrics=["eval/accuracy"], orientation="v"),
        wr.BarPlot(title="Format rate per stage", metrics=["eval/format_rate"], orientation="v"),
        wr.ScalarChart(title="Evaluation throughput (problems/s)", metric="eval/samples_per_second"),
    ]
    tables = [wr.WeavePanelSummaryTable(table_name=f"eval/{s}/predictions") for s in STAGES]
    return wr.Report(
        project=project,
        entity=entity,
        title=title or f"Agentic RL pipeline{f' - {group}' if group else ''}",
        description="prepare -> base -> SFT -> GRPO on params.yaml; built by scripts/wandb_report.py",
        blocks=[
            wr.H1("Training curves"),
            wr.P("SFT loss and learning rate; GRPO reward, KL and completion length per optimizer step."),
            wr.PanelGrid(runsets=[runset], panels=train_panels),
            wr.H1("Accuracy base -> SFT -> GRPO"),
            wr.P(
                "Held-out accuracy of each stage (greedy unless eval.temperature > 0); confidence intervals "
                "and the paired test are in metrics/compare.json and reports/report.html."
            ),
            wr.PanelGrid(runsets=[runset], panels=eval_panels),
            wr.H1("Example completions"),
            wr.PanelGrid(runsets=[runset], panels=tables),
        ],
    )


def report_json(report) -> dict:
    """The report as built (offline: nothing is sent; W&B resolves project ids only on save)."""
    from pydantic import TypeAdapter

    return TypeAdapter(type(report)).dump_python(report, mode="json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", help="W&B project (default: tracking.wandb_project in params.yaml)")
    ap.add_argument(
        "--entity",
        default=os.environ.get("WANDB_ENTITY"),
        help="W&B entity (default: $WANDB_ENTITY, else your default entity)",
    )
    ap.add_argument("--group", help="restrict to one W&B group (a pipeline run / DVC experiment name)")
    ap.add_argument("--title")
    ap.add_argument("--dry-run", action="store_true", help="build offline and print the JSON; save nothing")
    a = ap.parse_args(argv)
    project = a.project
    if project is None:
        from agentrl.config import load_params_or_exit

        project = load_params_or_exit().tracking.wandb_project
    if a.dry_run:
        print(json.dumps(report_json(build_report(project, a.entity or "offline", a.group, a.title)), indent=1))
        return 0
    if not os.environ.get("WANDB_API_KEY"):
        print(
            "wandb_report: WANDB_API_KEY is not set; a W&B Report can only be saved online "
            "(use --dry-run to build it offline, or `make report` for the offline HTML report)",
            file=sys.stderr,
        )
        return 2
    report = (
        build_report(project, a.entity, a.group, a.title)
        if a.entity
        else build_report(project, _default_entity(), a.group, a.title)
    )
    report.save()
    print(f"wandb_report: saved {report.url}")
    return 0


def _default_entity() -> str:
    import wandb

    return wandb.Api().default_entity


if __name__ == "__main__":
    raise SystemExit(main())
