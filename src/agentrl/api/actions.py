"""The pipeline as a tool for agents: JSON in, JSON out, every run a DVC experiment.

    python -m agentrl.api.actions describe
    python -m agentrl.api.actions run_experiment '{"overrides": {"seed": 7}, "name": "seed7"}'
    python -m agentrl.api.actions compare '{"a": "seed7", "b": "workspace"}'

Actions (`call(action, args)`; the MCP server in `agentrl.api.mcp_server` exposes the same functions):

  describe          params schema (from config.Params), the stages of dvc.yaml, the workspace's metrics
  run_experiment    params overrides -> `dvc exp run` with a name. mode "temp" (default) runs now in a DVC
                    temporary workspace and returns the metrics; "queue" queues it (`dvc exp run --queue`)
                    and starts a queue worker; "workspace" runs it like "temp", then applies the result to
                    the workspace (`dvc exp apply`), so a failed run never touches the workspace
  list_experiments  `dvc.api.exp_show` rows
  compare           two experiments' metrics, and the paired McNemar test (agentrl.stages.compare) when both
                    evaluated the same held-out problems
  evaluate          a model of an experiment (or the workspace) on its first N held-out problems, in a
                    scratch directory (agentrl.stages.evaluate); the workspace's outputs are not written
  status            runs started through this API (stage, progress) and DVC's queue

Every failure is a JSON object {"error": {"type", "key", "message", ...}}, never a traceback. Arguments and
overrides are checked before anything runs (agentrl.api.checks: the params schema, the agent rules, what
`dvc exp run -S` writes); this module runs and reads. Runs started here are serialised by a file lock
(.dvc/tmp/agentrl_agent/run.lock), so concurrent calls cannot interleave DVC operations on the repository.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from .. import config
from ..experiments import overrides as overrides_mod
from ..experiments.queue import WorkspaceBusy, workspace_run
from ..experiments.queue import dvc_stages as stages
from .checks import APIError, check_experiment_name, check_known, read_params, require, too_large, validate_overrides
from .probe import probe_environment

Progress = Optional[Callable[[float, Optional[float], str], None]]

MODES = ("temp", "queue", "workspace")
EVAL_STAGES = ("base", "sft", "grpo", "merged")
# The arguments each action takes; any other is refused (unknown_argument). The MCP tools publish exactly these.
ARGUMENTS: dict[str, set[str]] = {
    "describe": set(),
    "run_experiment": {"overrides", "name", "mode", "start_queue"},
    "list_experiments": {"all_commits"},
    "compare": {"a", "b", "stage"},
    "evaluate": {"experiment", "stage", "n"},
    "status": set(),
}
MODEL_CHAINS = {"base": ["base"], "sft": ["base", "sft"], "grpo": ["base", "sft", "grpo"], "merged": ["merged"]}
STATE_DIR = Path(".dvc") / "tmp" / "agentrl_agent"
LOCK_TIMEOUT_S = 24 * 3600  # a run waits for the one before it rather than failing
TAIL_CHARS = 3000


# ------------------------------------------------------------------------------------------ helpers
def _root(root: Optional[str | Path]) -> Path:
    repo = Path(root or os.environ.get("AGENTRL_REPO") or ".").resolve()
    if not (repo / "dvc.yaml").exists() or not (repo / "params.yaml").exists():
        raise APIError("not_a_pipeline_repo", f"{repo} has no dvc.yaml and params.yaml", key="root")
    return repo


def _env() -> dict:
    env = {
        **os.environ,
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
        "DVC_NO_ANALYTICS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def _state_dir(root: Path) -> Path:
    state = root / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    return state


def _dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["dvc", *args], cwd=root, env=_env(), capture_output=True, text=True)
    if check and result.returncode:
        raise APIError(
            "dvc_failed",
            f"dvc {' '.join(args)} exited {result.returncode}: "
            f"{(result.stderr or result.stdout)[-TAIL_CHARS:].strip()}",
            key=None,
        )
    return result


def _metrics_files(root: Path) -> list[str]:
    return [m for s in stages(root) for m in s["metrics"]]


def _read_metrics(root: Path, rev: Optional[str], diagnostics: bool = False) -> dict:
    """{metrics file: its JSON} of the workspace (rev None) or of a git revision / experiment; with
    `diagnostics`, the stages' diagnostics/<name>.json outputs instead (timings, memory, histograms)."""
    if diagnostics:
        files = [o for s in stages(root) for o in s["outs"] if o.startswith("diagnostics/")]
    else:
        files = _metrics_files(root)
    out: dict = {}
    if rev is None:
        for file in files:
            path = root / file
            if path.exists():
                out[file] = json.loads(path.read_text())
        return out
    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(root), rev=rev)
    for file in files:
        try:
            out[file] = json.loads(fs.read_text(file))
        except FileNotFoundError:
            continue
    return out


