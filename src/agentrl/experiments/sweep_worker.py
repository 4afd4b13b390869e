"""One search, many machines: workers anywhere join one Optuna study on shared storage; each trial is a named
`dvc exp run` on the worker's machine, pushed to the shared Git + DVC remotes (docs/sweeps-across-machines.md).

    python scripts/sweep_worker.py worker optuna|random|grid --storage S --name NAME [--trials N] [--space F]
    python scripts/sweep_worker.py status --storage S [--name NAME] [--json]
    python scripts/sweep_worker.py dashboard --storage S [--port 8080] [--writable]  # optuna-dashboard, 127.0.0.1

STORAGE: a journal file on a filesystem every worker mounts (Optuna's JournalStorage + JournalFileBackend), or an
RDB URL (postgresql://user@host/db, mysql+pymysql://..., sqlite:///file for one machine). Samplers: grid ->
GridSampler over the space's `grid:` lists, random -> RandomSampler, optuna -> TPESampler over `random:`; `fixed:`
values go to every trial (the same space files as scripts/sweep.py). Each trial: `dvc exp run --name
<name>-t<number> -S ...` in this clone, the objective read from the run's metrics file and told to the study, then
`dvc exp push <git remote> <experiment>` (the git ref to the Git remote, the outputs to the DVC remote), so
`dvc exp pull` + `dvc exp show` on any clone lists every trial of every worker.

Dead workers: every running trial beats (Optuna's heartbeat thread, --heartbeat seconds); a worker that starts a
trial first fails the trials whose beat is older than --grace seconds (optuna.storages.fail_stale_trials), and
Optuna's RetryHeartbeatStaleTrialCallback queues each again (WAITING, same params, up to --max-retry times), which
the next free worker runs. A worker stops when the study has --trials complete trials; while the last trials run
elsewhere it waits, to take over any of them whose worker dies. When two workers start the last slot at the same
moment, the later trial (higher number) is pruned as surplus before anything runs, so the study never runs more
than --trials trials.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import socket
import subprocess
import time
import warnings
import zlib
from pathlib import Path
from typing import Callable

from agentrl.experiments.queue import check_search_name
from agentrl.experiments.share import git_remote_url
from agentrl.experiments.sweep import SEARCHED, load_space, pick, set_args, suggest

RDB_URL = re.compile(r"^[A-Za-z][\w+.-]*://")
HEARTBEAT_KEY = "agentrl:heartbeat"  # trial system attr: time.time() of the trial's last beat (journal storage)


def quiet_experimental():
    """Heartbeats and the retry callback are experimental in Optuna: silence that warning, not others."""
    import optuna

    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)


def journal_heartbeat_storage_class():
    """JournalStorage with Optuna's heartbeat protocol (BaseHeartbeat). Optuna 5.0 implements it for RDBStorage
    only (optuna/optuna#6615): here each beat is a trial system attribute appended to the journal, so Optuna's own
    HeartbeatThread, fail_stale_trials and RetryHeartbeatStaleTrialCallback run unchanged on a journal file.
    Staleness compares the machines' clocks (time.time()): they must agree to well within --grace (NTP)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    class JournalHeartbeatStorage(JournalStorage, BaseHeartbeat):
        def __init__(self, backend, heartbeat_interval=None, grace_period=None, heartbeat_stale_trial_callback=None):
            super().__init__(backend)
            self._heartbeat_interval = heartbeat_interval
            self._grace_period = grace_period
            self._stale_callback = heartbeat_stale_trial_callback

        def record_heartbeat(self, trial_id: int) -> None:
            try:
                self.set_trial_system_attr(trial_id, HEARTBEAT_KEY, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another worker failed it as stale meanwhile; the trial's result will not be counted

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            grace = self._grace_period or 2 * self._heartbeat_interval
            now, stale = time.time(), []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                if HEARTBEAT_KEY not in t.system_attrs:
                    continue  # not run with heartbeats (as RDBStorage: only trials that beat can go stale)
                # a retried trial inherits its original's last beat: its own start counts as a beat
                last = max(t.system_attrs[HEARTBEAT_KEY], t.datetime_start.timestamp())
                if now - last > grace:
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self):
            return self._heartbeat_interval

        def get_heartbeat_stale_trial_callback(self):
            return self._stale_callback

    return JournalHeartbeatStorage


def rdb_storage(url: str, attempts: int = 3, wait_s: float = 2.0, **kwargs):
    """optuna.storages.RDBStorage(url, **kwargs). Workers started at the same moment on an empty database all
    create Optuna's tables, and PostgreSQL refuses the same type twice (IntegrityError on pg_type) to all but one:
    the others try again, when the tables are there and nothing is created."""
    import optuna
    import sqlalchemy.exc

    for attempt in range(1, attempts + 1):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as e:
            if kwargs.get("skip_table_creation"):
                raise  # only reading: nothing was being created, there is nothing to try again
            if attempt == attempts:
                shown = sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
                raise SystemExit(f"STORAGE {shown}: could not set up Optuna's tables ({attempts} tries): {e}") from e
            time.sleep(wait_s)


def shown_storage(spec: str) -> str:
    """STORAGE as it may be printed: an RDB URL without its password.

    Returns:
        The same, the password of an RDB URL replaced by ***.
    """
    if not RDB_URL.match(spec):
        return spec
    import sqlalchemy

    try:
        return sqlalchemy.engine.make_url(spec).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:
        return spec.split("://", 1)[0] + "://..."


def open_storage(
    spec: str,
    heartbeat: int | None = None,
    grace: int | None = None,
    max_retry: int | None = None,
    create: bool = True,
):
    """The study's storage: an RDB URL -> RDBStorage, else a journal file -> JournalStorage(JournalFileBackend);
    with `heartbeat` seconds, heartbeats on and stale trials retried (RetryHeartbeatStaleTrialCallback).
    Anything that is not an Optuna journal or database stops with a SystemExit naming STORAGE, not a traceback.

    Args:
        spec: STORAGE, a journal file path or an RDB URL.
        heartbeat: seconds between a running trial's beats (None: no heartbeats).
        grace: seconds without a beat before a trial is stale.
        max_retry: times a stale trial is queued again.
        create: whether a missing journal file, SQLite file or Optuna's tables may be created (a worker joining
            a new search); False for the commands that only read (status, dashboard).

    Returns:
        The storage, its existing journal or tables read once.
    """
    import optuna
    import sqlalchemy.exc

    quiet_experimental()
    if not spec:
        raise SystemExit("STORAGE is empty: give a journal file on a shared filesystem or an RDB URL")
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry) if heartbeat else None
    try:
        if RDB_URL.match(spec):
            if not create:
                _require_sqlite_file(spec)
            return rdb_storage(
                spec,
                heartbeat_interval=heartbeat,
                grace_period=grace,
                heartbeat_stale_trial_callback=retry,
                skip_table_creation=not create,
            )
        return journal_storage(spec, heartbeat, grace, retry, create)
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as e:
        cause = e.__cause__ if isinstance(e, optuna.exceptions.StorageInternalError) and e.__cause__ else e
        cause = getattr(cause, "orig", None) or cause  # the database's own message, not SQLAlchemy's wrapping
        reason = (str(cause).splitlines() or [type(cause).__name__])[0]
        raise SystemExit(f"STORAGE {shown_storage(spec)}: not a readable Optuna database ({reason})") from None
    except ImportError as e:  # the URL's database driver is not installed
        raise SystemExit(
            f"STORAGE {shown_storage(spec)}: {e} (install the driver: docs/sweeps-across-machines.md)"
        ) from None


