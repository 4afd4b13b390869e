"""The agent-facing API as a security boundary (issue 26, docs/security.md): one regression test per failure
of the hostile probe, and a Hypothesis fuzz of the agent API over its JSON schema.

The default tests run the validation path in-process with a stand-in DVC runner that records what would run
(`dvc exp run -S ...`); the end-to-end ones (real `dvc exp run`, real `dvc repro`) are marked slow."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentrl import config
from agentrl.api import actions as agent_api
from agentrl.api import checks as agent_checks
from agentrl.api import probe
from agentrl.experiments import overrides
from agentrl.experiments.scratch import GIT_IDENTITY, copy_repo
from conftest import ROOT, mini_params, tool_env

SECRET = "probe-secret-" + hashlib.sha256(os.urandom(16)).hexdigest()[:20]


# ------------------------------------------------------------------------------------------------ fixtures
def small_repo(dst: Path) -> Path:
    """What the agent API reads of a repository: params.yaml, dvc.yaml, configs/ (accelerate configs)."""
    return copy_repo(ROOT, dst, only=("params.yaml", "dvc.yaml", "configs"))


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file of the workspace: not git's, DVC's cache or its scratch directory (.dvc/tmp: the
    API's lock and progress files)."""
    return {
        rel: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not (rel := p.relative_to(root).as_posix()).startswith((".dvc/tmp/", ".dvc/cache/", ".git/"))
    }


class FakeDVC:
    """Stands in for every DVC command the agent API runs (agent_api._stream and _dvc), recording it; the
    read-back of a finished run is stubbed too. Any other process started during a test fails it."""

    def __init__(self, monkeypatch):
        self.calls: list[list[str]] = []
        self.spawned: list = []
        monkeypatch.setattr(agent_api, "_stream", self.stream)
        monkeypatch.setattr(agent_api, "_dvc", self.dvc)
        monkeypatch.setattr(agent_api, "experiment_names", lambda root: [])
        monkeypatch.setattr(agent_api, "_exp_rows", lambda root: [])
        monkeypatch.setattr(agent_api, "_read_metrics", lambda root, rev, diagnostics=False: {})
        monkeypatch.setattr(agent_api, "_check_params_reached", lambda root, rev, params, name: None)
        monkeypatch.setattr(agent_api, "_experiment_rev", lambda root, name: "0" * 40)
        monkeypatch.setattr(agent_api, "_git_revision", lambda root, name: None)  # no git here: no branch or tag
        import dvc.api
        import dvc.repo
        import dvc.scm

        class Repo:  # DVC's Repo for agent_api._resolve: no revision resolves (the API's own checks run first)
            def __init__(self, *a, **kw):
                self.scm = None

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        def resolve_rev(scm, name):
            raise dvc.scm.RevError(f"unknown revision {name}")

        monkeypatch.setattr(dvc.repo, "Repo", Repo)
        monkeypatch.setattr(dvc.scm, "resolve_rev", resolve_rev)

        monkeypatch.setattr(dvc.api, "exp_show", lambda **kw: [])

        def refuse(*a, **kw):
            self.spawned.append(a[:1])
            raise AssertionError(f"a process was started: {a[:1]}")

        real_popen = subprocess.Popen

        def probe_only(*a, **kw):  # api/probe.py's child, this interpreter running that module, is the one allowed
            if a[:1] == ([sys.executable, "-m", "agentrl.api.probe"],) and not kw.get("shell"):
                self.probes += 1
                return real_popen(*a, **kw)
            return refuse(*a, **kw)

        self.probes = 0
        monkeypatch.setattr(subprocess, "Popen", probe_only)
        for mod, name in [
            (subprocess, "run"),
            (os, "system"),
            (os, "popen"),
            (os, "execv"),
            (os, "execvp"),
            (os, "posix_spawn"),
        ]:
            monkeypatch.setattr(mod, name, refuse)

    def stream(self, root, cmd, run):
        self.calls.append(list(cmd))
        return 0, ""

    def dvc(self, root, *args, check=True):
        self.calls.append(["dvc", *args])
        return subprocess.CompletedProcess(["dvc", *args], 0, "", "")

    def set_args(self) -> list[str]:
        """The -S arguments of the last `dvc exp run`."""
        cmd = self.calls[-1]
        return [cmd[i + 1] for i, a in enumerate(cmd) if a == "-S"]


@pytest.fixture
def repo(tmp_path):
    return small_repo(tmp_path / "repo")


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("PROBE_SECRET", SECRET)
    return FakeDVC(monkeypatch)


def refused(out: dict, type_: str | None = None, key: str | None = "?") -> dict:
    assert set(out) == {"error"}, out
    err = out["error"]
    if type_ is not None:
        assert err["type"] == type_, err
    if key != "?":
        assert err["key"] == key, err
    assert SECRET not in json.dumps(out)
    return err


def run(repo: Path, overrides_: dict, **kw) -> dict:
    return agent_api.call("run_experiment", {"overrides": overrides_, "name": "probe", **kw}, root=repo)