def _summary(metrics: dict) -> dict:
    """The headline numbers: accuracy of every evaluated model, the paired test, training loss/reward."""
    summary = {}
    for file, values in metrics.items():
        stem = Path(file).stem
        if stem.startswith("eval_") and "accuracy" in values:
            summary[f"{stem[5:]}_accuracy"] = values["accuracy"]
        if stem == "compare":
            for k in ("grpo_minus_sft", "p_value", "ci95"):
                if k in values:
                    summary[f"compare.{k}"] = values[k]
    return summary


def _resolve(root: Path, name: str, key: str) -> Optional[str]:
    """Experiment name, git revision or "workspace" -> full commit sha (None for the workspace). A revision
    must name a commit: `rev:path` and `:/message` syntax, trees and blobs (`HEAD^{tree}`) name no experiment."""
    if name == "workspace":
        return None
    if len(name) > 200 or name.startswith("-") or overrides_mod.CONTROL_RE.search(name):
        raise APIError(
            "invalid_value", f"'{key}' must be an experiment name or git revision, got {name[:200]!r}", key=key
        )
    from dvc.repo import Repo
    from dvc.scm import RevError, resolve_rev

    def unknown(why: str) -> APIError:
        known = sorted(e for e in experiment_names(root) if e)
        return APIError(
            "unknown_experiment",
            f"{why}; experiments of this baseline: {known or 'none'} (or 'workspace', or a commit: a branch, "
            "a tag, a sha, HEAD~1)",
            key=key,
        )

    if ":" in name:  # git's path (`HEAD:params.yaml`) and commit-message (`:/text`) syntax
        raise unknown(f"'{name}' is a file or message-search revision, not an experiment or commit")
    with Repo(str(root)) as repo:
        try:
            sha = resolve_rev(repo.scm, name)
        except RevError:
            raise unknown(f"no experiment or git revision named '{name}'") from None
        kind = _object_kind(repo.scm, sha)
    if kind != "commit":
        raise unknown(f"'{name}' names a git {kind}, not an experiment or commit")
    return sha


def _object_kind(scm: Any, sha: str) -> str:
    """'commit', 'tree', 'blob' or 'tag': the type of a git object (pygit2, the backend DVC reads with)."""
    return type(scm.pygit2.repo.get(sha)).__name__.lower()


def _git_revision(root: Path, name: str) -> Optional[str]:
    """The commit `name` resolves to as a git revision (a branch, a tag, a remote, HEAD, a sha prefix), or None.
    Experiments are not looked at: DVC resolves a git revision before an experiment of the same name."""
    from dvc.repo import Repo
    from dvc.scm import SCMError
    from scmrepo.exceptions import RevError

    try:
        repo = Repo(str(root))
    except SCMError:
        raise APIError(
            "not_a_pipeline_repo",
            f"{root} is not a git repository: experiments are git refs (git init, commit the pipeline, then run)",
            key="root",
        ) from None
    with repo:
        try:
            return repo.scm.resolve_rev(name)
        except RevError:
            return None


