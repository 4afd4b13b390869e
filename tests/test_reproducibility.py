"""params.yaml `reproducibility` (agentrl.reproducibility): the kernels it pins reach torch and MKL before they
start, its knobs reach the code, and two different kernel dispatches give the same bytes with `portable` and
different ones with `native` (so the check can fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentrl import reproducibility as rep
from agentrl.config import ParamsError, load_params
from conftest import mini_params, write_params
from test_golden import golden_params, run_pipeline

# Another machine's kernel dispatch, emulated on this one: ATen's plain (non-vector) kernels, MKL's COMPATIBLE
# branch, one core (the stages' native thread count is the core count). This CPU's own dispatch is the other side.
# It must differ from what `native` picks on any CPU the suite runs on: ATen AVX2 + MKL_CBWR=AVX2 (the emulation
# until session 12) is what an AVX2-only AMD EPYC runs anyway (MKL ignores MKL_CBWR=AVX2 on AMD), and there one
# core instead of two did not change the base model's bytes, so the native side of the test could not differ.
OTHER_CPU = ({"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}, "1")
THIS_CPU = ({}, "2")


def test_environment_of_each_mode():
    env = rep.environment("portable", 3)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "COMPATIBLE"
    assert env["FBGEMM_ENABLE_INSTRUCTIONS"] == "AVX2" and env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert rep.environment("native", 3) == {}


@pytest.mark.parametrize(
    "mode, threads, error",
    [("fast", 2, "reproducibility.mode: expected one of"), ("portable", 0, "reproducibility.threads: expected")],
)
def test_bad_values_name_the_key(mode, threads, error):
    with pytest.raises(ValueError, match=error):
        rep.apply(mode, threads, environ={})


def test_params_file_errors_name_the_file_and_key(tmp_path):
    p = mini_params()
    p["reproducibility"] = {"mode": "portable", "threads": 0}
    write_params(tmp_path / "params.yaml", p)
    with pytest.raises(ParamsError, match=r"reproducibility\.threads"):
        load_params(tmp_path / "params.yaml")
    p["reproducibility"] = {"mode": "fastest"}
    write_params(tmp_path / "params.yaml", p)
    with pytest.raises(ParamsError, match=r"reproducibility\.mode"):
        load_params(tmp_path / "params.yaml")


def test_portable_refuses_a_cpu_it_cannot_pin(monkeypatch):
    monkeypatch.setattr(rep.platform, "machine", lambda: "arm64")
    with pytest.raises(ValueError, match="needs an x86-64 CPU with AVX2 and FMA, but this CPU is arm64.*native"):
        rep.apply("portable", 2, environ={})
    assert rep.apply("native", 2, environ={}) == {}  # native runs anywhere


def test_portable_thread_count_reaches_the_stages(monkeypatch):
    """reproducibility.threads is the count common.configure_cpu_threads gives torch (sft, grpo); native: the
    process's share of the cores."""
    import torch

    from agentrl.common import configure_cpu_threads

    before = dict(rep.APPLIED), torch.get_num_threads()
    try:
        env: dict = {}
        rep.apply("portable", 3, environ=env)
        assert env["OMP_NUM_THREADS"] == "3" and configure_cpu_threads() == 3 == torch.get_num_threads()
        rep.apply("native", 3, environ=env)
        monkeypatch.setattr(os, "cpu_count", lambda: 5)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(5)), raising=False)
        assert configure_cpu_threads() == 5
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)  # taskset -c 3
        assert configure_cpu_threads() == 1
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
        assert configure_cpu_threads() == 2  # each of 2 processes: half the 4 cores it may use
    finally:
        rep.APPLIED.clear()
        rep.APPLIED.update(before[0])
        torch.set_num_threads(before[1])


STATE = "import agentrl, json, torch; from agentrl.reproducibility import state; print(json.dumps(state()))"


def _state(cwd, code=STATE, env=None):
    env = {**rep.unpinned_environ(), **(env or {})}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env)


