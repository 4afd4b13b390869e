"""Sweeps over `dvc exp` end to end in a temporary copy of the repository (miniature config)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import mini_params

BIN = str(Path(sys.executable).parent)
pytestmark = pytest.mark.slow


def run(cmd, cwd):
    env = {
        **os.environ,
        "PATH": BIN + os.pathsep + os.environ["PATH"],
        "WANDB_MODE": "disabled",
        # dvc exp commits experiments: give git an identity on machines without one
        "GIT_AUTHOR_NAME": "agentrl-test",
        "GIT_AUTHOR_EMAIL": "test@example.invalid",
        "GIT_COMMITTER_NAME": "agentrl-test",
        "GIT_COMMITTER_EMAIL": "test@example.invalid",
    }
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture
def baseline(copy_repo):
    p = mini_params()
    p["tracking"]["report_to"] = ["dvclive"]
    (copy_repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    space = {
        "objective": {"metric": "metrics/eval_grpo.json", "key": "accuracy", "direction": "maximize"},
        "fixed": {"grpo.trainer.max_steps": 1},  # set in every trial, not searched
        "grid": {"grpo.trainer.learning_rate": [1e-4, 3e-4], "grpo.lora.r": [8], "grpo.trainer.beta": [0.0]},
        "random": {
            "grpo.trainer.learning_rate": {"type": "loguniform", "low": 1e-4, "high": 1e-3},
            "grpo.lora.r": {"type": "categorical", "choices": [4, 8]},
            "grpo.trainer.beta": {"type": "uniform", "low": 0.0, "high": 0.05},
        },
    }
    (copy_repo / "configs/sweeps/mini.yaml").write_text(yaml.safe_dump(space))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    run(["git", "init", "-q"], copy_repo)
    run(git + ["add", "-A"], copy_repo)
    run(git + ["commit", "-qm", "code"], copy_repo)
    run(["dvc", "repro"], copy_repo)
    run(git + ["add", "-A"], copy_repo)
    run(git + ["commit", "-qm", "baseline"], copy_repo)
    return copy_repo


def test_grid_and_optuna_sweeps(baseline):
    out = run(
        [sys.executable, "scripts/sweep.py", "grid", "--space", "configs/sweeps/mini.yaml", "--name", "g"], baseline
    )
    best = json.loads((baseline / "sweeps/g/best.json").read_text())
    assert best["trials"] == 2 and best["finished_experiments"] == 2
    assert best["params"]["grpo.trainer.learning_rate"] in (1e-4, 3e-4)
    assert "dvc exp apply" in best["apply"] and "best accuracy" in out
    run(
        [
            sys.executable,
            "scripts/sweep.py",
            "optuna",
            "--space",
            "configs/sweeps/mini.yaml",
            "--trials",
            "2",
            "--name",
            "o",
        ],
        baseline,
    )
    best = json.loads((baseline / "sweeps/o/best.json").read_text())
    assert best["trials"] == 2 and best["finished_experiments"] == 2
    assert (baseline / "sweeps/o/study.db").exists()
    shown = run(["dvc", "exp", "show", "--json"], baseline)
    assert shown.count("eval_grpo.json") >= 4
    exps = [e for b in json.loads(shown) for e in (b.get("experiments") or [])]
    steps = [
        r["data"]["params"]["params.yaml"]["data"]["grpo"]["trainer"]["max_steps"] for e in exps for r in e["revs"]
    ]
    assert steps and set(steps) == {1}, steps  # the space's `fixed` section reached every trial
    # no trial retrained SFT (queued runs included): every experiment carries the baseline's SFT metrics
    sft = [r["data"]["metrics"]["metrics/sft_train.json"]["data"]["runtime_s"] for e in exps for r in e["revs"]]
    baseline_sft = json.loads((baseline / "metrics/sft_train.json").read_text())["runtime_s"]
    assert len(sft) == 4 and set(sft) == {baseline_sft}, (sft, baseline_sft)