def _require_sqlite_file(url: str) -> None:
    """An sqlite:/// URL names a file that exists: reading it must not create an empty database.

    Args:
        url: the RDB URL (other databases pass unchecked: their server holds the tables).
    """
    import sqlalchemy

    parsed = sqlalchemy.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        if not Path(parsed.database).is_file():
            raise SystemExit(f"STORAGE {url}: {parsed.database} does not exist (no worker has written it yet?)")


def journal_storage(spec: str, heartbeat, grace, retry, create: bool):
    """JournalStorage (with heartbeats) over the journal file `spec`; a file that is not an Optuna journal (its
    replay fails) stops with a SystemExit naming it and the first problem.

    Args:
        heartbeat, grace, retry: as open_storage's heartbeat, grace and retry callback.
        create: whether a missing journal file may be created.

    Returns:
        The storage, the journal replayed.
    """
    from optuna.storages.journal import JournalFileBackend

    path = Path(spec).expanduser()
    if path.is_dir():
        raise SystemExit(f"STORAGE {spec}: a directory; expected a journal file path (e.g. {spec}/study.journal)")
    if not path.parent.is_dir():
        raise SystemExit(f"STORAGE {spec}: directory {path.parent} does not exist (mount the shared filesystem?)")
    if not create and not path.is_file():
        raise SystemExit(f"STORAGE {spec}: no such journal file (no worker has written it yet?)")
    if path.is_file() and path.read_bytes()[:16] == b"SQLite format 3\x00":
        raise SystemExit(f"STORAGE {spec}: an SQLite database; give it as an RDB URL, sqlite:///{path}")
    cls = journal_heartbeat_storage_class()
    try:
        return cls(JournalFileBackend(str(path)), heartbeat, grace, retry)  # replays the journal
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # JSON, encoding, op records
        raise SystemExit(f"STORAGE {spec}: not an Optuna journal file ({type(e).__name__}: {e})"[:500]) from None


