"""scripts/env_results.py (agentrl.experiments.env_results): an experiment's metrics copied out of its git ref
(make env)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts/env_results.py"


def git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def make_repo_with_experiment(tmp_path):
    """A git repository whose baseline has two declared metrics and whose experiment `env-x` (at refs/exps) changed
    one metric and the params, the workspace back at the baseline as after `dvc exp run --temp`."""
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "params.yaml").write_text("seed: 1\nlr: 1e-6\nagent:\n  tools: [calculator]\n  environment: null\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  a:\n    cmd: x\n    metrics: [metrics/eval_sft.json: {cache: false}]\n"
        "  b:\n    cmd: y\n    metrics: [metrics/compare.json]\n"
    )
    (tmp_path / "metrics/eval_sft.json").write_text('{"accuracy": 0.1}')
    (tmp_path / "metrics/compare.json").write_text('{"p_value": "1.00e+00"}')
    (tmp_path / "metrics/bench_tools.json").write_text('{"ratio": 1.2}')  # in git, not a pipeline metric
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "baseline")
    # as `dvc exp run -S` writes it: the layout rewritten (block list, empty null), one value changed, one key added
    # `1e-6` and `0.000001` are one float as the stages read them (YAML 1.1 alone reads the first as a string)
    (tmp_path / "params.yaml").write_text(
        "seed: 2\nlr: 0.000001\nagent:\n  tools:\n  - calculator\n  environment:\n  view: local\n"
    )
    (tmp_path / "metrics/eval_sft.json").write_text('{"accuracy": 0.5}')
    git(tmp_path, "commit", "-qam", "experiment")
    git(tmp_path, "update-ref", "refs/exps/ab/cdef/env-x", "HEAD")
    git(tmp_path, "reset", "-q", "--hard", "HEAD~1")  # the workspace holds the baseline, as after dvc exp --temp


def copy_results(tmp_path, *args):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True)


def test_copies_the_pipelines_metrics_and_names_a_missing_one(tmp_path):
    make_repo_with_experiment(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out/README.md").write_text("the hand-written account\n")
    run = copy_results(tmp_path, "env-x", "out")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "out/eval_sft.json").read_text()) == {"accuracy": 0.5}
    assert json.loads((tmp_path / "out/compare.json").read_text()) == {"p_value": "1.00e+00"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "README.md",
        "compare.json",
        "eval_sft.json",
        "experiment.md",
    ]  # not bench_tools.json: dvc.yaml does not declare it
    table = [line for line in (tmp_path / "out/experiment.md").read_text().splitlines() if line.startswith("| `")]
    assert table == ['| `agent.view` | (absent) | `"local"` |', "| `seed` | `1` | `2` |"]
    assert (tmp_path / "out/README.md").read_text() == "the hand-written account\n"
    missing = copy_results(tmp_path, "env-y", "out")
    assert missing.returncode != 0 and "no experiment named 'env-y'" in missing.stderr


def test_refuses_to_overwrite_another_runs_results_unless_forced(tmp_path):
    make_repo_with_experiment(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out/eval_sft.json").write_text('{"accuracy": 0.9}')  # a preset folder's committed run
    refused = copy_results(tmp_path, "env-x", "out")
    assert refused.returncode != 0
    assert "would overwrite: eval_sft.json. Nothing written" in refused.stderr and "--force" in refused.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval_sft.json"]
    assert (tmp_path / "out/eval_sft.json").read_text() == '{"accuracy": 0.9}'
    assert copy_results(tmp_path, "env-x", "fresh").returncode == 0  # a fresh folder: nothing to replace
    again = copy_results(tmp_path, "env-x", "fresh")  # the same experiment copied twice: identical files
    assert again.returncode == 0 and "replaced" not in again.stderr
    forced = copy_results(tmp_path, "env-x", "out", "--force")
    assert forced.returncode == 0 and "replaced (--force): eval_sft.json" in forced.stderr
    assert json.loads((tmp_path / "out/eval_sft.json").read_text()) == {"accuracy": 0.5}


def test_of_several_runs_of_one_name_the_one_on_head_is_copied(tmp_path):
    """`make real` re-run after a commit leaves two experiments of one name (refs/exps/<baseline>/<name>): the one
    on the checked-out commit is the run that just finished; with none or two there, nothing is guessed."""
    make_repo_with_experiment(tmp_path)  # env-x on a baseline that is not HEAD
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, check=True, capture_output=True, text=True)
    head = head.stdout.strip()
    (tmp_path / "metrics/eval_sft.json").write_text('{"accuracy": 0.7}')
    git(tmp_path, "commit", "-qam", "the run on HEAD")
    git(tmp_path, "update-ref", f"refs/exps/{head[:2]}/{head[2:]}/env-x", "HEAD")
    git(tmp_path, "reset", "-q", "--hard", "HEAD~1")
    run = copy_results(tmp_path, "env-x", "out")
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "out/eval_sft.json").read_text()) == {"accuracy": 0.7}
    git(tmp_path, "update-ref", "-d", f"refs/exps/{head[:2]}/{head[2:]}/env-x")
    git(tmp_path, "update-ref", "refs/exps/12/3456/env-x", "refs/exps/ab/cdef/env-x")
    refused = copy_results(tmp_path, "env-x", "fresh")
    assert refused.returncode != 0 and "2 experiments named 'env-x'" in refused.stderr
    assert "refs/exps/12/3456/env-x" in refused.stderr and "0 of them on HEAD" in refused.stderr
