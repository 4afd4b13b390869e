"""Multi-node training launched for real, with a params recipe applied: two `make train-multinode` processes
(machine ranks 0 and 1 of `--num_machines 2`, rank 0's address 127.0.0.1, configs/accelerate/multi_node.yaml:
DeepSpeed ZeRO-2), one process per "machine", in one checkout (a shared filesystem), each given
RECIPE="configs/recipes/qwen3-0.6b-gsm8k.yaml <stand-in overlay>" and STAGE="sft grpo". Every rank writes the
recipe into params.yaml (a no-op for the second), rank 0 runs `dvc repro prepare base`, then both run sft and
grpo (GRPO through the tool loop); the same stages under the 2-process single-machine ZeRO-2 launch
(configs/accelerate/zero2.yaml) on the same params, data and base model give the same curves.

There is no hub here, so the overlay replaces the recipe's hub model and data set with the project's own stand-ins
(`model.base_model: tiny`, built by `base`; `data.source: synthetic`), its bf16 and vLLM (CUDA only) with fp32 and
the project's rollouts, and its sizes and rewards with the miniature's: docs/scaling.md names these keys.

Both launches are two ranks of one DeepSpeed ZeRO-2 job over gloo with the same seeds, data order and per-rank
batches; only the rendezvous differs (two torchrun agents with --nnodes 2 instead of one with 2 processes), so
the per-step SFT loss and GRPO loss / reward / KL agree within float tolerance (in practice bit for bit).
The fast tests check the order of the cluster sequence (`make -n`, the SLURM script under stub srun/scontrol)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agentrl.serving.local import free_port
from conftest import MAKE, ROOT, TINY_DIMS, accelerate_launch, tool_env

RECIPE = "configs/recipes/qwen3-0.6b-gsm8k.yaml"
# the recipe's hub model and data set, bf16 and vLLM replaced by local, CPU stand-ins; its sizes by the miniature's
STAND_IN = {
    "model": {
        "base_model": "tiny",
        "precision": "fp32",
        "tiny": TINY_DIMS,
        "pretrain": {"num_arithmetic_facts": 200, "epochs": 1, "batch_size": 16},
    },
    "data": {"source": "synthetic", "synthetic": {"num_train": 200, "num_test": 24}},
    "distributed": {"accelerate_config": "configs/accelerate/zero2.yaml", "num_processes": 2},
    "sft": {
        "trainer": {
            "max_steps": 6,
            "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1,
            "save_steps": 3,
            "logging_steps": 1,
            "activation_checkpointing": False,
        }
    },
    "grpo": {
        "trainer": {
            "max_steps": 2,
            "per_device_train_batch_size": 8,
            "num_generations": 4,
            "max_completion_length": 16,
            "save_steps": 1,
            "logging_steps": 1,
            "use_vllm": False,
            "activation_checkpointing": False,
        },
        # length_penalty makes rewards differ inside a group while no answer is right yet: a non-zero advantage,
        # so GRPO's loss, reward and KL compared below are not all zero
        "rewards": {"accuracy": 1.0, "format": 0.1, "length_penalty": 1.0},
        "reward_kwargs": {"length_max": 8},
    },
    "tracking": {"report_to": ["tensorboard", "dvclive"]},
}
KEYS = {"sft": ("loss", "grad_norm", "learning_rate"), "grpo": ("loss", "reward", "kl", "tools/tool_use_rate")}


def curve(run: Path, stage: str) -> list[dict]:
    """Per-step log of the stage's last checkpoint (trainer_state.json): the keys of KEYS[stage] per step."""
    last = max((run / "checkpoints" / stage).glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    hist = json.loads((last / "trainer_state.json").read_text())["log_history"]
    rows = [{"step": h["step"], **{k: h[k] for k in KEYS[stage] if k in h}} for h in hist if "loss" in h]
    assert rows and all(set(KEYS[stage][:2]) <= set(r) for r in rows), (stage, hist)
    return rows


def multinode(run: Path, port: int, *make_vars: str, timeout_s: int = 1800) -> list[str]:
    """`make train-multinode` on two "machines" (machine ranks 0 and 1 at once, both in `run`), as each node of a
    real job runs it; the outputs of both (AssertionError with both tails when one fails)."""
    cmd = [*MAKE, "train-multinode", f"VENV={sys.prefix}", "NPROC=2", *make_vars]
    cmd += ["NUM_MACHINES=2", "MAIN_IP=127.0.0.1", f"MAIN_PORT={port}"]
    env = tool_env("offline", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(cmd + [f"MACHINE_RANK={r}"], cwd=run, env=env, stdout=subprocess.PIPE, text=True,
                         stderr=subprocess.STDOUT)
        for r in (0, 1)
    ]  # fmt: skip
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        tails = [f"machine rank {r} exited {p.returncode}:\n{o[-4000:]}" for r, (p, o) in enumerate(zip(procs, outs))]
        raise AssertionError("\n\n".join(tails))
    return outs


@pytest.mark.slow
@pytest.mark.distributed
def test_two_machine_ranks_run_the_recipe_like_two_processes_on_one_machine(copy_repo, tmp_path):
    from agentrl.common import read_metrics
    from agentrl.config import load_yaml
    from agentrl.experiments.overrides import get, leaves
    from agentrl.experiments.scratch import copy_repo as copy_code
    from agentrl.experiments.scratch import git_commit_all

    multi, single = copy_repo, tmp_path / "single"
    git_commit_all(multi, "a fresh clone")  # `recipe.py apply` refuses to overwrite uncommitted params edits
    overlay = tmp_path / "stand-in.yaml"
    overlay.write_text(yaml.safe_dump(STAND_IN))
    outs = multinode(multi, free_port(), f"RECIPE={RECIPE} {overlay}", "STAGE=sft grpo")

    applied = load_yaml(multi / "params.yaml")
    wanted = dict(leaves(load_yaml(ROOT / RECIPE))) | dict(leaves(STAND_IN))
    assert all(get(applied, k) == v for k, v in wanted.items()), [
        (k, v, get(applied, k)) for k, v in wanted.items() if get(applied, k) != v
    ]
    assert any(" -> " in out for out in outs), outs  # the changed keys printed
    lock = load_yaml(multi / "dvc.lock")["stages"]
    assert lock["prepare"]["params"]["params.yaml"]["data"]["system_prompt"] == applied["data"]["system_prompt"]
    assert lock["base"]["params"]["params.yaml"]["agent.format"] == "chat", lock["base"]  # the recipe's format

    # the single-machine launch on the same params, data and base model
    copy_code(ROOT, single)
    shutil.copy(multi / "params.yaml", single / "params.yaml")
    for d in ("data/prepared", "models/base"):
        shutil.copytree(multi / d, single / d, symlinks=True)
    for stage in ("sft", "grpo"):
        accelerate_launch(ROOT / "configs/accelerate/zero2.yaml", f"agentrl.stages.{stage}", single, num_processes=2)
        for run in (single, multi):
            m = read_metrics(run / f"metrics/{stage}_train.json")
            assert m["num_processes"] == 2 and m["distributed_type"] == "DEEPSPEED", (run, m)
        a, b = curve(single, stage), curve(multi, stage)
        assert [r["step"] for r in a] == [r["step"] for r in b], (a, b)
        signal = "reward" if stage == "grpo" else "loss"
        assert any(r[signal] != 0 for r in a), (stage, a)  # a curve that can disagree
        for ra, rb in zip(a, b):
            for k in ra:
                assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-7), (stage, k, a, b)
        print(f"{stage}: one machine x 2 processes {a}\n{stage}: 2 machine ranks x 1 process {b}")
    assert (multi / "models/grpo/adapter_config.json").exists()
    grpo = read_metrics(multi / "metrics/grpo_train.json")
    assert grpo["steps"] == STAND_IN["grpo"]["trainer"]["max_steps"], grpo