def _experiment_rev(root: Path, name: str) -> str:
    """The commit of the experiment `name` of this baseline, looked up among experiment refs only (a branch
    or tag of the same name is never taken for it)."""
    from dvc.repo import Repo
    from dvc.repo.experiments.utils import resolve_name

    with Repo(str(root)) as repo:
        ref = resolve_name(repo.scm, name).get(name)
        if ref is None:
            raise APIError("run_failed", f"dvc exp run finished but wrote no experiment '{name}'", key=None, name=name)
        return repo.scm.get_ref(str(ref))


def _exp_rows(root: Path) -> list[dict]:
    import dvc.api

    return dvc.api.exp_show(repo=str(root))


def experiment_names(root: Path) -> list[str]:
    """The names of the repository's DVC experiments (`dvc exp show`)."""
    return [r["Experiment"] for r in _exp_rows(root) if r.get("Experiment")]


# ------------------------------------------------------------------------------------------ runs
class _Run:
    """Progress of one run, mirrored to .dvc/tmp/agentrl_agent/runs/<name>.json for `status`."""

    def __init__(self, root: Path, name: str, mode: str, overrides: dict, progress: Progress):
        self.dir = _state_dir(root) / "runs"
        self.dir.mkdir(exist_ok=True)
        self.file = self.dir / f"{name}.json"
        self.total = len(stages(root))
        self.progress = progress
        self.info = {
            "name": name,
            "mode": mode,
            "overrides": overrides,
            "state": "waiting",
            "stage": None,
            "stages_done": 0,
            "stages_total": self.total,
            "started": time.time(),
            "pid": os.getpid(),
        }
        self._save()

    def _save(self) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.info))
        tmp.replace(self.file)

    def update(self, message: str, **kw: Any) -> None:
        self.info.update(kw, message=message)
        self._save()
        if self.progress:
            self.progress(float(self.info["stages_done"]), float(self.total), message)

    def line(self, line: str) -> None:
        match = re.match(r"Running stage '([^']+)'", line) or re.match(r"Stage '([^']+)' didn't change", line)
        if match:
            if self.info["stage"] is not None:
                self.info["stages_done"] += 1
            verb = "running" if line.startswith("Running") else "unchanged"
            self.update(
                f"stage {match.group(1)} ({verb}, {self.info['stages_done'] + 1}/{self.total})",
                stage=match.group(1),
                state="running",
            )

    def close(self) -> None:
        self.file.unlink(missing_ok=True)