def make_sampler(kind: str, space: dict, seed: int | None):
    """The sampler of a search kind: grid -> GridSampler over `grid:`, random -> RandomSampler, optuna -> TPE.

    Args:
        kind: grid, random or optuna.
        seed: the sampler's seed (None: unseeded).
    """
    import optuna

    if kind == "grid":
        return optuna.samplers.GridSampler(space["grid"], seed=seed)
    return (optuna.samplers.RandomSampler if kind == "random" else optuna.samplers.TPESampler)(seed=seed)


def draw(trial, kind: str, space: dict) -> dict:
    """The trial's point: grid -> one value per grid key (GridSampler chooses which), else the `random:` draws."""
    if kind == "grid":
        return {k: trial.suggest_categorical(k, vs) for k, vs in space["grid"].items()}
    return suggest(trial, space["random"])


class TrialError(RuntimeError):
    """A trial that ran and failed (its dvc exp run, its metric or its push): recorded FAIL, not retried."""


def counts(study) -> collections.Counter:
    """Trials per state.

    Returns:
        state name (COMPLETE, RUNNING, WAITING, FAIL, PRUNED) -> count.
    """
    return collections.Counter(t.state.name for t in study.get_trials(deepcopy=False))


def surplus(study, number: int, target: int) -> bool:
    """Whether trial `number` would run past `target`: `target` trials numbered before it are complete, running
    or queued (failed and pruned ones do not count; a dead worker's trial counts through its queued retry)."""
    from optuna.trial import TrialState

    live = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
    return sum(t.number < number for t in study.get_trials(deepcopy=False, states=live)) >= target


def run_worker(a) -> dict:
    """`worker`: join the study and run trials until it has its complete trials.

    Args:
        a: the parsed `worker` arguments.

    Returns:
        This worker's account: the trials it ran, the study's states, its seconds.
    """
    from optuna.trial import TrialState

    check_search_name(a.name)
    space = load_space(a.space, a.kind)
    if not a.no_push and git_remote_url(a.git_remote) is None:
        raise SystemExit(
            f"no git remote {a.git_remote!r} in this clone: every worker pushes its experiments there "
            "(GIT_REMOTE=<name>; --no-push for a search on this machine only)"
        )
    storage = open_storage(a.storage, a.heartbeat, a.grace, a.max_retry)
    study = join_study(a, space, storage)
    target = a.trials or (math.prod(len(vs) for vs in space["grid"].values()) if a.kind == "grid" else 0)
    if target < 1:
        raise SystemExit(f"--trials must be at least 1 (a {a.kind} search), got {a.trials}")
    seed = None if a.seed is None else (a.seed + zlib.crc32(a.worker.encode()) + len(study.trials)) % 2**32
    study.sampler = make_sampler(a.kind, space, seed)  # seeded per worker: two workers do not draw the same points
    mine: list[int] = []
    started = time.time()
    run_until_complete(a, study, trial_objective(a, study, space, target, mine), target, mine)
    out = {
        "worker": a.worker,
        "study": a.name,
        "trials_run_here": [n for n in mine if study.trials[n].state == TrialState.COMPLETE],
        "study_states": dict(counts(study)),
        "seconds": round(time.time() - started, 1),
    }
    print(f"[{a.worker}] study {a.name!r} complete ({target} trials): {json.dumps(out)}", flush=True)
    return out


