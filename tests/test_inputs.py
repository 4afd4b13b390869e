"""Inputs cannot pass silently (issue 19, items 3 and 4): local jsonl sources are DVC dependencies of
`prepare` (a changed file re-runs it), and empty, whitespace-only, UTF-16 or directory inputs, zero usable
rows and zero problems to evaluate are errors naming the file."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.common import read_metrics
from conftest import ROOT, mini_params, write_params

BIN = str(Path(sys.executable).parent)


def rows(lo: int, hi: int) -> list[dict]:
    return [
        {
            "question": f"Tom has {i} apples and buys 2 more. How many apples does Tom have?",
            "answer": f"{i}+2=<<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}",
        }
        for i in range(lo, hi)
    ]


def write_rows(path: Path, data: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in data))


def jsonl_params(workdir: Path, train: str, test: str, **data):
    from agentrl.config import validate_params

    p = mini_params()
    p["data"].update(source="jsonl", train_file=train, test_file=test, eval_max_samples=None, **data)
    write_params(workdir / "params.yaml", p)
    return validate_params(p)


@pytest.mark.parametrize(
    "kind, message",
    [
        ("empty", "no rows (the file is empty or holds only whitespace)"),
        ("whitespace", "no rows (the file is empty or holds only whitespace)"),
        ("utf16", "UTF-16 encoded"),
        ("latin1", "train.jsonl:1: not UTF-8 text"),
        ("directory", "is a directory"),
    ],
)
def test_unreadable_or_empty_train_file_is_an_error_naming_it(workdir, kind, message):
    from agentrl.stages import prepare

    bad = workdir / "train.jsonl"
    if kind == "empty":
        bad.write_bytes(b"")
    elif kind == "whitespace":
        bad.write_text("\n   \n\t\n")
    elif kind == "utf16":
        bad.write_text("".join(json.dumps(r) + "\n" for r in rows(0, 5)), encoding="utf-16")
    elif kind == "latin1":
        bad.write_bytes(
            ("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows(0, 5)).replace("Tom", "Tomé", 3)).encode(
                "latin-1"
            )
        )
    else:
        bad.mkdir()
    write_rows(workdir / "test.jsonl", rows(100, 110))
    params = jsonl_params(workdir, "train.jsonl", "test.jsonl")
    with pytest.raises(ValueError) as e:
        prepare.prepare(params)
    assert str(e.value).startswith("train.jsonl") and message in str(e.value), e.value
    assert not (workdir / "data/prepared").exists()


def test_directory_input_exits_cleanly_naming_it(workdir):
    """The stage's exit: status 1 and one line naming the file, no IsADirectoryError traceback."""
    (workdir / "train.jsonl").mkdir()
    write_rows(workdir / "test.jsonl", rows(100, 110))
    jsonl_params(workdir, "train.jsonl", "test.jsonl")
    r = subprocess.run([sys.executable, "-m", "agentrl.stages.prepare"], cwd=workdir, capture_output=True, text=True)
    assert r.returncode == 1, r.stderr
    assert "train.jsonl: is a directory" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_zero_usable_rows_after_dropping_is_an_error(workdir):
    """The same file as train and test with on_bad_rows: drop left 0 training rows and exited 0."""
    from agentrl.stages import prepare

    write_rows(workdir / "all.jsonl", rows(0, 10))
    params = jsonl_params(workdir, "all.jsonl", "all.jsonl", on_bad_rows="drop")
    with pytest.raises(
        ValueError, match=r"all.jsonl: no usable train rows \(10 read; dropped: 10 train_test_overlap\)"
    ):
        prepare.prepare(params)


def test_zero_problems_is_an_evaluation_error_naming_the_file(workdir):
    from agentrl.config import load_params
    from agentrl.stages.evaluate import TEST, evaluate

    Path(TEST).parent.mkdir(parents=True)
    Path(TEST).write_text("\n")
    with pytest.raises(ValueError, match=f"{TEST}: no problems to evaluate"):
        evaluate(load_params(), "base")
    assert not list(workdir.glob("metrics/eval_*.json"))


def test_jsonl_source_outside_the_stage_deps_is_refused(workdir):
    """With the project's dvc.yaml, a source file DVC does not watch is an error naming the key."""
    from agentrl.stages import prepare

    (workdir / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    write_rows(workdir / "train.jsonl", rows(0, 10))
    write_rows(workdir / "inputs/test.jsonl", rows(100, 110))
    params = jsonl_params(workdir, "train.jsonl", "inputs/test.jsonl")
    with pytest.raises(ValueError, match=r"data.train_file=train.jsonl: not a dependency of the prepare stage"):
        prepare.prepare(params)
    write_rows(workdir / "inputs/train.jsonl", rows(0, 10))
    m = prepare.prepare(jsonl_params(workdir, "inputs/train.jsonl", "inputs/test.jsonl"))
    assert m["valid"] == {"train": 10, "test": 10}


def dvc(args, cwd):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "WANDB_MODE": "disabled"}
    r = subprocess.run(["dvc", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"dvc {' '.join(args)}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return [ln.split("'")[1] for ln in r.stdout.splitlines() if ln.startswith("Running stage '")]


def test_changed_jsonl_source_reruns_prepare(copy_repo):
    """Appending a row to data.train_file re-runs prepare (it used to say "didn't change, skipping")."""
    p = mini_params()
    p["data"].update(
        source="jsonl", train_file="inputs/train.jsonl", test_file="inputs/test.jsonl", eval_max_samples=None
    )
    (copy_repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    write_rows(copy_repo / "inputs/train.jsonl", rows(0, 20))
    write_rows(copy_repo / "inputs/test.jsonl", rows(100, 110))
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "init"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *cmd], cwd=copy_repo, check=True)
    assert dvc(["repro", "prepare"], copy_repo) == ["prepare"]
    assert dvc(["repro", "prepare"], copy_repo) == []
    with (copy_repo / "inputs/train.jsonl").open("a") as f:
        f.write(json.dumps(rows(50, 51)[0]) + "\n")
    assert dvc(["repro", "prepare"], copy_repo) == ["prepare"]
    assert read_metrics(copy_repo / "metrics/prepare.json")["raw"]["train"] == 21
