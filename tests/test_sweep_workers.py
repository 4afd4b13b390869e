"""Sweeps across machines (scripts/sweep_worker.py, agentrl.experiments.sweep_worker): workers in separate clones
share one Optuna study.

Default tests: two worker processes on a journal file, with a stand-in `dvc` (seconds per trial) so the study's
accounting is checked in seconds: N trials, no duplicate, one worker killed mid-trial and its trial retried.
Slow tests: the same with real `dvc exp run` / `dvc exp push` in git clones sharing a bare Git remote and a DVC
remote directory (journal file, then a real PostgreSQL server), and optuna-dashboard rendered in headless
Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

from agentrl.experiments import sweep_worker
from conftest import MAKE, ROOT, mini_params, tool_env

WORKER = [sys.executable, str(ROOT / "scripts/sweep_worker.py")]

# a stand-in for `dvc` on PATH: `exp run --name X -S k=v ...` writes metrics/eval_grpo.json (accuracy from the
# learning rate) after STUB_SECONDS, or hangs when STUB_HANG is set; every call is one line in STUB_LOG
STUB = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys, time
    from pathlib import Path
    args = sys.argv[1:]
    log = open(os.environ["STUB_LOG"], "a")
    def note(*words):
        log.write(" ".join(words) + "\\n"); log.flush()
    if args[:2] == ["exp", "run"]:
        name = args[args.index("--name") + 1]
        point = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-S")
        note("start", os.environ["STUB_WORKER"], name, json.dumps(point, sort_keys=True))
        time.sleep(600 if os.environ.get("STUB_HANG") else float(os.environ.get("STUB_SECONDS", "0.5")))
        Path("metrics").mkdir(exist_ok=True)
        lr = float(point["grpo.trainer.learning_rate"])
        Path("metrics/eval_grpo.json").write_text(json.dumps({{"accuracy": round(1 - abs(lr - 3e-4) * 1e3, 6)}}))
        note("done", os.environ["STUB_WORKER"], name)
    elif args[:2] == ["exp", "push"]:
        note("push", os.environ["STUB_WORKER"], args[-1], args[-2])
    else:
        sys.exit("stub dvc: unexpected " + " ".join(args))
    """
)

SPACE = """\
objective: {metric: metrics/eval_grpo.json, key: accuracy, direction: maximize}
fixed: {grpo.trainer.max_steps: 1}
grid: {grpo.trainer.learning_rate: [1.0e-4, 3.0e-4]}
random:
  grpo.trainer.learning_rate: {type: loguniform, low: 1.0e-4, high: 1.0e-3}
  grpo.trainer.beta: {type: uniform, low: 0.0, high: 0.05}
"""


def stub_machine(tmp: Path, name: str, log: Path) -> tuple[Path, dict]:
    """A "machine": a git clone stand-in (its own directory, a git remote named origin) and an environment
    whose `dvc` is the stub."""
    d = tmp / name
    (d / "bin").mkdir(parents=True)
    (d / "bin/dvc").write_text(STUB.format(python=sys.executable))
    (d / "bin/dvc").chmod(0o755)
    (d / "space.yaml").write_text(SPACE)
    subprocess.run(["git", "init", "-q", str(d)], check=True)
    subprocess.run(["git", "-C", str(d), "remote", "add", "origin", str(tmp / "remote.git")], check=True)
    env = tool_env(None, STUB_LOG=str(log), STUB_WORKER=name, STUB_SECONDS="0.5")
    env["PATH"] = f"{d / 'bin'}{os.pathsep}{env['PATH']}"
    return d, env