def join_study(a, space: dict, storage):
    """The study `a.name` in `storage`, created by the first worker and loaded by the others, checked to be the
    same search (kind, space, direction) as this worker's.

    Args:
        a: the parsed `worker` arguments.
        storage: the study storage (open_storage).
    """
    import optuna

    obj = space["objective"]
    study = optuna.create_study(
        study_name=a.name, storage=storage, load_if_exists=True, direction=obj["direction"]
    )  # every worker runs this: the first creates the study, the others load it
    shared = {"kind": a.kind, "space": {k: space[k] for k in ("objective", "fixed", SEARCHED[a.kind])}}
    if "search" not in study.user_attrs:
        study.set_user_attr("search", shared)
    elif study.user_attrs["search"] != json.loads(json.dumps(shared)):
        raise SystemExit(
            f"study {a.name!r} in {a.storage} was started with another kind or space: {study.user_attrs['search']}; "
            f"this worker has {shared} ({a.space}). Every worker of a study uses the same kind and space file."
        )
    if study.direction.name.lower() != obj["direction"]:
        raise SystemExit(f"study {a.name!r} is {study.direction.name.lower()}, the space says {obj['direction']}")
    return study


def trial_objective(a, study, space: dict, target: int, mine: list[int]) -> Callable:
    """The objective this worker optimizes: one named `dvc exp run` of the trial's point, its metric read back,
    the experiment pushed; a trial past `target` is pruned as surplus before anything runs.

    Args:
        a: the parsed `worker` arguments.
        mine: the numbers of the trials this worker started (appended to).

    Returns:
        objective(trial) -> the objective's value; TrialError when the run, its metric or its push fails.
    """
    import optuna

    obj = space["objective"]

    def objective(trial) -> float:
        mine.append(trial.number)
        if surplus(study, trial.number, target):
            trial.set_user_attr("surplus", True)
            raise optuna.TrialPruned(f"surplus: {target} trials are already done or running")
        point = {**space["fixed"], **draw(trial, a.kind, space)}
        exp = f"{a.name}-t{trial.number}"
        for k, v in (("worker", a.worker), ("host", socket.gethostname()), ("experiment", exp)):
            trial.set_user_attr(k, v)
        started = time.time()
        cmd = ["dvc", "exp", "run", "--name", exp, *set_args(point)]
        print("+", " ".join(cmd), flush=True)
        if rc := subprocess.run(cmd).returncode:
            raise TrialError(f"{' '.join(cmd)} exited {rc}")
        value = read_objective(exp, obj)
        trial.set_user_attr("seconds", round(time.time() - started, 1))
        if not a.no_push:
            push_experiment(a, trial, exp)
        print(f"[{a.worker}] {exp}: {obj['key']} = {value}", flush=True)
        return float(value)

    return objective


def read_objective(exp: str, obj: dict) -> int | float:
    """The objective's value in the metrics file the run just wrote in this clone.

    Args:
        exp: the experiment's name, for the errors.
        obj: the space's `objective:` section.

    Returns:
        The value; TrialError when the file, the key or a number is missing.
    """
    try:
        value = pick(json.loads(Path(obj["metric"]).read_text()), obj["key"])
    except (OSError, ValueError, KeyError) as e:
        raise TrialError(f"{exp}: no {obj['key']} in {obj['metric']} after the run ({e!r})") from e
    if not isinstance(value, (int, float)):
        raise TrialError(f"{exp}: {obj['metric']}:{obj['key']} is {value!r}, not a number")
    return value


def push_experiment(a, trial, exp: str) -> None:
    """`dvc exp push`: the experiment's git ref to the Git remote, its outputs to the DVC remote.

    Args:
        a: the parsed `worker` arguments (git_remote, dvc_remote).
        trial: the Optuna trial (records where it was pushed).
    """
    push = ["dvc", "exp", "push", *(["-r", a.dvc_remote] if a.dvc_remote else []), a.git_remote, exp]
    print("+", " ".join(push), flush=True)
    if rc := subprocess.run(push).returncode:
        raise TrialError(f"{' '.join(push)} exited {rc}")
    trial.set_user_attr("pushed_to", a.git_remote)


