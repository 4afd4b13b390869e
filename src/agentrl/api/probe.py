"""What an agent's environment costs, measured before its run (issue 56): every size-like knob bounded by its effect.

An environment's knobs are open-ended (106 reasoning-gym tasks, each with its own config; Gymnasium's `env_kwargs`
go to any env's constructor), so no list of knob names can say which are sizes. Their cost can be measured: before
an agent's run whose overrides touch `agent.environment` or `environments`, a child process generates a few rows of
each split with the run's params, exactly as `prepare` would (stages.prepare.environment_rows), under a wall clock
and a memory cap. The run is refused, naming the environment's knobs, when

- one or three rows per split do not finish within PROBE_TIMEOUT_S or pass PROBE_RSS_BYTES (reasoning-gym
  `min_terms: 999999999` hit a 6 GiB cap after 126 s; a 250x250 Gymnasium map ran 20 min with no log line), or
- the rows' measured time, extrapolated to num_train + num_test, exceeds PREPARE_BUDGET_S.

The probe holds no lock: a refused run never starts, so it cannot hold the API's run lock for other agents' runs.

    python -m agentrl.api.probe < params.pickle    # prints {"seconds": [t1, t3]}: the params tree, pickled (YAML's
                                                   # integer keys survive, JSON's would not)
"""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Optional

import psutil

from .checks import APIError

PROBE_TIMEOUT_S = 60.0  # the whole probe: importing the package (~2 s), then 1 + 3 rows per split
PROBE_RSS_BYTES = 3 << 30  # the probe's resident memory (torch imported: ~0.4 GiB)
PREPARE_BUDGET_S = 1800.0  # prepare's extrapolated generation time for num_train + num_test rows
ROW_COUNTS = (1, 3)  # rows per split of the two timed generations; their difference gives the cost per row
POLL_S = 0.05


def _shrunk(tree: dict, name: str, rows: int) -> dict:
    """params with `environments.<name>` asking for `rows` rows per split (a mixture's totals: the same keys)."""
    small = copy.deepcopy(tree)
    small["environments"][name].update(num_train=rows, num_test=rows)
    return small


def _measure(tree: dict) -> dict:
    """The child's job: generate the rows of each count in ROW_COUNTS, timing each generation."""
    from ..config import validate_params
    from ..stages.prepare import environment_rows

    name = tree["agent"]["environment"]
    seconds = []
    for rows in ROW_COUNTS:
        params = validate_params(_shrunk(tree, name, rows), "params + overrides (probe)")
        start = time.perf_counter()
        environment_rows(params)
        seconds.append(time.perf_counter() - start)
    return {"seconds": seconds}


def _run_child(tree: dict) -> tuple[Optional[dict], str, float]:
    """(the child's answer or None, why it has none, its peak RSS in bytes), killing it at the time or memory cap;
    why starts with "failed" when the generator raised (a bad knob), else says which cap stopped it."""
    errors = tempfile.TemporaryFile()  # a file, not a pipe: a child that logs a lot must not block on a full pipe
    child = subprocess.Popen(
        [sys.executable, "-m", "agentrl.api.probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
    )
    child.stdin.write(pickle.dumps(tree))
    child.stdin.close()
    deadline, peak, why = time.monotonic() + PROBE_TIMEOUT_S, 0, ""
    while child.poll() is None:
        try:
            peak = max(peak, psutil.Process(child.pid).memory_info().rss)
        except psutil.Error:  # exited between poll and read
            pass
        if peak > PROBE_RSS_BYTES or time.monotonic() > deadline:
            why = f"over {PROBE_RSS_BYTES >> 20} MiB of memory" if peak > PROBE_RSS_BYTES else "still running"
            why += f" after {PROBE_TIMEOUT_S - max(0.0, deadline - time.monotonic()):.0f} s"
            child.kill()
            child.wait()
            return None, why, peak
        time.sleep(POLL_S)
    out = child.stdout.read().decode()  # one short JSON line
    errors.seek(0)
    err = errors.read().decode(errors="replace")
    errors.close()
    if child.returncode:
        tail = err.strip().splitlines()[-1:] or [f"exit {child.returncode}"]
        if child.returncode < 0 or "MemoryError" in tail[0]:  # killed (the OOM killer) or out of memory: its cost
            return None, f"out of memory ({tail[0][:100]}) at {peak >> 20} MiB", peak
        return None, f"failed: {tail[0][:300]}", peak
    return json.loads(out), "", peak


def probe_environment(tree: dict, overrides: dict) -> Optional[dict]:
    """Measure the environment of `tree` (params as the run will read them) when `overrides` touch it; None when
    they do not or no environment runs. APIError("too_costly") naming `environments.<name>` when over a limit.

    Args:
        tree: the params the experiment runs with (checks.validate_overrides' first result).
        overrides: the agent's overrides (dotted keys).

    Returns:
        {"environment", "rows", "seconds_per_row", "estimated_prepare_s", "peak_rss_mb"}, or None.
    """
    from ..envs.registry import task_module

    name = (tree.get("agent") or {}).get("environment")
    touched = any(k == "agent.environment" or k.split(".")[0] == "environments" for k in overrides)
    if (
        task_module(name) is None or not touched
    ):  # no environment, or the user's own class / server: nothing generated here
        return None
    knobs = tree["environments"][name]
    key = f"environments.{name}"
    answer, why, peak = _run_child(tree)
    if answer is None and why.startswith("failed"):
        raise APIError("invalid_value", f"{key}: generating rows with these knobs {why}", key=key)
    if answer is None:
        raise APIError(
            "too_costly",
            f"{key}: generating {ROW_COUNTS[-1]} rows per split with these knobs was stopped, {why}; an agent's run "
            f"may ask for an environment whose rows take at most {PROBE_TIMEOUT_S:.0f} s and "
            f"{PROBE_RSS_BYTES >> 20} MiB to generate (smaller sizes, fewer terms, a smaller map)",
            key=key,
        )
    first, last = answer["seconds"]
    per_row = max(0.0, last - first) / (2 * (ROW_COUNTS[-1] - ROW_COUNTS[0]))
    total = knobs["num_train"] + knobs["num_test"]
    estimate = first + per_row * max(0, total - 2 * ROW_COUNTS[0])
    if estimate > PREPARE_BUDGET_S:
        raise APIError(
            "too_costly",
            f"{key}: {total} rows at {per_row:.3f} s each (measured on {2 * ROW_COUNTS[-1]}) would take prepare about "
            f"{estimate / 60:.0f} min; an agent's run may ask for at most {PREPARE_BUDGET_S / 60:.0f} min "
            "(fewer rows or smaller knobs)",
            key=key,
        )
    return {
        "environment": name,
        "rows": total,
        "seconds_per_row": round(per_row, 5),
        "estimated_prepare_s": round(estimate, 1),
        "peak_rss_mb": round(peak / 2**20, 1),
    }


if __name__ == "__main__":
    print(json.dumps(_measure(pickle.load(sys.stdin.buffer))))
