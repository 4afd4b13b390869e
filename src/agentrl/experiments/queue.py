"""The DVC experiment queue, run to the end without hanging (scripts/sweep.py and scripts/seeds.py); the rule for
experiment names and dvc.yaml's stages, which the sweeps, `make env` and the agent API share; one run at a time
in the workspace (workspace_run: `make repro`, `make train-*`, `make recipe`, the API's apply).

`dvc exp run --run-all -j N` starts N queue workers and then waits for each queued task to start. When a worker
exits while tasks are still queued (DVC 3.x, treeverse/dvc#10398, #10428, #10562: it runs one or two experiments,
then no worker is left), that wait never ends: a sweep or a CI job hangs until it is killed. `run_queue` does the
same job with DVC's own queue (`celery_queue.start_workers`, `status`, `worker_status`): it polls the state of the
named experiments, gives a queued task workers again whenever none is alive (what `dvc queue start` does by hand),
prints each experiment as it finishes, retries a poll that read a JSON file while a worker was writing it, and
stops with an error naming the experiments when a task is left running with no worker to run it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import yaml

WAITING = ("Queued", "Running")

# An experiment name is a ref under refs/exps/ and the handle every later call (compare, evaluate, `dvc exp
# apply`) resolves; DVC resolves git revisions before experiment names, so a name that also reads as a git
# revision would stand for that commit, not the experiment. Checked in full (fullmatch: `$` would let "x\n" in).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# git's own names at the top of .git (HEAD, FETCH_HEAD, ORIG_HEAD, MERGE_HEAD, ...: git resolves any all-caps
# name there) and the stash, whether or not they exist yet
PSEUDO_REF_RE = re.compile(r"[A-Z][A-Z_-]*|stash")
# what git may read as an abbreviated commit id, now or after the next commit
ABBREV_SHA_RE = re.compile(r"[0-9a-fA-F]{4,40}")


def experiment_name_problem(name: str) -> str:
    """What is wrong with `name` as an experiment name, or "" when it is a plain one: git's ref-name rules (`git
    check-ref-format`, as dulwich implements them, on the ref DVC writes), letters, digits, '.', '_' and '-' only
    (no revision syntax: ~ ^ : @{ whitespace), and not a name git itself resolves (pseudo-refs, abbreviated commit
    ids). The agent API (api/checks.py) and the sweeps share this rule.

    Returns:
        The rule it breaks, worded to follow "'name' ", or "".
    """
    from dulwich.refs import check_ref_format

    if not NAME_RE.fullmatch(name):
        return "must be letters, digits, '.', '_' or '-', starting with a letter or digit, at most 100 characters"
    if not check_ref_format(f"refs/exps/{name}".encode()):
        return "must be a valid git ref name (git check-ref-format: no '..', not ending in '.' or '.lock')"
    if PSEUDO_REF_RE.fullmatch(name):
        return "must not be one of git's own names (all-caps names such as HEAD, FETCH_HEAD, ORIG_HEAD; stash)"
    if ABBREV_SHA_RE.fullmatch(name):
        return "must not be 4 to 40 hex digits (git reads those as an abbreviated commit id)"
    if name == "workspace":
        return "must not be 'workspace' (compare and evaluate read that as the workspace)"
    return ""


def check_search_name(name: str, flag: str = "--name") -> None:
    """A search's name prefixes its experiments' names (<name>-t<N>, <name>-<time>) and a directory
    (sweeps/<name>/): it must make valid experiment names, checked before a study or a queue entry is created.

    Args:
        name: the search's (or study's) name.
        flag: how the user gave it, for the error.
    """
    first = f"{name}-t0"
    problem = experiment_name_problem(first)
    if problem:
        raise SystemExit(
            f"{flag} {name[:200]!r}: names its experiments {name[:100]}-tN, and 'name' {problem}; got {first[:200]!r}"
        )


def dvc_stages(root: Path) -> list[dict]:
    """dvc.yaml's stages in `root`, each as name, cmd, params, outs and metrics (paths only).

    Returns:
        One dict per stage, in dvc.yaml's order.
    """
    spec = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
    out = []
    for name, stage in (spec.get("stages") or {}).items():
        out.append(
            {
                "name": name,
                "cmd": stage.get("cmd"),
                "params": stage.get("params") or [],
                "outs": [o if isinstance(o, str) else next(iter(o)) for o in stage.get("outs") or []],
                "metrics": [m if isinstance(m, str) else next(iter(m)) for m in stage.get("metrics") or []],
            }
        )
    return out


# ------------------------------------------------------------------------------- one run in the workspace
# Two runs in one workspace wreck each other: a second `dvc exp run -S` rewrites params.yaml under the first (whose
# experiment then records the wrong params or fails), and DVC notices only at a stage whose files are locked, or
# when git's index is. So each workspace run of ours holds WORKSPACE_LOCK for its whole length and a second one is
# refused at once, naming the first; a DVC process of someone else's running a stage here (DVC's own rwlock names
# it) refuses it too. Runs in a DVC temporary workspace or the queue (--temp, --queue) touch neither.
WORKSPACE_LOCK = Path(".dvc/tmp/agentrl-workspace.lock")


class WorkspaceBusy(RuntimeError):
    """Another run holds the workspace; the message names it and what to do instead."""


def _alive(pid: object) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError, OverflowError):
        return False
    return True


def dvc_runs_here(root: Path) -> list[str]:
    """'PID n: command' of each live process holding one of DVC's stage locks in `root` (.dvc/tmp/rwlock)."""
    try:
        lock = json.loads((root / ".dvc/tmp/rwlock").read_text())
    except (OSError, ValueError):
        return []
    holders = {}
    for mode in ("write", "read"):
        for infos in (lock.get(mode) or {}).values() if isinstance(lock, dict) else ():
            for info in infos if isinstance(infos, list) else [infos]:
                if isinstance(info, dict) and info.get("pid") != os.getpid() and _alive(info.get("pid")):
                    holders[info["pid"]] = f"PID {info['pid']}: {str(info.get('cmd'))[:200]}"
    return list(holders.values())


@contextlib.contextmanager
def workspace_run(root: Path, command: str) -> Iterator[None]:
    """Hold the workspace of `root` while `command` runs there; WorkspaceBusy at once when another run holds it."""
    from filelock import FileLock, Timeout

    path = root / WORKSPACE_LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    owner = path.with_suffix(".owner")
    lock = FileLock(str(path))
    instead = (
        "wait for it to finish, or run this one in a temporary workspace or the queue (dvc exp run --temp / --queue)"
    )
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            holder = owner.read_text().strip()
        except OSError:
            holder = "another process"
        raise WorkspaceBusy(f"the workspace {root} is busy: {holder}; {instead}") from None
    try:
        others = dvc_runs_here(root)
        if others:
            raise WorkspaceBusy(f"the workspace {root} is busy: DVC runs a stage here ({'; '.join(others)}); {instead}")
        owner.write_text(f"PID {os.getpid()}: {command[:300]} (since {time.strftime('%H:%M:%S')})\n")
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


# DVC 3.67.1's WorkspaceExecutor.cleanup closes the experiment's git repository, then opens it again
# (self.scm.remove_ref) and never closes that handle. When the garbage collector first meets it during interpreter
# shutdown, dulwich's __del__ prints ~20 lines of "Exception ignored ... sys.meta_path is None" after a workspace
# `dvc exp run`; collected at exit, while the interpreter is whole, it goes quietly (docs/experiments.md).
_DVC_MAIN = (
    "import atexit, gc, sys; atexit.register(gc.collect); from dvc.cli import main; sys.exit(main(sys.argv[1:]))"
)


def dvc_command(args: list[str]) -> list[str]:
    """`dvc ARGS` as this interpreter runs it, DVC's leaked git handle collected at exit (no shutdown noise)."""
    return [sys.executable, "-c", _DVC_MAIN, *args]


def run_in_workspace(command: list[str]) -> int:
    """Run `command` (dvc repro, a workspace dvc exp run) holding the workspace of the current directory; its exit
    status. A busy workspace exits at once (SystemExit naming the run that holds it); nothing is run or written."""
    import shlex

    try:
        with workspace_run(Path.cwd(), shlex.join(command)):
            return subprocess.call(dvc_command(command[1:]) if command[:1] == ["dvc"] else command)
    except WorkspaceBusy as e:
        raise SystemExit(f"refused: {e}") from None


def dvc(*args: str, capture: bool = True) -> str:
    """Run this interpreter's `dvc` (the venv's, else the one on PATH); exit naming the command when it fails."""
    exe = Path(sys.executable).parent / "dvc"
    cmd = [str(exe) if exe.is_file() else "dvc", *args]
    print("+ dvc", " ".join(args), flush=True)
    r = subprocess.run(cmd, text=True, capture_output=capture)
    if r.returncode:
        sys.exit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{(r.stdout or '')[-2000:]}{r.stderr or ''}")
    return r.stdout or ""


def queue_state(names: list[str]) -> tuple[dict[str, str], int]:
    """(name -> Queued / Running / Success / Failed / missing, workers alive) for the queued experiments `names`."""
    from dvc.repo import Repo

    with Repo() as repo:  # opened afresh each time: the workers change the queue
        q = repo.experiments.celery_queue
        status = {e["name"]: e["status"] for e in q.status()}
        workers = len(q.worker_status())
    return {n: status.get(n, "missing") for n in names}, workers


def start_workers(jobs: int) -> int:
    """Start the queue workers numbered 1..jobs that are not alive; how many were started."""
    from dvc.repo import Repo

    with Repo() as repo:
        return repo.experiments.celery_queue.start_workers(jobs)


def run_queue(
    names: list[str],
    jobs: int,
    poll: float = 5.0,
    orphan_grace: float = 120.0,
    max_read_errors: int = 12,
    settle: float = 60.0,
) -> dict[str, str]:
    """Run the queued experiments `names` with up to `jobs` workers; their final states (Success / Failed).

    Reading the state can fail while a worker writes one of the queue's JSON files (a JSONDecodeError, seen in a
    sweep here): that poll is retried, up to `max_read_errors` times in a row. When every experiment has ended,
    it waits (up to `settle` seconds) for the workers to exit: the last one cleans the queue's files as it goes,
    and whatever reads the experiments next (`dvc exp show`) would race it."""
    started = time.time()

    def say(line: str) -> None:
        print(f"[queue {time.time() - started:6.0f}s] {line}", flush=True)

    last: dict[str, str] = {}
    orphaned_since = ended_at = None
    read_errors = 0
    while True:
        try:
            state, workers = queue_state(names)
        except (ValueError, OSError) as e:  # a JSON file the workers were writing while it was read (dvc#10428)
            read_errors += 1
            if read_errors > max_read_errors:
                raise SystemExit(f"queue: could not read the queue's state {read_errors} times in a row: {e!r}") from e
            say(f"reading the queue's state failed ({e!r}); again")
            time.sleep(poll)
            continue
        read_errors = 0
        for n, s in state.items():
            if s != last.get(n):
                say(f"{n}: {s}")
        last = state
        waiting = [n for n, s in state.items() if s in WAITING]
        queued = [n for n, s in state.items() if s == "Queued"]
        if not waiting:
            ended_at = ended_at or time.time()
            if workers == 0 or time.time() - ended_at > settle:
                done = sum(s == "Success" for s in state.values())
                say(f"{done} of {len(names)} experiments succeeded")
                return state
        elif queued and workers < jobs and (n_new := start_workers(jobs)):
            say(f"started {n_new} worker(s)")
        if waiting and not queued and workers == 0:
            orphaned_since = orphaned_since or time.time()
            if time.time() - orphaned_since > orphan_grace:
                sys.exit(
                    f"queue: {waiting} still 'Running' with no queue worker alive for {orphan_grace:.0f}s "
                    "(the worker died); see `dvc queue logs <name>`, then `dvc queue kill` / `dvc exp remove`"
                )
        else:
            orphaned_since = None
        time.sleep(poll if waiting else 1.0)