def run_until_complete(a, study, objective: Callable, target: int, mine: list[int]) -> None:
    """Run trials one at a time until the study has `target` complete ones; while the last ones run elsewhere,
    wait (to take over any whose worker dies); stop after --max-failures failed trials of this worker.

    Args:
        a: the parsed `worker` arguments.
        mine: the numbers of the trials this worker started.
    """
    import optuna
    from optuna.trial import TrialState

    failed = 0
    while True:
        optuna.storages.fail_stale_trials(study)  # dead workers' trials -> FAIL, and queued again (WAITING)
        c = counts(study)
        if c["COMPLETE"] >= target:
            break
        if c["WAITING"] or c["COMPLETE"] + c["RUNNING"] < target:
            try:
                study.optimize(objective, n_trials=1, catch=(TrialError,))
            except optuna.exceptions.UpdateFinishedTrialError:
                # this worker went silent for longer than --grace (not dead: stalled), so another failed its trial
                # and queued it again; its result is not counted, the retry runs the same point
                print(f"[{a.worker}] trial {mine[-1]} was failed as stale meanwhile; raise --grace", flush=True)
                continue
            if study.trials[mine[-1]].state == TrialState.FAIL:
                failed += 1
                if failed >= a.max_failures:
                    raise SystemExit(f"[{a.worker}] {failed} of this worker's trials failed; stopping (see above)")
        else:
            time.sleep(a.poll)  # the last trials run elsewhere: wait, to take over any whose worker dies


