"""A training stage killed midway resumes from its last checkpoint when re-run."""

import os
import signal
import subprocess
import sys
import time

from agentrl.common import read_metrics
from conftest import mini_params, write_params


def test_sft_killed_midway_resumes(workdir):
    from agentrl import base, prepare
    from agentrl.config import load_params

    p = mini_params()
    p["sft"]["trainer"].update(max_steps=400, save_steps=20, logging_steps=20, per_device_train_batch_size=4)
    p["tracking"]["report_to"] = []
    write_params(workdir / "params.yaml", p)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.sft"],
        cwd=workdir,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    ckpt = workdir / "checkpoints/sft"
    while time.time() < deadline and proc.poll() is None:
        done = [d for d in ckpt.glob("checkpoint-*") if (d / "trainer_state.json").exists()]
        if done:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; raise max_steps"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (workdir / "metrics/sft_train.json").exists()
    killed_at = max(int(d.name.split("-")[1]) for d in ckpt.glob("checkpoint-*") if (d / "trainer_state.json").exists())
    assert killed_at < 400

    r = subprocess.run([sys.executable, "-m", "agentrl.sft"], cwd=workdir, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_metrics(workdir / "metrics/sft_train.json")
    assert m["resumed_from"], "the re-run did not resume"
    assert int(m["resumed_from"].rsplit("-", 1)[1]) >= killed_at
    assert m["steps"] == 400
    assert "resuming from" in r.stderr

    # a changed config does not resume the stale run
    p["sft"]["trainer"]["learning_rate"] = 1e-3
    p["sft"]["trainer"]["max_steps"] = 30
    write_params(workdir / "params.yaml", p)
    r = subprocess.run([sys.executable, "-m", "agentrl.sft"], cwd=workdir, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_metrics(workdir / "metrics/sft_train.json")["resumed_from"] is None