# --------------------------------------------------------------------------- 1. shell injection, accelerate path
@pytest.mark.parametrize(
    "path",
    [
        "configs/accelerate/$(id>marker)/../../../single.yaml",
        "/etc/passwd",
        "configs/accelerate/../../../../etc/passwd",
        "configs/accelerate/`id`.yaml",
        "configs/accelerate/x.yaml; id",
        "configs/accelerate/nope.yaml",  # plain but not there
    ],
)
def test_accelerate_config_must_be_a_plain_file_under_configs_accelerate(repo, fake, path):
    before = snapshot(repo)
    err = refused(run(repo, {"distributed.accelerate_config": path}), key="distributed.accelerate_config")
    assert "configs/accelerate/" in err["message"]
    assert fake.calls == [] and snapshot(repo) == before and not (repo / "marker").exists()


def test_accelerate_config_is_checked_by_the_schema_too():
    raw = mini_params()
    for bad in ("/etc/passwd", "configs/accelerate/$(id>m)/../single.yaml", "configs/accelerate/a b.yaml"):
        raw["distributed"]["accelerate_config"] = bad
        with pytest.raises(config.ParamsError, match=r"distributed.accelerate_config: .*under configs/accelerate/"):
            config.validate_params(raw)
    raw["distributed"]["accelerate_config"] = "configs/accelerate/zero3_offload.yaml"
    config.validate_params(raw)


