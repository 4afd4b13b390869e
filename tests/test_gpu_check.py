"""scripts/gpu_check.py (agentrl.benchmarks.gpu_check): it refuses without a CUDA device, and its --cpu-smoke mode
runs the whole sequence (recipe params on a local random stand-in model, LoRA SFT and GRPO-LoRA through the stage
modules, evaluation, export, int8 evaluation, the tool loop's speed) on the CPU, every row in one table, none
failed."""

import json
import os
import subprocess
import sys

import pytest

from agentrl.benchmarks.gpu_check_setup import pad_vocab
from conftest import ROOT, mini_params

SCRIPT = ROOT / "scripts" / "gpu_check.py"
ROWS_OK = [
    "baseline: interpreter + libraries",
    "recipe: prepare (synthetic)",
    "recipe: stand-in model (random, local dir)",
    "recipe: base (local dir, fp32, sdpa)",
    "recipe: sft LoRA (single)",
    "recipe: grpo LoRA (single)",
    "recipe: eval grpo (tool loop)",
    "export: merge + verify",
    "int8: eval merged + int8",
    "tool loop: generate_with_tools vs generate",
    "zero2: sft LoRA",
    "zero2: grpo LoRA",
    "zero3: sft LoRA",
    "zero3: grpo LoRA",
]
TRAINING_ROWS = [p for p in ROWS_OK if "sft LoRA" in p or "grpo LoRA" in p]
ROWS_CUDA_ONLY = ["vllm: grpo LoRA colocate"]


def test_local_dir_base_model_loads_offline_in_target_dtype(workdir, tiny_model_dir, monkeypatch):
    """`model.base_model` as a local directory (the check's stand-in): base loads it without any hub lookup, in
    model.precision's dtype, and records a digest of the directory instead of a hub commit."""
    import huggingface_hub

    from agentrl.config import validate_params
    from agentrl.stages import base

    def no_hub(*a, **k):
        raise AssertionError("hub lookup for a local directory")

    monkeypatch.setattr(huggingface_hub, "model_info", no_hub)
    p = mini_params()
    p["model"].update(base_model=str(tiny_model_dir), precision="bf16", attn_implementation="eager")
    info = base.from_hub(validate_params(p))
    assert info["resolved_commit"].startswith("local:")
    saved = json.loads((workdir / "models/base/config.json").read_text())
    assert saved["dtype"] == "bfloat16"  # loaded as bf16 and saved so, not fp32


def test_padded_tokenizer_decodes_every_id():
    """The stand-in's tokenizer is padded to the model's vocabulary: encoding is unchanged, every id decodes."""
    from agentrl.modeling import train_tokenizer

    tok = train_tokenizer(["Tom has 3 apples. 3+4=7 #### 7"] * 20, 300)
    padded = pad_vocab(tok, 1000)
    assert len(padded) == 1000
    text = "Tom has 3 apples. 3+4=7"
    assert padded(text)["input_ids"] == tok(text)["input_ids"]
    added = list(range(len(tok), 1000))
    assert padded.convert_ids_to_tokens(added) == [f"<filler_{i}>" for i in range(len(added))]
    assert all(padded.decode([i]) for i in added)  # an id outside the vocabulary decodes to "" without a word
    assert padded.decode(list(range(len(tok)))) == tok.decode(list(range(len(tok))))


def _env():
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def test_refuses_without_cuda(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no CUDA device" in r.stderr and "--cpu-smoke" in r.stderr
    assert not (tmp_path / "gpu_check.md").exists()


@pytest.mark.slow
def test_cpu_smoke_runs_every_row(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = {row["path"]: row for row in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]}
    assert set(rows) == set(ROWS_OK + ROWS_CUDA_ONLY)
    assert not [p for p, row in rows.items() if row["status"] == "fail"]
    for p in ROWS_OK:
        assert rows[p]["status"] == "ok", rows[p]
        assert rows[p]["seconds"] > 0
    for p in ROWS_CUDA_ONLY:
        assert rows[p]["status"] == "skipped" and "CUDA-only" in rows[p]["note"]
    for p in ("recipe: sft LoRA (single)", "recipe: grpo LoRA (single)", "tool loop: generate_with_tools vs generate"):
        assert rows[p]["tokens_per_s"] > 0, rows[p]
    # every row ran in processes the kernel measured; the ZeRO rows ran 2 of them; each training row has its plan
    baseline = rows["baseline: interpreter + libraries"]["peak_rss_bytes"]
    assert all(rows[p]["peak_rss_bytes"] > 0 for p in ROWS_OK)
    for p in TRAINING_ROWS:
        assert rows[p]["peak_rss_bytes"] > baseline, rows[p]  # a model and a trainer on top of the libraries
        measured = rows[p]["peak_rss_bytes"] - baseline
        assert rows[p]["plan_error"] == pytest.approx((rows[p]["plan_bytes"] - measured) / measured)
        assert "memory plan" in rows[p]["note"]
    for p in TRAINING_ROWS[2:]:
        assert "DEEPSPEED, 2 process(es)" in rows[p]["note"], rows[p]
    table = (tmp_path / "gpu_check.md").read_text()
    assert table in r.stdout  # the same table on stdout
    assert "Memory plan (make memory-plan, device cpu)" in table and "CPU: " in table
    lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
    assert lines[0] == "| path | status | seconds | tokens/s | peak RSS GiB | note |"
    assert all(ln.count("|") == 7 for ln in lines), "a note broke the table"
    assert "| fail |" not in table
    assert (tmp_path / "logs.tar.gz").is_file()
    assert "tiny-random" not in (ROOT / "params.yaml").read_text()  # the scratch copy's params, never the repository's


def test_baked_chat_template_kwargs_keep_trl_tool_loop_working():
    """Found by the check: model.chat_template_kwargs (the recipe's enable_thinking: false) baked in front of
    Qwen3's template hid it from TRL's tool loop, and GRPOTrainer(tools=...) refused the template. grpo picks the
    parser and the training template on the unbaked text, then puts the tokenizer's own template back."""
    from trl.chat_template_utils import get_training_chat_template, qwen3_chat_template

    from agentrl.modeling import bake_chat_template_kwargs, train_tokenizer
    from agentrl.stages.grpo import baked_tool_template

    tok = train_tokenizer(["Tom has 3 apples. 3+4=7 #### 7"] * 20, 300)
    tok.chat_template = qwen3_chat_template
    bake_chat_template_kwargs(tok, {"enable_thinking": False})
    baked = tok.chat_template
    finish = baked_tool_template(tok)
    assert finish is not None
    assert getattr(tok, "response_template", None) is not None or getattr(tok, "response_schema", None) is not None
    assert get_training_chat_template(tok) is None  # what GRPOTrainer checks while it is built: nothing to patch

    class Trainer:
        chat_template = None

    t = Trainer()
    finish(t)
    assert tok.chat_template == baked  # saved with the result unchanged
    assert t.chat_template.startswith("{%- set enable_thinking = false %}") and "generation" in t.chat_template
    msgs = [{"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False, chat_template=t.chat_template
    )
