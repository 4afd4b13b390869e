"""Sweeps (scripts/sweep.py, agentrl.experiments.sweep): the space file's checks, random / optuna studies over a
scripted queue, and grid / optuna end to end over `dvc exp` in a temporary copy of the repository (miniature
config, slow)."""

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.experiments import sweep
from conftest import ROOT, mini_params, tool_env

LR, R, BETA = "grpo.trainer.learning_rate", "grpo.lora.r", "grpo.trainer.beta"
SPACE = {
    "objective": {"metric": "metrics/eval_grpo.json", "key": "accuracy", "direction": "maximize"},
    "fixed": {"grpo.trainer.max_steps": 1},  # set in every trial, not searched (the miniature baseline has 2)
    "grid": {LR: [1e-4, 3e-4], R: [8], BETA: [0.0]},
    "random": {
        LR: {"type": "loguniform", "low": 1e-4, "high": 1e-3},
        R: {"type": "categorical", "choices": [4, 8]},
        BETA: {"type": "uniform", "low": 0.0, "high": 0.05},
    },
}


@pytest.mark.parametrize(
    "kind, edit, error",
    [
        ("grid", lambda s: s.pop("grid"), "missing or empty section 'grid'"),
        ("optuna", lambda s: s.pop("random"), "missing or empty section 'random'"),
        ("grid", lambda s: s.update(gird=s.pop("grid")), "unknown section(s) ['gird']"),
        ("grid", lambda s: s["random"][R].update(type="normal"), f"random.{R} needs a 'type'"),
        ("random", lambda s: s["random"][BETA].pop("high"), f"random.{BETA} (uniform) lacks ['high']"),
        ("grid", lambda s: s["objective"].pop("key"), "objective needs 'metric'"),
        ("grid", lambda s: s["objective"].update(direction="up"), "objective.direction must be"),
        ("grid", lambda s: s["grid"].update({R: 8}), f"grid.{R} must be a non-empty list"),
        ("grid", lambda s: s["fixed"].update({R: 8}), "both fixed and searched"),
        ("grid", lambda s: s["fixed"].update(seed="${oc.env:HOME}"), "seed: '${' is an interpolation"),
        ("grid", lambda s: s["grid"].update({LR: [1e-4, float("inf")]}), f"{LR}: must be a finite number (got inf)"),
    ],
)
def test_space_errors_name_the_file_and_key(tmp_path, kind, edit, error):
    space = copy.deepcopy(SPACE)
    edit(space)
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    with pytest.raises(SystemExit, match=re.escape(f"{path}: ") + ".*" + re.escape(error)):
        sweep.load_space(str(path), kind)


