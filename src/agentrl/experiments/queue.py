"""The DVC experiment queue, run to the end without hanging (scripts/sweep.py and scripts/seeds.py).

`dvc exp run --run-all -j N` starts N queue workers and then waits for each queued task to start. When a worker
exits while tasks are still queued (DVC 3.x, treeverse/dvc#10398, #10428, #10562: it runs one or two experiments,
then no worker is left), that wait never ends: a sweep or a CI job hangs until it is killed. `run_queue` does the
same job with DVC's own queue (`celery_queue.start_workers`, `status`, `worker_status`): it polls the state of the
named experiments, gives a queued task workers again whenever none is alive (what `dvc queue start` does by hand),
prints each experiment as it finishes, retries a poll that read a JSON file while a worker was writing it, and
stops with an error naming the experiments when a task is left running with no worker to run it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

WAITING = ("Queued", "Running")


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