def worker_cmd(kind: str, storage: str, name: str, trials: int | None, *extra: str) -> list[str]:
    """The worker's command line, with short heartbeat / grace / poll times (seconds)."""
    cmd = WORKER + ["worker", kind, "--storage", storage, "--name", "s", "--space", "space.yaml", "--worker", name]
    cmd += ["--heartbeat", "1", "--grace", "4", "--poll", "0.5", "--seed", "0", *extra]
    return cmd + ([] if trials is None else ["--trials", str(trials)])


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if (got := predicate()) is not None:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def status(storage: str, cwd: Path) -> dict:
    r = subprocess.run(WORKER + ["status", "--storage", storage, "--json"], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def check_accounting(st: dict, trials: int, killed: str, survivor: str) -> dict:
    """The study after a search in which worker `killed` died mid-trial: `trials` complete, the dead worker's
    trial failed and retried once by `survivor`, no other failure, no surplus; returns the numbers."""
    assert st["states"].get("COMPLETE") == trials, st
    assert st["states"].get("FAIL") == 1 and not st["surplus"], st
    assert st["workers"][killed] == {"FAIL": 1}, st
    (retry,) = st["retries"]
    assert retry["state"] == "COMPLETE", st
    assert sum(st["workers"][survivor].values()) == trials, st
    experiments = list(st["experiments"].values())
    assert len(set(experiments)) == trials and None not in experiments, st
    return {"done": trials, "failed": 1, "retried": 1, "dead_trial": retry["retries"], "retry_trial": retry["trial"]}


def test_two_workers_journal_one_killed_mid_trial(tmp_path):
    """Two workers (separate directories, as two machines) on one journal file: 4 trials done, none twice; the
    worker killed mid-trial has its trial failed by heartbeat and retried (same params) by the other."""
    import optuna

    log = tmp_path / "calls.log"
    log.touch()
    storage = str(tmp_path / "shared/study.journal")
    (tmp_path / "shared").mkdir()
    m1, env1 = stub_machine(tmp_path, "w1", log)
    m2, env2 = stub_machine(tmp_path, "w2", log)
    env2["STUB_HANG"] = "1"  # w2's `dvc exp run` never returns: w2 is killed in the middle of it
    t0 = time.time()
    p2 = subprocess.Popen(worker_cmd("optuna", storage, "w2", 4), cwd=m2, env=env2, start_new_session=True)
    wait_for(lambda: "start w2" in log.read_text() or None, 60, "w2 to start a trial")
    p1 = subprocess.Popen(worker_cmd("optuna", storage, "w1", 4), cwd=m1, env=env1, stdout=subprocess.PIPE, text=True)
    os.killpg(p2.pid, signal.SIGKILL)  # the machine dies: the worker and its dvc
    p2.wait()
    out, _ = p1.communicate(timeout=120)
    assert p1.returncode == 0, out[-3000:]
    wall = time.time() - t0

    st = status(storage, tmp_path)
    acct = check_accounting(st, 4, "w2", "w1")
    calls = [line.split() for line in log.read_text().splitlines()]
    started = [c[2] for c in calls if c[0] == "start"]
    assert len(started) == 5 and len(set(started)) == 5, calls  # 4 done + the killed one: each experiment once
    done = [c[2] for c in calls if c[0] == "done"]
    pushed = [c[2] for c in calls if c[0] == "push"]
    assert sorted(done) == sorted(pushed) == sorted(st["experiments"].values()), calls
    assert {c[3] for c in calls if c[0] == "push"} == {"origin"}
    study = optuna.load_study(study_name="s", storage=sweep_worker.open_storage(storage))
    dead, retry = study.trials[acct["dead_trial"]], study.trials[acct["retry_trial"]]
    assert retry.params == dead.params and dead.user_attrs["worker"] == "w2", (dead, retry)
    assert retry.user_attrs["worker"] == "w1" and retry.user_attrs["experiment"] == f"s-t{retry.number}"
    assert st["best"]["value"] == max(t.value for t in study.trials if t.value is not None)
    best = st["best"]["experiment"]
    assert best == f"s-t{st['best']['trial']}"
    assert st["best"]["apply"] == f"dvc exp pull origin {best} && dvc exp apply {best}"
    print(f"two stub workers, journal: {wall:.1f} s, {acct}")


def test_grid_kind_runs_each_point_once(tmp_path):
    """grid: GridSampler over the space's grid lists; the target defaults to the grid's size (2 points)."""
    log = tmp_path / "calls.log"
    log.touch()
    m1, env1 = stub_machine(tmp_path, "w1", log)
    cmd = worker_cmd("grid", str(tmp_path / "g.journal"), "w1", None, "--no-push")
    r = subprocess.run(cmd, cwd=m1, env=env1, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    points = [json.loads(line.split(" ", 3)[3]) for line in log.read_text().splitlines() if line.startswith("start")]
    assert sorted(p["grpo.trainer.learning_rate"] for p in points) == ["0.0001", "0.0003"], points
    assert all(p["grpo.trainer.max_steps"] == "1" for p in points)  # fixed: in every trial
    assert "push" not in log.read_text()  # --no-push: nothing pushed


def test_surplus_counts_complete_running_and_queued_trials():
    import optuna
    from optuna.trial import TrialState, create_trial

    study = optuna.create_study()
    study.add_trial(create_trial(value=1.0))  # 0 complete
    study.add_trial(create_trial(state=TrialState.FAIL))  # 1 failed: does not count
    running = study.ask()  # 2 running
    study.enqueue_trial({"x": 1.0})  # 3 waiting
    n = study.ask().number  # 4: takes the waiting one (3) first
    assert n == 3 and running.number == 2
    assert not sweep_worker.surplus(study, 3, 3)  # 0 and 2 ahead of it: room for a third
    assert sweep_worker.surplus(study, 3, 2)
    late = study.ask().number  # 4, asked while 0, 2, 3 are live
    assert sweep_worker.surplus(study, late, 3) and not sweep_worker.surplus(study, late, 4)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_journal_heartbeat_marks_silent_trials_stale(tmp_path):
    """The journal storage's heartbeat (Optuna 5.0 has none for journals): a trial whose beats stop is failed by
    Optuna's fail_stale_trials and queued again, with its params, by RetryHeartbeatStaleTrialCallback."""
    import optuna
    from optuna.trial import TrialState

    storage = sweep_worker.open_storage(str(tmp_path / "j.journal"), heartbeat=1, grace=2, max_retry=1)
    study = optuna.create_study(storage=storage, study_name="h")
    alive, dead = study.ask(), study.ask()
    dead.suggest_float("x", 0, 1)
    storage.record_heartbeat(alive._trial_id)
    storage.record_heartbeat(dead._trial_id)
    time.sleep(1.5)
    storage.record_heartbeat(alive._trial_id)
    optuna.storages.fail_stale_trials(study)
    assert [t.state for t in study.trials] == [TrialState.RUNNING] * 2  # within grace: nothing failed
    time.sleep(1.0)
    storage.record_heartbeat(alive._trial_id)
    optuna.storages.fail_stale_trials(study)
    states = [t.state for t in study.trials]
    assert states == [TrialState.RUNNING, TrialState.FAIL, TrialState.WAITING], states
    assert study.trials[2].params == study.trials[1].params
    # a trial that never beat (heartbeats off) is never stale
    quiet = optuna.create_study(storage=sweep_worker.open_storage(str(tmp_path / "q.journal"), 1, 1), study_name="q")
    quiet.ask()
    time.sleep(1.2)
    optuna.storages.fail_stale_trials(quiet)
    assert quiet.trials[0].state == TrialState.RUNNING


def test_rdb_storage_retries_when_another_worker_creates_the_tables(monkeypatch):
    """Workers starting at once on an empty PostgreSQL database race to create Optuna's tables: the losers get an
    IntegrityError (seen with two workers in the slow PostgreSQL test) and must try again, not exit."""
    import optuna
    import sqlalchemy.exc

    real, calls = optuna.storages.RDBStorage, []

    def racing(url, **kw):
        calls.append(url)
        if len(calls) < 3:
            raise sqlalchemy.exc.IntegrityError("CREATE TYPE trialstate", {}, Exception("pg_type_typname_nsp_index"))
        return real(url, **kw)

    monkeypatch.setattr(optuna.storages, "RDBStorage", racing)
    storage = sweep_worker.rdb_storage("sqlite:///:memory:", wait_s=0, heartbeat_interval=5)
    assert len(calls) == 3 and storage.get_heartbeat_interval() == 5
    calls.clear()
    with pytest.raises(SystemExit, match=re_escape("STORAGE postgresql://u:***@h/db: could not set up")):
        sweep_worker.rdb_storage("postgresql://u:secret@h/db", attempts=2, wait_s=0)
    assert len(calls) == 2


@pytest.mark.parametrize(
    "spec, error",
    [
        ("", "STORAGE is empty"),
        ("{tmp}", "a directory; expected a journal file path"),
        ("{tmp}/no/such/dir/s.journal", "does not exist (mount the shared filesystem?)"),
        ("{tmp}/db.sqlite", "an SQLite database; give it as an RDB URL, sqlite:///"),
    ],
)
def test_storage_errors_name_the_storage(tmp_path, spec, error):
    import sqlite3

    sqlite3.connect(tmp_path / "db.sqlite").execute("create table t (x)").connection.commit()
    with pytest.raises(SystemExit, match=re_escape(error)):
        sweep_worker.open_storage(spec.format(tmp=tmp_path))


@pytest.mark.parametrize(
    "content, spec, error",
    [
        (b"hello\nworld\n", "{f}", "not an Optuna journal file (JSONDecodeError"),
        (b'{"a": 1}\n', "{f}", "not an Optuna journal file (KeyError"),
        (b"\xff\xfe\n", "{f}", "not an Optuna journal file (UnicodeDecodeError"),
        (b"root:x:0:0:root:/root:/bin/bash\n", "sqlite:///{f}", "not a readable Optuna database (file is not a"),
        (None, "{f}", "no such journal file (no worker has written it yet?)"),
        (None, "sqlite:///{f}", "{f} does not exist (no worker has written it yet?)"),
    ],
)
def test_reading_a_storage_that_is_not_a_study_names_it_and_creates_nothing(tmp_path, content, spec, error):
    """Issue 45 item 14: status/dashboard on a file that is not an Optuna journal or database stop with an error
    naming STORAGE (a traceback before); a missing journal or SQLite file is not created empty."""
    f = tmp_path / "storage"
    if content is not None:
        f.write_bytes(content)
    spec = spec.format(f=f)
    with pytest.raises(SystemExit, match=re_escape(f"STORAGE {spec}: {error.format(f=f)}")):
        sweep_worker.open_storage(spec, create=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["storage"] if content is not None else [])
    if content is not None:
        assert f.read_bytes() == content


def test_status_on_a_password_file_prints_no_traceback(tmp_path):
    r = subprocess.run([*WORKER, "status", "--storage", "sqlite:////etc/passwd"], capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == "STORAGE sqlite:////etc/passwd: not a readable Optuna database (file is not a database)"


def test_make_sweep_targets_quote_their_variables(tmp_path):
    """Issue 45 item 14: STUDY, SPACE, STORAGE reach the script as one argument each, never the shell: a value with
    `;`, spaces and quotes runs nothing (make -n shows one word per value; the real target runs no `touch`)."""
    import shlex

    marker = tmp_path / "marker"
    hostile = f"x; touch {marker}; echo 'q' \"d\""
    storage = str(tmp_path / "no such dir" / "s.journal")
    variables = [f"STUDY={hostile}", f"SPACE={hostile}", f"STORAGE={storage}", f"GIT_REMOTE={hostile}", "KIND=grid"]
    for target, flag in (("sweep-worker", "--name"), ("sweep-status", "--name"), ("sweep-grid", "--space")):
        r = subprocess.run([*MAKE, "-n", target, *variables], cwd=ROOT, capture_output=True, text=True)
        words = shlex.split(r.stdout.replace("\\\n", " ").splitlines()[-1])
        assert words[words.index(flag) + 1] == hostile, (target, r.stdout)
    r = subprocess.run(
        [*MAKE, "sweep-status", f"VENV={sys.prefix}", *variables],
        cwd=ROOT,
        env=tool_env(None),
        capture_output=True,
        text=True,
    )
    assert r.returncode and f"STORAGE {storage}: directory" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()


def test_a_study_name_that_makes_no_valid_experiment_name_is_refused_before_the_study_exists(tmp_path):
    """STUDY prefixes every trial's experiment name: one `dvc exp run --name` would refuse (or that git would read
    as a revision) stops the worker before the shared study is created, naming the flag."""
    storage = tmp_path / "s.journal"
    for name in ("x; id", "a..b", "x\n", "sub/dir", ".hidden"):
        r = subprocess.run(
            [*WORKER, "worker", "optuna", "--storage", str(storage), "--name", name, "--no-push"],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 1 and r.stderr.startswith(f"--name {name!r}: names its experiments"), r.stderr[-2000:]
    assert not storage.exists()


def test_dashboard_refuses_foreign_hosts_and_changes_without_its_token(tmp_path):
    """Issue 45 item 13: `DELETE /api/studies/0` with `Host: attacker.example` (DNS rebinding) wiped the shared
    study. Behind DashboardGuard: a foreign Host is refused; read-only by default; with a token a change needs it
    (Bearer, or the SameSite cookie the printed `/?token=` URL sets)."""
    import optuna
    from werkzeug.test import Client

    storage = sweep_worker.open_storage(str(tmp_path / "s.journal"))
    study_id = optuna.create_study(study_name="shared", storage=storage)._study_id

    def studies() -> list[str]:
        return [s.study_name for s in optuna.get_all_study_summaries(storage)]

    url = f"/api/studies/{study_id}"
    here = {"Host": "127.0.0.1:8080"}
    read_only = Client(sweep_worker.dashboard_app(storage, 8080))
    assert read_only.get("/api/studies", headers=here).status_code == 200
    assert read_only.get("/api/studies", headers={"Host": "localhost"}).status_code == 200
    for host in ("attacker.example", "attacker.example:8080", "127.0.0.1.attacker.example", "127.0.0.1:9999"):
        r = read_only.delete(url, headers={"Host": host})
        assert r.status_code == 403 and "not this dashboard's address" in r.text, (host, r.text)
        assert read_only.get("/api/studies", headers={"Host": host}).status_code == 403
    r = read_only.delete(url, headers=here)
    assert r.status_code == 403 and "read-only" in r.text
    assert studies() == ["shared"]

    token = "t" * 32
    writable = Client(sweep_worker.dashboard_app(storage, 8080, token))
    for headers in (
        here,
        {**here, "Authorization": "Bearer wrong"},
        {"Host": "attacker.example", "Authorization": f"Bearer {token}"},
    ):
        assert writable.delete(url, headers=headers).status_code == 403, headers
    assert writable.get("/?token=wrong", headers=here).status_code == 403
    r = writable.get(f"/dashboard?token={token}", headers=here)
    assert r.status_code == 303 and r.headers["Location"] == "/dashboard"
    assert "SameSite=Strict" in r.headers["Set-Cookie"] and "HttpOnly" in r.headers["Set-Cookie"]
    assert studies() == ["shared"]
    assert writable.delete(url, headers=here).status_code == 204  # the cookie the token URL set
    assert studies() == []


def test_dashboard_answers_404_to_traversal_and_serves_static_files_without_accept_encoding(tmp_path):
    """Issue 56: `GET /static/../../etc/passwd` (curl: no Accept-Encoding) answered 500 from optuna-dashboard's static
    route, which reads that header unguarded."""
    from werkzeug.test import Client

    client = Client(sweep_worker.dashboard_app(sweep_worker.open_storage(str(tmp_path / "s.journal")), 8080))
    here = {"Host": "127.0.0.1:8080"}
    for path in ("/static/../../etc/passwd", "/static/%2e%2e/%2e%2e/etc/passwd", "/../static/bundle.js"):
        r = client.get(path, headers=here)
        assert r.status_code == 404 and "no such path" in r.text, (path, r.status_code)
    assert client.get("/static/bundle.js", headers=here).status_code == 200
    assert client.get("/static/no-such-file.js", headers=here).status_code == 404


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_worker_refuses_another_space_and_a_missing_git_remote(tmp_path):
    log = tmp_path / "calls.log"
    log.touch()
    m1, env1 = stub_machine(tmp_path, "w1", log)
    storage = str(tmp_path / "s.journal")
    r = subprocess.run(
        worker_cmd("optuna", storage, "w1", 1, "--git-remote", "nowhere"), cwd=m1, env=env1, capture_output=True
    )
    assert r.returncode and b"no git remote 'nowhere' in this clone" in r.stderr, r.stderr
    r = subprocess.run(worker_cmd("random", storage, "w1", 1), cwd=m1, env=env1, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(worker_cmd("optuna", storage, "w1", 2), cwd=m1, env=env1, capture_output=True, text=True)
    assert r.returncode and "was started with another kind or space" in r.stderr, r.stderr[-2000:]
    assert log.read_text().count("start") == 1


@pytest.mark.parametrize("kind, trials", [("optuna", ["--trials", "7"]), ("grid", [])])
def test_make_targets_pass_their_variables(kind, trials):
    """make sweep-worker / sweep-status / sweep-dashboard: every make variable reaches the script's command line
    (grid: no --trials, the grid's size is the target)."""
    import shlex

    def line(target: str, *var: str) -> list[str]:
        r = subprocess.run(
            ["make", "-n", "--no-print-directory", "-o", "setup", target, *var],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        return shlex.split(r.stdout.replace("\\\n", " ").splitlines()[-1])

    common = ["STORAGE=/mnt/s/x.journal", "STUDY=lr", "GIT_REMOTE=up"]
    worker = line("sweep-worker", *common, f"KIND={kind}", "TRIALS=7", "SPACE=configs/sweeps/tiny.yaml",
                  "WORKER_ARGS=--grace 300")  # fmt: skip
    expected = ["python", "scripts/sweep_worker.py", "worker", kind, "--storage", "/mnt/s/x.journal"]
    expected += ["--name", "lr", "--space", "configs/sweeps/tiny.yaml", *trials, "--git-remote", "up"]
    assert worker == expected + ["--grace", "300"]
    assert line("sweep-status", *common)[2:] == ["status", "--storage", "/mnt/s/x.journal", "--name", "lr",
                                                 "--git-remote", "up"]  # fmt: skip
    dash = line("sweep-dashboard", *common, "DASH_PORT=8123")
    assert dash[2:] == ["dashboard", "--storage", "/mnt/s/x.journal", "--port", "8123"]


# ------------------------------------------------------------------------------------------------ slow, real
REAL_SPACE = {
    "objective": {"metric": "metrics/eval_grpo.json", "key": "accuracy", "direction": "maximize"},
    "fixed": {"grpo.trainer.max_steps": 1},
    "random": {
        "grpo.trainer.learning_rate": {"type": "loguniform", "low": 1e-4, "high": 1e-3},
        "grpo.trainer.beta": {"type": "uniform", "low": 0.0, "high": 0.05},
    },
}


def sh(cmd: list[str], cwd: Path, timeout_s: float = 900) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=tool_env("disabled"), capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, f"{' '.join(cmd)} in {cwd}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """A miniature baseline (dvc repro, committed) whose outputs are in a DVC remote directory (dvc push): the
    repository every machine's clone starts from; built once for the module's real-DVC tests."""
    import yaml

    from agentrl.experiments.scratch import copy_repo

    top = tmp_path_factory.mktemp("baseline")
    origin = copy_repo(ROOT, top / "origin")
    p = mini_params()
    p["tracking"]["report_to"] = ["dvclive"]
    (origin / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    (origin / "configs/sweeps/mini.yaml").write_text(yaml.safe_dump(REAL_SPACE))
    sh(["git", "init", "-q"], origin)
    sh(["dvc", "remote", "add", "-d", "-f", "shared", str(top / "dvc-remote")], origin)
    sh(["git", "add", "-A"], origin)
    sh(["git", "commit", "-qm", "code"], origin)
    sh(["dvc", "repro"], origin)
    sh(["git", "add", "-A"], origin)
    sh(["git", "commit", "-qm", "baseline"], origin)
    sh(["dvc", "push"], origin)
    return origin


@pytest.fixture
def machines(baseline, tmp_path):
    """A Git remote of its own (a bare clone of the baseline) and the DVC remote, and clones of it as machines
    would have: clone(name) -> its path (with the baseline's outputs from the DVC remote unless pull=False)."""
    sh(["git", "clone", "-q", "--bare", str(baseline), str(tmp_path / "remote.git")], tmp_path)

    def clone(name: str, pull: bool = True) -> Path:
        sh(["git", "clone", "-q", str(tmp_path / "remote.git"), name], tmp_path)
        if pull:
            sh(["dvc", "pull"], tmp_path / name)  # the baseline's outputs: trials re-run only grpo and after
        return tmp_path / name

    return clone


def start_postgres() -> tuple[str, Callable[[], None]]:
    """A PostgreSQL server (Debian's package) on a free 127.0.0.1 port with its data in a new temporary
    directory; (URL, stop). As root it runs as the `postgres` user (initdb refuses root)."""
    import glob
    import tempfile

    from agentrl.serving.local import free_port

    found = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))), None)
    if found is None:
        pytest.skip("no PostgreSQL server binaries (initdb): apt-get install -y postgresql (.ci/run does)")
    bindir = Path(os.path.realpath(found)).parent
    data = Path(tempfile.mkdtemp(prefix="agentrl-pg-", dir="/tmp"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam("postgres")
        os.chown(data, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    port = free_port()

    def pg(*args: str):
        r = subprocess.run(as_user + list(args), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{' '.join(args)}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"

    pg(str(bindir / "initdb"), "-D", str(data / "db"), "-U", "agentrl", "--auth=trust", "-E", "UTF8")
    opts = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={data}"
    pg(str(bindir / "pg_ctl"), "-D", str(data / "db"), "-l", str(data / "log"), "-o", opts, "-w", "start")

    def stop():
        subprocess.run(as_user + [str(bindir / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"])
        shutil.rmtree(data, ignore_errors=True)

    return f"postgresql+psycopg2://agentrl@127.0.0.1:{port}/postgres", stop


@pytest.mark.slow
# both storages run the same workers; the file journal's real-DVC run (5 min on 2 cores) is heavy, so CI runs the
# PostgreSQL one (the several-machines case); the journal's locking is tested above without DVC
@pytest.mark.parametrize("backend", [pytest.param("journal", marks=pytest.mark.heavy), "postgresql"])
def test_two_clones_one_study_real_dvc(backend, machines, tmp_path):
    """Two clones run one study with real `dvc exp run` trials: 4 trials done, none lost or run twice; worker w2
    is killed in the middle of its second trial, which w1 takes over; a third clone sees every experiment after
    `dvc exp pull`, with the objective the study recorded."""
    import dvc.api
    import optuna

    stop, procs, logs = None, {}, {}
    if backend == "journal":
        (tmp_path / "shared").mkdir()
        storage = str(tmp_path / "shared/study.journal")  # the shared filesystem both machines mount
    else:
        storage, stop = start_postgres()
    try:
        w1, w2 = machines("w1"), machines("w2")
        t0 = time.time()
        for name, where in (("w2", w2), ("w1", w1)):
            logs[name] = open(tmp_path / f"{name}.log", "w")
            cmd = [sys.executable, "scripts/sweep_worker.py", "worker", "optuna", "--storage", storage]
            cmd += ["--name", "mini", "--space", "configs/sweeps/mini.yaml", "--trials", "4", "--worker", name]
            cmd += ["--heartbeat", "2", "--grace", "10", "--poll", "2", "--seed", "0"]
            procs[name] = subprocess.Popen(
                cmd,
                cwd=where,
                env=tool_env("disabled"),
                stdout=logs[name],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # w2 dies (worker and dvc) a few seconds into its second trial
        wait_for(lambda: (tmp_path / "w2.log").read_text().count("+ dvc exp run") >= 2 or None, 900, "w2's 2nd trial")
        time.sleep(3)
        os.killpg(procs["w2"].pid, signal.SIGKILL)
        procs["w2"].wait()
        assert procs["w1"].wait(timeout=1500) == 0, (tmp_path / "w1.log").read_text()[-4000:]
        wall = time.time() - t0
        st = status(storage, w1)
        assert st["states"].get("COMPLETE") == 4 and st["states"].get("FAIL") == 1, st
        # a trial pruned as surplus (both workers took the last slot at once) ran nothing; any other is an error
        assert st["states"].get("PRUNED", 0) == len(st["surplus"]), st
        assert set(st["states"]) <= {"COMPLETE", "FAIL", "PRUNED"}, st
        assert st["workers"]["w2"] == {"COMPLETE": 1, "FAIL": 1}, st  # one done, one killed
        assert st["workers"]["w1"]["COMPLETE"] == 3, st
        (retry,) = st["retries"]
        assert retry["state"] == "COMPLETE", st
        values = {}
        study = optuna.load_study(study_name="mini", storage=sweep_worker.open_storage(storage))
        for t in study.trials:
            if t.state.name == "COMPLETE":
                values[t.user_attrs["experiment"]] = t.value
        assert study.trials[retry["trial"]].params == study.trials[retry["retries"]].params

        w3 = machines("w3", pull=False)
        sh(["dvc", "exp", "pull", "origin"], w3)
        rows = {r["Experiment"]: r for r in dvc.api.exp_show(repo=str(w3)) if r["Experiment"]}
        assert set(rows) == set(values), (sorted(rows), values)  # every trial of both workers, nothing else
        for exp, value in values.items():
            row = rows[exp]
            got = row.get("metrics/eval_grpo.json:accuracy", row.get("accuracy"))
            assert got == value, (exp, got, value)
        best = st["best"]["experiment"]
        sh(["dvc", "exp", "apply", best], w3)
        assert "up to date" in sh(["dvc", "status"], w3)  # the best trial's outputs came from the DVC remote
        acct = {"done": 4, "failed": 1, "retried": 1, "w1": st["workers"]["w1"], "w2": st["workers"]["w2"]}
        print(f"two clones, real dvc, {backend}: {wall:.0f} s for the search, {acct}")
    finally:
        for f in logs.values():
            f.close()
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        if stop:
            stop()


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no chromium binary: apt-get install -y chromium (.ci/run does)")
    return found


@pytest.mark.slow
def test_dashboard_renders_the_study_in_chromium(tmp_path):
    """`make sweep-dashboard` serves optuna-dashboard on the study's storage (127.0.0.1); headless Chromium loads
    the study's trial list and renders it (the DOM names the study and its trials; a screenshot is kept in
    $AGENTRL_ARTIFACTS, else the test's temporary directory)."""
    import httpx
    import optuna

    from agentrl.serving.local import free_port

    browser = chromium()
    storage = str(tmp_path / "study.journal")
    study = optuna.create_study(
        study_name="dash-mini", storage=sweep_worker.open_storage(storage), direction="maximize"
    )
    for n, acc in enumerate((0.25, 0.5, 0.375)):
        t = study.ask()
        t.suggest_float("grpo.trainer.learning_rate", 1e-4, 1e-3, log=True)
        t.set_user_attr("worker", f"w{n % 2}")
        study.tell(t, acc)
    port = free_port()
    cmd = [*MAKE, "sweep-dashboard", f"VENV={sys.prefix}", f"STORAGE={storage}"]
    server = subprocess.Popen(cmd + [f"DASH_PORT={port}"], cwd=ROOT, env=tool_env(None), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:

        def up():
            try:
                return httpx.get(f"{base}/api/studies", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                assert server.poll() is None, "the dashboard exited"
                return None

        studies = wait_for(up, 60, "the dashboard's /api/studies")["study_summaries"]
        (mine,) = [s for s in studies if s["study_name"] == "dash-mini"]
        url = f"{base}/dashboard/studies/{mine['study_id']}/trials"
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        flags.append("--virtual-time-budget=20000")  # let the page fetch the study and render before the dump
        out = Path(os.environ.get("AGENTRL_ARTIFACTS") or tmp_path)
        out.mkdir(parents=True, exist_ok=True)
        shot = out / "optuna-dashboard.png"
        dom = subprocess.run([browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
        subprocess.run([browser, *flags, "--window-size=1400,900", f"--screenshot={shot}", url], capture_output=True,
                       timeout=120)  # fmt: skip
        assert "dash-mini" in dom and "3 Trials" in dom, dom[-3000:]
        for n in range(3):
            assert f"Trial {n}" in dom, (n, dom[-3000:])
        assert shot.stat().st_size > 10_000, shot
        print(f"optuna-dashboard screenshot: {shot}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
