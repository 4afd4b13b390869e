#!/usr/bin/env python
"""`make bench`: performance measured side by side, as ratios, in one run on one machine.

Writes BENCHMARKS.md (table + how each figure was obtained) and metrics/bench.json. Each figure is the
median of --repeats runs (default 3) with min and max; the pipeline timings (full repro, GRPO-only
change) of --repro-repeats runs, made in a scratch copy of the repository so the workspace is untouched.
Needs a finished `dvc repro` (models/base, models/sft, models/grpo, data/prepared). Goals (reported,
never asserted): SFT ratio <= 1.25 (each trainer step paired with a plain PyTorch step on the same
batch), eval speed-up >= 10 (batched vs one problem at a time, on the SFT and GRPO models), no-op repro
<= 5 s, full repro <= 900 s.

    python scripts/bench.py [--repeats 3] [--repro-repeats 3] [--skip-dvc]
    python scripts/bench.py --merged-rollouts 8    # what grpo.merged_rollouts saves (8 steps per side)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from agentrl.common import peak_rss_mb, write_json
from agentrl.config import load_params
from agentrl.data import load_jsonl
from agentrl.experiments.scratch import copy_repo, git_commit_all, set_param

STEPS = 40
EVAL_STAGES = ("sft", "grpo")  # base runs every completion to eval.max_new_tokens: not the hard case
LOOP_ROUNDS = 3  # loop/plain pairs per tool_loop_vs_plain run
LOOP_GOAL = 1.3  # issue 29: the loop at least this many times plain batched generate's tokens/s
CHAT_STEPS, CHAT_WARMUP = 4, 1  # chat-format GRPO steps per trainer, the first left out (~25 s each on 2 cores)


def machine() -> str:
    """The CPU model (from /proc/cpuinfo where there is one: kernels and timings depend on it), cores, torch."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        field = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in text.split("\n\n")[0].splitlines())}
        flags = field.get("flags", "").split()
        isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), "no AVX2")
        cpu = f"{field['model name']} (family {field.get('cpu family')} model {field.get('model')}, {isa})"
    except (OSError, KeyError):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def sync(model) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a timer reads what it ran."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def tool_loop_vs_plain(
    model, tok, prompts: list, toolset, max_new: int, batch_size: int, template_kwargs=None, rounds: int = LOOP_ROUNDS
) -> dict:
    """Generated tokens/s of the tool loop (agent.generate_with_tools) against one plain `model.generate` per
    batch on the same prompts and batch size (no tool runs there: the model writes every result itself), greedy,
    after a short warm-up. The two alternate for `rounds` rounds, and the ratio is the median of the rounds' paired
    ratios (loop then plain, back to back), so a change of the machine's speed between the two lands on both.
    Tokens are counted up to and including eos; the loop's count includes the tool results it inserts, which it
    does not sample (`loop_sampled_tokens_per_second` leaves them out)."""
    import torch

    from agentrl.agent.loop import generate_with_tools

    kw = template_kwargs or {}
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw) for p in prompts]

    def loop() -> tuple[float, list]:
        sync(model)
        t = time.perf_counter()
        rolls = [
            r[0]
            for r in generate_with_tools(model, tok, prompts, toolset, max_new, batch_size, chat_template_kwargs=kw)
        ]
        sync(model)
        return time.perf_counter() - t, rolls

    def plain() -> tuple[float, int]:
        tok.padding_side = "left"
        n, t = 0, time.perf_counter()
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
                    n += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        sync(model)
        return time.perf_counter() - t, n

    generate_with_tools(model, tok, prompts[:2], toolset, 4, batch_size=batch_size, chat_template_kwargs=kw)
    loop_s, plain_s, ratios = [], [], []
    for _ in range(rounds):
        s, rolls = loop()
        p, plain_tokens = plain()
        loop_s.append(s)
        plain_s.append(p)
        loop_tokens = sum(r.num_tokens for r in rolls)  # greedy: the same rolls every round
        ratios.append((loop_tokens / s) / (plain_tokens / p))
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
    }


