"""A training stage killed midway resumes from its last checkpoint when re-run, to the same final weights."""

import os
import shutil
import subprocess
import sys

from agentrl.common import read_metrics
from conftest import mini_params, write_params
from test_resume_kill import final_weights, killed, run_stage, train_in_process


def test_sft_killed_midway_resumes(workdir):
    """SIGKILL in the training step after checkpoint-20 was saved (between saves); the re-run resumes from it and
    ends with the uninterrupted run's adapter bytes; a changed config then trains from the start."""
    from agentrl.config import load_params
    from agentrl.stages import base, prepare

    p = mini_params()
    p["sft"]["trainer"].update(max_steps=40, save_steps=20, logging_steps=20, per_device_train_batch_size=4)
    p["tracking"]["report_to"] = []
    write_params(workdir / "params.yaml", p)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    train_in_process("sft")
    uninterrupted = final_weights("sft", workdir)
    (workdir / "metrics/sft_train.json").unlink()
    shutil.rmtree(workdir / "checkpoints")
    shutil.rmtree(workdir / "models/sft")

    killed(run_stage("sft", workdir, {"kind": "between", "step": 20}), "kill after checkpoint-20")
    assert not (workdir / "metrics/sft_train.json").exists()
    assert not (workdir / "checkpoints/sft/checkpoint-40").exists()

    env = {**os.environ, "WANDB_MODE": "disabled"}
    r = subprocess.run(
        [sys.executable, "-m", "agentrl.stages.sft"], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_metrics(workdir / "metrics/sft_train.json")
    assert m["resumed_from"] and m["resumed_from"].endswith("checkpoint-20"), m
    assert m["steps"] == 40 and m["steps_this_run"] == 20, m
    assert "resuming from" in r.stderr
    assert final_weights("sft", workdir) == uninterrupted, "the resumed run ended with other weights"

    # a changed config does not resume the stale run
    p["sft"]["trainer"]["learning_rate"] = 1e-3
    p["sft"]["trainer"]["max_steps"] = 30
    write_params(workdir / "params.yaml", p)
    r = subprocess.run(
        [sys.executable, "-m", "agentrl.stages.sft"], cwd=workdir, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_metrics(workdir / "metrics/sft_train.json")["resumed_from"] is None