def summary(study, git_remote: str = "origin") -> dict:
    """The study's accounting: trials per state and per worker, retries of dead workers' trials, the best."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
    from optuna.trial import TrialState

    quiet_experimental()
    trials = study.get_trials(deepcopy=False)
    workers: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for t in trials:
        workers[t.user_attrs.get("worker", "-")][t.state.name] += 1
    out = {
        "study": study.study_name,
        "trials": len(trials),
        "states": dict(collections.Counter(t.state.name for t in trials)),
        "workers": {w: dict(c) for w, c in sorted(workers.items())},
        "retries": [
            {"trial": t.number, "retries": Retry.retried_trial_number(t), "state": t.state.name}
            for t in trials
            if Retry.retried_trial_number(t) is not None
        ],
        "surplus": [t.number for t in trials if t.user_attrs.get("surplus")],
        "experiments": {t.number: t.user_attrs.get("experiment") for t in trials if t.state == TrialState.COMPLETE},
        "best": None,
    }
    if any(t.state == TrialState.COMPLETE for t in trials):
        b = study.best_trial
        exp = b.user_attrs.get("experiment")
        out["best"] = {
            "trial": b.number,
            "value": b.value,
            "params": b.params,
            "experiment": exp,
            "worker": b.user_attrs.get("worker"),
            "apply": f"dvc exp pull {git_remote} {exp} && dvc exp apply {exp}",
        }
    return out


def study_name(storage, name: str | None, spec: str) -> str:
    """The study to read: `name`, or the storage's only study when no name is given.

    Args:
        storage: the study storage (open_storage).
        name: --name, or None.
        spec: STORAGE as given, for the error.

    Returns:
        The study's name; SystemExit naming the studies there are when it is not among them.
    """
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if name is None and len(names) == 1:
        return names[0]
    if name not in names:
        raise SystemExit(f"STORAGE {spec}: no study {name!r}; it holds {names or 'no study'} (--name / STUDY=)")
    return name


def run_status(a) -> dict:
    """`status`: the study's accounting (summary), printed as lines or, with --json, as JSON.

    Args:
        a: the parsed `status` arguments.
    """
    import optuna

    storage = open_storage(a.storage, create=False)
    study = optuna.load_study(study_name=study_name(storage, a.name, a.storage), storage=storage)
    out = summary(study, a.git_remote)
    if a.json:
        print(json.dumps(out, indent=2))
        return out
    print(f"study {out['study']}: {out['trials']} trials, {out['states']}")
    for w, c in out["workers"].items():
        print(f"  worker {w}: {c}")
    for r in out["retries"]:
        print(f"  trial {r['trial']} retries trial {r['retries']} (its worker stopped beating): {r['state']}")
    if out["surplus"]:
        print(f"  pruned as surplus (the last slot was taken at the same moment): {out['surplus']}")
    if b := out["best"]:
        print(f"best {b['value']} with {b['params']} (trial {b['trial']}, {b['experiment']}, worker {b['worker']})")
        print(f"apply: {b['apply']}")
    return out


DASHBOARD_HOSTS = ("127.0.0.1", "localhost", "[::1]")
TOKEN_ENV = "AGENTRL_DASHBOARD_TOKEN"


class DashboardGuard:
    """WSGI middleware around optuna-dashboard's app, which has no authentication and answers whatever Host a
    request names: a web page whose own name resolves to 127.0.0.1 (DNS rebinding) could otherwise delete the
    shared study from the user's browser. A request whose Host is not this dashboard's address is refused; a
    request that changes something (any method but GET and HEAD) is refused unless the dashboard was started
    with a token and the request carries it (Authorization: Bearer, or the cookie that opening the printed
    `/?token=...` URL once sets: SameSite=Strict, so another site's page cannot send it)."""

    SAFE_METHODS = ("GET", "HEAD")

    def __init__(self, app, port: int, token: str | None = None):
        """
        Args:
            app: optuna-dashboard's WSGI application (optuna_dashboard.wsgi).
            port: the port it is served on (a Host header may name it).
            token: the secret that allows changes; None: read-only.
        """
        self.app, self.port, self.token = app, port, token
        self.hosts = {f"{h}{p}" for h in DASHBOARD_HOSTS for p in ("", f":{port}")}
        self.cookie = f"agentrl_dashboard_{port}"

    def __call__(self, environ, start_response):
        import hmac
        from http.cookies import SimpleCookie
        from urllib.parse import parse_qs, urlencode

        host = environ.get("HTTP_HOST", "").lower()
        if host not in self.hosts:
            return self.refuse(
                start_response,
                f"Host {host[:100]!r} is not this dashboard's address (127.0.0.1 or localhost, port {self.port})",
            )
        query = parse_qs(environ.get("QUERY_STRING", ""))
        if "token" in query:  # the printed URL, opened once: the token becomes a cookie, the URL loses it
            if self.token is None or not hmac.compare_digest(query["token"][0].encode(), self.token.encode()):
                return self.refuse(start_response, "wrong token")
            rest = urlencode({k: v for k, v in query.items() if k != "token"}, doseq=True)
            cookie = f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"
            where = "/" + environ.get("PATH_INFO", "/").lstrip("/")  # never `//host`: another site
            where += f"?{rest}" if rest else ""
            start_response("303 See Other", [("Location", where), ("Set-Cookie", cookie), ("Content-Length", "0")])
            return [b""]
        if ".." in environ.get("PATH_INFO", "/").split("/"):  # traversal (PATH_INFO is already percent-decoded)
            return self.refuse(start_response, "no such path", "404 Not Found")
        # optuna-dashboard's static route reads the header unguarded: without it (curl's default) it answered 500
        environ.setdefault("HTTP_ACCEPT_ENCODING", "identity")
        if environ.get("REQUEST_METHOD", "GET") in self.SAFE_METHODS:
            return self.app(environ, start_response)
        if self.token is None:
            return self.refuse(
                start_response, "this dashboard is read-only (start it with --writable to change studies)"
            )
        auth = environ.get("HTTP_AUTHORIZATION", "")
        jar = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        given = [auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else ""]
        given.append(jar[self.cookie].value if self.cookie in jar else "")
        if not any(g and hmac.compare_digest(g.encode(), self.token.encode()) for g in given):
            return self.refuse(start_response, "a change needs the dashboard's token (open the URL it printed once)")
        return self.app(environ, start_response)

    @staticmethod
    def refuse(start_response, why: str, status: str = "403 Forbidden") -> list[bytes]:
        """A plain-text refusal (403 unless `status` says otherwise) saying why; returns the body."""
        body = f"{status}: {why}\n".encode()
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]