@torch.inference_mode()
def bare_greedy_decode(model, input_ids, attention_mask, n: int) -> torch.Tensor:
    """`n` new token ids per row (batch x n) of a left-padded batch: one prefill, then one forward per token with
    the KV cache and an argmax; positions from the attention mask, as `generate` computes them. Nothing stops early."""
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
    batches of `batch_size` (no stopping, no tool, no sampling logic). Tokens/s over every token generated, after a
    short warm-up."""
    kw = template_kwargs or {}
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw) for p in prompts]

    def decode(batch: list[str], n: int) -> torch.Tensor:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        return bare_greedy_decode(model, enc["input_ids"], enc["attention_mask"], n)

    decode(texts[:2], 4)
    sync(model)
    t = time.perf_counter()
    tokens = sum(decode(texts[i : i + batch_size], max_new).numel() for i in range(0, len(texts), batch_size))
    sync(model)
    seconds = time.perf_counter() - t
    return {"tokens_per_second": tokens / seconds, "tokens": tokens, "seconds": seconds}


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


def sft_step_times(params, trl_defaults: bool) -> dict:
    """Seconds per optimizer step of SFTTrainer, each paired with a plain PyTorch step on the same batch.

    The trainer's step is the wall time from the end of one step to the end of the next (data loading,
    collation, forward/backward, clipping, optimizer and scheduler, logging: everything it does per step),
    less the plain step run in between. The plain step runs forward (HF loss on the collated labels),
    backward, clip, fused AdamW on a second copy of the same model, right after the trainer's step on the
    same collated batch, so both see the same sequence lengths and the same machine state. Medians of steps
    6..STEPS (warm-up excluded).
    """
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from agentrl.modeling import STAGE_DIRS, load_model, load_tokenizer
    from agentrl.stages import sft
    from agentrl.stages import training as stage

    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"
    bs = params.sft.trainer["per_device_train_batch_size"]
    ds = load_dataset("json", data_files=sft.DATA, split="train").select(range(bs * STEPS))
    plain = load_model(STAGE_DIRS["base"])
    if params.sft.use_lora:
        from peft import get_peft_model

        plain = get_peft_model(plain, stage.peft_config(params, "sft"))
    plain.train()
    opt = torch.optim.AdamW(
        [p for p in plain.parameters() if p.requires_grad], lr=stage.learning_rate(params, "sft"), fused=True
    )
    batches: list[dict] = []
    trainer_s: list[float] = []
    plain_s: list[float] = []

    def plain_step(micro_batches: list[dict]) -> float:
        t = time.perf_counter()
        for b in micro_batches:
            (
                plain(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
                / len(micro_batches)
            ).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), params.sft.trainer["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    class Paired(TrainerCallback):
        last, used = None, 0  # end of the previous step; collated batches already paired

        def on_step_begin(self, *a, **k):
            if self.last is None:  # first step: from its start
                self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            trainer_s.append(time.perf_counter() - self.last)
            plain_s.append(plain_step(batches[self.used :]))
            self.used = len(batches)
            self.last = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        if trl_defaults:  # what a plain TRL script gets: library defaults except batch/steps
            args = SFTConfig(
                output_dir=tmp,
                per_device_train_batch_size=bs,
                max_steps=STEPS,
                report_to="none",
                save_strategy="no",
                use_cpu=not torch.cuda.is_available(),
            )  # bf16: TRL's default
        else:
            args = sft.sft_config(params, output_dir=tmp, report_to="none")
            args.max_steps, args.save_strategy = STEPS, "no"
        trainer = SFTTrainer(
            model=load_model(STAGE_DIRS["base"]),
            args=args,
            train_dataset=ds,
            processing_class=tok,
            peft_config=stage.peft_config(params, "sft"),
            callbacks=[Paired()],
        )
        collate = trainer.data_collator

        def recording_collator(examples):
            batch = collate(examples)
            batches.append({k: v.clone() for k, v in batch.items()})
            return batch

        trainer.data_collator = recording_collator
        trainer.train()
    k = 5
    return {
        "trainer": statistics.median(trainer_s[k:]),
        "plain_loop": statistics.median(plain_s[k:]),
        "paired_ratio": statistics.median(t / p for t, p in zip(trainer_s[k:], plain_s[k:])),
    }


def eval_speed(params, n: int, stage: str) -> dict:
    """Problems/s of the evaluation's generate on `stage`'s model: batched (eval.batch_size) vs one at a time."""
    from agentrl.agent.tools import toolset_from_params
    from agentrl.modeling import load_policy
    from agentrl.stages.evaluate import generate, score

    model, tok = load_policy(stage)
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token)
    rows = load_jsonl("data/prepared/test.jsonl")[:n]
    prompts = [r["prompt"] for r in rows]
    out = {}
    for name, bs in (("batched", params.eval.batch_size), ("per_sample", 1)):
        t = time.perf_counter()
        samples = generate(model, tok, prompts, bs, params.eval.max_new_tokens, desc=f"{stage} {name}", toolset=toolset)
        dt = time.perf_counter() - t
        m, _ = score(rows, samples, {"accuracy": 1.0}, {})
        out[name] = {
            "problems_per_second": n / dt,
            "accuracy": m["accuracy"],
            "mean_completion_tokens": m["mean_completion_tokens"],
        }
    return out


def grpo_step_stats(params, steps: int = 12, alternate_merged: bool = False) -> dict:
    """A short GRPOTrainer run with params.yaml's grpo config: seconds per optimizer step, share of it
    spent generating, rollout tokens/s (steps 3..steps; nothing written to the workspace). `alternate_merged`:
    the rollouts of odd steps sample from the LoRA merged into a plain copy (grpo.merged_rollouts), of even
    steps from the PEFT model, and the figures come per side (`merged`, `adapter`)."""
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from agentrl.agent.rewards import build_rewards
    from agentrl.modeling import STAGE_DIRS, load_tokenizer
    from agentrl.stages import grpo
    from agentrl.stages import training as stage

    g = params.grpo
    funcs, _ = build_rewards(g.rewards, g.reward_kwargs.model_dump())
    ds = load_dataset("json", data_files=grpo.DATA, split="train")
    step_t: list[float] = []
    gen_per_step: list[float] = []
    tokens_per_step: list[int] = []
    merged_steps: list[bool] = []

    class Timer(TrainerCallback):
        rollout = None  # grpo.ToolRollout, which times itself

        def on_step_begin(self, args, state, control, **k):
            if alternate_merged:
                self.rollout.merged = state.global_step % 2 == 1
            self.t, self.g, self.n = time.perf_counter(), self.rollout.seconds, self.rollout.tokens

        def on_step_end(self, *a, **k):
            step_t.append(time.perf_counter() - self.t)
            gen_per_step.append(self.rollout.seconds - self.g)
            tokens_per_step.append(self.rollout.tokens - self.n)
            merged_steps.append(self.rollout.merged)

    with tempfile.TemporaryDirectory() as tmp:
        args = grpo.grpo_config(params, output_dir=tmp, report_to="none")
        args.max_steps, args.save_strategy, args.logging_steps = steps, "no", 1
        tok = load_tokenizer(STAGE_DIRS["sft"])
        rollout, tools = grpo.rollout_plan(params, args, tok, list(ds))  # rows: each episode reset with its own
        if rollout is None:
            raise SystemExit("bench: GRPO step timing needs the project's rollout function (not vLLM or chat tools)")
        Timer.rollout = rollout
        trainer = GRPOTrainer(
            model=grpo.starting_model(),
            reward_funcs=funcs,
            args=args,
            train_dataset=ds,
            processing_class=tok,
            peft_config=stage.peft_config(params, "grpo"),
            callbacks=[Timer()],
            rollout_func=rollout,
            tools=tools,
        )
        trainer.train()
    k = 2  # warm-up steps left out
    if alternate_merged:
        sides = {
            name: [i for i in range(k, len(step_t)) if merged_steps[i] == flag]
            for name, flag in (("merged", True), ("adapter", False))
        }
        out = {
            name: {
                "steps": len(idx),
                "seconds_per_step": statistics.median(step_t[i] for i in idx),
                "generation_seconds_per_step": statistics.median(gen_per_step[i] for i in idx),
                "rollout_tokens_per_second": sum(tokens_per_step[i] for i in idx) / sum(gen_per_step[i] for i in idx),
            }
            for name, idx in sides.items()
        }
        out["rollout_tokens_per_second_ratio"] = (
            out["merged"]["rollout_tokens_per_second"] / out["adapter"]["rollout_tokens_per_second"]
        )
        out["seconds_per_step_ratio"] = out["adapter"]["seconds_per_step"] / out["merged"]["seconds_per_step"]
        return out
    gen = sum(gen_per_step[k:])
    return {
        "seconds_per_step": statistics.median(step_t[k:]),
        "generation_share": gen / sum(step_t[k:]),
        "rollout_tokens_per_second": rollout.tokens / rollout.seconds if rollout.seconds else None,
        "tool_use_rate": [h["tools/tool_use_rate"] for h in trainer.state.log_history if "tools/tool_use_rate" in h][
            -1:
        ]
        or None,
    }


def timed_grpo(params, args, model, tok, rows: list[dict], warmup: int, finish=None, **trainer_kwargs):
    """(trainer, steps): a short GRPOTrainer run (`args.max_steps` steps, `finish(trainer)` before training) timed
    per optimizer step after `warmup`: wall seconds of the step, and the seconds, policy-sampled tokens (the ones of
    the returned tool/env mask, or every completion token without one) and completions of the trainer's
    `_generate`, which every rollout path (rollout_func or TRL's own loop) runs inside."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from agentrl.agent.rewards import build_rewards
    from agentrl.stages import training as stage

    funcs, _ = build_rewards(params.grpo.rewards, params.grpo.reward_kwargs.model_dump())
    clock = {"seconds": 0.0, "tokens": 0, "completions": 0}
    steps: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.at = time.perf_counter(), dict(clock)

        def on_step_end(self, *a, **k):
            steps.append({"step_s": time.perf_counter() - self.t, **{x: clock[x] - self.at[x] for x in clock}})

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        peft_config=stage.peft_config(params, "grpo"),
        callbacks=[StepClock()],
        **trainer_kwargs,
    )
    generate = trainer._generate

    def timed_generate(prompts):
        t = time.perf_counter()
        out = generate(prompts)
        clock["seconds"] += time.perf_counter() - t
        completion_ids, mask = out[1], out[2]
        clock["tokens"] += int(sum(map(sum, mask)) if mask is not None else sum(map(len, completion_ids)))
        clock["completions"] += len(completion_ids)
        return out

    trainer._generate = timed_generate
    if finish:
        finish(trainer)
    trainer.train()
    return trainer, steps[warmup:]


