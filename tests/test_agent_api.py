"""agentrl.api.actions: JSON in/out actions over the DVC pipeline; errors are structured and leave the
workspace byte-identical. The end-to-end runs (a real experiment) are in test_mcp.py (slow)."""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from agentrl import config
from agentrl.api import actions as agent_api
from agentrl.experiments import overrides
from agentrl.experiments.scratch import GIT_IDENTITY
from conftest import mini_params, tool_env

BIN = str(Path(sys.executable).parent)


def sh(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, env=tool_env(None), capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def make_repo(root: Path, monkeypatch) -> Path:
    """The copied repository with the miniature params, committed (the baseline of the experiments)."""
    for k, v in GIT_IDENTITY.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    p = mini_params()
    p["tracking"]["report_to"] = ["dvclive"]
    (root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    sh(["git", "init", "-q"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "baseline"], root)
    return root


@pytest.fixture
def repo(copy_repo, monkeypatch):
    return make_repo(copy_repo, monkeypatch)


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file of the workspace (DVC's and git's own directories aside)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and rel.parts[0] not in (".git", ".dvc"):
            out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_error(out: dict, type_: str, key):
    assert set(out) == {"error"}, out
    err = out["error"]
    assert (err["type"], err["key"]) == (type_, key), err
    assert err["message"] and "Traceback" not in err["message"]
    json.dumps(out)  # JSON all the way
    return err


def test_describe_reads_the_schema_stages_and_metrics(copy_repo):
    (copy_repo / "metrics").mkdir()
    (copy_repo / "metrics/eval_sft.json").write_text(json.dumps({"accuracy": 0.25}))
    out = agent_api.call("describe", {}, root=copy_repo)
    assert "error" not in out, out
    assert out["params_schema"] == json.loads(json.dumps(config.Params.model_json_schema()))
    dvc_stages = yaml.safe_load((copy_repo / "dvc.yaml").read_text())["stages"]
    assert [s["name"] for s in out["stages"]] == list(dvc_stages)
    assert out["metrics"] == {"metrics/eval_sft.json": {"accuracy": 0.25}}
    assert out["params"] == json.loads(json.dumps(config.load_yaml(copy_repo / "params.yaml")))
    assert set(out["actions"]) == set(agent_api.ACTIONS)


@pytest.mark.parametrize(
    "overrides, type_, key",
    [
        ({"sedd": 1}, "unknown_key", "sedd"),
        ({"eval.batch_sise": 4}, "unknown_key", "eval.batch_sise"),
        ({"eval.batch_size": "many"}, "wrong_type", "eval.batch_size"),
        ({"data.synthetic": 5}, "wrong_type", "data.synthetic"),
        ({"seed": -1}, "out_of_range", "seed"),
        ({"seed.x": 1}, "unknown_key", "seed.x"),
        ({"seed": 3, "data.source": "hub"}, "invalid_value", "data.source"),
    ],
)
def test_overrides_are_validated_against_the_schema_before_anything_runs(copy_repo, overrides, type_, key):
    before = snapshot(copy_repo)
    out = agent_api.call("run_experiment", {"overrides": overrides, "name": "never"}, root=copy_repo)
    err = assert_error(out, type_, key)
    assert key in err["message"] and err["errors"][0]["key"] == key
    assert snapshot(copy_repo) == before
    assert not (copy_repo / ".git").exists()  # nothing ran: the copy is not even a git repo


def test_overrides_reach_dvc_exactly():
    """The `-S` values parse back (Hydra's grammar, as `dvc exp run -S` does) to the JSON values given."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    values = [
        7,
        1e-6,
        0.5,
        True,
        None,
        "it's a \\ test",
        "a\\'b",
        "end\\",
        "x=1,y",
        "synthetic",
        [1, "a", [2.5]],
        {"accuracy": 1.0, "fmt": 0.1},
    ]
    for v in values:
        parsed = parser.parse_overrides([f"k={overrides.hydra_value(v)}"])[0].value()
        assert parsed == v, (v, overrides.hydra_value(v), parsed)


def test_bad_arguments_are_structured_errors(repo):
    before = snapshot(repo)
    cases = [
        (("nope", {}), "unknown_action", "action"),
        (("describe", {"verbose": True}), "unknown_argument", "verbose"),
        (("run_experiment", {"overrides": "seed=1"}), "wrong_type", "overrides"),
        (("run_experiment", {"overrides": {}, "mode": "cluster"}), "invalid_value", "mode"),
        (("run_experiment", {"overrides": {}, "name": "bad name"}), "invalid_value", "name"),
        (("compare", {"a": "workspace"}), "missing_argument", "b"),
        (("compare", {"a": "workspace", "b": "no-such-exp"}), "unknown_experiment", "b"),
        (("compare", {"a": "workspace", "b": "HEAD", "stage": "final"}), "invalid_value", "stage"),
        (("evaluate", {"experiment": "no-such-exp", "n": 4}), "unknown_experiment", "experiment"),
        (("evaluate", {"experiment": "workspace", "n": 0}), "out_of_range", "n"),
        (("evaluate", {"experiment": "workspace", "n": "4"}), "wrong_type", "n"),
        (("evaluate", {"experiment": "workspace", "n": 4}), "missing_outputs", "experiment"),  # nothing run yet
    ]
    for (action, args), type_, key in cases:
        assert_error(agent_api.call(action, args, root=repo), type_, key)
    assert agent_api.call("run_experiment", ["seed"], root=repo)["error"]["type"] == "wrong_type"
    assert snapshot(repo) == before
    assert agent_api.experiment_names(repo) == []


def test_cli_prints_json_errors_without_traceback(repo):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"]}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl.api.actions",
            "run_experiment",
            json.dumps({"overrides": {"eval.batch_sise": 2}}),
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert_error(json.loads(r.stdout), "unknown_key", "eval.batch_sise")
    assert "Traceback" not in r.stderr


def test_failed_calls_leave_params_and_outputs_byte_identical(repo):
    """With real outputs in the workspace: validation errors, unknown experiments and a run that fails at
    run time (valid schema, missing data files) change nothing, in every mode."""
    sh(["dvc", "repro", "prepare"], repo)
    sh(["git", "add", "-A"], repo)
    sh(["git", "commit", "-qm", "prepared"], repo)
    before = snapshot(repo)
    assert "data/prepared/test.jsonl" in before and "metrics/prepare.json" in before
    assert_error(
        agent_api.call("run_experiment", {"overrides": {"sedd": 1}, "mode": "workspace"}, root=repo),
        "unknown_key",
        "sedd",
    )
    assert_error(
        agent_api.call("run_experiment", {"overrides": {"eval.batch_size": [4]}, "mode": "workspace"}, root=repo),
        "wrong_type",
        "eval.batch_size",
    )
    assert_error(agent_api.call("compare", {"a": "nope", "b": "workspace"}, root=repo), "unknown_experiment", "a")
    assert_error(
        agent_api.call("evaluate", {"experiment": "workspace", "stage": "sft", "n": 2}, root=repo),
        "missing_outputs",
        "experiment",
    )
    # valid for the schema, fails when prepare runs; mode 'workspace' would apply a successful run
    seen = []
    bad_data = {"data.source": "jsonl", "data.train_file": "missing/train.jsonl", "data.test_file": "missing/t.jsonl"}
    out = agent_api.call(
        "run_experiment",
        {"overrides": bad_data, "mode": "workspace", "name": "broken"},
        root=repo,
        progress=lambda p, t, m: seen.append(m),
    )
    err = assert_error(out, "run_failed", None)
    assert err["stage"] == "prepare" and "missing/train.jsonl" in err["message"], err
    assert any("stage prepare" in m for m in seen), seen
    assert snapshot(repo) == before
    assert agent_api.call("status", {}, root=repo)["runs"] == []  # no stale progress left behind
    assert "broken" not in agent_api.experiment_names(repo)


def test_queue_mode_queues_a_named_experiment(repo):
    before = snapshot(repo)
    out = agent_api.call(
        "run_experiment", {"overrides": {"seed": 5}, "name": "q1", "mode": "queue", "start_queue": False}, root=repo
    )
    assert out.get("state") == "queued" and out["name"] == "q1", out
    try:
        st = agent_api.call("status", {}, root=repo)
        assert {"name": "q1", "state": "Queued"} in [{k: q[k] for k in ("name", "state")} for q in st["queue"]], st
        assert "q1" in st["dvc_queue_status"]
        rows = agent_api.call("list_experiments", {}, root=repo)["experiments"]
        assert [r["State"] for r in rows if r["Experiment"] == "q1"] == ["Queued"]
        assert_error(
            agent_api.call("run_experiment", {"overrides": {}, "name": "q1"}, root=repo), "name_conflict", "name"
        )
        assert snapshot(repo) == before
    finally:
        sh(["dvc", "queue", "remove", "--all"], repo)


def test_runs_are_serialised_by_the_repository_lock(copy_repo):
    """A second run waits (and says so) until the first leaves its critical section."""
    events, waits = [], []

    def runner(name, hold):
        run = agent_api._Run(copy_repo, name, "temp", {}, lambda p, t, m: waits.append((name, m)))
        with agent_api._lock(copy_repo, run):
            events.append(("in", name))
            time.sleep(hold)
            events.append(("out", name))
        run.close()

    first = threading.Thread(target=runner, args=("a", 0.6))
    first.start()
    while ("in", "a") not in events:
        time.sleep(0.01)
    second = threading.Thread(target=runner, args=("b", 0.0))
    second.start()
    first.join()
    second.join()
    assert events == [("in", "a"), ("out", "a"), ("in", "b"), ("out", "b")]
    assert [n for n, m in waits if "waiting for another run" in m] == ["b"]


def test_experiment_names_cannot_be_git_revisions_or_revision_syntax(repo, monkeypatch):
    """Issue 45 items 5 and 11: a name that git reads as something else (the branch, a tag, a remote, HEAD and
    git's other own names, a sha prefix) would make the run's results that commit's; revision syntax, whitespace
    and a trailing newline (`$` matches before it) are refused too. Nothing runs, nothing is written."""
    started = []
    monkeypatch.setattr(agent_api, "_stream", lambda root, cmd, run: started.append(cmd) or (1, ""))
    sh(["git", "tag", "v1"], repo)
    sh(["git", "branch", "feature"], repo)
    sh(["git", "update-ref", "refs/remotes/origin/HEAD", "HEAD"], repo)
    branch = sh(["git", "branch", "--show-current"], repo).strip()
    head = sh(["git", "rev-parse", "HEAD"], repo).strip()
    before = snapshot(repo)
    names = [branch, "feature", "v1", "origin", "HEAD", "FETCH_HEAD", "ORIG_HEAD", "MERGE_HEAD", "stash"]
    names += [head[:7], head, "beef", "workspace", "x\n", "x ", "x\t", "main~1", "HEAD^", "a:b", "HEAD@{0}"]
    names += ["a..b", "x.", "x.lock", "a/b", "@"]
    for name in names:
        err = assert_error(
            agent_api.call("run_experiment", {"overrides": {}, "name": name}, root=repo),
            "invalid_value",
            "name",
        )
        assert repr(name)[1:-1] in err["message"], err
    assert started == [] and snapshot(repo) == before  # no `dvc exp run` started


def test_compare_answers_unknown_experiment_for_revisions_that_are_not_commits(repo):
    """Issue 45 item 12: a path (`HEAD:params.yaml`), a tree (`HEAD^{tree}`) and a commit-message search
    (`:/baseline`) name no experiment: unknown_experiment naming the argument, not internal_error."""
    for rev in ("HEAD:params.yaml", "HEAD^{tree}", ":/baseline", "HEAD:no-such-file", "HEAD^{blob}"):
        err = assert_error(
            agent_api.call("compare", {"a": "workspace", "b": rev}, root=repo), "unknown_experiment", "b"
        )
        assert rev in err["message"]
    # a commit whose outputs are not in the local DVC cache (the copy's dvc.lock names eval/grpo, its cache is
    # empty): metrics side by side, no paired test, and why (DataIndexDirError, an internal_error, before)
    out = agent_api.call("compare", {"a": "HEAD", "b": "workspace"}, root=repo)
    assert "error" not in out and out["paired_test"] is None, out
    assert "eval/grpo/predictions.jsonl is not in the local DVC cache" in out["paired_test_reason"], out
    assert_error(
        agent_api.call("evaluate", {"experiment": "HEAD:params.yaml", "n": 2}, root=repo),
        "unknown_experiment",
        "experiment",
    )


def test_a_finished_run_is_read_back_from_its_experiment_ref_not_a_branch_of_the_same_name(repo):
    """Issue 45 item 5, the read-back: DVC resolves a git revision before an experiment, so a branch named like
    the experiment would stand for it (its commit and metrics reported, or a good run removed as
    override_not_applied). agent_api._experiment_rev looks among experiment refs only."""
    baseline = sh(["git", "rev-parse", "HEAD"], repo).strip()
    tree = sh(["git", "rev-parse", "HEAD^{tree}"], repo).strip()
    exp_commit = sh(["git", "commit-tree", tree, "-p", baseline, "-m", "experiment"], repo).strip()
    sh(["git", "update-ref", f"refs/exps/{baseline[:2]}/{baseline[2:]}/bs4", exp_commit], repo)
    sh(["git", "branch", "bs4", baseline], repo)  # made after the run: the name check could not see it
    assert agent_api._experiment_rev(repo, "bs4") == exp_commit
    assert agent_api._resolve(repo, "bs4", "a") == baseline  # what the run's read-back used before
    err = assert_error(agent_api.call("run_experiment", {"name": "bs4"}, root=repo), "invalid_value", "name")
    assert baseline[:12] in err["message"]


def test_a_run_outside_a_git_repository_is_a_clean_error(copy_repo):
    before = snapshot(copy_repo)
    err = assert_error(
        agent_api.call("run_experiment", {"name": "okname"}, root=copy_repo), "not_a_pipeline_repo", "root"
    )
    assert "not a git repository" in err["message"]
    assert snapshot(copy_repo) == before