def dashboard_app(storage, port: int, token: str | None = None):
    """optuna-dashboard's WSGI app on `storage`, behind DashboardGuard (Host check; read-only without `token`).

    Args:
        storage: the study storage (open_storage).
        token: the secret that allows changes; None: read-only.
    """
    from optuna_dashboard import wsgi

    return DashboardGuard(wsgi(storage), port, token)


def run_dashboard(a) -> None:
    """`dashboard`: optuna-dashboard on 127.0.0.1 behind DashboardGuard, until interrupted.

    Args:
        a: the parsed `dashboard` arguments.
    """
    import secrets
    from wsgiref.simple_server import make_server

    if a.host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"--host {a.host}: the dashboard binds 127.0.0.1 only (reach it with ssh -L)")
    token = (os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)) if a.writable else None
    if token is not None and not re.fullmatch(r"[A-Za-z0-9_-]{16,200}", token):
        raise SystemExit(f"${TOKEN_ENV}: 16 to 200 letters, digits, '_' or '-' expected (it goes into a cookie)")
    app = dashboard_app(open_storage(a.storage, create=False), a.port, token)
    url = f"http://{a.host}:{a.port}/"
    if token is None:
        print(f"optuna-dashboard on {url} ({a.storage}), read-only (--writable to change studies)", flush=True)
    else:
        print(f"optuna-dashboard on {url} ({a.storage}), writable: open {url}?token={token} once", flush=True)
    with make_server(a.host, a.port, app) as server:
        server.serve_forever()


def parser() -> argparse.ArgumentParser:
    """The command line of scripts/sweep_worker.py: worker, status and dashboard."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker", help="join the study and run trials until it is complete")
    w.add_argument("kind", choices=list(SEARCHED))
    for p in (w, sub.add_parser("status", help="the study's trials"), sub.add_parser("dashboard")):
        p.add_argument("--storage", required=True, help="journal file on a shared filesystem, or an RDB URL")
    w.add_argument("--name", required=True, help="study name (every worker of one search gives the same)")
    w.add_argument("--space", default="configs/sweeps/grpo.yaml")
    w.add_argument("--trials", type=int, default=None, help="complete trials the study aims for (grid: the grid)")
    w.add_argument("--worker", default=f"{socket.gethostname()}-{os.getpid()}", help="this worker's name")
    w.add_argument("--git-remote", default="origin", help="git remote the experiments are pushed to")
    w.add_argument("--dvc-remote", default=None, help="DVC remote for the outputs (default: .dvc/config's)")
    w.add_argument("--no-push", action="store_true", help="keep the experiments in this clone (one machine)")
    w.add_argument("--heartbeat", type=int, default=30, help="seconds between a running trial's heartbeats")
    w.add_argument("--grace", type=int, default=120, help="seconds without a beat before a trial is failed")
    w.add_argument("--max-retry", type=int, default=3, help="times a dead worker's trial is queued again")
    w.add_argument("--max-failures", type=int, default=3, help="failed trials before this worker gives up")
    w.add_argument("--poll", type=float, default=5.0, help="seconds between looks while others finish")
    w.add_argument("--seed", type=int, default=None, help="sampler seed (mixed with the worker name)")
    s = sub.choices["status"]
    s.add_argument("--name", default=None, help="study name (default: the storage's only study)")
    s.add_argument("--git-remote", default="origin", help="for the printed `dvc exp pull` command")
    s.add_argument("--json", action="store_true")
    d = sub.choices["dashboard"]
    d.add_argument("--host", default="127.0.0.1")
    d.add_argument("--port", type=int, default=8080)
    d.add_argument(
        "--writable",
        action="store_true",
        help=f"allow changes (delete, notes) with a token: ${TOKEN_ENV}, else a generated one (printed)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    """`python scripts/sweep_worker.py worker|status|dashboard ...`.

    Args:
        argv: the arguments (default: sys.argv[1:]).
    """
    a = parser().parse_args(argv)
    if a.command == "worker":
        for flag in ("heartbeat", "grace", "max_failures"):
            if getattr(a, flag) < 1:
                raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(a, flag)}")
        if a.grace <= a.heartbeat:
            raise SystemExit(f"--grace ({a.grace} s) must exceed --heartbeat ({a.heartbeat} s)")
        run_worker(a)
    elif a.command == "status":
        run_status(a)
    else:
        run_dashboard(a)
