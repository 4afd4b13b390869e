"""Build a W&B Report (wandb-workspaces) of the plots dvc.yaml declares, the per-stage columns of `make report`
and the per-sample prediction tables of the evaluations.

    python scripts/wandb_report.py                      # save to W&B (needs WANDB_API_KEY, online)
    python scripts/wandb_report.py --group exp-1234     # only the runs of one pipeline run / DVC experiment
    python scripts/wandb_report.py --dry-run            # build offline and print the report's JSON

The panels are not defined here: each plot of dvc.yaml's `plots:` becomes one panel (wandb_key maps its
files to the keys W&B gets), and the bars are agentrl.experiments.report.STAGE_COLUMNS. A training stage logs the same
values to DVCLive (dvclive/<stage>/plots/metrics/<key>.tsv) and, through transformers' WandbCallback, to W&B
as "train/<key>" in a run of job type <stage>; evaluation runs (job type "eval") put "eval/<metric>" in their
summary and log "eval/<stage>/predictions" tables (src/agentrl/tracking.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path, PurePosixPath

from agentrl.experiments.report import STAGE_COLUMNS, STAGES, dvc_plots

ROOT = Path(__file__).resolve().parents[3]  # the checkout whose dvc.yaml declares the plots (src/agentrl/experiments)


def wandb_key(file: str, column: str) -> tuple[str, str]:
    """The W&B run and key that hold one y column of a dvc.yaml plot.

    Args:
        file: the plot's file (dvclive/<stage>/plots/metrics/*.tsv or metrics/*.csv).

    Returns:
        (W&B job type, W&B key); ValueError for a file with no known key.
    """
    p = PurePosixPath(file)
    if p.parts[:1] == ("dvclive",) and p.parts[2:4] == ("plots", "metrics") and p.suffix == ".tsv":
        if column != p.stem:
            raise ValueError(f"dvc.yaml plot {file}: column '{column}', expected '{p.stem}' (DVCLive's own)")
        return p.parts[1], "train/" + PurePosixPath(*p.parts[4:]).with_suffix("").as_posix()
    if p.parts[:1] == ("metrics",) and p.suffix == ".csv":  # one row per stage (stages/compare.py)
        return "eval", f"eval/{column}"
    raise ValueError(
        f"dvc.yaml plot {file}: no W&B key known (expected dvclive/<stage>/plots/metrics/*.tsv or metrics/*.csv)"
    )


def panel_specs(root: Path = ROOT) -> dict[str, list[tuple[str, str, list[str]]]]:
    """The report's panels: the dvc.yaml plots, then a bar per report column not plotted yet.

    Returns:
        {W&B job type: [(kind, title, keys)]}.
    """
    specs: dict[str, list[tuple[str, str, list[str]]]] = {}
    for title, plot in dvc_plots(root):
        found = [
            wandb_key(file, col)
            for file, cols in plot["y"].items()
            for col in ([cols] if isinstance(cols, str) else cols)
        ]
        if len({job for job, _ in found}) != 1:
            raise ValueError(f"dvc.yaml plot '{title}': its files come from different stages {found}")
        kind = {"step": "line", "stage": "bar"}.get(plot.get("x"))
        if kind is None:
            raise ValueError(f"dvc.yaml plot '{title}': x is {plot.get('x')!r}; expected 'step' (a curve) or 'stage'")
        specs.setdefault(found[0][0], []).append((kind, title, [key for _, key in found]))
    plotted = {k for panels in specs.values() for _, _, keys in panels for k in keys}
    specs.setdefault("eval", []).extend(
        ("bar", f"{label.capitalize()} per stage", [f"eval/{key}"])
        for key, (label, _) in STAGE_COLUMNS.items()
        if f"eval/{key}" not in plotted
    )
    return specs


def training_panels(root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """The training curves of the report: what tests/test_training.py checks the stages really log.

    Returns:
        (title, W&B keys) per curve.
    """
    return [(t, keys) for job, ps in panel_specs(root).items() if job != "eval" for kind, t, keys in ps]


def build_report(project: str, entity: str, group: str | None = None, title: str | None = None, root: Path = ROOT):
    """The W&B Report (wandb_workspaces.reports.v2), built offline: nothing is sent until it is saved.

    Args:
        group: only the runs of this W&B group (a pipeline run / DVC experiment); None: all runs.
        title: the report's title (default: "Agentic RL pipeline", with the group).
    """
    import wandb_workspaces.reports.v2 as wr

    def runset(job: str):
        where = " and ".join([f"Group = '{group}'"] * bool(group) + [f"JobType = '{job}'"])
        return wr.Runset(entity=entity, project=project, name=f"{group or 'all runs'}: {job}", filters=where)

    def panel(kind: str, t: str, keys: list[str]):
        if kind == "line":
            return wr.LinePlot(title=t, x="train/global_step", y=keys)  # dvc.yaml's x: step (the optimizer step)
        return wr.BarPlot(title=t, metrics=keys, orientation="v")

    specs = panel_specs(root)
    blocks = []
    for job, panels in specs.items():
        if job != "eval":
            blocks += [
                wr.H1(f"{job.upper()} training"),
                wr.PanelGrid(runsets=[runset(job)], panels=[panel(*p) for p in panels]),
            ]
    blocks += [
        wr.H1("Accuracy and tool use per stage"),
        wr.P("Confidence intervals and the paired test GRPO - SFT: `make report` (reports/report.html)."),
        wr.PanelGrid(runsets=[runset("eval")], panels=[panel(*p) for p in specs["eval"]]),
        wr.H1("Example completions"),
        wr.PanelGrid(
            runsets=[runset("eval")],
            panels=[wr.WeavePanelSummaryTable(table_name=f"eval/{s}/predictions") for s in STAGES],
        ),
    ]
    return wr.Report(
        project=project,
        entity=entity,
        title=title or f"Agentic RL pipeline{f' - {group}' if group else ''}",
        description="prepare -> base -> SFT -> GRPO; panels from dvc.yaml plots, built by scripts/wandb_report.py",
        blocks=blocks,
    )


def report_json(report) -> dict:
    """The report as built (offline: nothing is sent; W&B resolves project ids only on save)."""
    from pydantic import TypeAdapter

    return TypeAdapter(type(report)).dump_python(report, mode="json")


def main(argv: list[str] | None = None) -> int:
    """`python scripts/wandb_report.py`: save the report to W&B, or print it with --dry-run.

    Args:
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        The exit status: 2 when saving needs WANDB_API_KEY.
    """
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
    report = build_report(project, a.entity or _default_entity(), a.group, a.title)
    report.save()
    print(f"wandb_report: saved {report.url}")
    return 0


def _default_entity() -> str:
    """The logged-in user's default W&B entity (online)."""
    import wandb

    return wandb.Api().default_entity