def stage_commands() -> dict[str, str]:
    """dvc.yaml's stage commands with the default params interpolated, as DVC renders them."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as r:
        return {s.name: s.cmd for s in r.index.stages}


def stub(path: Path, name: str, log: Path) -> Path:
    """An executable that appends `name argv...` to `log` and exits 0 (python stubs also answer -c checks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 0\n')
    path.chmod(0o755)
    return path


def test_stage_commands_quote_the_accelerate_config(tmp_path):
    """Even a value that bypassed validation reaches `accelerate launch` as one literal argument: the shell
    DVC runs the command in expands nothing in it."""
    log = tmp_path / "log"
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/stage-python.sh", tmp_path / "scripts")
    env = {"PATH": "/usr/bin:/bin", "AGENTRL_PYTHON": str(stub(tmp_path / "py", "venv-python", log))}
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["sft"]["cmd"]
    hostile = "configs/accelerate/$(touch MARK1)`touch MARK2`;touch MARK3.yaml"
    cmd = spec.replace("${distributed.accelerate_config}", hostile).replace("${distributed.num_processes}", "1")
    subprocess.run(["sh", "-c", cmd], cwd=tmp_path, env=env, check=True)
    assert not list(tmp_path.glob("MARK*")), "the shell ran part of the value"
    assert hostile in log.read_text()


# --------------------------------------------------------------------------------- 2. no environment value out
@pytest.mark.parametrize(
    "ov",
    [
        {"serve.host": "${oc.env:PROBE_SECRET}"},
        {"data.system_prompt": "${oc.env:PROBE_SECRET}"},
        {"data.system_prompt": "say ${oc.env:PROBE_SECRET,none}"},
        {"data.system_prompt": "${seed}"},
        {"data.system_prompt": "\\${oc.env:PROBE_SECRET}"},
        {"model.chat_template_kwargs": {"k": "${oc.env:PROBE_SECRET}"}},
        {"sft.lora.target_modules": ["q_proj", "${oc.env:PROBE_SECRET}"]},
        {"tracking.wandb_project": "${oc.decode:${oc.env:PROBE_SECRET}}"},
    ],
)
def test_interpolations_are_refused_before_anything_runs(repo, fake, ov):
    before = snapshot(repo)
    err = refused(run(repo, ov), "invalid_value", next(iter(ov)))
    assert "interpolation" in err["message"]
    assert fake.calls == [] and snapshot(repo) == before


# ----------------------------------------------------------------------------- 3. import paths from an allowlist
@pytest.mark.parametrize(
    "ov",
    [
        {"agent.tools": ["os:system"]},
        {"agent.tools": ["subprocess:check_call"]},
        {"agent.tools": ["PIL.ImageMath:unsafe_eval"]},
        {"agent.tools": ["this:s"]},
        {"agent": {"tools": ["os:system"], "format": "chat"}},
        {"agent.environment": "os:system", "agent.tools": []},
    ],
)
def test_an_override_cannot_name_a_new_import_path(repo, fake, ov):
    if "agent" in ov:  # a section replaces the workspace's whole: the rest of it as params.yaml has it
        ov = {"agent": {**agent_checks.read_params(repo)["agent"], **ov["agent"]}}
    before = snapshot(repo)
    err = refused(run(repo, ov))
    assert err["type"] in ("not_allowed", "unknown_key"), err  # unknown_key: a schema without agent.environment
    assert fake.calls == [] and snapshot(repo) == before


def test_reward_import_paths_cannot_be_added_by_an_override(repo, fake):
    for ov in ({"grpo.rewards": {"subprocess:check_call": 1.0}}, {"grpo.rewards": {"accuracy": 1.0, "os:system": 1}}):
        refused(run(repo, ov), key="grpo.rewards")
    assert fake.calls == []


def test_import_paths_the_users_params_name_stay_usable(repo, fake):
    """The allowlist is the registry plus what params.yaml itself names: the user's own module:function."""
    p = config.load_yaml(repo / "params.yaml")
    p["agent"]["tools"] = ["agentrl.agent.tools:calculator"]
    (repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    assert "error" not in run(repo, {"agent.tools": ["agentrl.agent.tools:calculator"], "seed": 3})
    assert "error" not in run(repo, {"agent.tools": ["calculator"]}, name="probe2")
    refused(
        run(repo, {"agent.tools": ["agentrl.agent.tools:format_number"]}, name="probe3"), "not_allowed", "agent.tools"
    )


def test_an_override_cannot_make_gymnasium_import_a_module(repo, fake):
    """Issue 56 item 6: environments.gymnasium.env_id "this:FrozenLake-v1" (gymnasium imports `this` to make it)
    was accepted by the agent API, outside the import allowlist; it is refused like a new module:function."""
    before = snapshot(repo)
    knobs = {"num_train": 8, "num_test": 4}
    ov = {
        "agent.environment": "gymnasium",
        "agent.tools": [],
        "environments.gymnasium": {**knobs, "env_id": "this:FrozenLake-v1"},
    }
    err = refused(run(repo, ov), "not_allowed", "environments.gymnasium.env_id")
    assert "makes gymnasium import a module" in err["message"]
    assert fake.calls == [] and snapshot(repo) == before
    ov["environments.gymnasium"] = {**knobs, "env_id": "FrozenLake-v1"}
    assert "error" not in run(repo, ov, name="probe2")


RG_TERMS = {"num_train": 8, "num_test": 4, "task": "chain_sum", "tool": "calculator"}


def test_an_environment_too_large_to_generate_is_refused_before_the_run(repo, fake, monkeypatch):
    """Issue 56 item 6: reasoning-gym `min_terms: 999999999` was accepted (prepare then hit a 6 GiB cap after 126 s,
    holding the API's run lock), as was a 250x250 Gymnasium map (still running after 20 min). Their cost is measured
    before the run (api/probe.py: a few rows generated under a clock and a memory cap) and the run refused naming the
    environment; nothing runs. The caps are lowered here to keep the test short; the defaults are 60 s / 3 GiB."""
    monkeypatch.setattr(probe, "PROBE_RSS_BYTES", 768 << 20)  # torch imported: ~0.4 GiB
    monkeypatch.setattr(probe, "PROBE_TIMEOUT_S", 12.0)
    before = snapshot(repo)
    huge_terms = {**RG_TERMS, "config": {"min_terms": 999_999_999, "max_terms": 999_999_999}}
    ov = {"agent.environment": "reasoning_gym", "agent.tools": [], "environments.reasoning_gym": huge_terms}
    err = refused(run(repo, ov), "too_costly", "environments.reasoning_gym")
    assert any(why in err["message"] for why in ("over 768 MiB of memory", "out of memory", "still running after")), err
    big_map = ["S" + "F" * 249] + ["F" * 250] * 248 + ["F" * 249 + "G"]
    knobs = {"num_train": 6, "num_test": 6, "env_id": "FrozenLake-v1", "max_steps": 12}
    ov = {
        "agent.environment": "gymnasium",
        "agent.tools": [],
        # slippery: a deterministic map fails on its own ("only 0 distinct train episodes") in ~12 s on an AMD EPYC
        # Zen 4, a race with the 12 s cap; a slippery one is still searching for episodes there at 27 s
        "environments.gymnasium": {**knobs, "env_kwargs": {"desc": big_map, "is_slippery": True}},
    }
    err = refused(run(repo, ov, name="probe2"), "too_costly", "environments.gymnasium")
    assert any(why in err["message"] for why in ("still running after 12 s", "MiB of memory", "out of memory")), err
    assert fake.calls == [] and fake.probes == 2 and snapshot(repo) == before


def test_the_rows_an_environment_asks_for_are_bounded_by_their_measured_time(repo, monkeypatch):
    """The measured cost per row, extrapolated to num_train + num_test, against prepare's budget: the same knobs are
    accepted (with the estimate) under the default budget and refused, naming the row count, under a tiny one."""
    tree = mini_params()
    tree["agent"].update(environment="countdown", tools=[])
    tree["environments"]["countdown"].update(num_train=1_000_000, num_test=500)
    ov = {"environments.countdown.num_train": 1_000_000}
    measured = probe.probe_environment(tree, ov)
    assert measured["rows"] == 1_000_500 and measured["estimated_prepare_s"] >= 0, measured
    assert probe.probe_environment(tree, {"seed": 3}) is None  # the user's own environment knobs: not probed
    monkeypatch.setattr(probe, "PREPARE_BUDGET_S", 1e-6)
    with pytest.raises(agent_checks.APIError, match=r"environments.countdown: 1000500 rows at .* would take prepare"):
        probe.probe_environment(tree, ov)


def test_a_knob_the_generator_rejects_is_named_not_called_too_costly(monkeypatch):
    tree = mini_params()
    tree["agent"].update(environment="countdown", tools=[])
    tree["environments"]["countdown"].update(number_min=50, number_max=10)
    with pytest.raises(agent_checks.APIError, match=r"environments.countdown: generating rows .* failed") as e:
        probe.probe_environment(tree, {"environments.countdown.number_min": 50})
    assert e.value.type == "invalid_value"


def test_validation_imports_no_module(monkeypatch):
    """params naming an unimported module validate by form; the module is imported by the stage, not here."""
    raw = mini_params()
    raw["agent"]["tools"] = ["agentrl_probe_never_imported:fn"]
    raw["grpo"]["rewards"] = {"accuracy": 1.0, "agentrl_probe_never_imported2:fn": 0.5}
    config.validate_params(raw)
    assert "agentrl_probe_never_imported" not in sys.modules
    assert "agentrl_probe_never_imported2" not in sys.modules
    raw["agent"]["tools"] = ["not a tool"]
    with pytest.raises(config.ParamsError, match="unknown tool 'not a tool'"):
        config.validate_params(raw)


# --------------------------------------------------------------------- 5. validated and applied in the same form
def dvc_applies(repo: Path, tmp: Path, args: list[str]) -> str:
    """params.yaml after DVC's own apply_overrides (what `dvc exp run -S args` does) on a copy."""
    from dvc.utils.hydra import apply_overrides

    f = tmp / "params.yaml"
    shutil.copy(repo / "params.yaml", f)
    apply_overrides(str(f), args)
    return f.read_text()


def test_a_dict_value_replaces_the_mapping(repo, fake, tmp_path):
    p = config.load_yaml(repo / "params.yaml")
    p["model"]["chat_template_kwargs"] = {"enable_thinking": False, "b": 2}
    (repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    out = run(repo, {"model.chat_template_kwargs": {"a": 1}})
    assert "error" not in out, out
    applied = overrides.load(dvc_applies(repo, tmp_path, fake.set_args()))
    assert applied["model"]["chat_template_kwargs"] == {"a": 1}  # not merged into {enable_thinking, b}
    assert applied["seed"] == p["seed"] and applied["grpo"] == p["grpo"]


@pytest.mark.parametrize(
    "ov",
    [
        {"grpo.rewards": {"subprocess:check_call": 1.0}},  # was written `subprocess: 'check_call:1.0'`
        {"model.chat_template_kwargs": {"x:1,seed:7,y": 1}},  # was three keys
        {"model.chat_template_kwargs": {"a b": 1}},
        {"data.system_prompt": "${seed}"},  # was 42
        {"data.system_prompt": "yes"},  # DVC writes yes, the stage reads True
        {"data.system_prompt": "12:30"},  # ... and 750
        {"data.hub_config": "on"},
    ],
)
def test_what_dvc_would_write_differently_is_refused(repo, fake, ov):
    refused(run(repo, ov), key=next(iter(ov)))
    assert fake.calls == []


ROUND_TRIP = [
    {"seed": 7, "eval.batch_size": 16},
    {"sft.trainer.learning_rate": 1e-6, "grpo.trainer.temperature": 0.7, "eval.top_p": 0.5},
    {"data.system_prompt": "It's a \\ test: \"quoted\" 'single' $(not run) `nor this` ; | & > < * ? ~ # % !"},
    {"data.system_prompt": "line one\nline two\ttabbed, commas, {braces} [brackets] =equals"},
    {"data.system_prompt": "ends with a backslash \\"},
    {"model.chat_template_kwargs": {"enable_thinking": False, "n": 3, "s": "x,y:z"}},
    {"data.synthetic.steps": {"1": 0.5, "4": 0.5}},
    {"agent.tools": [], "grpo.rewards": {"accuracy": 1.0, "step": 0.25}},
    {"data.synthetic.operations": ["+", "*"], "sft.lora.target_modules": ["q_proj", "v_proj"]},
    {"data.max_samples": None, "model.pretrain.enabled": False, "distributed.num_processes": 2},
    {"distributed.accelerate_config": "configs/accelerate/ddp.yaml"},
]


@pytest.mark.parametrize("ov", ROUND_TRIP)
def test_validated_params_are_byte_for_byte_what_dvc_writes(repo, fake, tmp_path, ov):
    """The -S arguments the API passes to `dvc exp run`, applied by DVC's own function to the workspace's
    params.yaml, give the exact text the API validated, and the stages read the values as given."""
    text = (repo / "params.yaml").read_text()
    params, args, predicted = agent_api.validate_overrides(repo, ov)
    assert dvc_applies(repo, tmp_path, args) == predicted
    assert overrides.load(predicted) == params
    for k, v in ov.items():
        assert overrides.same(overrides.get(params, k), v), (k, overrides.get(params, k), v)
    assert "error" not in run(repo, ov)
    assert fake.set_args() == args and (repo / "params.yaml").read_text() == text


# ---------------------------------------------------------------------------------- 6. linear, with a size limit
def test_huge_requests_are_refused_before_params_are_read(repo, fake, monkeypatch):
    def unread(root):
        raise AssertionError("params.yaml was read for a request over the limit")

    monkeypatch.setattr(agent_checks, "_params_text", unread)
    for n in (agent_checks.MAX_OVERRIDES + 1, 8000, 100_000):
        err = refused(run(repo, {f"k{i}": 1 for i in range(n)}), "request_too_large")
        assert str(agent_checks.MAX_OVERRIDES) in err["message"] or "characters" in err["message"]
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    refused(run(repo, {"seed": deep}), "request_too_large")
    refused(run(repo, {"data.system_prompt": "x" * 200_000}), "request_too_large")
    refused(agent_api.call("compare", {"a": "x" * 200_000, "b": "workspace"}, root=repo), "request_too_large")
    assert fake.calls == []


def test_error_report_is_linear_in_the_number_of_keys(repo, fake):
    """The most keys one request may carry, all unknown: every one is reported, the overridden keys first
    (the ordering used to compare every error with every key)."""
    keys = {f"unknown{i}": 1 for i in range(agent_checks.MAX_OVERRIDES)}
    err = refused(run(repo, keys), "unknown_key")
    assert {e["key"] for e in err["errors"]} == set(keys)


# ------------------------------------------------------------------------------------------- 8. upper bounds
BOUNDS = [
    ("data.synthetic.num_train", 10**18, "10000000"),
    ("model.tiny.hidden_size", 10**9, "16384"),
    ("eval.batch_size", 10**12, "65536"),
    ("grpo.trainer.max_steps", 10**15, "10,000,000"),
    ("sft.trainer.learning_rate", 1e308, "10.0"),
    ("grpo.trainer.learning_rate", 1e308, "10.0"),
    ("grpo.trainer.temperature", 1e308, "100.0"),
    ("eval.temperature", 1e308, "100"),
    ("model.pretrain.learning_rate", 1e308, "1"),
    ("sft.trainer.per_device_train_batch_size", 10**12, "65,536"),
]


@pytest.mark.parametrize("key, value, bound", BOUNDS)
def test_sizes_steps_and_rates_have_upper_bounds(repo, fake, key, value, bound):
    raw = mini_params()
    overrides.set_value(raw, key, value)
    with pytest.raises(config.ParamsError) as e:
        config.validate_params(raw)
    line = next(x for x in str(e.value).splitlines() if x.strip().startswith(key + ":"))
    assert bound in line, line
    refused(run(repo, {key: value}), "out_of_range" if "trainer" not in key else "invalid_value", key)
    assert fake.calls == []


# --------------------------------------------------------------------------- 9. the project's interpreter
def test_stage_commands_run_the_projects_interpreter_whatever_python_is_on_path(tmp_path):
    """Every stage command, run by a shell the way DVC runs it (DVC_ROOT set, cwd the workspace) with a
    different `python`, `python3` and `accelerate` first on PATH, runs $DVC_ROOT/.venv/bin/python."""
    log = tmp_path / "log"
    fakebin = tmp_path / "fakebin"
    for name in ("python", "python3", "accelerate"):
        stub(fakebin / name, f"WRONG-{name}", log)
    main = tmp_path / "main"
    stub(main / ".venv/bin/python", "venv-python", log)
    work = tmp_path / "exp-temp-workspace"  # like .dvc/tmp/exps/<tmp>: the scripts, no .venv
    (work / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/stage-python.sh", work / "scripts")
    env = {"PATH": f"{fakebin}:/usr/bin:/bin", "DVC_ROOT": str(main), "HOME": str(tmp_path)}
    cmds = stage_commands()
    assert len(cmds) >= 10
    for name, cmd in cmds.items():
        log.write_text("")
        subprocess.run(["bash", "--noprofile", "--norc", "-c", cmd], cwd=work, env=env, check=True)
        lines = log.read_text().splitlines()
        assert lines and all(x.startswith("venv-python ") for x in lines), (name, cmd, lines)
        module = cmd.split(" -m ")[1].split()[0]
        assert lines[-1].startswith(f"venv-python -m {module}"), (name, lines)
        if name in ("sft", "grpo"):
            assert "-m accelerate.commands.launch --config_file configs/accelerate/single.yaml" in lines[-1]
            assert lines[-1].endswith(f"-m agentrl.stages.{name}")


def test_stage_python_names_an_interpreter_without_the_package(tmp_path):
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "python3").write_text("#!/bin/sh\nexit 1\n")
    (fakebin / "python3").chmod(0o755)
    r = subprocess.run(
        ["sh", str(ROOT / "scripts/stage-python.sh"), "-m", "agentrl.stages.prepare"],
        env={"PATH": f"{fakebin}:/usr/bin:/bin", "DVC_ROOT": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 3 and "cannot import agentrl" in r.stderr and "make setup" in r.stderr, r.stderr


@pytest.mark.slow
def test_venv_dvc_repro_with_the_system_python_first_on_path(tmp_path):
    """README's `.venv/bin/dvc repro <stage>` with /usr/bin first on PATH (whose python has no agentrl)."""
    repo = copy_repo(ROOT, tmp_path / "repo")
    (repo / "params.yaml").write_text(yaml.safe_dump(mini_params(), sort_keys=False))
    (repo / ".venv").symlink_to(Path(sys.executable).parents[1])
    env = {**tool_env(None), "PATH": "/usr/bin:/bin"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    r = subprocess.run(
        [str(Path(sys.executable).parent / "dvc"), "repro", "prepare"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (repo / "data/prepared/test.jsonl").exists()


# ------------------------------------------------------------------------------ 10. finished checkpoints
def fake_checkpoint(d: Path, step: int, max_steps: int) -> Path:
    from test_resume_kill import write_checkpoint  # a complete one: every file the Trainer's resume reads

    return write_checkpoint(d, step, max_steps)


def test_a_finished_checkpoint_is_kept_to_be_loaded_not_trained_past(tmp_path):
    """Issue 56 item 4: a finished checkpoint (saved at max_steps) used to be cleared, so a kill after the last
    step's save cost the whole stage; it is now returned and marked finished (training.train loads it)."""
    from agentrl.common import finished_checkpoint, resumable_checkpoint

    d = tmp_path / "checkpoints/sft"
    d.mkdir(parents=True)
    (d / "fingerprint.txt").write_text("key\n")
    fake_checkpoint(d, 20, 40)
    assert resumable_checkpoint(d, "key") == str(d / "checkpoint-20") and not finished_checkpoint(d / "checkpoint-20")
    fake_checkpoint(d, 40, 40)
    assert resumable_checkpoint(d, "key") == str(d / "checkpoint-40") and finished_checkpoint(d / "checkpoint-40")


@pytest.mark.slow
def test_sft_killed_after_its_last_save_finishes_from_it_with_the_same_weights(workdir):
    """Issue 26 item 10: SFT re-run with its final checkpoint present used to log 'resuming from checkpoint-N'
    and record N + 1 steps. Issue 56 item 4: it then trained every step again instead; now, with models/sft gone
    as a kill after the last save leaves it, the re-run loads checkpoint-N, trains no step, records N steps and
    saves the uninterrupted run's weights byte for byte."""
    from agentrl.common import read_metrics
    from agentrl.config import load_params
    from agentrl.stages import base, prepare

    p = mini_params()
    p["sft"]["trainer"].update(max_steps=6, save_steps=3)
    p["tracking"]["report_to"] = []
    (workdir / "params.yaml").write_text(yaml.safe_dump(p))
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    weights = []
    for run in range(2):
        r = subprocess.run(
            [sys.executable, "-m", "agentrl.stages.sft"], cwd=workdir, env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-3000:]
        m = read_metrics(workdir / "metrics/sft_train.json")
        assert m["steps"] == 6, m
        files = sorted((workdir / "models/sft").glob("*.safetensors"))
        weights.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files})
        if run == 0:
            assert m["resumed_from"] is None and m["steps_this_run"] == 6, m
            shutil.rmtree(workdir / "models/sft")  # killed after the last save, before models/sft was written
        else:
            assert m["resumed_from"].endswith("checkpoint-6") and m["steps_this_run"] == 0, m
            assert "ends a finished run" in r.stderr, r.stderr[-3000:]
    assert weights[0] and weights[0] == weights[1]


# ------------------------------------------------------------------------------------------------- the fuzz
MARK = "agentrl-fuzz-marker"
HOSTILE = [
    f"$(touch {MARK})",
    f"`touch {MARK}`",
    f"; touch {MARK}",
    f"| touch {MARK} &",
    f"&& touch {MARK}",
    "$PROBE_SECRET",
    "${oc.env:PROBE_SECRET}",
    "${oc.env:PROBE_SECRET,}",
    "\\${oc.env:PROBE_SECRET}",
    "${seed}",
    "${oc.decode:'1'}",
    "$(id)",
    "os:system",
    "subprocess:check_call",
    "PIL.ImageMath:unsafe_eval",
    "this:s",
    "builtins:eval",
    "agentrl.agent.tools:calculator",
    "/etc/passwd",
    "../../etc/passwd",
    "~/.ssh/id_rsa",
    "configs/accelerate/$(id>marker)/../../../single.yaml",
    "configs/accelerate/ddp.yaml",
    "configs/accelerate/single.yaml",
    "http://127.0.0.1:1/x",
    "yes",
    "12:30",
    "null",
    "'",
    '"',
    "\\",
    "a\\'b",
    "\n",
    "\x00",
    "\x1b[31m",
    "{a:1,b:2}",
    "[1,2]",
    "x=1,y=2",
    "++seed=1",
    "~seed",
    "calculator",
    "",
    "x" * 5000,
]
HUGE = [10**18, 2**63, -(10**30), 10**400, 1e308, -1e308, 5e-324, list(range(3000)), {"k": list(range(3000))}]


def schema_keys() -> list[str]:
    """Every dotted key of params.yaml (sections and leaves), and the schema's top-level sections."""
    out = list(config.Params.model_fields)

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            out.append(key)
            if isinstance(v, dict):
                walk(v, key + ".")

    walk(config.load_yaml(ROOT / "params.yaml"), "")
    return sorted(set(out))


def strategies():
    from hypothesis import strategies as st

    keys = schema_keys()
    current = config.load_yaml(ROOT / "params.yaml")
    leaves = {
        k: v for k in keys if (v := overrides.get(current, k)) is not overrides.MISSING and not isinstance(v, dict)
    }
    hostile = st.sampled_from(HOSTILE)
    text = st.text(alphabet=st.characters(codec="utf-8"), max_size=20)
    string = st.one_of(hostile, text, st.builds(lambda a, b, c: a + b + c, text, hostile, text))
    scalar = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 200),
        st.sampled_from(HUGE),
        st.floats(allow_nan=True, allow_infinity=True),
        string,
    )
    dict_key = st.one_of(st.sampled_from(["a", "k", "enable_thinking", "1", "accuracy"]), hostile, text)
    value = st.recursive(
        scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(dict_key, inner, max_size=4), max_leaves=8
    )

    def like(key):  # a value of the current one's type: these are often valid, so runs are recorded too
        cur = leaves[key]
        if isinstance(cur, bool):
            return st.booleans()
        if isinstance(cur, int):
            return st.integers(0, 64) | st.sampled_from(HUGE)
        if isinstance(cur, float):
            return st.floats(0, 1) | st.sampled_from(HUGE)
        if isinstance(cur, str):
            return string | st.sampled_from([cur])
        if isinstance(cur, list):
            return st.lists(st.sampled_from(cur) if cur else string, max_size=3, unique=True) | st.lists(
                string, max_size=2
            )
        return value

    leaf_keys = sorted(leaves)
    typed = st.sampled_from(leaf_keys).flatmap(lambda k: st.tuples(st.just(k), like(k)))
    any_pair = st.tuples(st.one_of(st.sampled_from(keys), hostile, text), value)
    targeted = st.tuples(
        st.sampled_from(
            [
                "agent.tools",
                "grpo.rewards",
                "agent.environment",
                "distributed.accelerate_config",
                "serve.host",
                "data.train_file",
                "model.base_model",
                "sft.trainer.push_to_hub",
                "grpo.trainer.hub_model_id",
                "model.chat_template_kwargs",
            ]
        ),
        st.one_of(
            hostile,
            st.lists(hostile, max_size=3),
            st.dictionaries(st.sampled_from(HOSTILE[:20]), st.floats(0, 2), max_size=2),
        ),
    )
    pairs = st.lists(st.one_of(typed, any_pair, targeted), min_size=1, max_size=6)
    ovs = pairs.map(dict) | st.sampled_from([{}, "seed=1", ["seed"], None, 7])
    name = st.one_of(st.none(), st.sampled_from(["ok-name", "a" * 101, "../x", "x;id", "$(id)", "-rf", "x.lock"]), text)
    run_args = st.fixed_dictionaries(
        {"overrides": ovs},
        optional={"name": st.sampled_from(["run-a", "run.b_1"]), "mode": st.sampled_from(["temp", "queue"])},
    )
    junk_args = st.fixed_dictionaries(  # the other arguments' checks
        {"overrides": ovs},
        optional={
            "name": name,
            "mode": st.sampled_from(["temp", "queue", "workspace", "cluster", ""]) | text,
            "start_queue": st.booleans() | scalar,
            "extra": scalar,
        },
    )
    other = st.one_of(
        st.tuples(
            st.just("compare"),
            st.fixed_dictionaries({"a": string, "b": st.just("workspace") | string}, optional={"stage": string}),
        ),
        st.tuples(
            st.just("evaluate"),
            st.fixed_dictionaries({}, optional={"experiment": string, "stage": string, "n": scalar}),
        ),
        st.tuples(
            st.sampled_from(["describe", "status", "list_experiments", "nope", "$(id)"]),
            st.dictionaries(text, scalar, max_size=2),
        ),
    )
    runs = st.tuples(st.just("run_experiment"), run_args)
    junk = st.tuples(st.just("run_experiment"), junk_args)
    return st.integers(0, 9).flatmap(lambda i: runs if i < 6 else junk if i < 9 else other)


def test_fuzz_the_agent_api(tmp_path, monkeypatch):
    """>= 1,000 Hypothesis-generated calls (shell metacharacters, interpolations, import paths, huge and nested
    values) through agent_api.call, in-process, with the stand-in DVC runner: every answer is JSON without the
    environment's secret; a refused call leaves the workspace byte-identical and runs nothing; an accepted one
    runs only `dvc exp run` (or DVC's queue), whose -S arguments DVC applies to valid params with no new import
    path, no interpolation and the accelerate config a file under configs/accelerate/; no process is started,
    no file is written outside the repository's .dvc/tmp."""
    from hypothesis import HealthCheck, given, settings

    monkeypatch.setenv("PROBE_SECRET", SECRET)
    repo = small_repo(tmp_path / "repo")
    (repo / "params.yaml").write_text(yaml.safe_dump(mini_params(), sort_keys=False))
    base = config.load_yaml(repo / "params.yaml")
    text = (repo / "params.yaml").read_text()
    monkeypatch.chdir(tmp_path)
    (repo / ".dvc/tmp").mkdir(parents=True)  # the API's lock and progress files
    outside, top = set(os.listdir(tmp_path)), set(os.listdir(repo))
    fake = FakeDVC(monkeypatch)
    before = snapshot(repo)
    stats = {"calls": 0, "refused": 0, "ran": 0, "api_s": 0.0}
    t_start = time.perf_counter()

    @settings(
        max_examples=1100, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True
    )
    @given(strategies())
    def one(call):
        action, args = call
        n = len(fake.calls)
        t0 = time.perf_counter()
        out = agent_api.call(action, args, root=repo)
        stats["api_s"] += time.perf_counter() - t0
        stats["calls"] += 1
        blob = json.dumps(out)
        assert SECRET not in blob and "Traceback" not in blob
        assert not fake.spawned and not (repo / "marker").exists()
        assert set(os.listdir(tmp_path)) == outside and set(os.listdir(repo)) == top  # no marker, no new file
        if "error" in out:
            stats["refused"] += 1
            assert set(out) == {"error"} and out["error"]["type"] != "internal_error", out
            assert snapshot(repo) == before
            if action == "run_experiment":
                assert len(fake.calls) == n, "a refused run reached DVC"
            return
        if action != "run_experiment":
            return
        stats["ran"] += 1
        runs = [c for c in fake.calls[n:] if c[:3] == ["dvc", "exp", "run"]]
        assert len(runs) == 1 and all(c[0] == "dvc" for c in fake.calls[n:]), fake.calls[n:]
        args_ = [runs[0][i + 1] for i, a in enumerate(runs[0]) if a == "-S"]
        assert not any("${" in a or SECRET in a for a in args_)
        assert snapshot(repo) == before  # a temp/queue run leaves the workspace alone (the stand-in ran nothing)
        if stats["ran"] % 3:  # DVC's application of the arguments, for every third run (it is the slow part)
            return
        params = overrides.load(overrides.apply(text, args_))
        config.validate_params(params)
        for key in agent_checks.IMPORT_KEYS:
            assert {n for n in agent_checks._import_names(params, key) if ":" in n} <= set(
                agent_checks._import_names(base, key)
            )
        acc = (repo / params["distributed"]["accelerate_config"]).resolve()
        assert acc.is_file() and acc.is_relative_to((repo / "configs/accelerate").resolve())

    one()
    print(
        f"\nfuzz: {stats['calls']} calls, {stats['refused']} refused, {stats['ran']} runs recorded; "
        f"{stats['api_s']:.1f} s in the API of {time.perf_counter() - t_start:.1f} s"
    )
    assert stats["calls"] >= 1000 and stats["ran"] >= 20 and stats["refused"] >= 500, stats


# ----------------------------------------------------------------------------------- the fuzz, end to end
@pytest.mark.slow
def test_hostile_runs_end_to_end_with_real_dvc(tmp_path, monkeypatch):
    """Real `dvc exp run --temp` on a one-stage pipeline that records the params it ran with: hostile strings
    in free-text fields reach params.yaml as data (no shell runs them), the experiment's params.yaml is
    byte-for-byte the text the API validated, refused calls leave no experiment and an identical workspace."""
    repo = small_repo(tmp_path / "repo")
    (repo / "params.yaml").write_text(yaml.safe_dump(mini_params(), sort_keys=False))
    (repo / "dvc.yaml").write_text(
        "stages:\n  echo:\n    cmd: cp params.yaml ran_with.yaml\n    params: [seed, data]\n    outs: [ran_with.yaml]\n"
    )
    env = tool_env(None, PROBE_SECRET=SECRET)
    for k, v in {**GIT_IDENTITY, "PROBE_SECRET": SECRET, "PATH": env["PATH"]}.items():
        monkeypatch.setenv(k, v)
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "x"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    before = snapshot(repo)
    marker = tmp_path / MARK
    hostile_prompt = f"$(touch {marker}) `touch {marker}`; touch {marker} | x & y > z 'q' \"d\" \\"
    for i, ov in enumerate(
        [
            {"serve.host": "${oc.env:PROBE_SECRET}"},
            {"distributed.accelerate_config": "configs/accelerate/$(id>marker)/../../../single.yaml"},
            {"agent.tools": ["os:system"]},
            {"grpo.rewards": {"subprocess:check_call": 1.0}},
            {"model.chat_template_kwargs": {"x:1,seed:7,y": 1}},
        ]
    ):
        refused(run(repo, ov, name=f"bad{i}"))
    assert agent_api.experiment_names(repo) == [] and snapshot(repo) == before
    params, _, predicted = agent_api.validate_overrides(repo, {"data.system_prompt": hostile_prompt, "seed": 9})
    out = run(repo, {"data.system_prompt": hostile_prompt, "seed": 9}, name="good")
    assert "error" not in out, out
    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(repo), rev="good")
    assert fs.read_text("params.yaml") == predicted and fs.read_text("ran_with.yaml") == predicted
    assert not marker.exists() and not (repo / "marker").exists()
    assert snapshot(repo) == before and SECRET not in json.dumps(agent_api.call("list_experiments", {}, root=repo))


def test_stage_python_runs_the_workspace_code_not_the_main_repositorys(tmp_path):
    """An experiment's temporary workspace (a copy of src/ as queued) imports its own agentrl, not the main
    repository's src/ that the venv's editable install points at."""
    work = tmp_path / "exp-temp-workspace"
    shutil.copytree(ROOT / "src", work / "src", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/stage-python.sh", work / "scripts")
    r = subprocess.run(
        ["sh", "scripts/stage-python.sh", "-c", "import agentrl; print(agentrl.__file__)"],
        cwd=work,
        env={**os.environ, "AGENTRL_PYTHON": sys.executable, "DVC_ROOT": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == work / "src/agentrl/__init__.py", r.stdout
