"""The DVC pipeline itself, run for real in a temporary copy of the repository on a miniature config."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import mini_params

BIN = str(Path(sys.executable).parent)


def run(cmd, cwd, check=True):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "WANDB_MODE": "offline",
           "GIT_AUTHOR_NAME": "agentrl-test", "GIT_AUTHOR_EMAIL": "test@example.invalid",
           "GIT_COMMITTER_NAME": "agentrl-test", "GIT_COMMITTER_EMAIL": "test@example.invalid"}
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]


def local_imports(module: str, src: Path) -> set[str]:
    """The package modules `module` imports, directly or through each other (`from .x import`, `from . import x`)."""
    import ast

    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for node in ast.walk(ast.parse((src / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                todo += [node.module] if node.module else [a.name for a in node.names]
    return seen


def test_every_stage_depends_on_all_the_code_it_runs():
    """A stage's deps list every package module its entry module imports, so `dvc repro` re-runs it when
    any of that code changes (and only then)."""
    root = Path(__file__).resolve().parents[1]
    src = root / "src/agentrl"
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert stages
    for name, stage in stages.items():
        module = stage["cmd"].split("-m agentrl.")[1].split()[0]
        needed = {f"src/agentrl/{m}.py" for m in local_imports(module, src)}
        missing = needed - set(stage["deps"])
        assert not missing, f"dvc.yaml stage {name!r} runs agentrl.{module} but does not depend on {sorted(missing)}"


@pytest.fixture
def repo(copy_repo):
    (copy_repo / "params.yaml").write_text(yaml.safe_dump(mini_params(), sort_keys=False))
    run(["git", "init", "-q"], copy_repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A"], copy_repo)
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], copy_repo)
    return copy_repo


def set_param(repo, path, value):
    p = yaml.safe_load((repo / "params.yaml").read_text())
    node = p
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))


def test_prepare_stage_caching(repo):
    out = run(["dvc", "repro", "prepare"], repo).stdout
    assert ran_stages(out) == ["prepare"]
    assert (repo / "data/prepared/test.jsonl").exists() and (repo / "metrics/prepare.json").exists()
    assert "up to date" in run(["dvc", "status", "prepare"], repo).stdout.lower() or \
        run(["dvc", "status", "prepare"], repo).stdout.strip() in ("", "Data and pipelines are up to date.")
    assert ran_stages(run(["dvc", "repro", "prepare"], repo).stdout) == []
    set_param(repo, "grpo.learning_rate", 1e-5)
    assert ran_stages(run(["dvc", "repro", "prepare"], repo).stdout) == []
    set_param(repo, "data.max_samples", 50)
    assert ran_stages(run(["dvc", "repro", "prepare"], repo).stdout) == ["prepare"]
    assert json.loads((repo / "metrics/prepare.json").read_text())["written"]["sft_train"] == 50


def test_full_pipeline_then_grpo_only_change(repo):
    out = run(["dvc", "repro"], repo).stdout
    stages = ran_stages(out)
    for s in ("prepare", "base", "sft", "grpo", "eval_base", "eval_sft", "eval_grpo", "compare", "export",
              "eval_quantized"):
        assert s in stages, out[-2000:]
    assert run(["dvc", "status"], repo).stdout.strip() == "Data and pipelines are up to date."
    assert ran_stages(run(["dvc", "repro"], repo).stdout) == []
    metrics = run(["dvc", "metrics", "show", "--json"], repo).stdout
    assert "eval_grpo.json" in metrics and "accuracy" in metrics
    # `dvc plots show` renders the training curves and the accuracy per stage from the run's outputs
    plots = json.loads(run(["dvc", "plots", "show", "--json"], repo).stdout)
    for name, field in (("SFT loss", "loss"), ("SFT learning rate", "learning_rate"), ("GRPO reward", "reward"),
                        ("GRPO completion length", "mean_length"), ("Accuracy per stage", "accuracy")):
        values = plots["data"][name][0]["content"]["data"]["values"]
        assert values and all(field in v or "reward_std" in v for v in values), name
    stages = {v["stage"] for v in plots["data"]["Accuracy per stage"][0]["content"]["data"]["values"]}
    assert stages == {"base", "sft", "grpo"}, stages
    kl_coef = yaml.safe_load((repo / "params.yaml").read_text())["grpo"]["kl_coef"]
    missing = {e["name"] for e in plots.get("errors", [])}
    assert missing <= ({"GRPO KL"} if kl_coef == 0 else set()), plots.get("errors")  # TRL logs kl only if beta > 0
    set_param(repo, "grpo.learning_rate", 2e-4)
    rerun = ran_stages(run(["dvc", "repro"], repo).stdout)
    assert set(rerun) == {"grpo", "eval_grpo", "compare", "export", "eval_quantized"}, rerun
    assert json.loads((repo / "metrics/export.json").read_text())["passed"]