@contextlib.contextmanager
def _lock(root: Path, run: _Run):
    from filelock import FileLock, Timeout

    lock = FileLock(str(_state_dir(root) / "run.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        run.update("waiting for another run of this repository to finish", state="waiting")
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout:
            raise APIError("busy", "another run held the repository lock for too long", key=None) from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _workspace(root: Path, name: str, mode: str):
    """Mode 'workspace' holds the workspace from the start (experiments.queue.workspace_run): refused at once while
    `make repro` or another workspace run is going on there, whose files `dvc exp apply` would overwrite."""
    if mode != "workspace":
        yield
        return
    try:
        with workspace_run(root, f"agent API run_experiment {name} (mode workspace)"):
            yield
    except WorkspaceBusy as e:
        raise APIError("busy", str(e), key="mode") from None


def _stream(root: Path, cmd: list[str], run: _Run) -> tuple[int, str]:
    """Run a dvc command, feeding its output lines to the progress; returns (exit code, output tail)."""
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        errors="replace",
    )
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        run.line(line.strip())
        tail.append(line)
        if len(tail) > 400:
            del tail[:200]
    return proc.wait(), "".join(tail)[-TAIL_CHARS:]


def _failed_stage(output: str) -> Optional[str]:
    stages = re.findall(r"failed to reproduce '([^']+)'", output) or re.findall(r"Running stage '([^']+)'", output)
    return stages[-1] if stages else None


def _check_name_free(repo: Path, name: str) -> None:
    """APIError unless `name` is free: no git revision (it would be read back as that commit), no experiment."""
    taken = _git_revision(repo, name)
    if taken:
        raise APIError(
            "invalid_value",
            f"'name' {name!r} is already a git revision here (a branch, tag, remote or ref: commit {taken[:12]}); "
            "an experiment of that name would be read back as that commit: choose another name",
            key="name",
        )
    if name in experiment_names(repo) or _run_in_progress(repo, name):
        raise APIError(
            "name_conflict",
            f"an experiment named '{name}' already exists for this baseline; choose another name",
            key="name",
        )


def run_experiment(args: dict, root: Optional[str | Path] = None, progress: Progress = None) -> dict:
    """Action `run_experiment`: overrides checked and validated, then one `dvc exp run` in the mode asked (temp, queue
    or workspace); returns the experiment's metrics, or APIError naming what was refused."""
    check_known(args, ARGUMENTS["run_experiment"])
    repo = _root(root)
    overrides = require(args, "overrides", dict, {}, 'an object {"dotted.key": value}')
    mode = require(args, "mode", str, "temp")
    if mode not in MODES:
        raise APIError("invalid_value", f"'mode' must be one of {list(MODES)}, got '{mode}'", key="mode")
    start_queue = require(args, "start_queue", bool, True)
    name = require(args, "name", str, None)
    if name is None:
        name = f"agent-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    else:
        check_experiment_name(name)
    params, set_args, _ = validate_overrides(repo, overrides)
    set_args = [x for arg in set_args for x in ("-S", arg)]  # each one `dvc exp run -S <arg>`
    probe_environment(params, overrides)  # sizes bounded by what they cost: refused before any lock is taken
    _check_name_free(repo, name)
    run = _Run(repo, name, mode, overrides, progress)
    try:
        with _lock(repo, run):
            if name in experiment_names(repo):  # named by a run that held the lock before us
                raise APIError("name_conflict", f"an experiment named '{name}' already exists", key="name")
            if mode == "queue":
                _dvc(repo, "exp", "run", "--queue", "-n", name, *set_args)
                if start_queue:
                    _dvc(repo, "queue", "start", "-j", "1")
                run.update("queued", state="queued")
                return {
                    "name": name,
                    "mode": mode,
                    "state": "queued",
                    "overrides": overrides,
                    "next": "call status to follow it, list_experiments/compare once it has run",
                }
            with _workspace(repo, name, mode):
                run.update("starting dvc exp run --temp", state="running")
                t0 = time.time()
                code, out = _stream(repo, ["dvc", "exp", "run", "--temp", "-n", name, *set_args], run)
                if code:
                    raise APIError(
                        "run_failed",
                        f"dvc exp run failed (exit {code}); the workspace is unchanged. Output tail:\n{out}",
                        key=None,
                        stage=_failed_stage(out),
                        name=name,
                    )
                rev = _experiment_rev(repo, name)
                _check_params_reached(repo, rev, params, name)
                applied = False
                if mode == "workspace":
                    run.update("applying the experiment to the workspace (dvc exp apply)")
                    _dvc(repo, "exp", "apply", name)
                    applied = True
            metrics = _read_metrics(repo, rev)
            run.update("done", state="done", stages_done=run.total)
            return {
                "name": name,
                "mode": mode,
                "rev": rev,
                "applied_to_workspace": applied,
                "overrides": overrides,
                "seconds": round(time.time() - t0, 1),
                "summary": _summary(metrics),
                "metrics": metrics,
                "diagnostics": _read_metrics(repo, rev, diagnostics=True),
            }
    finally:
        run.close()


def _run_in_progress(root: Path, name: str) -> bool:
    """A live run of this API holds the name (the progress file of a killed process does not)."""
    progress_file = _state_dir(root) / "runs" / f"{name}.json"
    try:
        return _pid_alive(json.loads(progress_file.read_text()).get("pid"))
    except (OSError, ValueError):
        return False


def _check_params_reached(root: Path, rev: Optional[str], params: dict, name: str) -> None:
    """The experiment ran with exactly the params that were validated (no silent fallback); otherwise the
    experiment is removed and the call fails naming the first differing key."""
    from dvc.api import DVCFileSystem

    got = overrides_mod.load(DVCFileSystem(str(root), rev=rev).read_text("params.yaml"))
    if overrides_mod.same(got, params):
        return
    diff = next(
        (
            k
            for k, v in overrides_mod.leaves(params, lists=True)
            if not overrides_mod.same(overrides_mod.get(got, k), v)
        ),
        "params.yaml",
    )
    _dvc(root, "exp", "remove", name, check=False)
    raise APIError(
        "override_not_applied",
        f"{diff}: the experiment ran with {overrides_mod.get(got, diff)!r}, validated was "
        f"{overrides_mod.get(params, diff)!r}; the experiment '{name}' was removed",
        key=diff,
    )


# --------------------------------------------------------------------------------------- reading
def describe(args: dict, root: Optional[str | Path] = None) -> dict:
    """Action `describe`: the params with their JSON schema, the stages, the current metrics and the actions."""
    check_known(args, ARGUMENTS["describe"])
    repo = _root(root)
    params = read_params(repo)
    return {
        "params_schema": config.Params.model_json_schema(),
        "params": params,
        "stages": stages(repo),
        "metrics": _read_metrics(repo, None),
        "actions": sorted(ACTIONS),
        "override_syntax": {"overrides": {"seed": 7, "eval.batch_size": 16}},
    }


def list_experiments(args: dict, root: Optional[str | Path] = None) -> dict:
    """Action `list_experiments`: the experiments with their params and headline metrics."""
    check_known(args, ARGUMENTS["list_experiments"])
    repo = _root(root)
    import dvc.api

    num = -1 if require(args, "all_commits", bool, False) else 1
    rows = dvc.api.exp_show(repo=str(repo), num=num)
    return {"experiments": [_clean(row) for row in rows]}


def _clean(row: dict) -> dict:
    """exp_show rows: DVC writes '!' for a missing value and NaN for an absent one; JSON wants null."""
    out = {}
    for k, value in row.items():
        if value == "!" or (isinstance(value, float) and value != value):
            value = None
        out[k] = value
    return out


def _correctness(root: Path, rev: Optional[str], stage: str) -> tuple[Optional[dict[str, bool]], str]:
    """({problem id: correct} of `stage`'s predictions, "") or (None, why they cannot be read)."""
    from dvc_data.index import DataIndexError

    path = f"eval/{stage}/predictions.jsonl"
    try:
        if rev is None:
            text = (root / path).read_text()
        else:
            from dvc.api import DVCFileSystem

            text = DVCFileSystem(str(root), rev=rev).read_text(path)
    except FileNotFoundError:
        return None, f"no {path}"
    except DataIndexError:  # an older commit whose outputs are not in the local DVC cache
        return None, f"{path} is not in the local DVC cache (dvc pull / dvc exp pull it)"
    rows = (json.loads(x) for x in text.splitlines() if x.strip())
    return {row["id"]: bool(row["correct"]) for row in rows}, ""


def compare(args: dict, root: Optional[str | Path] = None) -> dict:
    """Metrics of a and b side by side; exact McNemar + paired bootstrap (agentrl.stages.compare) on `stage`'s
    predictions when both evaluated the same problems."""
    from ..stages.compare import paired_test

    check_known(args, ARGUMENTS["compare"])
    repo = _root(root)
    name_a = require(args, "a", str, what="an experiment name, a git revision or 'workspace'")
    name_b = require(args, "b", str, what="an experiment name, a git revision or 'workspace'")
    stage = require(args, "stage", str, "grpo")
    if stage not in EVAL_STAGES:
        raise APIError("invalid_value", f"'stage' must be one of {list(EVAL_STAGES)}, got '{stage}'", key="stage")
    ra, rb = _resolve(repo, name_a, "a"), _resolve(repo, name_b, "b")
    ma, mb = _read_metrics(repo, ra), _read_metrics(repo, rb)
    sa, sb = _summary(ma), _summary(mb)
    out: dict = {
        "a": {"name": name_a, "rev": ra, "summary": sa},
        "b": {"name": name_b, "rev": rb, "summary": sb},
        "difference": {k: sb[k] - sa[k] for k in sa if k.endswith("_accuracy") and k in sb},
        "stage": stage,
    }
    (ca, why_a), (cb, why_b) = _correctness(repo, ra, stage), _correctness(repo, rb, stage)
    if ca is None or cb is None:
        out["paired_test"] = None
        out["paired_test_reason"] = "; ".join(f"{why} in {n!r}" for n, why in ((name_a, why_a), (name_b, why_b)) if why)
    elif set(ca) != set(cb):
        out["paired_test"] = None
        out["paired_test_reason"] = (
            f"the two evaluated different problems ({len(ca)} and {len(cb)}, "
            f"{len(set(ca) & set(cb))} in common): no paired test"
        )
    else:
        seed = read_params(repo).get("seed", 0)
        out["paired_test"] = {**paired_test(ca, cb, seed), "before": name_a, "after": name_b}
    return out


def evaluate(args: dict, root: Optional[str | Path] = None, progress: Progress = None) -> dict:
    """Evaluate `stage`'s model of `experiment` on the first `n` held-out problems of that experiment, in a
    scratch copy (its params.yaml, test set and models) so that nothing of the workspace is written."""
    check_known(args, ARGUMENTS["evaluate"])
    repo = _root(root)
    exp = require(args, "experiment", str, "workspace")
    stage = require(args, "stage", str, "grpo")
    if stage not in EVAL_STAGES:
        raise APIError("invalid_value", f"'stage' must be one of {list(EVAL_STAGES)}, got '{stage}'", key="stage")
    problems = require(args, "n", int, 50)
    if problems < 1:
        raise APIError("out_of_range", f"'n' must be >= 1, got {problems}", key="n")
    rev = _resolve(repo, exp, "experiment")
    needed = ["params.yaml", "data/prepared/test.jsonl"] + [f"models/{m}" for m in MODEL_CHAINS[stage]]
    scratch = Path(tempfile.mkdtemp(prefix="eval-", dir=_state_dir(repo)))
    try:
        if progress:
            progress(0.0, 2.0, f"fetching {stage} model of {exp}")
        _fetch(repo, rev, needed, scratch, exp)
        if progress:
            progress(1.0, 2.0, f"evaluating {stage} of {exp} on {problems} problems")
        proc = subprocess.run(
            [sys.executable, "-m", "agentrl.api.actions", "_eval_worker", json.dumps({"stage": stage, "n": problems})],
            cwd=scratch,
            env=_env(),
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise APIError(
                "evaluation_failed",
                f"evaluation exited {proc.returncode}: {(proc.stderr or proc.stdout)[-TAIL_CHARS:]}",
                key=None,
            )
        metrics = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"experiment": exp, "rev": rev, "stage": stage, "n": metrics.get("num_samples"), "metrics": metrics}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fetch(root: Path, rev: Optional[str], paths: list[str], dst: Path, exp: str) -> None:
    """Copy paths of the workspace (rev None) or of an experiment (from git and the DVC cache) into dst."""
    missing = []
    if rev is None:
        for path in paths:
            src = root / path
            if src.is_dir() and any(src.iterdir()):
                shutil.copytree(src, dst / path)
            elif src.is_file():
                (dst / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst / path)
            else:
                missing.append(path)
    else:
        from dvc.api import DVCFileSystem

        fs = DVCFileSystem(str(root), rev=rev)
        for path in paths:
            (dst / path).parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get(path, str(dst / path), recursive=True)
            except Exception:  # not in the experiment, or not in the local DVC cache
                missing.append(path)
    if missing:
        raise APIError(
            "missing_outputs",
            f"'{exp}' has no {missing} (or they are not in the local DVC cache): "
            "run the pipeline for it first (run_experiment)",
            key="experiment",
        )


def _eval_worker(args: dict) -> dict:
    from ..stages.evaluate import evaluate as run_eval

    params = config.load_params()
    return run_eval(params, args["stage"], name=f"agent_{args['stage']}", limit=args["n"], log_to_trackers=False)


def status(args: dict, root: Optional[str | Path] = None) -> dict:
    """Action `status`: the runs an agent started here, whether each still runs, and for how long."""
    check_known(args, ARGUMENTS["status"])
    repo = _root(root)
    runs = []
    for run_file in sorted((_state_dir(repo) / "runs").glob("*.json")):
        try:
            info = json.loads(run_file.read_text())
        except (OSError, ValueError):
            continue
        alive = _pid_alive(info.get("pid"))
        info["elapsed_s"] = round(time.time() - info.get("started", time.time()), 1)
        if not alive:
            info["state"] = "interrupted"
        runs.append(info)
    queue = _dvc(repo, "queue", "status", check=False)
    queue_rows = [
        row for row in (_clean(x) for x in _exp_rows(repo)) if row.get("State") in ("Queued", "Running", "Failed")
    ]
    return {
        "runs": runs,
        "queue": [{"name": x.get("Experiment"), "rev": x.get("rev"), "state": x.get("State")} for x in queue_rows],
        "dvc_queue_status": (queue.stdout or queue.stderr).strip(),
    }


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


ACTIONS: dict[str, Callable[..., dict]] = {
    "describe": describe,
    "run_experiment": run_experiment,
    "list_experiments": list_experiments,
    "compare": compare,
    "evaluate": evaluate,
    "status": status,
}
PROGRESS_ACTIONS = {"run_experiment", "evaluate"}


def call(
    action: str, args: Optional[dict] = None, root: Optional[str | Path] = None, progress: Progress = None
) -> dict:
    """Run one action; always returns a JSON-serialisable dict (an {"error": ...} object on failure)."""
    try:
        if action not in ACTIONS:
            raise APIError(
                "unknown_action",
                f"unknown action {str(action)[:100]!r}; expected one of {sorted(ACTIONS)}",
                key="action",
            )
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise APIError("wrong_type", f"arguments must be a JSON object, got {type(args).__name__}", key=None)
        big = too_large(args)
        if big:
            why, key = big
            raise APIError("request_too_large", f"'{key}' is {why}: the request is refused unread", key=key)
        kw = {"progress": progress} if action in PROGRESS_ACTIONS else {}
        result = ACTIONS[action](args, root=root, **kw)
        return json.loads(json.dumps(result, default=str))
    except APIError as e:
        return e.to_json()
    except Exception as e:  # the contract is JSON out, never a traceback
        return APIError("internal_error", f"{type(e).__name__}: {e}", key=None).to_json()


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m agentrl.api.actions ACTION JSON`: one action, its answer as JSON on stdout (also the evaluation
    worker's entry point)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "_eval_worker":
        print(json.dumps(_eval_worker(json.loads(argv[1]))))
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        args = json.loads(argv[1]) if len(argv) > 1 else {}
    except json.JSONDecodeError as e:
        out = APIError("invalid_json", f"arguments are not valid JSON: {e}", key=None).to_json()
    else:
        out = call(argv[0], args, progress=lambda p, t, m: print(f"[{p:g}/{t:g}] {m}", file=sys.stderr))
    print(json.dumps(out, indent=2))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    raise SystemExit(main())