def test_importing_agentrl_pins_the_kernels_before_torch_starts(tmp_path):
    """A stage process (`python -m agentrl.stages.<stage>`) imports the package first: params.yaml's mode is in effect
    in torch (ATen AVX2 kernels) and MKL (COMPATIBLE branch) whatever the environment asked for."""
    if rep.cpu_problem():
        pytest.skip(rep.cpu_problem())
    p = mini_params()
    p["reproducibility"] = {"mode": "portable", "threads": 3}
    write_params(tmp_path / "params.yaml", p)
    r = _state(tmp_path, env={"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO", "OMP_NUM_THREADS": "1"})
    s = json.loads(r.stdout)
    assert (s["aten_cpu_capability"], s["mkl_cbwr_branch"], s["threads"]) == ("AVX2", rep.MKL_CBWR_COMPATIBLE, 3)
    p["reproducibility"]["mode"] = "native"
    write_params(tmp_path / "params.yaml", p)
    s = json.loads(_state(tmp_path, env={"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}).stdout)
    assert (s["aten_cpu_capability"], s["threads"]) == ("DEFAULT", 1)  # native: the environment's choice


def test_a_stage_stops_when_torch_computed_before_the_kernels_were_pinned(tmp_path):
    """torch and MKL fix their kernels at their first computation: a process that computed before loading
    portable params cannot honour them, and load_params says so instead of training on other kernels."""
    if rep.cpu_problem():
        pytest.skip(rep.cpu_problem())
    p = mini_params()
    p["reproducibility"] = {"mode": "portable", "threads": 2}
    write_params(tmp_path / "params.yaml", p)
    code = (
        "import os, torch; os.chdir('elsewhere'); a = torch.randn(64, 64); (a @ a).sum()\n"
        "os.chdir('..'); from agentrl.config import load_params; load_params()"
    )
    (tmp_path / "elsewhere").mkdir()
    r = _state(tmp_path, code, env={"ATEN_CPU_CAPABILITY": "default"})
    assert r.returncode and "reproducibility.mode portable is not in effect: ATen kernels DEFAULT" in r.stderr, (
        r.stderr[-2000:]
    )


def _hashes(tmp_path, name, mode, cpu, stages):
    env, cpus = cpu
    return run_pipeline(tmp_path / name, golden_params(mode), stages=stages, env=env, cpus=cpus)["weights"]


@pytest.mark.parametrize(
    "stages",
    [
        pytest.param(("base",), id="base"),
        pytest.param(("base", "sft", "grpo"), id="base-sft-grpo", marks=pytest.mark.slow),
    ],
)
def test_two_kernel_dispatches_same_bytes_only_when_portable(tmp_path, stages):
    """This CPU's own dispatch and another one (ATen's plain kernels, MKL's COMPATIBLE branch, one core) give
    byte-identical weights under `portable`, and different ones under `native` (the setting is what makes them
    agree)."""
    if rep.cpu_problem():
        pytest.skip(rep.cpu_problem())
    portable = [_hashes(tmp_path, f"p{i}", "portable", cpu, stages) for i, cpu in enumerate((THIS_CPU, OTHER_CPU))]
    assert portable[0] == portable[1], portable
    native = [_hashes(tmp_path, f"n{i}", "native", cpu, stages) for i, cpu in enumerate((THIS_CPU, OTHER_CPU))]
    for stage in stages:
        assert native[0][stage] != native[1][stage], (stage, native)


COMPARE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "compare_locks.py")


def _compare(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, COMPARE, *args], capture_output=True, text=True, cwd=cwd)


def _lock(tmp_path, name, outs: dict) -> str:
    import yaml

    stages = {s: {"cmd": "x", "outs": [{"path": p, "md5": m} for p, m in o.items()]} for s, o in outs.items()}
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"schema": "2.0", "stages": stages}))
    return str(path)


def test_compare_locks_decides_on_the_models(tmp_path):
    """scripts/compare_locks.py (two machines' dvc.lock): exit 0 when every models/ output has the same md5, 1 when
    one differs or is missing; metrics and the model card that differ are listed but only decide with --all; a bad
    file is named."""
    a = _lock(
        tmp_path,
        "a.lock",
        {"sft": {"models/sft": "1.dir", "metrics/sft_train.json": "m1"}, "card": {"models/card": "c1.dir"}},
    )
    same = _lock(
        tmp_path,
        "b.lock",
        {"sft": {"models/sft": "1.dir", "metrics/sft_train.json": "m2"}, "card": {"models/card": "c2.dir"}},
    )
    other = _lock(tmp_path, "c.lock", {"sft": {"models/sft": "2.dir", "metrics/sft_train.json": "m1"}})
    missing = _lock(tmp_path, "d.lock", {"sft": {"metrics/sft_train.json": "m1"}})

    run = _compare
    r = run(a, same)
    assert r.returncode == 0 and "DIFFERENT  metrics/sft_train.json" in r.stdout and "1 of 1 model" in r.stdout
    assert "DIFFERENT  models/card" in r.stdout  # the card names its commit: listed, not a model
    assert run(a, same, "--all").returncode == 1
    r = run(a, other)
    assert r.returncode == 1 and "DIFFERENT  models/sft" in r.stdout, r.stdout
    r = run(a, missing)
    assert r.returncode == 1 and "only in A  models/sft" in r.stdout, r.stdout
    (tmp_path / "bad.lock").write_text("stages: [1, 2]\n")
    r = run(a, str(tmp_path / "bad.lock"))
    assert r.returncode and "bad.lock is not a dvc.lock" in r.stderr, r.stderr


def test_compare_locks_reads_an_experiments_lock(tmp_path):
    """`exp:NAME` reads dvc.lock from the DVC experiment's git ref (what `make repro-check` compares); an unknown
    name is an error naming it."""
    repo = tmp_path / "repo"
    repo.mkdir()
    lock = _lock(tmp_path, "a.lock", {"sft": {"models/sft": "1.dir"}})

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (repo / "dvc.lock").write_text(open(lock).read())
    git("add", "dvc.lock")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "exp")
    git("update-ref", "refs/exps/ab/cdef/repro-check", "HEAD")
    r = _compare("exp:repro-check", lock, cwd=repo)
    assert r.returncode == 0 and "same  models/sft" in r.stdout, r.stdout + r.stderr
    r = _compare("exp:nope", lock, cwd=repo)
    assert r.returncode and "no experiment named 'nope'" in r.stderr, r.stderr


def test_importing_agentrl_sets_a_short_openmp_spin_unless_the_user_set_one(tmp_path):
    """agentrl/__init__.py sets GOMP_SPINCOUNT (libgomp, torch's OpenMP on Linux, reads it when torch loads) before
    torch starts, so a stage's idle threads sleep soon instead of spinning on cores another process needs
    (`make bench-shared` measures the effect); a value in the environment is kept."""
    import os

    import agentrl

    code = "import os, agentrl, torch; print(os.environ['GOMP_SPINCOUNT'], torch.get_num_threads() >= 1)"
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.stdout.split() == [agentrl.SPIN_COUNT, "True"], run.stderr[-2000:]
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, "GOMP_SPINCOUNT": "77"},
                         capture_output=True, text=True)  # fmt: skip
    assert run.stdout.split() == ["77", "True"], run.stderr[-2000:]
