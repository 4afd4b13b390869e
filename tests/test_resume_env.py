"""Resuming is safe across launches (issue 19, items 1 and 8): the checkpoint fingerprint covers the launch
configuration (accelerate config contents, process count, launch settings, resolved precision), every
file of every input model and the stage's own code (its dvc.yaml deps, nothing else); a resumed run reports
its own segment's speed, its DVCLive curves hold every step, and a `make repro` checkout then trains under
ZeRO-2 / DDP from scratch instead of crashing."""

import contextlib
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from agentrl.experiments.scratch import copy_repo
from conftest import ROOT, accelerate_launch, mini_params, write_params
from test_resume_kill import write_checkpoint


def test_launch_environment_digest(workdir, monkeypatch):
    from agentrl.config import validate_params
    from agentrl.stages.training import run_environment_digest

    cfg = workdir / "configs/accelerate/single.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("distributed_type: NO\n")
    p = mini_params()
    p["distributed"]["accelerate_config"] = "configs/accelerate/single.yaml"
    params = validate_params(p)
    base = run_environment_digest(params)
    cfg.write_text("distributed_type: DEEPSPEED\n")  # same path, other contents
    assert run_environment_digest(params) != base
    cfg.write_text("distributed_type: NO\n")
    assert run_environment_digest(params) == base
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_environment_digest(params) != base
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert run_environment_digest(params) != base
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    for precision in ("fp32", "bf16"):  # the resolved precision counts, not the spelling
        p["model"]["precision"] = precision
        same = run_environment_digest(validate_params(p)) == base
        assert same == (precision == run_environment_digest(params)["precision"]), precision