# ------------------------------------------------------------------ the cluster sequence's order (fast)
def dry_run(*make_vars: str) -> list[str]:
    """The command lines `make -n train-multinode` would run, one per line (continuations joined)."""
    r = subprocess.run([*MAKE, "-n", "train-multinode", *make_vars], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.replace("\\\n", " ").splitlines()


def test_rank_0_applies_the_recipe_and_prepares_before_it_launches():
    lines = dry_run(f"RECIPE={RECIPE} site.yaml", "STAGE=sft grpo", "MACHINE_RANK=0")
    assert lines[0] == f"python scripts/recipe.py apply {RECIPE} site.yaml", lines
    assert lines[1] == "python scripts/workspace_run.py dvc repro prepare base", lines  # refused when busy
    assert lines[2].startswith("for stage in sft grpo; do") and "--machine_rank 0" in lines[2], lines
    assert "-m agentrl.stages.$stage || exit 1" in lines[2], lines


def test_other_ranks_apply_the_recipe_and_only_launch():
    lines = dry_run(f"RECIPE={RECIPE}", "MACHINE_RANK=1")
    assert lines[0] == f"python scripts/recipe.py apply {RECIPE}" and "dvc repro" not in " ".join(lines), lines
    assert "for stage in sft;" in lines[1] and "--machine_rank 1" in lines[1], lines
    assert "recipe.py" not in " ".join(dry_run("MACHINE_RANK=1"))  # no RECIPE: params.yaml as it is


def test_slurm_script_prepares_once_on_one_node_before_the_stages(tmp_path):
    """scripts/slurm_multinode.sh under stub `srun`/`scontrol` that log their arguments: the recipe and
    `dvc repro prepare base` run as one-task steps (srun returns when a step ends: the barrier) before sft and
    grpo start on every node, and the job ends with dvc commit + repro."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "srun $*" >> {log}\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node-a; echo node-b\n")
    venv = tmp_path / "job" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "dvc").write_text(f'#!/bin/sh\necho "dvc $*" >> {log}\n')
    for f in (bin_dir / "srun", bin_dir / "scontrol", venv / "dvc"):
        f.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(tmp_path / "job"),
    }
    env |= {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "RECIPE": RECIPE}
    r = subprocess.run(["bash", str(ROOT / "scripts/slurm_multinode.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    calls = [" ".join(line.split()) for line in log.read_text().splitlines()]
    assert calls[0] == f"srun --nodes=1 --ntasks=1 .venv/bin/python scripts/recipe.py apply {RECIPE}", calls
    assert calls[1] == "srun --nodes=1 --ntasks=1 .venv/bin/dvc repro prepare base", calls
    for call, stage in zip(calls[2:4], ("sft", "grpo")):
        assert call.startswith("srun --ntasks-per-node=1 bash -c make train-multinode STAGE=" + stage), calls
        assert "NPROC=16 NUM_MACHINES=2 MACHINE_RANK=$SLURM_NODEID MAIN_IP=node-a" in call, calls
    assert calls[4:] == ["dvc commit -f sft grpo", "dvc repro"], calls
