"""Scratch copies of the repository, for the scripts that run the pipeline somewhere else (bench.py, gpu_check.py)
and for the tests: a copy without outputs, committed under a fixed git identity, with params set by dotted key.
No pipeline stage imports this module."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Optional

# dvc exp and the repository copies commit: a git identity for machines without one
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "agentrl-test",
    "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "agentrl-test",
    "GIT_COMMITTER_EMAIL": "test@example.invalid",
}


def set_param(params_file: str | Path, dotted: str, value) -> None:
    """Set one value of a params.yaml by its dotted key (`grpo.trainer.learning_rate`); every key above the
    last must exist (a KeyError names the missing one and the file)."""
    import yaml

    from .overrides import OverrideError, set_value

    path = Path(params_file)
    tree = yaml.safe_load(path.read_text())
    try:
        set_value(tree, dotted, value, create=False)
    except OverrideError as e:
        raise KeyError(f"{path}: {e}") from None
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


# top-level entries a copy of the repository leaves out: pipeline outputs, caches, local tool state
NOT_COPIED = frozenset(
    {
        ".venv",
        ".git",
        ".pytest_cache",
        ".ruff_cache",
        ".hypothesis",
        ".whl",
        ".gl",
        "data",
        "models",
        "checkpoints",
        "eval",
        "metrics",
        "diagnostics",
        "dvclive",
        "runs",
        "wandb",
        "reports",
        "sweeps",
        "gpu_check",
    }
)


def copy_repo(
    src: str | Path, dst: str | Path, *, only: Optional[Iterable[str]] = None, outputs: Iterable[str] = ()
) -> Path:
    """Copy the repository at `src` (code, configs, dvc.yaml, params) to `dst`: every top-level entry but
    NOT_COPIED (or only the ones named in `only`), without __pycache__ / *.egg-info and without .dvc's cache
    and tmp; then each path of `outputs` (e.g. "models", ".dvc/cache") as it is, when it exists."""
    src, dst = Path(src), Path(dst)
    anywhere = shutil.ignore_patterns("__pycache__", "*.egg-info")
    keep = set(only) if only is not None else None

    def ignore(directory, names):
        skip = set(anywhere(directory, names))
        if Path(directory) == src:
            skip |= {n for n in names if n in NOT_COPIED or (keep is not None and n not in keep)}
        if Path(directory) == src / ".dvc":
            skip |= {"cache", "tmp"} & set(names)  # the copy starts with an empty cache
        return skip

    shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
    for p in outputs:
        if (src / p).is_dir():
            shutil.copytree(src / p, dst / p, symlinks=True, dirs_exist_ok=True)
        elif (src / p).is_file():
            (dst / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / p, dst / p)
    return dst


def git_commit_all(repo: str | Path, message: str) -> None:
    """`git init` (when `repo` is not one yet), `git add -A`, `git commit` under a fixed local identity."""
    env = {**os.environ, **GIT_IDENTITY}
    cmds = [["git", "add", "-A"], ["git", "commit", "-qm", message]]
    if not (Path(repo) / ".git").exists():
        cmds.insert(0, ["git", "init", "-q"])
    for cmd in cmds:
        r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} in {repo} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