def test_model_files_digest_covers_every_shard(tmp_path):
    from agentrl.common import model_files_digest

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    for i in (1, 2):
        (d / f"model-0000{i}-of-00002.safetensors").write_bytes(b"shard %d" % i)
    first = model_files_digest(d)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"shard 2, trained further")
    assert model_files_digest(d) != first
    (d / "pytorch_model.bin").write_bytes(b"x")
    assert model_files_digest(d) != first
    with pytest.raises(FileNotFoundError, match="nope: model directory not found"):
        model_files_digest(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no weight file"):
        model_files_digest(empty)


@pytest.mark.parametrize(
    ("stage", "not_a_dep", "dep"),
    [("sft", "agent/rewards.py", "data.py"), ("grpo", "serving/app.py", "agent/rewards.py")],
)
def test_checkpoint_resumes_after_edits_outside_the_stage_code_only(stage, not_a_dep, dep, tmp_path, monkeypatch):
    """The fingerprint's code is the stage's dvc.yaml deps under src/: editing another module (serving/app.py, or
    agent/rewards.py for sft) keeps a checkpoint resumable; editing one of its modules, or a file of a package
    directory it depends on (envs/), trains from the start. __pycache__ files do not count."""
    from agentrl.config import validate_params
    from agentrl.stages import training as skeleton

    repo = tmp_path / "repo"  # a copy of the code the fingerprint reads: edited here, not in the checkout
    shutil.copytree(ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    monkeypatch.setattr(skeleton, "REPO", repo)
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "checkpoints"
    args = SimpleNamespace(
        output_dir=str(ckpt), save_only_model=False, main_process_first=lambda **kw: contextlib.nullcontext()
    )
    params = validate_params(mini_params())

    def resumes_after(edit: str | None) -> bool:
        if edit:
            f = repo / "src/agentrl" / edit
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text((f.read_text() if f.exists() else "") + "\n# edited\n")
        return skeleton.resume_checkpoint(args, params, stage, "params and inputs") is not None

    def interrupted_run():  # a complete checkpoint of a run killed halfway, under the fingerprint written last
        write_checkpoint(ckpt, 2, max_steps=4)

    assert not resumes_after(None)  # nothing to resume yet; the fingerprint is written
    interrupted_run()
    assert resumes_after(None)
    assert resumes_after(not_a_dep)
    assert resumes_after("envs/__pycache__/countdown.cpython-311.pyc")
    assert not resumes_after(dep)  # the stale checkpoint is cleared, the new fingerprint written
    interrupted_run()
    assert resumes_after(None)
    assert not resumes_after("envs/countdown.py")


def _steps(tsv: Path) -> list[int]:
    lines = tsv.read_text().splitlines()
    col = lines[0].split("\t").index("step")
    return [int(ln.split("\t")[col]) for ln in lines[1:]]


def test_sft_resume_respects_launch_config_and_reports_its_own_segment(workdir):
    """1. a changed accelerate config (same path, other contents) trains from scratch, not from the old
    checkpoint; 2. a resumed run's seconds_per_step divides its time by the steps it ran, and its DVCLive
    loss curve holds every step of the run once."""
    from agentrl.config import load_params
    from agentrl.stages import base, prepare, sft

    cfg = workdir / "configs/accelerate/single.yaml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text((ROOT / "configs/accelerate/single.yaml").read_text())
    p = mini_params()
    p["distributed"]["accelerate_config"] = "configs/accelerate/single.yaml"
    write_params(workdir / "params.yaml", p)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    first = sft.train(params)
    assert first["resumed_from"] is None
    total = first["steps"]
    loss_tsv = workdir / "dvclive/sft/plots/metrics/loss.tsv"
    fresh_steps = _steps(loss_tsv)
    assert fresh_steps and fresh_steps[-1] <= total

    cfg.write_text(cfg.read_text() + "# another launch configuration\n")
    changed = sft.train(params)
    assert changed["resumed_from"] is None, "resumed a checkpoint written under another accelerate config"
    assert changed["steps"] == total

    ckpts = sorted((workdir / "checkpoints/sft").glob("checkpoint-*"), key=lambda d: int(d.name.split("-")[1]))
    assert len(ckpts) >= 2, ckpts
    shutil.rmtree(ckpts[-1])  # as if killed after the previous checkpoint
    resume_at = int(ckpts[-2].name.split("-")[1])
    (workdir / "metrics/sft_train.json").unlink()
    resumed = sft.train(params)
    assert resumed["resumed_from"] and resumed["resumed_from"].endswith(f"checkpoint-{resume_at}"), resumed
    assert resumed["steps"] == total and resumed["steps_this_run"] == total - resume_at
    assert resumed["seconds_per_step"] == pytest.approx(resumed["runtime_s"] / (total - resume_at), rel=0.01, abs=2e-4)
    assert _steps(loss_tsv) == fresh_steps, "the DVCLive loss curve lost the steps before the resume"


def _launch(config: str, module: str, cwd: Path) -> subprocess.CompletedProcess:
    nproc = 1 if config == "single.yaml" else 2
    return accelerate_launch(f"configs/accelerate/{config}", module, cwd, num_processes=nproc)


@pytest.mark.slow
@pytest.mark.distributed
def test_repro_then_zero2_and_ddp_train_from_scratch(workdir):
    """`make repro` (single process) followed by `make train-zero2 NPROC=2` and `make train-ddp NPROC=2` in the
    same checkout: each trains from scratch under its config (it crashed: DeepSpeed could not load the
    single-process checkpoint the old fingerprint let it "resume")."""
    from agentrl import common
    from agentrl.config import load_params
    from agentrl.stages import base, prepare

    copy_repo(ROOT, workdir, only=("configs",))
    p = mini_params()
    write_params(workdir / "params.yaml", p)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    for stage in ("sft", "grpo"):
        _launch("single.yaml", f"agentrl.stages.{stage}", workdir)
    for config in ("zero2.yaml", "ddp.yaml"):
        p["distributed"].update(accelerate_config=f"configs/accelerate/{config}", num_processes=2)
        write_params(workdir / "params.yaml", p)
        for stage in ("sft", "grpo"):
            _launch(config, f"agentrl.stages.{stage}", workdir)
            m = common.read_metrics(workdir / f"metrics/{stage}_train.json")
            assert m["resumed_from"] is None and m["num_processes"] == 2, (config, stage, m)
            assert m["distributed_type"] == ("DEEPSPEED" if config == "zero2.yaml" else "MULTI_CPU"), m
    assert yaml.safe_load((workdir / "params.yaml").read_text())["distributed"]["num_processes"] == 2