def test_the_search_name_is_checked_before_anything_is_created(tmp_path, monkeypatch):
    """sweep.main checks the space, then the name with the agent API's experiment-name rule
    (experiments.queue.experiment_name_problem), before sweeps/<name>/ or a queue entry exists."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    monkeypatch.setattr(sweep, "dvc", lambda *a, **k: pytest.fail(f"queued {a}"))
    refused = "--name 'a..b': names its experiments a..b-tN, and 'name' must be a valid git ref name"
    with pytest.raises(SystemExit, match=re.escape(refused)):
        sweep.main(["grid", "--space", "space.yaml", "--name", "a..b"])
    assert not (tmp_path / "sweeps").exists()
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({k: v for k, v in SPACE.items() if k != "random"}))
    with pytest.raises(SystemExit, match="space.yaml: missing or empty section 'random'"):
        sweep.main(["optuna", "--space", "space.yaml", "--name", "a..b"])  # a bad space stops first


def test_the_api_and_the_sweeps_share_one_name_rule():
    """The agent API's check and the sweeps' check word the same rule (experiments.queue.experiment_name_problem)."""
    from agentrl.api.checks import APIError, check_experiment_name
    from agentrl.experiments.queue import check_search_name, experiment_name_problem

    for name in ("HEAD", "abcd", "a b", "workspace", "x.lock"):
        problem = experiment_name_problem(name)
        assert problem, name
        with pytest.raises(APIError, match=re.escape(f"'name' {problem}; got {name!r}")):
            check_experiment_name(name)
    with pytest.raises(SystemExit, match=re.escape(f"'name' {experiment_name_problem('a b-t0')}")):
        check_search_name("a b")
    assert experiment_name_problem("grpo-lr-3") == ""
    check_experiment_name("grpo-lr-3")
    check_search_name("grpo-lr")


def test_valid_space_and_its_optuna_distributions(tmp_path):
    import optuna

    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in SPACE.items() if k not in ("grid", "fixed")}))
    space = sweep.load_space(str(path), "random")  # no grid and no fixed: fine for a random search
    assert space["fixed"] == {}
    trial = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0)).ask()
    point = sweep.suggest(trial, space["random"])
    assert 1e-4 <= point[LR] <= 1e-3 and point[R] in (4, 8) and 0.0 <= point[BETA] <= 0.05, point
    assert trial.distributions[LR].log and not trial.distributions[BETA].log


def test_a_trials_arguments_make_dvc_write_its_point():
    """`-S key=value` per key of a point (agentrl.experiments.overrides' renderer): DVC's own override code writes
    exactly the point into params.yaml (the JSON renderer sweeps had before wrote 'é' as '\\u00e9' and doubled
    backslashes)."""
    from agentrl.experiments import overrides

    point = {LR: 1.2345e-4, R: 8, BETA: 0.0, "data.system_prompt": "Réponds: 'End with #### n' \\ fin"}
    args = sweep.set_args(point)
    assert args[::2] == ["-S"] * len(point)
    applied = overrides.load(overrides.apply((ROOT / "params.yaml").read_text(), args[1::2]))
    assert all(overrides.same(overrides.get(applied, k), v) for k, v in point.items()), applied


@pytest.mark.parametrize("kind, sampler", [("random", "RandomSampler"), ("optuna", "TPESampler")])
def test_study_queues_each_trial_and_tells_optuna_its_result(tmp_path, monkeypatch, kind, sampler):
    """run_study without DVC (queueing, the queue and exp_show replaced): the kind's sampler draws each trial, the
    trial is queued with its point, JOBS trials a round, and its objective (or its failure) is told to the study."""
    import optuna

    monkeypatch.chdir(tmp_path)
    Path("sweeps/s").mkdir(parents=True)
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    space = sweep.load_space(str(tmp_path / "space.yaml"), kind)
    queued, rounds, used = {}, [], []
    monkeypatch.setattr(sweep, "dvc", lambda *a, **k: queued.update({a[a.index("--name") + 1]: a}))
    monkeypatch.setattr(sweep, "run_queue", lambda names, jobs: rounds.append((list(names), jobs)))

    def results(names, objective):  # trial 1 fails; trial k scores k / 10
        ok = {n: {"Experiment": n, "objective": int(n.rsplit("t", 1)[1]) / 10} for n in names if n != "s-t1"}
        return ok, [n for n in names if n not in ok]

    monkeypatch.setattr(sweep, "results", results)
    monkeypatch.setattr(sweep, "finish", lambda *a: a)
    for cls in ("RandomSampler", "TPESampler"):
        real = getattr(optuna.samplers, cls)
        monkeypatch.setattr(
            optuna.samplers, cls, lambda seed=None, r=real, c=cls: used.append((c, seed)) or r(seed=seed)
        )
    sweep.run_study("s", space, kind, trials=3, jobs=2, seed=0)
    assert [u for u in used if u[1] is not None] == [(sampler, 0)]  # (optuna's own default is an unseeded TPE)
    assert rounds == [(["s-t0", "s-t1"], 2), (["s-t2"], 2)]
    study = optuna.load_study(study_name="s", storage="sqlite:///sweeps/s/study.db")
    assert [(t.state.name, t.value) for t in study.trials] == [("COMPLETE", 0.0), ("FAIL", None), ("COMPLETE", 0.2)]
    for t in study.trials:  # the point queued for a trial is the one the study recorded, with the fixed keys
        args = queued[f"s-t{t.number}"]
        point = dict(args[i + 1].split("=", 1) for i, x in enumerate(args) if x == "-S")
        assert float(point[LR]) == pytest.approx(t.params[LR]) and int(point[R]) == t.params[R]
        assert 1e-4 <= t.params[LR] <= 1e-3 and point["grpo.trainer.max_steps"] == "1"


def run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, env=tool_env("disabled"), capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture
def baseline(copy_repo):
    p = mini_params()
    p["tracking"]["report_to"] = ["dvclive"]
    (copy_repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    (copy_repo / "configs/sweeps/mini.yaml").write_text(yaml.safe_dump(SPACE))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    run(["git", "init", "-q"], copy_repo)
    run(git + ["add", "-A"], copy_repo)
    run(git + ["commit", "-qm", "code"], copy_repo)
    run(["dvc", "repro"], copy_repo)
    run(git + ["add", "-A"], copy_repo)
    run(git + ["commit", "-qm", "baseline"], copy_repo)
    return copy_repo


def column(row: dict, file: str, key: str):
    """A value of a `dvc.api.exp_show` row: the column is `key` alone when no other file has that key."""
    return row[f"{file}:{key}"] if f"{file}:{key}" in row else row[key]


@pytest.mark.slow
def test_grid_and_optuna_sweeps(baseline):
    import dvc.api

    def search(*args):
        return run([sys.executable, "scripts/sweep.py", *args, "--space", "configs/sweeps/mini.yaml"], baseline)

    # grid and optuna, two queue workers each; random search differs from optuna only in the Optuna sampler
    # (run_study), so it is not run a third time here: each trial costs a minute of the CI's time
    out = {
        "g": search("grid", "--jobs", "2", "--name", "g"),
        "o": search("optuna", "--trials", "2", "--jobs", "2", "--name", "o"),
    }
    assert (baseline / "sweeps/o/study.db").exists()
    rows = [r for r in dvc.api.exp_show(repo=str(baseline)) if r["Experiment"]]
    assert len(rows) == 4 and {r["State"] for r in rows} == {"Success"}, rows
    for name, section in (("g", "grid"), ("o", "random")):
        best = json.loads((baseline / f"sweeps/{name}/best.json").read_text())
        mine = {r["Experiment"]: r for r in rows if r["Experiment"].startswith(f"{name}-")}
        assert best["trials"] == best["finished_experiments"] == len(mine) == 2 and not best["failed_experiments"]
        accuracy = {n: column(r, "metrics/eval_grpo.json", "accuracy") for n, r in mine.items()}
        assert best["best_experiment"] in mine and best["accuracy"] == max(accuracy.values()), (best, accuracy)
        assert best["apply"] == f"dvc exp apply {best['best_experiment']}" and "best accuracy" in out[name]
        assert sorted(best["params"]) == sorted(SPACE[section])  # the searched keys, with the best trial's values
        assert all(column(mine[best["best_experiment"]], "params.yaml", k) == v for k, v in best["params"].items())
    assert best["params"][R] in (4, 8) and 1e-4 <= best["params"][LR] <= 1e-3
    # the space's `fixed` section reached every trial
    assert {column(r, "params.yaml", "grpo.trainer.max_steps") for r in rows} == {1}
    # no trial retrained SFT: each experiment's own log (every trial runs in the DVC queue) shows GRPO trained
    # and SFT skipped (unchanged or restored from the run cache)
    for name in (r["Experiment"] for r in rows):
        log = run(["dvc", "queue", "logs", name], baseline)
        assert "Running stage 'grpo'" in log and "Running stage 'sft'" not in log, (name, log[-3000:])
