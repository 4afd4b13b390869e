"""scripts/env_results.py: an experiment's metrics copied out of its git ref (make env)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/env_results.py"


def git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_copies_the_experiments_metrics_and_names_a_missing_one(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "params.yaml").write_text("seed: 1\n")
    (tmp_path / "metrics/eval_sft.json").write_text('{"accuracy": 0.1}')
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "baseline")
    (tmp_path / "params.yaml").write_text("seed: 2\n")
    (tmp_path / "metrics/eval_sft.json").write_text('{"accuracy": 0.5}')
    git(tmp_path, "commit", "-qam", "experiment")
    git(tmp_path, "update-ref", "refs/exps/ab/cdef/env-x", "HEAD")
    git(tmp_path, "reset", "-q", "--hard", "HEAD~1")  # the workspace holds the baseline, as after dvc exp --temp
    run = subprocess.run([sys.executable, SCRIPT, "env-x", "out"], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "out/eval_sft.json").read_text()) == {"accuracy": 0.5}
    assert "+seed: 2" in (tmp_path / "out/README.md").read_text()
    missing = subprocess.run([sys.executable, SCRIPT, "env-y", "out"], cwd=tmp_path, capture_output=True, text=True)
    assert missing.returncode != 0 and "no experiment named 'env-y'" in missing.stderr
