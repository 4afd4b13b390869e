"""Multi-node training launched for real: two `make train-multinode` processes (machine ranks 0 and 1 of
`--num_machines 2`, rank 0's address 127.0.0.1, configs/accelerate/multi_node.yaml: DeepSpeed ZeRO-2) run the sft
and grpo stages (GRPO through the tool loop) on the miniature params, one process per "machine"; the same stages
under the 2-process single-machine ZeRO-2 launch (configs/accelerate/zero2.yaml) give the same loss curve.

Both launches are two ranks of one DeepSpeed ZeRO-2 job over gloo with the same seeds, data order and per-rank
batches; only the rendezvous differs (two torchrun agents with --nnodes 2 instead of one with 2 processes), so
the per-step SFT loss and GRPO loss / reward / KL agree within float tolerance (in practice bit for bit)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.serving.local import free_port
from conftest import MAKE, ROOT, accelerate_launch, mini_params, tool_env, write_params

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

KEYS = {"sft": ("loss", "grad_norm", "learning_rate"), "grpo": ("loss", "reward", "kl", "tools/tool_use_rate")}


def curve(run: Path, stage: str) -> list[dict]:
    """Per-step log of the stage's last checkpoint (trainer_state.json): the keys of KEYS[stage] per step."""
    last = max((run / "checkpoints" / stage).glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    hist = json.loads((last / "trainer_state.json").read_text())["log_history"]
    rows = [{"step": h["step"], **{k: h[k] for k in KEYS[stage] if k in h}} for h in hist if "loss" in h]
    assert rows and all(set(KEYS[stage][:2]) <= set(r) for r in rows), (stage, hist)
    return rows


def multinode(run: Path, stage: str, port: int, timeout_s: int = 1200) -> list[str]:
    """`make train-multinode` on two "machines" (machine ranks 0 and 1 at once), as each node of a real job runs
    it; the outputs of both (AssertionError with both tails when one fails)."""
    cmd = [*MAKE, "train-multinode", f"VENV={sys.prefix}", f"STAGE={stage}", "NPROC=2"]
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


def test_two_machine_ranks_match_two_processes_on_one_machine(copy_repo, tmp_path, monkeypatch):
    from agentrl.common import read_metrics
    from agentrl.config import load_params
    from agentrl.stages import base, prepare

    single, multi = copy_repo, tmp_path / "multi"
    p = mini_params()
    p["distributed"].update(accelerate_config="configs/accelerate/zero2.yaml", num_processes=2)
    write_params(single / "params.yaml", p)
    monkeypatch.chdir(single)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    shutil.copytree(single, multi, symlinks=True)  # the same code, params, data and base model on both

    for stage in ("sft", "grpo"):
        accelerate_launch(ROOT / "configs/accelerate/zero2.yaml", f"agentrl.stages.{stage}", single, num_processes=2)
        multinode(multi, stage, free_port())
        for run in (single, multi):
            m = read_metrics(run / f"metrics/{stage}_train.json")
            assert m["num_processes"] == 2 and m["distributed_type"] == "DEEPSPEED", (run, m)
        a, b = curve(single, stage), curve(multi, stage)
        assert [r["step"] for r in a] == [r["step"] for r in b], (a, b)
        for ra, rb in zip(a, b):
            for k in ra:
                assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-7), (stage, k, a, b)
        print(f"{stage}: one machine x 2 processes {a}\n{stage}: 2 machine ranks x 1 process {b}")
    assert (multi / "models/grpo/adapter_config.json").exists()
    grpo = read_metrics(multi / "metrics/grpo_train.json")
    assert grpo["steps"] == p["grpo"]["trainer"]["max_steps"], grpo