def chat_loops_side_by_side(params, make_model, tok, rows: list[dict], steps: int, warmup: int) -> dict:
    """GRPO in the chat format (params with agent.format chat, in memory) through our tool loop as rollout_func
    (grpo.ToolRollout) and through TRL's own environment loop (GRPOTrainer(environment_factory=...), what the grpo
    stage runs for chat), one after the other on the same starting policy (`make_model()`, fresh for each), tokenizer
    (a tool-calling chat template) and rows, built as grpo.train builds them (grpo_config, rollout_plan,
    baked_tool_template): seconds per optimizer step and rollout tokens/s (timed_grpo) after `warmup` of `steps`
    steps, tool calls per completion, and ours / TRL's."""
    from agentrl.agent.tools import toolset_from_params
    from agentrl.config import Params
    from agentrl.stages import grpo

    p = Params.model_validate({**params.model_dump(), "agent": {**params.agent.model_dump(), "format": "chat"}})
    toolset = toolset_from_params(p.agent, tok.eos_token, p.environments)
    if toolset is None:
        raise SystemExit("bench: the chat-format comparison needs agent.tools or agent.environment")
    kw = toolset.chat_template_kwargs()
    # ToolRollout renders message prompts without the tools (the grpo stage hands chat to TRL): ours gets each prompt
    # rendered as TRL renders it, tools described
    rendered = [
        {**r, "prompt": tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False, **kw)}
        for r in rows
    ]
    prompt_tokens = statistics.mean(len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rendered)
    out: dict = {"steps": steps, "warmup_steps": warmup, "mean_prompt_tokens": prompt_tokens}
    with tempfile.TemporaryDirectory() as tmp:

        def config():
            args = grpo.grpo_config(p, output_dir=tmp, report_to="none")
            args.max_steps, args.save_strategy, args.logging_steps = steps, "no", 1
            return args

        rollout = grpo.ToolRollout(toolset, rendered)
        _, timed = timed_grpo(p, config(), make_model(), tok, rendered, warmup, rollout_func=rollout)
        calls = rollout.curves["tools/tool_calls_per_problem"][warmup:]
        out["ours"] = {"steps": timed, "tool_calls_per_completion": statistics.mean(calls)}

        args = config()
        _, factory = grpo.rollout_plan(p, args, tok, rows)
        finish = grpo.baked_tool_template(tok)
        trainer, timed = timed_grpo(p, args, make_model(), tok, rows, warmup, finish, environment_factory=factory)
        calls = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
        out["trl"] = {"steps": timed, "tool_calls_per_completion": statistics.mean(calls[warmup:])}
    for side in ("ours", "trl"):
        o = out[side]
        o["seconds_per_step"] = statistics.median(x["step_s"] for x in o["steps"])
        o["rollout_tokens_per_second"] = sum(x["tokens"] for x in o["steps"]) / sum(x["seconds"] for x in o["steps"])
        o["sampled_tokens_per_completion"] = sum(x["tokens"] for x in o["steps"]) / sum(
            x["completions"] for x in o["steps"]
        )
    out["step_time_ratio"] = out["ours"]["seconds_per_step"] / out["trl"]["seconds_per_step"]
    out["rollout_tokens_per_second_ratio"] = (
        out["ours"]["rollout_tokens_per_second"] / out["trl"]["rollout_tokens_per_second"]
    )
    return out


def tool_loop_speed(params, n: int, stage: str = "grpo", ceiling: bool = False) -> dict:
    """tool_loop_vs_plain on `stage`'s policy: the tool loop (tools from params.agent) against plain
    `model.generate` on the first `n` held-out prompts, params.eval's batch size and max_new_tokens. `ceiling`: then
    decode_ceiling on the same model, prompts and sizes, and both loops' tokens/s as fractions of it."""
    from agentrl.agent.tools import toolset_from_params
    from agentrl.modeling import load_policy

    model, tok = load_policy(stage)
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token)
    prompts = [r["prompt"] for r in load_jsonl("data/prepared/test.jsonl")[:n]]
    kw = toolset.chat_template_kwargs() if toolset else None
    max_new, bs = params.eval.max_new_tokens, params.eval.batch_size
    out = tool_loop_vs_plain(model, tok, prompts, toolset, max_new, bs, kw)
    if ceiling:
        c = decode_ceiling(model, tok, prompts, max_new, bs, kw)["tokens_per_second"]
        out["ceiling_tokens_per_second"] = c
        for k in ("loop", "loop_sampled", "plain"):
            out[f"{k}_fraction_of_ceiling"] = out[f"{k}_tokens_per_second"] / c
    return out


def _forced_demonstrations(tok, rows: list[dict]):
    """A LogitsProcessor that makes the policy write each row's demonstration (inline format): the text before each
    `<<expr=` and the call itself; the loop appends what the environment answers (`result>>`), then the next piece."""
    from transformers import LogitsProcessor

    from agentrl.agent.tools import _ANNOTATION

    def pieces(answer: str) -> list[list[int]]:
        out, pos = [], 0
        for m in _ANNOTATION.finditer(answer):
            out.append(answer[pos : m.start()] + f"<<{m.group(1)}=")
            pos = m.end()
        return [tok(x, add_special_tokens=False)["input_ids"] for x in out + [answer[pos:]]]

    demos = [(r["question"], pieces(r["answer"])) for r in rows]

    class Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for i in range(input_ids.shape[0]):
                text = tok.decode([t for t in input_ids[i].tolist() if t != tok.pad_token_id])
                prompt, _, comp = text.rpartition("<|im_start|>assistant\n")
                ids = next(p for q, p in demos if q in prompt)
                k, tail = comp.count(">>"), comp.rpartition(">>")[2]
                piece = ids[k] if k < len(ids) else []
                j = next((j for j in range(len(piece)) if tok.decode(piece[:j]) == tail), None)
                want = piece[j] if j is not None else tok.eos_token_id
                scores[i, :] = -1e9
                scores[i, want] = 0
            return scores

    return Forced()


