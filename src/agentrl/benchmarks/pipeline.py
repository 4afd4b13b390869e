"""`dvc repro` timings for `make bench` (unless --skip-dvc): a no-op repro in the workspace, then a GRPO-only change
and full forced repros in a scratch copy of the repository with its outputs and cache, so the workspace is
untouched."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrl.experiments.scratch import copy_repo, git_commit_all, set_param

from .measure import stats

# stage -> the diagnostics file that records its peak RSS
STAGE_METRICS = {
    "prepare": "prepare",
    "base": "base",
    "sft": "sft_train",
    "grpo": "grpo_train",
    "eval_base": "eval_base",
    "eval_sft": "eval_sft",
    "eval_grpo": "eval_grpo",
    "export": "export",
    "eval_quantized": "eval_merged_int8",
}


def timed(cmd: list[str], cwd: str | None = None) -> tuple[float, str]:
    """Run a command with this interpreter's bin/ first on PATH; SystemExit with its output when it fails.

    Args:
        cwd: where it runs (None: here).

    Returns:
        (wall seconds, its stdout).
    """
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    start = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return time.perf_counter() - start, r.stdout


def stages_run(out: str) -> list[str]:
    """The stages a `dvc repro` output says it ran.

    Returns:
        Stage names in the order they ran.
    """
    return [ln.split("'")[1] for ln in out.splitlines() if ln.startswith("Running stage")]


def scratch_copy(dst: Path) -> None:
    """The repository plus the workspace's DVC outputs and cache, committed as a fresh git repo: `dvc repro`
    there starts from the same state as here, and nothing here changes.
    """
    outputs = ("data", "models", "checkpoints", "eval", "metrics", "diagnostics", "dvclive", ".dvc/cache")
    copy_repo(Path.cwd(), dst, outputs=outputs)
    git_commit_all(dst, "bench copy")


def _grpo_change_repros(dvc: str, scratch: Path, learning_rate: float, repro_repeats: int) -> dict:
    """`dvc repro` after a GRPO-only change (a new grpo.trainer.learning_rate each time) in the scratch copy.

    Args:
        scratch: the scratch copy (scratch_copy's).
        learning_rate: the workspace's grpo.trainer.learning_rate, scaled by 1.5, 1.75, ... per run.

    Returns:
        {"seconds": stats, "stages_rerun": the first run's, "runs": each run's seconds and stages}.
    """
    change = []
    for i in range(repro_repeats):
        set_param(
            scratch / "params.yaml", "grpo.trainer.learning_rate", float(f"{learning_rate * (1.5 + 0.25 * i):.3g}")
        )
        secs, log = timed([dvc, "repro"], cwd=str(scratch))
        change.append({"seconds": round(secs, 1), "stages_rerun": stages_run(log)})
    return {"seconds": stats([c["seconds"] for c in change]), "stages_rerun": change[0]["stages_rerun"], "runs": change}


def _full_repros(dvc: str, scratch: Path, repro_repeats: int) -> dict:
    """`dvc repro --force` in the scratch copy: every stage from scratch (set-up excluded), checkpoints removed
    first (or sft/grpo would resume from their last step).

    Args:
        scratch: the scratch copy, with the workspace's params.yaml.

    Returns:
        full_repro_seconds, full_repro_stages, full_repro_accuracies (identical across repeats when the pipeline
        is deterministic) and peak_rss_mb_per_stage (max over the runs, from the stages' diagnostics).
    """
    full, rss, acc = [], {}, []
    for _ in range(repro_repeats):
        shutil.rmtree(scratch / "checkpoints", ignore_errors=True)
        secs, log = timed([dvc, "repro", "--force"], cwd=str(scratch))
        full.append(secs)
        compare = json.loads((scratch / "metrics/compare.json").read_text())
        acc.append({k: compare[k] for k in ("base_accuracy", "sft_accuracy", "grpo_accuracy", "p_value")})
        for stage, name in STAGE_METRICS.items():
            path = scratch / "diagnostics" / f"{name}.json"  # timings and memory: the stages' diagnostics
            if path.exists() and "peak_rss_mb" in (stage_metrics := json.loads(path.read_text())):
                rss.setdefault(stage, []).append(stage_metrics["peak_rss_mb"])
    return {
        "full_repro_seconds": stats(full),
        "full_repro_stages": stages_run(log),
        "full_repro_accuracies": acc,
        "peak_rss_mb_per_stage": {k: max(v) for k, v in rss.items()},
    }


def dvc_timings(params, repeats: int, repro_repeats: int) -> dict:
    """The pipeline's timings: `repeats` no-op repros here, then in a scratch copy `repro_repeats` GRPO-only
    changes and `repro_repeats` full repros. SystemExit when the workspace's pipeline is not up to date.

    Args:
        params: the validated params (grpo.trainer.learning_rate).
        repro_repeats: GRPO-change and full repros.

    Returns:
        noop_repro_seconds, grpo_change_repro and _full_repros' keys.
    """
    dvc = str(Path(sys.executable).parent / "dvc")
    status = timed([dvc, "status"])[1]
    if "up to date" not in status:
        raise SystemExit(f"bench: the pipeline is not up to date (`dvc status`); run `make repro` first\n{status}")
    out: dict = {"noop_repro_seconds": stats([timed([dvc, "repro"])[0] for _ in range(repeats)])}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        scratch_copy(scratch)
        ran = stages_run(timed([dvc, "repro"], cwd=tmp)[1])
        if ran:
            print(f"bench: the scratch copy was not up to date, re-ran {ran}", file=sys.stderr)
        learning_rate = params.grpo.trainer["learning_rate"]
        out["grpo_change_repro"] = _grpo_change_repros(dvc, scratch, learning_rate, repro_repeats)
        shutil.copy("params.yaml", scratch / "params.yaml")  # back to the workspace's params for the full repros
        out.update(_full_repros(dvc, scratch, repro_repeats))
    return out
