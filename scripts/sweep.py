#!/usr/bin/env python
"""Hyperparameter search over `dvc exp`: grid, random, or Bayesian (Optuna TPE).

    python scripts/sweep.py grid   --space configs/sweeps/grpo.yaml --jobs 1
    python scripts/sweep.py random --space configs/sweeps/grpo.yaml -n 10
    python scripts/sweep.py optuna --space configs/sweeps/grpo.yaml --trials 20

grid/random queue one `dvc exp run --queue -S key=value ...` per point and run the queue with
`dvc queue start -j JOBS`; optuna runs one `dvc exp run -S ...` per trial (TPE sampler, study in SQLite
under sweeps/<name>/ so an interrupted search resumes). Every trial reuses the cached
prepare/base/sft results: only grpo and what depends on it re-run. Each search ends by printing the
best parameters and accuracy and writing sweeps/<name>/best.json; apply the best with
`dvc exp apply <experiment>` (printed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import subprocess
import sys
import time
from pathlib import Path

import yaml


def sh(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, text=True, capture_output=True)
    if check and r.returncode:
        sys.exit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def load_space(path: str) -> dict:
    space = yaml.safe_load(Path(path).read_text())
    for key in ("objective", "grid", "random"):
        if key not in space:
            sys.exit(f"{path}: missing section '{key}'")
    return space


def set_args(point: dict, space: dict) -> list[str]:
    """`-S key=value` for a trial: the space's `fixed:` section (set in every trial, not searched, e.g.
    fewer steps), then the point."""
    return [a for k, v in {**(space.get("fixed") or {}), **point}.items() for a in ("-S", f"{k}={v}")]


def sample(dist: dict, rng: random.Random):
    t = dist["type"]
    if t == "loguniform":
        return float(f"{math.exp(rng.uniform(math.log(dist['low']), math.log(dist['high']))):.3g}")
    if t == "uniform":
        return round(rng.uniform(dist["low"], dist["high"]), 4)
    if t == "categorical":
        return rng.choice(dist["choices"])
    raise SystemExit(f"unknown distribution type '{t}' (loguniform, uniform, categorical)")


def experiments(metric_file: str, key: str) -> list[dict]:
    """All experiments of the workspace's baseline with their params and objective."""
    data = json.loads(sh(["dvc", "exp", "show", "--json"]).stdout or "[]")
    rows = []
    for base in data:
        for exp in base.get("experiments") or []:
            for rev in exp.get("revs") or []:
                d = rev.get("data") or {}
                metric = ((d.get("metrics") or {}).get(metric_file) or {}).get("data", {})
                params = ((d.get("params") or {}).get("params.yaml") or {}).get("data", {})
                if key in metric:
                    rows.append(
                        {
                            "name": rev.get("name") or exp.get("name"),
                            "rev": rev.get("rev"),
                            "objective": metric[key],
                            "params": params,
                        }
                    )
    return rows


def finish(name: str, space: dict, names: list[str], started: float, trials: int) -> dict:
    obj = space["objective"]
    rows = [r for r in experiments(obj["metric"], obj["key"]) if not names or r["name"] in names]
    if not rows:
        sys.exit("no finished experiment with the objective metric; see `dvc exp show`")
    best = (max if obj.get("direction", "maximize") == "maximize" else min)(rows, key=lambda r: r["objective"])
    keys = list(space["grid"])

    def pick(params, dotted):
        node = params
        for k in dotted.split("."):
            node = node.get(k, {}) if isinstance(node, dict) else {}
        return node

    out = {
        "search": name,
        "best_experiment": best["name"],
        obj["key"]: best["objective"],
        "params": {k: pick(best["params"], k) for k in keys},
        "trials": trials,
        "finished_experiments": len(rows),
        "seconds": round(time.time() - started, 1),
        "seconds_per_trial": round((time.time() - started) / max(1, trials), 1),
        "apply": f"dvc exp apply {best['name']}",
    }
    d = Path("sweeps") / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "best.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"best {obj['key']} {best['objective']:.4f} with {out['params']} ({best['name']}); apply: {out['apply']}")
    print(f"all trials: dvc exp show --sort-by {obj['metric']}:{obj['key']} --sort-order descending")
    return out


def queue_and_run(name: str, points: list[dict], jobs: int, space: dict) -> dict:
    started = time.time()
    names = []
    for i, point in enumerate(points):
        exp = f"{name}-{int(started)}-{i}"
        sh(["dvc", "exp", "run", "--queue", "--name", exp, *set_args(point, space)])
        names.append(exp)
    sh(["dvc", "queue", "start", "-j", str(jobs)])
    while True:  # wait for the queue to drain
        status = sh(["dvc", "queue", "status"], check=False).stdout
        if not any(s in status for s in ("Queued", "Running")):
            break
        time.sleep(5)
    failed = [line for line in status.splitlines() if "Failed" in line]
    if failed:
        print("failed trials:\n  " + "\n  ".join(failed) + "\n(see `dvc queue logs <name>`)")
    return finish(name, space, names, started, len(points))


def run_optuna(name: str, space: dict, trials: int) -> dict:
    import optuna

    obj = space["objective"]
    d = Path("sweeps") / name
    d.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(
        study_name=name,
        storage=f"sqlite:///{d / 'study.db'}",
        load_if_exists=True,
        direction=obj.get("direction", "maximize"),
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.NopPruner(),
    )  # a trial reports only its final metric
    started = time.time()
    names: list[str] = []

    def objective(trial: optuna.Trial) -> float:
        point = {}
        for k, dist in space["random"].items():
            if dist["type"] == "loguniform":
                point[k] = trial.suggest_float(k, dist["low"], dist["high"], log=True)
            elif dist["type"] == "uniform":
                point[k] = trial.suggest_float(k, dist["low"], dist["high"])
            else:
                point[k] = trial.suggest_categorical(k, dist["choices"])
        exp = f"{name}-t{trial.number}"
        sh(["dvc", "exp", "run", "--name", exp, *set_args(point, space)])
        value = json.loads(Path(obj["metric"]).read_text())[obj["key"]]
        names.append(exp)
        return value

    done = len([t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE])
    study.optimize(objective, n_trials=max(0, trials - done))
    print(f"optuna best value {study.best_value:.4f} params {study.best_params} (study: {d / 'study.db'})")
    return finish(name, space, [f"{name}-t{t.number}" for t in study.trials], started, trials)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["grid", "random", "optuna"])
    ap.add_argument("--space", default="configs/sweeps/grpo.yaml")
    ap.add_argument("--name", default=None)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("-n", type=int, default=10, help="random: number of points")
    ap.add_argument("--trials", type=int, default=20, help="optuna: number of trials")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    space = load_space(a.space)
    name = a.name or a.kind
    if a.kind == "grid":
        keys = list(space["grid"])
        points = [dict(zip(keys, combo)) for combo in itertools.product(*(space["grid"][k] for k in keys))]
        queue_and_run(name, points, a.jobs, space)
    elif a.kind == "random":
        rng = random.Random(a.seed)
        points = [{k: sample(dist, rng) for k, dist in space["random"].items()} for _ in range(a.n)]
        queue_and_run(name, points, a.jobs, space)
    else:
        run_optuna(name, space, a.trials)


if __name__ == "__main__":
    main()