@torch.inference_mode()
def openenv_transport(params, n: int = 64, rounds: int = LOOP_ROUNDS, environment: str = "countdown") -> dict:
    """Rollout time of our tool loop with `environment`'s episodes in-process against over OpenEnv (issue 42:
    agent.environment_url serve, a server subprocess on 127.0.0.1, one WebSocket session per completion). The
    policy is a model of params.model.tiny's size (the default pipeline's) forced to write `n` held-out rows'
    demonstrations, greedy, in batches of params.eval.batch_size: both sides decode the same tokens and make the
    same calls. `rounds` pairs back to back; the ratio is the median of the paired ratios. torch runs one thread
    here: with two on a busy 2-core machine each small matmul waits for the other thread (rounds measured 1 s and
    17 s apart), and the server process gets the other core."""
    import random

    from transformers import LogitsProcessorList

    from agentrl.agent.loop import generate_with_tools
    from agentrl.agent.tools import TASKS, toolset_from_params
    from agentrl.config import TinyModelParams
    from agentrl.data import messages
    from agentrl.envs import openenv_client
    from agentrl.modeling import build_tiny_model, train_tokenizer

    rows = TASKS[environment].make_rows(n, random.Random(0), "test")
    prompts = [messages("", r["question"]) for r in rows]
    tiny = params.model.tiny
    tok = train_tokenizer([r["question"] + r["answer"] for r in rows], tiny.vocab_size)
    model = build_tiny_model(tok, TinyModelParams(**tiny.model_dump()), params.seed).eval()
    agent = params.agent.model_copy(update={"tools": [], "format": "inline", "environment": environment})
    forced = LogitsProcessorList([_forced_demonstrations(tok, rows)])

    def rollout(url) -> tuple[float, list]:
        toolset = toolset_from_params(agent.model_copy(update={"environment_url": url}), tok.eos_token,
                                      params.environments)  # fmt: skip
        t = time.perf_counter()
        out = generate_with_tools(model, tok, prompts, toolset, 96, params.eval.batch_size, rows=rows,
                                  logits_processor=forced)  # fmt: skip
        return time.perf_counter() - t, [r[0] for r in out]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rollout(None), rollout("serve")  # warm-up: the first calls of both paths, and the server's start
        pairs = [(rollout(None), rollout("serve")) for _ in range(rounds)]
    finally:
        openenv_client._stop_served()
        torch.set_num_threads(threads)
    (_, local), (_, remote) = pairs[0]
    if [r.completion_ids for r in local] != [r.completion_ids for r in remote]:
        raise RuntimeError("openenv_transport: the rollouts over OpenEnv differ from in-process ones")
    return {
        "environment": environment,
        "rollouts": n,
        "tool_calls": sum(len(r.calls) for r in local),
        "in_process_seconds": stats([a[0] for a, _ in pairs]),
        "openenv_seconds": stats([b[0] for _, b in pairs]),
        "ratio": statistics.median(b[0] / a[0] for a, b in pairs),
        "round_ratios": [b[0] / a[0] for a, b in pairs],
    }


def chat_loops_speed(params, steps: int = CHAT_STEPS, warmup: int = CHAT_WARMUP) -> dict:
    """chat_loops_side_by_side on the policy GRPO starts from (grpo.starting_model) and the first GRPO prompts the
    run needs. The workspace's tokenizer keeps its template when it can render tool calls; otherwise (an inline-format
    pipeline's) it gets Qwen3's in memory, as the base stage gives a chat-format pipeline's tokenizer."""
    from trl.chat_template_utils import qwen3_chat_template, supports_tool_calling

    from agentrl.modeling import STAGE_DIRS, load_tokenizer
    from agentrl.stages import grpo

    tok = load_tokenizer(STAGE_DIRS["sft"])
    if not supports_tool_calling(tok):
        tok.chat_template = qwen3_chat_template
    n = steps * grpo.check_batch(params) // params.grpo.trainer["num_generations"]
    rows = load_jsonl(grpo.DATA)[:n]
    return chat_loops_side_by_side(params, lambda: grpo.starting_model(params), tok, rows, steps, warmup)


def timed(cmd: list[str], cwd: str | None = None) -> tuple[float, str]:
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t, r.stdout


def stages_run(out: str) -> list[str]:
    return [ln.split("'")[1] for ln in out.splitlines() if ln.startswith("Running stage")]


def scratch_copy(dst: Path) -> None:
    """The repository plus the workspace's DVC outputs and cache, committed as a fresh git repo: `dvc repro`
    there starts from the same state as here, and nothing here changes."""
    outputs = ("data", "models", "checkpoints", "eval", "metrics", "diagnostics", "dvclive", ".dvc/cache")
    copy_repo(Path.cwd(), dst, outputs=outputs)
    git_commit_all(dst, "bench copy")


STAGE_METRICS = {
    "prepare": "prepare",
    "base": "base",
    "sft": "sft_train",
    "grpo": "grpo_train",
    "eval_base": "eval_base",
    "eval_sft": "eval_sft",
    "eval_grpo": "eval_grpo",
    "export": "export",
    "eval_quantized": "eval_merged_int8",
}


def dvc_timings(params, repeats: int, repro_repeats: int) -> dict:
    dvc = str(Path(sys.executable).parent / "dvc")
    status = timed([dvc, "status"])[1]
    if "up to date" not in status:
        raise SystemExit(f"bench: the pipeline is not up to date (`dvc status`); run `make repro` first\n{status}")
    out: dict = {"noop_repro_seconds": stats([timed([dvc, "repro"])[0] for _ in range(repeats)])}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        scratch_copy(d)
        ran = stages_run(timed([dvc, "repro"], cwd=tmp)[1])
        if ran:
            print(f"bench: the scratch copy was not up to date, re-ran {ran}", file=sys.stderr)
        change, lr = [], params.grpo.trainer["learning_rate"]
        for i in range(repro_repeats):  # GRPO-only change: a new grpo.trainer.learning_rate each time
            set_param(d / "params.yaml", "grpo.trainer.learning_rate", float(f"{lr * (1.5 + 0.25 * i):.3g}"))
            secs, log = timed([dvc, "repro"], cwd=tmp)
            change.append({"seconds": round(secs, 1), "stages_rerun": stages_run(log)})
        out["grpo_change_repro"] = {
            "seconds": stats([c["seconds"] for c in change]),
            "stages_rerun": change[0]["stages_rerun"],
            "runs": change,
        }
        shutil.copy("params.yaml", d / "params.yaml")  # back to the workspace's params for the full repros
        full, rss, acc = [], {}, []
        for _ in range(repro_repeats):  # everything from scratch (set-up excluded)
            shutil.rmtree(d / "checkpoints", ignore_errors=True)  # or sft/grpo would resume from their last step
            secs, log = timed([dvc, "repro", "--force"], cwd=tmp)
            full.append(secs)
            c = json.loads((d / "metrics/compare.json").read_text())
            acc.append({k: c[k] for k in ("base_accuracy", "sft_accuracy", "grpo_accuracy", "p_value")})
            for stage, f in STAGE_METRICS.items():
                m = d / "diagnostics" / f"{f}.json"  # timings and memory: the stages' diagnostics
                if m.exists() and "peak_rss_mb" in (stage_metrics := json.loads(m.read_text())):
                    rss.setdefault(stage, []).append(stage_metrics["peak_rss_mb"])
        out["full_repro_seconds"] = stats(full)
        out["full_repro_stages"] = stages_run(log)
        out["full_repro_accuracies"] = acc  # identical across repeats when the pipeline is deterministic
        out["peak_rss_mb_per_stage"] = {k: max(v) for k, v in rss.items()}
    return out


