"""Hyperparameter search on DVC's and Optuna's own machinery: grid, random, or Bayesian (Optuna TPE).

    python scripts/sweep.py grid|random|optuna --space configs/sweeps/grpo.yaml [-n 10 | --trials 20] [--jobs 1]

grid: one `dvc exp run --queue -S key=v1,v2 ...` (DVC expands the product of the space's `grid:` lists); random /
optuna: Optuna's RandomSampler / TPESampler draw from the `random:` section, each trial one queued `dvc exp run
--name <name>-t<N>` (study in SQLite under sweeps/<name>/: an interrupted search resumes). `fixed:` values go to every
trial. JOBS DVC queue workers run the queue in temporary copies (cached prepare/base/sft are reused); the
best by `dvc.api.exp_show()` goes to sweeps/<name>/best.json with its `dvc exp apply` command, failed trials listed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import yaml

from agentrl.experiments import overrides
from agentrl.experiments.queue import check_search_name, dvc, run_queue

DISTRIBUTIONS = {  # type -> (required fields, Optuna suggestion)
    "loguniform": (("low", "high"), lambda t, k, d: t.suggest_float(k, d["low"], d["high"], log=True)),
    "uniform": (("low", "high"), lambda t, k, d: t.suggest_float(k, d["low"], d["high"])),
    "categorical": (("choices",), lambda t, k, d: t.suggest_categorical(k, d["choices"])),
}


def suggest(trial, section: dict) -> dict:
    """A point of the space's `random:` section drawn by an Optuna trial (its sampler decides how).

    Args:
        section: the space's `random:` section (param -> distribution).

    Returns:
        param -> the value drawn.
    """
    return {k: DISTRIBUTIONS[dist["type"]][1](trial, k, dist) for k, dist in section.items()}


SEARCHED = {"grid": "grid", "random": "random", "optuna": "random"}  # kind -> section of the space it searches


def load_space(path: str, kind: str) -> dict:
    """The space file, checked: every error names the file and the key.

    Args:
        path: the space file (configs/sweeps/*.yaml).
        kind: grid, random or optuna (which section must be there).

    Returns:
        The space, `objective.direction` and `fixed` filled in with their defaults.
    """
    space = yaml.safe_load(Path(path).read_text())
    if not isinstance(space, dict):
        raise SystemExit(f"{path}: expected a mapping with objective, grid, random and optional fixed sections")
    if unknown := set(space) - {"objective", "fixed", "grid", "random"}:
        raise SystemExit(f"{path}: unknown section(s) {sorted(unknown)} (expected objective, fixed, grid, random)")
    for section in ("objective", SEARCHED[kind]):
        if not isinstance(space.get(section), dict) or not space[section]:
            raise SystemExit(f"{path}: missing or empty section '{section}' (needed by a {kind} search)")
    _check_objective(path, space["objective"])
    _check_searched(path, space)
    space["fixed"] = space.get("fixed") or {}  # optional
    if not isinstance(space["fixed"], dict):
        raise SystemExit(f"{path}: fixed must be a mapping of param -> value, got {space['fixed']!r}")
    if both := set(space["fixed"]) & set(space[SEARCHED[kind]]):
        raise SystemExit(f"{path}: {sorted(both)} both fixed and searched in '{SEARCHED[kind]}'")
    try:  # the values `dvc exp run -S` will carry, checked before anything is queued
        overrides.render(space["fixed"], add=False)
        overrides.render_grid(space.get("grid") or {})
    except overrides.OverrideError as e:
        raise SystemExit(f"{path}: {e}") from None
    return space


def _check_objective(path: str, obj: dict) -> None:
    """The space's `objective:` names a metrics file and a key in it; its direction defaults to maximize.

    Args:
        path: the space file, for the errors.
        obj: its `objective:` section (direction set in place when absent).
    """
    if not all(isinstance(obj.get(k), str) for k in ("metric", "key")):
        raise SystemExit(f"{path}: objective needs 'metric' (a metrics file) and 'key' (a key in it), got {obj}")
    if obj.setdefault("direction", "maximize") not in ("maximize", "minimize"):
        raise SystemExit(f"{path}: objective.direction must be maximize or minimize, got {obj['direction']!r}")


def _check_searched(path: str, space: dict) -> None:
    """Each `grid:` key has a non-empty list of values, each `random:` key a known distribution with its fields.

    Args:
        path: the space file, for the errors.
    """
    for key, values in (space.get("grid") or {}).items():
        if not isinstance(values, list) or not values:
            raise SystemExit(f"{path}: grid.{key} must be a non-empty list of values, got {values!r}")
    for key, dist in (space.get("random") or {}).items():
        if not isinstance(dist, dict) or dist.get("type") not in DISTRIBUTIONS:
            raise SystemExit(f"{path}: random.{key} needs a 'type' among {sorted(DISTRIBUTIONS)}, got {dist!r}")
        if missing := [f for f in DISTRIBUTIONS[dist["type"]][0] if f not in dist]:
            raise SystemExit(f"{path}: random.{key} ({dist['type']}) lacks {missing}")


def set_args(point: dict) -> list[str]:
    """`-S key=value` per key of the point (agentrl.experiments.overrides.render: keys params.yaml has, so DVC
    refuses a typo).

    Args:
        point: param -> value of one trial.

    Returns:
        The `dvc exp run` arguments.
    """
    return [a for arg in overrides.render(point, add=False) for a in ("-S", arg)]


def results(names: list[str], objective: dict) -> tuple[dict[str, dict], list[str]]:
    """The search's experiments that succeeded with a value of the objective, and the others.

    Args:
        objective: the space's `objective:` section.

    Returns:
        (name -> exp_show row with its objective, names that failed or have no objective) among `names`.
    """
    import dvc.api

    column = f"{objective['metric']}:{objective['key']}"  # exp_show drops the file when the key is unique
    rows = [{**r, "objective": r.get(column, r.get(objective["key"]))} for r in dvc.api.exp_show()]
    # a failed experiment shows its baseline's metrics: only successes count
    ok = {r["Experiment"]: r for r in rows if r["Experiment"] in names and r["State"] == "Success"}
    ok = {n: r for n, r in ok.items() if isinstance(r["objective"], float)}
    return ok, [n for n in names if n not in ok]


def finish(name: str, space: dict, kind: str, names: list[str], started: float, ran: int) -> dict:
    """Best of the search's experiments `names` (`ran` of them run now) by the objective -> sweeps/<name>/best.json.

    Args:
        kind: grid, random or optuna.
        started: time.time() when the search started.
    """
    import dvc.api

    obj = space["objective"]
    ok, failed = results(names, obj)
    if failed:
        print(f"failed trials (no {obj['metric']}:{obj['key']}): {failed}; see `dvc queue logs <name>`")
    if not ok:
        sys.exit(f"no trial of '{name}' finished with {obj['metric']}:{obj['key']}; see `dvc exp show`")
    best = (max if obj["direction"] == "maximize" else min)(ok.values(), key=lambda r: r["objective"])
    exp = best["Experiment"]
    if pick(dvc.api.metrics_show(obj["metric"], rev=exp), obj["key"]) != best["objective"]:
        sys.exit(f"exp_show's {obj['key']} of {exp} is not the one in {obj['metric']}")
    params = dvc.api.params_show(rev=exp)
    out = {
        "search": name,
        "best_experiment": exp,
        obj["key"]: best["objective"],
        "params": {k: pick(params, k) for k in space[SEARCHED[kind]]},
        "trials": len(names),
        "finished_experiments": len(ok),
        "failed_experiments": failed,
        "seconds": round(time.time() - started, 1),
        "seconds_per_trial": round((time.time() - started) / max(1, ran), 1),
        "apply": f"dvc exp apply {exp}",
    }
    Path(f"sweeps/{name}/best.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"best {obj['key']} {best['objective']:.4f} with {out['params']} ({exp}); apply: {out['apply']}")
    print(f"all trials: dvc exp show --sort-by {obj['metric']}:{obj['key']} --sort-order descending")
    return out


def pick(tree: dict, dotted: str):
    """The value at a dotted key of a params or metrics tree; KeyError naming the key when it has none.

    Args:
        tree: the params or metrics.
        dotted: the key (`grpo.trainer.beta`).
    """
    value = overrides.get(tree, dotted)
    if value is overrides.MISSING:
        raise KeyError(dotted)
    return value


def run_grid(name: str, space: dict, jobs: int) -> dict:
    """Queue the grid's product as one `dvc exp run --queue`, run it, and pick the best.

    Returns:
        What sweeps/<name>/best.json holds.
    """
    started = time.time()
    prefix = f"{name}-{int(started)}"  # DVC names the points <prefix>-1 .. -N (just <prefix> when there is one)
    sweeps = [a for arg in overrides.render_grid(space["grid"]) for a in ("-S", arg)]
    dvc("exp", "run", "--queue", "--name", prefix, *set_args(space["fixed"]), *sweeps)
    n = math.prod(len(vs) for vs in space["grid"].values())
    names = [prefix] if n == 1 else [f"{prefix}-{i}" for i in range(1, n + 1)]
    run_queue(names, jobs)
    return finish(name, space, "grid", names, started, n)


def run_study(name: str, space: dict, kind: str, trials: int, jobs: int, seed: int) -> dict:
    """An Optuna study (SQLite under sweeps/<name>/, resumed when there) whose trials are queued DVC experiments,
    `jobs` at a time, each result told to the study; then the best.

    Args:
        kind: random (RandomSampler) or optuna (TPESampler).
        jobs: DVC queue workers, and trials asked per round.

    Returns:
        What sweeps/<name>/best.json holds.
    """
    import optuna
    from optuna.trial import TrialState

    db, direction = f"sqlite:///sweeps/{name}/study.db", space["objective"]["direction"]
    study = optuna.create_study(study_name=name, storage=db, load_if_exists=True, direction=direction)
    sampler = optuna.samplers.RandomSampler if kind == "random" else optuna.samplers.TPESampler
    study.sampler = sampler(seed=seed + len(study.trials))  # a resumed search does not redraw the same points
    started = time.time()
    pending = [t.number for t in study.trials if t.state == TrialState.RUNNING]  # left by an interrupted search
    todo = trials - len([t for t in study.trials if t.state == TrialState.COMPLETE]) - len(pending)
    ran = len(pending) + max(todo, 0)
    while pending or todo > 0:
        for _ in range(min(jobs, max(todo, 0))):
            trial = study.ask()
            point = {**space["fixed"], **suggest(trial, space["random"])}
            dvc("exp", "run", "--queue", "--name", f"{name}-t{trial.number}", *set_args(point))
            pending.append(trial.number)
            todo -= 1
        run_queue([f"{name}-t{n}" for n in pending], jobs)
        ok, _ = results([f"{name}-t{n}" for n in pending], space["objective"])
        for n in pending:
            row = ok.get(f"{name}-t{n}")
            study.tell(n, row["objective"] if row else None, state=TrialState.COMPLETE if row else TrialState.FAIL)
        pending = []
    print(f"{kind}: {len(study.trials)} trials in {db}")
    return finish(name, space, kind, [f"{name}-t{t.number}" for t in study.trials], started, ran)


def main(argv: list[str] | None = None) -> None:
    """`python scripts/sweep.py`: parse the arguments, check the space and the search's name, run the search.

    Args:
        argv: the arguments (default: sys.argv[1:]).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=list(SEARCHED))
    ap.add_argument("--space", default="configs/sweeps/grpo.yaml")
    ap.add_argument("--name", default=None, help="search name (default: the kind); sweeps/<name>/")
    ap.add_argument("--jobs", type=int, default=1, help="trials run at a time by the DVC queue")
    ap.add_argument("-n", type=int, default=10, help="random: number of trials")
    ap.add_argument("--trials", type=int, default=20, help="optuna: number of trials")
    ap.add_argument("--seed", type=int, default=0, help="random / optuna sampler seed")
    a = ap.parse_args(argv)
    space, name = load_space(a.space, a.kind), a.name or a.kind
    check_search_name(name)
    Path("sweeps", name).mkdir(parents=True, exist_ok=True)
    if a.kind == "grid":
        run_grid(name, space, a.jobs)
    else:
        run_study(name, space, a.kind, a.n if a.kind == "random" else a.trials, a.jobs, a.seed)
