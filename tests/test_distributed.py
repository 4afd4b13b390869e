"""Real 2-process runs through `accelerate launch` on CPU: DDP over gloo, DeepSpeed ZeRO-2 and ZeRO-3.

Each config runs the sft and grpo stage modules exactly as dvc.yaml does, then the adapter is loaded
and evaluated. Only rank 0 writes metrics and logs.
"""

import subprocess
from pathlib import Path

import pytest

from agentrl.common import read_metrics
from conftest import ROOT, accelerate_launch, mini_params, write_params

pytestmark = [pytest.mark.distributed]


def launch(config: str, module: str, cwd: Path) -> subprocess.CompletedProcess:
    return accelerate_launch(ROOT / "configs/accelerate" / config, module, cwd, num_processes=2)


@pytest.mark.parametrize("config", ["ddp.yaml", "zero2.yaml", "zero3.yaml"])
def test_two_process_sft_and_grpo(config, tmp_path, monkeypatch):
    from agentrl.config import load_params
    from agentrl.stages import base, prepare
    from agentrl.stages.evaluate import evaluate

    monkeypatch.chdir(tmp_path)
    p = mini_params()
    p["distributed"].update(accelerate_config=f"configs/accelerate/{config}", num_processes=2)
    p["sft"]["use_lora"] = True
    write_params(tmp_path / "params.yaml", p)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    # a stale checkpoint from another config: every rank must agree not to resume it (rank 0 clears it
    # before the others look; without that, a rank could try to load what rank 0 is deleting)
    stale = tmp_path / "checkpoints/sft/checkpoint-999"
    stale.mkdir(parents=True)
    (stale / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints/sft/fingerprint.txt").write_text("another-config\n")

    sft_run = launch(config, "agentrl.stages.sft", tmp_path)
    assert not stale.exists()
    grpo_run = launch(config, "agentrl.stages.grpo", tmp_path)

    for stage, run in (("sft", sft_run), ("grpo", grpo_run)):
        m = read_metrics(tmp_path / f"metrics/{stage}_train.json")
        assert m["steps"] >= 1
        # really distributed: one trainer over 2 processes (not 2 independent single-process runs)
        assert m["num_processes"] == 2, m
        assert m["distributed_type"] == ("MULTI_CPU" if config == "ddp.yaml" else "DEEPSPEED"), m
        assert (tmp_path / f"models/{stage}/adapter_config.json").exists()
        # one process logs the stage's INFO lines: no message twice (a second rank logging would repeat each)
        messages = [ln.split(f"[{stage}] INFO ", 1)[1] for ln in run.stderr.splitlines() if f"[{stage}] INFO " in ln]
        assert messages and len(messages) == len(set(messages)), run.stderr[-3000:]
        saved = [ln for ln in run.stderr.splitlines() if f"[{stage}] INFO" in ln and "saved models" in ln]
        assert len(saved) == 1, run.stderr[-3000:]
    sft_m = read_metrics(tmp_path / "metrics/sft_train.json")
    assert sft_m["effective_batch"] == 2 * p["sft"]["trainer"]["per_device_train_batch_size"]
    metrics = evaluate(params, "grpo")
    assert metrics["num_samples"] == p["data"]["synthetic"]["num_test"]