def tools_only(params, repeats: int, n: int) -> None:
    """`make bench-tools`: the tool loop against plain generate and the decode ceiling, the GRPO step with tools,
    and chat-format GRPO through our loop against TRL's environment loop (medians of `repeats` runs) ->
    metrics/bench_tools.json and BENCHMARKS-tools.md."""
    R = range(repeats)
    tl = [tool_loop_speed(params, n, ceiling=True) for _ in R]
    gr = [grpo_step_stats(params) for _ in R]
    ch = [chat_loops_speed(params) for _ in R]
    oe = openenv_transport(params)  # one run of LOOP_ROUNDS paired rounds
    side_keys = ("seconds_per_step", "rollout_tokens_per_second", "sampled_tokens_per_completion")
    res = {
        "machine": machine(),
        "repeats": repeats,
        "problems": n,
        "tools": list(params.agent.tools),
        "tool_loop": {
            k: stats([x[k] for x in tl])
            for k in (
                "loop_tokens_per_second",
                "loop_sampled_tokens_per_second",
                "plain_tokens_per_second",
                "ratio",
                "ceiling_tokens_per_second",
                "loop_fraction_of_ceiling",
                "loop_sampled_fraction_of_ceiling",
                "plain_fraction_of_ceiling",
            )
        },
        "tool_calls": tl[0]["tool_calls"],
        "grpo": {
            k: stats([x[k] for x in gr]) for k in ("seconds_per_step", "generation_share", "rollout_tokens_per_second")
        },
        "chat_grpo": {
            "steps": CHAT_STEPS,
            "warmup_steps": CHAT_WARMUP,
            "mean_prompt_tokens": ch[0]["mean_prompt_tokens"],
            **{
                side: {
                    **{k: stats([x[side][k] for x in ch]) for k in side_keys},
                    "tool_calls_per_completion": [x[side]["tool_calls_per_completion"] for x in ch],
                }
                for side in ("ours", "trl")
            },
            **{k: stats([x[k] for x in ch]) for k in ("step_time_ratio", "rollout_tokens_per_second_ratio")},
        },
    }
    res["tool_loop"]["round_ratios"] = [r for x in tl for r in x["round_ratios"]]
    res["tool_loop_vs_plain_generate_ratio"] = res["tool_loop"]["ratio"]["median"]
    res["tool_loop_fraction_of_decode_ceiling"] = res["tool_loop"]["loop_fraction_of_ceiling"]["median"]
    res["plain_generate_fraction_of_decode_ceiling"] = res["tool_loop"]["plain_fraction_of_ceiling"]["median"]
    res["chat_grpo_step_time_ours_over_trl"] = res["chat_grpo"]["step_time_ratio"]["median"]
    res["chat_grpo_rollout_tokens_per_second_ours_over_trl"] = res["chat_grpo"]["rollout_tokens_per_second_ratio"][
        "median"
    ]
    res["openenv_transport"] = oe
    res["openenv_rollout_time_over_in_process"] = oe["ratio"]
    write_json("metrics/bench_tools.json", res)
    t, g, c = res["tool_loop"], res["grpo"], res["chat_grpo"]
    timed_steps = f"steps {CHAT_WARMUP + 1}–{CHAT_STEPS}"
    calls = {side: ", ".join(f"{x:.2f}" for x in c[side]["tool_calls_per_completion"]) for side in ("ours", "trl")}
    mm = lambda x, f="{:.3f}": f"{f.format(x['median'])} ({f.format(x['min'])}–{f.format(x['max'])})"  # noqa: E731
    lines = [
        "# Benchmarks: the tool loop",
        "",
        f"Measured by `make bench-tools` on {res['machine']}; medians of {repeats} runs (min–max), on the GRPO "
        f"model and {n} held-out problems, greedy, batch {params.eval.batch_size}.",
        "",
        "| figure | value | how |",
        "|---|---|---|",
        f"| tool loop, tokens/s | {mm(t['loop_tokens_per_second'], '{:.0f}')} (sampled only: "
        f"{mm(t['loop_sampled_tokens_per_second'], '{:.0f}')}) | `agent.generate_with_tools`, {res['tool_calls']} "
        "calculator calls, each result appended to the KV cache |",
        f"| plain `generate`, tokens/s | {mm(t['plain_tokens_per_second'], '{:.0f}')} | one `model.generate` call "
        "per batch on the same prompts, no tool |",
        f"| **tool_loop_vs_plain_generate_ratio** | {mm(t['ratio'], '{:.2f}')} (goal ≥ {LOOP_GOAL}) | loop tokens/s ÷ "
        f"plain tokens/s: per run the median of {LOOP_ROUNDS} rounds of loop then plain, back to back (all rounds' "
        f"ratios: {', '.join(f'{x:.2f}' for x in t['round_ratios'])}) |",
        f"| GRPO optimizer step with tools | {mm(g['seconds_per_step'])} s | GRPOTrainer + the tool loop as "
        "rollout_func, params.yaml's config, steps 3–12 |",
        f"| GRPO share of a step spent generating | {mm(g['generation_share'], '{:.2f}')} | |",
        f"| GRPO rollout tokens/s | {mm(g['rollout_tokens_per_second'], '{:.0f}')} | tokens the policy sampled / "
        "rollout time |",
        f"| decode ceiling, tokens/s | {mm(t['ceiling_tokens_per_second'], '{:.0f}')} | bare batched greedy decode "
        "on the same model, prompts and batch: one prefill, then one forward per token with the KV cache and an "
        f"argmax, every prompt to {params.eval.max_new_tokens} tokens (no stopping, no tool) |",
        f"| **tool loop / decode ceiling** | {mm(t['loop_fraction_of_ceiling'], '{:.2f}')} (sampled only: "
        f"{mm(t['loop_sampled_fraction_of_ceiling'], '{:.2f}')}) | loop tokens/s ÷ ceiling tokens/s |",
        f"| plain `generate` / decode ceiling | {mm(t['plain_fraction_of_ceiling'], '{:.2f}')} | plain tokens/s ÷ "
        "ceiling tokens/s |",
        f"| chat format, GRPO step: ours / TRL's | {mm(c['step_time_ratio'], '{:.2f}')} (ours "
        f"{mm(c['ours']['seconds_per_step'], '{:.1f}')} s, TRL's {mm(c['trl']['seconds_per_step'], '{:.1f}')} s) | "
        "params.yaml's grpo config with agent.format chat, the policy GRPO starts from and the same prompts; ours: "
        "the tool loop as rollout_func (grpo.ToolRollout), TRL's: GRPOTrainer(environment_factory=...); seconds "
        f"per optimizer step, {timed_steps} of each |",
        f"| chat format, rollout tokens/s: ours / TRL's | {mm(c['rollout_tokens_per_second_ratio'], '{:.2f}')} "
        f"(ours {mm(c['ours']['rollout_tokens_per_second'], '{:.0f}')}, TRL's "
        f"{mm(c['trl']['rollout_tokens_per_second'], '{:.0f}')}) | tokens the policy sampled ÷ seconds in the "
        f"trainer's `_generate` (both loops run inside it), {timed_steps}; "
        f"{c['ours']['sampled_tokens_per_completion']['median']:.0f} vs "
        f"{c['trl']['sampled_tokens_per_completion']['median']:.0f} sampled tokens per completion |",
        f"| **OpenEnv transport: rollout time over OpenEnv / in-process** | {oe['ratio']:.2f} (rounds: "
        f"{', '.join(f'{x:.2f}' for x in oe['round_ratios'])}; in-process {mm(oe['in_process_seconds'], '{:.2f}')} s, "
        f"OpenEnv {mm(oe['openenv_seconds'], '{:.2f}')} s) | `agent.generate_with_tools` on {oe['rollouts']} held-out "
        f"{oe['environment']} rows ({oe['tool_calls']} calls), the episodes in-process vs over OpenEnv "
        "(`agent.environment_url: serve`: a server subprocess on 127.0.0.1, one WebSocket session per completion); "
        "a params.model.tiny-sized policy forced to write the demonstrations, greedy, one torch thread; one run, "
        f"{LOOP_ROUNDS} rounds back to back, median of the paired ratios |",
        "",
        f"Chat format: prompts of {c['mean_prompt_tokens']:.0f} tokens on average (Qwen3's tool description; the "
        "base stage trains the tokenizer on it only when the pipeline runs in the chat format). Tool calls per "
        f"completion, one figure per run: ours: {calls['ours']}; TRL's: {calls['trl']}"
        + (
            ". Neither loop ran a tool here (a policy trained in the inline format does not write chat tool calls): "
            "this compares chat-format generation and the GRPO step, not tool turns."
            if not any(x for side in ("ours", "trl") for x in c[side]["tool_calls_per_completion"])
            else "."
        ),
    ]
    Path("BENCHMARKS-tools.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def merged_rollouts_cost(params, repeats: int, steps: int) -> dict:
    """`--merged-rollouts`: what grpo.merged_rollouts saves, on the workspace's params and models. One GRPOTrainer
    run per repeat whose steps alternate between sampling from the PEFT model and from the merged copy (the same
    machine state for both sides), `steps` steps after 2 warm-up ones -> metrics/bench_merged_rollouts.json."""
    if not params.grpo.use_lora:
        raise SystemExit("bench --merged-rollouts: needs grpo.use_lora: true (there is no LoRA to merge)")
    runs = [grpo_step_stats(params, steps + 2, alternate_merged=True) for _ in range(repeats)]
    res = {
        "machine": machine(),
        "repeats": repeats,
        "steps_per_side": runs[0]["merged"]["steps"],
        "agent": {"environment": params.agent.environment, "tools": list(params.agent.tools)},
        "completions_per_step": params.grpo.trainer["per_device_train_batch_size"],
        "threads": torch.get_num_threads(),
        **{
            side: {k: stats([r[side][k] for r in runs]) for k in runs[0][side] if k != "steps"}
            for side in ("merged", "adapter")
        },
        **{k: stats([r[k] for r in runs]) for k in ("rollout_tokens_per_second_ratio", "seconds_per_step_ratio")},
    }
    write_json("metrics/bench_merged_rollouts.json", res)
    r, t = res["rollout_tokens_per_second_ratio"], res["seconds_per_step_ratio"]
    print(
        f"grpo.merged_rollouts on {res['machine']} ({res['threads']} threads, {res['repeats']} runs of "
        f"{res['steps_per_side']} steps per side, medians (min-max)):\n"
        f"  rollout tokens/s merged / adapter: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})\n"
        f"  GRPO step seconds adapter / merged: {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f})\n"
        "  -> metrics/bench_merged_rollouts.json"
    )
    return res


def reproducibility_child(mode: str) -> None:
    """One side of `--reproducibility` in its own process (the kernels are fixed per process), in the scratch
    directory the parent prepared: SFT and GRPO step times under reproducibility.mode `mode`, one JSON line."""
    from agentrl.reproducibility import state

    global STEPS

    params = load_params()  # the scratch params.yaml, whose mode `import agentrl` applied before torch computed
    assert params.reproducibility.mode == mode, (params.reproducibility, mode)
    STEPS = REPRO_SFT_STEPS
    sft = sft_step_times(params, False)
    grpo = grpo_step_stats(params, steps=REPRO_GRPO_STEPS)
    out = {"mode": mode, "state": state(), "sft": sft, "grpo_seconds_per_step": grpo["seconds_per_step"]}
    print("RESULT " + json.dumps(out), flush=True)


REPRO_SFT_STEPS = 15  # steps 6..15 timed (sft_step_times leaves 5 out)
REPRO_GRPO_STEPS = 5  # steps 3..5 timed (grpo_step_stats leaves 2 out)


def reproducibility_cost(repeats: int) -> dict:
    """`make bench-repro`: the cost of reproducibility.mode portable, side by side with native, on params.yaml's
    model and trainer configs. In a scratch directory: prepare, the base model (not pre-trained: the shapes and
    the work per step are the default's) and a 2-step SFT adapter; then SFT steps (sft_step_times) and GRPO steps
    (grpo_step_stats, steps 3..5) in one process per mode (torch and MKL fix their kernels per process),
    alternating native, portable, native, ... so a drifting machine load hits both. Ratio = portable / native of
    the medians -> metrics/bench_reproducibility.json."""
    import yaml

    from agentrl.config import load_yaml
    from agentrl.reproducibility import unpinned_environ

    here = Path.cwd()
    runs: dict[str, list[dict]] = {"native": [], "portable": []}
    with tempfile.TemporaryDirectory() as tmp:
        p = load_yaml("params.yaml")
        p["data"]["synthetic"].update(num_train=2000, num_test=50)
        p["model"]["pretrain"]["enabled"] = False
        p["sft"]["trainer"].update(max_steps=2, save_strategy="no")
        p["tracking"]["report_to"] = []
        env = {**unpinned_environ(), "WANDB_MODE": "disabled"}
        env.pop("AGENTRL_PARAMS", None)

        def run(cmd: list[str], what: str) -> str:
            r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"bench: {what} failed ({r.returncode}):\n{r.stderr[-3000:]}")
            return r.stdout

        Path(tmp, "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
        for stage in ("prepare", "base", "sft"):
            run([sys.executable, "-m", f"agentrl.stages.{stage}"], stage)
        for i in range(repeats):
            for mode in ("native", "portable"):
                p.setdefault("reproducibility", {})["mode"] = mode
                Path(tmp, "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
                out = run([sys.executable, str(Path(__file__).resolve()), "--reproducibility-child", mode], mode)
                line = [x for x in out.splitlines() if x.startswith("RESULT ")]
                if not line:
                    raise SystemExit(f"bench: {mode} run {i + 1} printed no result:\n{out[-2000:]}")
                runs[mode].append(json.loads(line[-1][len("RESULT ") :]))
                print(f"{mode} run {i + 1}: {runs[mode][-1]}", flush=True)
    fig = {
        "sft_trainer_step_s": lambda x: x["sft"]["trainer"],
        "sft_plain_step_s": lambda x: x["sft"]["plain_loop"],
        "grpo_step_s": lambda x: x["grpo_seconds_per_step"],
    }
    res: dict = {
        "machine": machine(),
        "repeats": repeats,
        "kernels": {m: runs[m][0]["state"] for m in runs},
    }
    for name, get in fig.items():
        med = {m: stats([get(x) for x in runs[m]]) for m in runs}
        res[name] = {**med, "ratio_portable_over_native": med["portable"]["median"] / med["native"]["median"]}
    write_json(here / "metrics/bench_reproducibility.json", res)
    lines = [
        f"reproducibility.mode portable vs native on {res['machine']}, medians of {repeats} runs per mode "
        "(alternating processes):",
        "",
        "| figure | native s | portable s | portable / native |",
        "|---|---|---|---|",
    ]
    for name in fig:
        r = res[name]
        lines.append(
            f"| {name} | {r['native']['median']:.3f} | {r['portable']['median']:.3f} | "
            f"{r['ratio_portable_over_native']:.2f} |"
        )
    print("\n".join(lines))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repro-repeats", type=int, default=3, help="runs of the full and GRPO-change repros")
    ap.add_argument("--eval-problems", type=int, default=None, help="default: the whole held-out set")
    ap.add_argument(
        "--skip-dvc", action="store_true", help="skip the dvc timings (no-op repro, GRPO-only change, full repro)"
    )
    ap.add_argument(
        "--tools-only",
        action="store_true",
        help="only the tool-loop figures (loop vs plain generate, GRPO step with tools): metrics/bench_tools.json",
    )
    ap.add_argument(
        "--reproducibility",
        action="store_true",
        help="only the cost of reproducibility.mode portable vs native (SFT and GRPO step times): "
        "metrics/bench_reproducibility.json",
    )
    ap.add_argument(
        "--merged-rollouts",
        type=int,
        metavar="STEPS",
        help="only what grpo.merged_rollouts saves: GRPO steps alternating between sampling from the PEFT model and "
        "from the LoRA merged into a plain copy, STEPS per side: metrics/bench_merged_rollouts.json",
    )
    ap.add_argument("--reproducibility-child", choices=["native", "portable"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    if a.reproducibility_child:
        reproducibility_child(a.reproducibility_child)
        return
    if a.reproducibility:
        reproducibility_cost(a.repeats)
        return
    params = load_params()
    if a.merged_rollouts:
        merged_rollouts_cost(params, a.repeats, 2 * a.merged_rollouts)
        return
    R = range(a.repeats)
    if a.tools_only:
        tools_only(params, a.repeats, a.eval_problems or len(load_jsonl("data/prepared/test.jsonl")))
        return
    res: dict = {
        "machine": machine(),
        "repeats": a.repeats,
        "repro_repeats": 0 if a.skip_dvc else a.repro_repeats,
    }

    ours = [sft_step_times(params, False) for _ in R]
    trl_default = [sft_step_times(params, True) for _ in R]
    res["sft_step_seconds"] = {
        "ours": stats([x["trainer"] for x in ours]),
        "plain_loop": stats([x["plain_loop"] for x in ours]),
        "trl_defaults": stats([x["trainer"] for x in trl_default]),
        "plain_loop_beside_trl_defaults": stats([x["plain_loop"] for x in trl_default]),
    }
    res["sft_paired_ratios"] = {
        "ours": stats([x["paired_ratio"] for x in ours]),
        "trl_defaults": stats([x["paired_ratio"] for x in trl_default]),
    }
    res["sft_vs_plain_loop_ratio"] = res["sft_paired_ratios"]["ours"]["median"]
    res["sft_trl_defaults_vs_plain_loop_ratio"] = res["sft_paired_ratios"]["trl_defaults"]["median"]

    from agentrl.agent import loop as agent

    n = a.eval_problems or len(load_jsonl("data/prepared/test.jsonl"))
    res["eval_problems"] = n
    res["eval"] = {}
    for stage in EVAL_STAGES:
        ev = [eval_speed(params, n, stage) for _ in R]
        share, agent.PRUNE_SHARE = agent.PRUNE_SHARE, 2.0  # ablation: one generate call per batch
        whole = [eval_speed(params, n, stage)["batched"] for _ in R]
        agent.PRUNE_SHARE = share
        e = {
            k: {
                "problems_per_second": stats([x[k]["problems_per_second"] for x in ev]),
                "accuracy": ev[0][k]["accuracy"],
                "mean_completion_tokens": ev[0][k]["mean_completion_tokens"],
            }
            for k in ("batched", "per_sample")
        }
        e["batched_one_call_per_batch"] = {
            "problems_per_second": stats([w["problems_per_second"] for w in whole]),
            "accuracy": whole[0]["accuracy"],
        }
        e["speedup"] = e["batched"]["problems_per_second"]["median"] / e["per_sample"]["problems_per_second"]["median"]
        e["identical_accuracy"] = all(x["batched"]["accuracy"] == x["per_sample"]["accuracy"] for x in ev) and all(
            w["accuracy"] == ev[0]["batched"]["accuracy"] for w in whole
        )
        res["eval"][stage] = e
    res["eval_batched_vs_per_sample_speedup"] = min(e["speedup"] for e in res["eval"].values())

    tl = [tool_loop_speed(params, n) for _ in R]
    res["tool_loop"] = {
        k: stats([x[k] for x in tl])
        for k in ("loop_tokens_per_second", "plain_tokens_per_second", "loop_sampled_tokens_per_second", "ratio")
    }
    res["tool_loop"]["tool_calls"] = tl[0]["tool_calls"]
    res["tool_loop_vs_plain_generate_ratio"] = res["tool_loop"]["ratio"]["median"]

    gr = [grpo_step_stats(params) for _ in R]
    res["grpo"] = {
        k: stats([x[k] for x in gr]) for k in ("seconds_per_step", "generation_share", "rollout_tokens_per_second")
    }
    res["grpo"]["completions_per_step"] = (
        params.grpo.trainer["per_device_train_batch_size"] * params.grpo.trainer["gradient_accumulation_steps"]
    )
    res["peak_rss_mb_bench_process"] = peak_rss_mb()
    if not a.skip_dvc:
        res.update(dvc_timings(params, a.repeats, a.repro_repeats))
    write_json("metrics/bench.json", res)

    s, g = res["sft_step_seconds"], res["grpo"]
    mm = lambda x, f="{:.3f}": f"{f.format(x['median'])} ({f.format(x['min'])}–{f.format(x['max'])})"  # noqa: E731
    lines = [
        "# Benchmarks",
        "",
        f"Measured by `make bench` on {res['machine']}. Each figure is the median of "
        f"{a.repeats} runs (min–max); the full and GRPO-change repros of {res['repro_repeats']} runs, in a "
        "scratch copy of the repository. Regenerate with `make bench`.",
        "",
        "| figure | value | how |",
        "|---|---|---|",
        f"| SFT step, ours | {mm(s['ours'])} s | "
        "SFTTrainer with params.yaml's config: wall time from one step's end to the next "
        f"(data loading, collation, logging included), steps 6–{STEPS} |",
        f"| SFT step, plain PyTorch loop | {mm(s['plain_loop'])} s | "
        "forward (HF loss on the same collated labels) / backward / clip / fused AdamW on a second copy of the model, "
        "run on the same batch right after each trainer step |",
        f"| **sft_vs_plain_loop_ratio** | {mm(res['sft_paired_ratios']['ours'], '{:.2f}')} (goal ≤ 1.25) | "
        "median over steps of trainer step / paired plain step |",
        "| SFT step, TRL defaults | "
        f"{mm(s['trl_defaults'])} s (plain beside it {mm(s['plain_loop_beside_trl_defaults'])} s) | "
        "SFTConfig defaults (bf16 autocast where supported, gradient checkpointing on), same pairing |",
        f"| TRL defaults / plain loop | {mm(res['sft_paired_ratios']['trl_defaults'], '{:.2f}')} | |",
    ]
    for stage, e in res["eval"].items():
        lines += [
            f"| eval {stage}, batched | {mm(e['batched']['problems_per_second'], '{:.1f}')} problems/s | "
            f"{n} held-out problems, `eval.batch_size` {params.eval.batch_size}, left padding, greedy, "
            f"ended rows leave the batch; {e['batched']['mean_completion_tokens']:.1f} tokens per completion |",
            f"| eval {stage}, batched, one `generate` call per batch | "
            f"{mm(e['batched_one_call_per_batch']['problems_per_second'], '{:.1f}')} problems/s | "
            "ablation: every row computed until the batch's longest ends |",
            f"| eval {stage}, one at a time | {mm(e['per_sample']['problems_per_second'], '{:.1f}')} problems/s | "
            f"the same {n} problems at batch 1 (HelloAgents' way) |",
            f"| eval {stage} speed-up | {e['speedup']:.1f}× | identical accuracy: {e['identical_accuracy']} |",
        ]
    lines += [
        f"| **eval_batched_vs_per_sample_speedup** | {res['eval_batched_vs_per_sample_speedup']:.1f}× (goal ≥ 10) | "
        "the smaller of the stages' speed-ups |",
        f"| GRPO optimizer step | {mm(g['seconds_per_step'])} s, {g['completions_per_step']} completions | "
        "GRPOTrainer with params.yaml's config, steps 3–12 |",
        f"| GRPO share of a step spent generating | {mm(g['generation_share'], '{:.2f}')} | rollout time / step time |",
        f"| GRPO rollout tokens/s | {mm(g['rollout_tokens_per_second'], '{:.0f}')} | "
        "tokens the policy sampled / rollout time (tool loop) |",
        "| tool loop, generated tokens/s | "
        f"{mm(res['tool_loop']['loop_tokens_per_second'], '{:.0f}')} "
        f"({mm(res['tool_loop']['loop_sampled_tokens_per_second'], '{:.0f}')} sampled) | "
        f"`agent.generate_with_tools` on the GRPO model, {n} held-out problems, batch {params.eval.batch_size}, "
        f"greedy, {res['tool_loop']['tool_calls']} tool calls |",
        f"| plain `generate`, tokens/s | {mm(res['tool_loop']['plain_tokens_per_second'], '{:.0f}')} | "
        "one `model.generate` call per batch on the same prompts, no tool |",
        f"| **tool_loop_vs_plain_generate_ratio** | {mm(res['tool_loop']['ratio'], '{:.2f}')} (goal ≥ {LOOP_GOAL}) | "
        "a call appends its result to the KV cache; nothing is re-encoded |",
    ]
    if not a.skip_dvc:
        c = res["grpo_change_repro"]
        lines += [
            f"| **noop_repro_seconds** | {mm(res['noop_repro_seconds'], '{:.2f}')} s (goal ≤ 5) | "
            "`dvc repro` with nothing changed |",
            f"| GRPO-only change | {mm(c['seconds'], '{:.0f}')} s; re-ran {', '.join(c['stages_rerun'])} | "
            "new `grpo.trainer.learning_rate`, then `dvc repro` |",
            f"| **full_repro_seconds** | {mm(res['full_repro_seconds'], '{:.0f}')} s (goal ≤ 900) | "
            "`dvc repro --force`: every stage, set-up excluded |",
            f"| GRPO-only change / full repro | {c['seconds']['median'] / res['full_repro_seconds']['median']:.2f} | |",
            "",
            "Peak RSS per stage (MiB, max over the full repros; each stage records its own): "
            + ", ".join(f"{k} {v:.0f}" for k, v in res["peak_rss_mb_per_stage"].items()),
            "",
            "Accuracies of the full repros (base / SFT / GRPO): "
            + "; ".join(
                f"{a['base_accuracy']:.3f} / {a['sft_accuracy']:.3f} / {a['grpo_accuracy']:.3f}"
                for a in res["full_repro_accuracies"]
            ),
        ]
    Path("BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
