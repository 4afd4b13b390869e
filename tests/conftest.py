"""Shared fixtures: a miniature configuration of the embedded default that trains in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")


# the tests' smallest Qwen3: one 32-wide layer (mini_params' model.tiny and tiny_lm's default)
TINY_DIMS = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


# --------------------------------------------------------------------- subprocesses of the project's tools
# `make <target>` as the tests run it: quiet, no "Entering directory" lines (under `make test` MAKELEVEL turns
# them on), set-up taken as done
MAKE = ["make", "-s", "--no-print-directory", "-o", "setup"]


def tool_env(wandb_mode: Optional[str] = "offline", **extra: str) -> dict:
    """The environment to run the project's tools in a subprocess: os.environ with this interpreter's bin/ first
    on PATH (dvc, accelerate), the git identity, WANDB_MODE (unchanged when None) and `extra`."""
    from agentrl.experiments.scratch import GIT_IDENTITY

    env = {**os.environ, **GIT_IDENTITY, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if wandb_mode is not None:
        env["WANDB_MODE"] = wandb_mode
    return {**env, **extra}


def accelerate_launch(
    config_file: str | Path, module: str, cwd: str | Path, num_processes: int = 2, timeout_s: int = 900
) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file F --num_processes N -m module` in `cwd`, with this interpreter's
    accelerate, W&B offline and one OpenMP thread per process; AssertionError with the output's tail on failure."""
    env = tool_env("offline", OMP_NUM_THREADS="1")
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config_file)]
    cmd += ["--num_processes", str(num_processes), "-m", module]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r


def raw_params() -> dict:
    from agentrl.config import load_yaml

    return load_yaml(ROOT / "params.yaml")  # the stages' strict reader (duplicate keys, 1e-6 as a number)


def mini_params() -> dict:
    """params.yaml shrunk to seconds: few problems, tiny model, a handful of steps."""
    p = raw_params()
    p["data"]["synthetic"].update(num_train=200, num_test=24)
    p["data"]["eval_max_samples"] = None
    p["model"]["tiny"].update(TINY_DIMS)
    p["model"]["pretrain"].update(num_arithmetic_facts=200, epochs=1, batch_size=16)
    p["sft"]["use_lora"] = True  # the tests exercise the LoRA path of both stages
    p["sft"]["trainer"].update(
        max_steps=6, per_device_train_batch_size=8, save_steps=3, logging_steps=1, learning_rate=5e-3
    )
    p["grpo"]["trainer"].update(
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        save_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
    )
    # length_penalty makes rewards differ inside a group even when no answer is right yet,
    # so a few GRPO steps have a non-zero advantage to learn from
    p["grpo"]["rewards"] = {"accuracy": 1.0, "format": 0.1, "length_penalty": 1.0}
    p["grpo"]["reward_kwargs"]["length_max"] = 8
    p["eval"].update(batch_size=8, max_new_tokens=16)
    p["export"].update(num_verify_prompts=2)
    p["tracking"]["report_to"] = ["tensorboard", "dvclive"]
    return p


def make_toolset(names, fmt, **kw):
    """A Toolset with params.yaml's agent knobs (max_tool_calls, max_expression_chars, tool_timeout_s) unless
    `kw` sets them (Toolset has no defaults of its own: params.yaml is where they live)."""
    from agentrl.agent.tools import Toolset

    agent = raw_params()["agent"]
    knobs = {
        "max_calls": agent["max_tool_calls"],
        "max_expression_chars": agent["max_expression_chars"],
        "timeout_s": agent["tool_timeout_s"],
    }
    return Toolset(names, fmt, **{**knobs, **kw})


def tiny_lm(texts: list[str], vocab_size: int, seed: int = 0, **model_params):
    """(tokenizer, model): the project's tiny Qwen3 builder at the tests' smallest size (one 32-wide layer
    unless `model_params` say otherwise), tokenizer trained on `texts`."""
    from agentrl.config import TinyModelParams
    from agentrl.modeling import build_tiny_model, train_tokenizer

    tok = train_tokenizer(texts, vocab_size)
    dims = {**raw_params()["model"]["tiny"], **TINY_DIMS, **model_params}  # params.yaml's, shrunk
    return tok, build_tiny_model(tok, TinyModelParams(**dims), seed)


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory holding a miniature params.yaml; stages write relative paths."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(mini_params()))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_params(path: Path, params: dict) -> None:
    path.write_text(yaml.safe_dump(params))


@pytest.fixture
def copy_repo(tmp_path):
    """A copy of the repository (code, configs, dvc.yaml, params; no outputs, no DVC cache), not a git repo yet."""
    from agentrl.experiments.scratch import copy_repo

    return copy_repo(ROOT, tmp_path / "repo")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny saved model + tokenizer the serving tests load (one per test module)."""

    d = tmp_path_factory.mktemp("served")
    texts = ["Tom has 3 apples. He buys 4 more apples. How many apples does Tom have now?", "3+4=7\n#### 7"] * 50
    tok, model = tiny_lm(texts, 320, max_position_embeddings=128)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d
