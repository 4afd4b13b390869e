"""What `make gpu-check` sets up and its helper rows (gpu_check.py runs them in its scratch copy as
`python -m agentrl.benchmarks.gpu_check --_stand-in DIR` and `--_tool-speed`): the check's params (the recipe on a
short local run), a randomly initialised Qwen3 of Qwen3-0.6B's dimensions (or a tiny one for --cpu-smoke) with the
project's tokenizer padded to its vocabulary, and the tool loop's tokens/s on the device. The sizes: "gpu" (`make
gpu-check`), "cpu" (--cpu-smoke: tiny model, the script's logic) and "rehearse" (--cpu-full-size, `make rehearse`:
the 0.6B-sized model in fp32 on the CPU, a few steps)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout: src/agentrl/benchmarks/gpu_check_setup.py
RECIPE = ROOT / "configs/recipes/qwen3-0.6b-gsm8k.yaml"

# Qwen/Qwen3-0.6B's config.json dimensions
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
)
SMOKE_MODEL = dict(
    vocab_size=1024,  # padded like the GPU model's, so the padding path runs here too
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10000.0,
)


# step counts and sizes: GPU (about 6-8 minutes on one H200 in all), the CPU smoke run and the CPU rehearsal at full
# size (sft_length: SFT's max_length; None: the recipe's)
SIZES = {
    "gpu": dict(
        num_train=2000,
        num_test=64,
        eval_n=64,
        eval_new=128,
        sft_steps=8,
        grpo_steps=3,
        gens=8,
        grpo_batch=16,
        completion=128,
        verify=4,
        sft_batch=None,
        sft_length=None,
        budget=570,
    ),
    "cpu": dict(
        num_train=120,
        num_test=8,
        eval_n=4,
        eval_new=8,
        sft_steps=2,
        grpo_steps=1,
        gens=2,
        grpo_batch=2,
        completion=8,
        verify=2,
        sft_batch=4,
        sft_length=None,
        budget=900,
    ),
    "rehearse": dict(
        num_train=200,
        num_test=8,
        eval_n=4,
        eval_new=32,
        sft_steps=2,
        grpo_steps=1,
        gens=2,
        grpo_batch=2,
        completion=32,
        verify=2,
        sft_batch=2,
        sft_length=None,
        budget=5400,
    ),
}


# ------------------------------------------------------------------------------------------ params
def check_params(size: str, stand_in: str) -> dict:
    """params.yaml + the recipe (applied as `scripts/recipe.py` applies it: DVC's `-S` code) + the local, short-run
    overrides of the check.

    Args:
        size: a SIZES key; "cpu" and "rehearse" run in fp32, "cpu" without activation checkpointing.
        stand_in: the stand-in model's directory (model.base_model).

    Returns:
        The params tree the scratch copy's params.yaml is written from.
    """
    from agentrl.experiments import overrides
    from agentrl.experiments.recipe import overrides as recipe_args

    s, cpu = SIZES[size], size != "gpu"
    p = overrides.load(overrides.apply((ROOT / "params.yaml").read_text(), recipe_args(RECIPE)))
    over = {
        "data.source": "synthetic",
        "data.max_samples": None,
        "data.eval_max_samples": s["eval_n"],
        "data.synthetic.num_train": s["num_train"],
        "data.synthetic.num_test": s["num_test"],
        "model.base_model": stand_in,
        "model.revision": "main",
        "model.precision": "fp32" if cpu else "bf16",
        "model.attn_implementation": "sdpa",
        "distributed.accelerate_config": "configs/accelerate/single.yaml",
        "distributed.num_processes": 1,
        "distributed.scale_lr": "none",
        "tracking.report_to": [],
        "tracking.wandb_mode": "disabled",
        "sft.trainer.max_steps": s["sft_steps"],
        "sft.trainer.logging_steps": 1,
        "sft.trainer.save_steps": 1000,
        "grpo.trainer.max_steps": s["grpo_steps"],
        "grpo.trainer.num_generations": s["gens"],
        "grpo.trainer.per_device_train_batch_size": s["grpo_batch"],
        "grpo.trainer.gradient_accumulation_steps": 1,
        "grpo.trainer.max_completion_length": s["completion"],
        "grpo.trainer.logging_steps": 1,
        "grpo.trainer.save_steps": 1000,
        "grpo.trainer.use_vllm": False,  # vLLM is its own row
        "eval.batch_size": 64,
        "eval.max_new_tokens": s["eval_new"],
        "export.quantize": "int8",
        "export.num_verify_prompts": s["verify"],
    }
    if size == "cpu":  # activation checkpointing only costs time on the tiny model
        over["sft.trainer.activation_checkpointing"] = False
        over["grpo.trainer.activation_checkpointing"] = False
    if s["sft_batch"]:  # a smaller SFT batch on the CPU
        over["sft.trainer.per_device_train_batch_size"] = s["sft_batch"]
        over["sft.trainer.gradient_accumulation_steps"] = 1
    if s["sft_length"]:
        over["sft.trainer.max_length"] = s["sft_length"]
    for k, v in over.items():
        overrides.set_value(p, k, v)
    return p


def pad_vocab(tok, size: int):
    """The tokenizer with filler tokens appended to its BPE vocabulary up to `size` entries: the encoder never
    produces them (no merge leads there) but every id a random model samples decodes.

    Args:
        tok: a fast tokenizer (the project's, modeling.train_tokenizer's).

    Returns:
        A new tokenizer (modeling.wrap_tokenizer) with `<filler_i>` tokens after the existing ids.
    """
    from tokenizers import Tokenizer

    from agentrl.modeling import wrap_tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    nxt = max(max(vocab.values()), *(t["id"] for t in spec["added_tokens"])) + 1
    i = 0
    while nxt < size:
        name = f"<filler_{i}>"
        i += 1
        if name not in vocab:
            vocab[name] = nxt
            nxt += 1
    return wrap_tokenizer(Tokenizer.from_str(json.dumps(spec)))


def _stand_in_tokenizer(params, rows: list[dict], vocab_size: int):
    """The project's tokenizer trained on the prepared SFT rows (prompts and completions, chat calls rendered as
    the chat format writes them), padded to `vocab_size`, with Qwen3's template in the chat format (as
    base.build_tiny: it renders tool calls and tool turns).

    Args:
        rows: data/prepared/sft_train.jsonl's rows.
    """
    from agentrl.agent.tools import split_annotated
    from agentrl.modeling import train_tokenizer

    completions = [r["completion"][0]["content"] for r in rows]
    chat = bool(params.agent.tools) and params.agent.format == "chat"
    if chat:
        completions = ["".join(seg for seg, _ in split_annotated(c, "chat")) for c in completions]
    texts = [m["content"] for r in rows for m in r["prompt"]] + completions
    tok = pad_vocab(train_tokenizer(texts, 512), vocab_size)
    if chat:
        from trl.chat_template_utils import qwen3_chat_template

        tok.chat_template = qwen3_chat_template
    return tok


def build_stand_in(out: str, size: str) -> dict:
    """A randomly initialised Qwen3 (QWEN3_0_6B dimensions, or SMOKE_MODEL) + the project's tokenizer trained on
    the prepared data, saved like a hub snapshot. Run from the scratch copy after `prepare`.

    Args:
        size: a SIZES key: "gpu" the 0.6B-sized model in bf16, "rehearse" in fp32, "cpu" the tiny SMOKE_MODEL
            in fp32.

    Returns:
        {"parameters", "vocab_size", "mean_sft_tokens"} (mean tokens of 200 SFT examples, capped at max_length),
        "longest_sft_tokens" (capped likewise), "longest_prompt_tokens" (their prompt part, chat template and tool
        description, which GRPO's prompts share), "model_dims" (measure.model_dims) and "matmul_peak"
        (measure.matmul_peak: a bf16 8192x8192 GEMM on the GPU, an fp32 one of 512 or, at full size, 2048 on the
        CPU), for the rows' MFU and the memory plan.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentrl.agent.loop import sft_features
    from agentrl.agent.tools import toolset_from_params
    from agentrl.config import load_params
    from agentrl.data import load_jsonl

    from .measure import matmul_peak, model_dims

    params = load_params()
    cpu = size != "gpu"
    dims = dict(SMOKE_MODEL if size == "cpu" else QWEN3_0_6B)
    rows = load_jsonl("data/prepared/sft_train.jsonl")
    tok = _stand_in_tokenizer(params, rows, dims.pop("vocab_size"))
    dtype = torch.float32 if cpu else torch.bfloat16
    cfg = Qwen3Config(
        vocab_size=len(tok),
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **dims,
    )
    torch.manual_seed(params.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    # the lengths the stages train on: SFT's examples as its dataset renders them (chat template, the tool
    # description, the tool loop's segments), and their prompt part, which GRPO's prompts share
    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    feats = [sft_features(tok, r["prompt"], r["completion"][0]["content"], toolset, r) for r in rows[:200]]
    lengths = [len(f["input_ids"]) for f in feats]
    prompt_lengths = [
        f["completion_mask"].index(1) if 1 in f["completion_mask"] else len(f["completion_mask"]) for f in feats
    ]
    max_len = params.sft.trainer.get("max_length", 1024) or 1024
    gemm = {"gpu": 8192, "rehearse": 2048, "cpu": 512}[size]
    peak = matmul_peak(dtype, size=gemm, device="cpu" if cpu else "cuda")
    return {
        "parameters": n_params,
        "vocab_size": len(tok),
        "mean_sft_tokens": sum(min(n, max_len) for n in lengths) / len(lengths),
        "longest_sft_tokens": min(max(lengths), max_len),
        "longest_prompt_tokens": max(prompt_lengths),
        "model_dims": model_dims(cfg, "the stand-in's Qwen3Config"),
        "matmul_peak": peak,
    }


def tool_speed(n: int) -> dict:
    """bench's tool_loop_speed on the device (decoding.tool_loop_vs_plain): tokens/s of agent.generate_with_tools
    (the GRPO policy, params.agent's tools) against one plain `model.generate` per batch on the same prompts,
    greedy. Run from the scratch copy after the grpo row.
    """
    import torch

    from agentrl.agent.tools import toolset_from_params
    from agentrl.common import torch_dtype
    from agentrl.config import load_params
    from agentrl.data import load_jsonl
    from agentrl.modeling import load_policy

    from .decoding import tool_loop_vs_plain

    params = load_params()
    model, tok = load_policy("grpo", dtype=torch_dtype(params.model.precision))
    if torch.cuda.is_available():
        model = model.cuda()
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    kw = toolset.chat_template_kwargs() if toolset else None
    prompts = [r["prompt"] for r in load_jsonl("data/prepared/test.jsonl")[:n]]
    return tool_loop_vs_plain(model, tok, prompts, toolset, params.eval.max_new_tokens, params.eval.batch_size, kw)


def size_of(args) -> str:
    """The SIZES key the flags ask for.

    Args:
        args: the parsed flags (cpu_smoke, cpu_full_size).

    Returns:
        "cpu", "rehearse" or "gpu".
    """
    return "cpu" if args.cpu_smoke else "rehearse" if args.cpu_full_size else "gpu"


def helper_row(args) -> None:
    """Run a helper row in the scratch copy (the working directory): the stand-in model or the tool loop's speed,
    its figures written to metrics/gpu_check_stand_in.json or metrics/gpu_check_tool_speed.json.

    Args:
        args: the parsed flags (stand_in or tool_speed set).
    """
    from agentrl.common import write_json

    size = size_of(args)
    if args.stand_in:
        write_json("metrics/gpu_check_stand_in.json", build_stand_in(args.stand_in, size))
    else:
        n = SIZES[size]["eval_n"]
        write_json("metrics/gpu_check_tool_speed.json", tool_speed(n))
