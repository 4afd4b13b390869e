"""Trainer step timings (`make bench`, `make bench-tools`, `make bench-repro`, `scripts/bench.py --merged-rollouts`):
SFTTrainer steps each paired with a plain PyTorch step on the same batch, short runs of the grpo stage's trainer
timed per step (with the project's rollout function, or any rollout path through the trainer's `_generate`), and
what grpo.merged_rollouts saves."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrl.common import write_json

from .measure import machine, stats

STEPS = 40  # SFT steps per sft_step_times run (the first 5 are warm-up)
SFT_WARMUP = 5
GRPO_WARMUP = 2  # GRPO steps grpo_step_stats leaves out


def _plain_twin(params, stage):
    """The plain PyTorch side of the SFT pairing: a second copy of the base model (with SFT's LoRA when
    sft.use_lora) in train mode and a fused AdamW over its trainable parameters.

    Args:
        stage: agentrl.stages.training (peft_config, learning_rate).

    Returns:
        (model, optimizer).
    """
    from agentrl.modeling import STAGE_DIRS, load_model

    plain = load_model(STAGE_DIRS["base"])
    if params.sft.use_lora:
        from peft import get_peft_model

        plain = get_peft_model(plain, stage.peft_config(params, "sft"))
    plain.train()
    trainable = [p for p in plain.parameters() if p.requires_grad]
    return plain, torch.optim.AdamW(trainable, lr=stage.learning_rate(params, "sft"), fused=True)


def _plain_step(model, optimizer, micro_batches: list[dict], max_grad_norm: float) -> float:
    """One plain optimizer step: forward (HF loss on the collated labels) and backward per micro-batch, clip,
    step.

    Args:
        micro_batches: the collated batches the trainer's step consumed.
    """
    start = time.perf_counter()
    for b in micro_batches:
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        (loss / len(micro_batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _sft_args(params, trl_defaults: bool, output_dir: str, batch_size: int, steps: int):
    """The SFTConfig of a timing run: params.yaml's (sft.sft_config), or what a plain TRL script gets (library
    defaults except batch and steps; bf16 is TRL's default). Nothing is saved."""
    from trl import SFTConfig

    from agentrl.stages import sft

    if trl_defaults:
        return SFTConfig(
            output_dir=output_dir,
            per_device_train_batch_size=batch_size,
            max_steps=steps,
            report_to="none",
            save_strategy="no",
            use_cpu=not torch.cuda.is_available(),
        )
    args = sft.sft_config(params, output_dir=output_dir, report_to="none")
    args.max_steps, args.save_strategy = steps, "no"
    return args


def sft_step_times(params, trl_defaults: bool, steps: int = STEPS) -> dict:
    """Seconds per optimizer step of SFTTrainer, each paired with a plain PyTorch step on the same batch.

    The trainer's step is the wall time from the end of one step to the end of the next (data loading,
    collation, forward/backward, clipping, optimizer and scheduler, logging: everything it does per step),
    less the plain step run in between. The plain step runs forward (HF loss on the collated labels),
    backward, clip, fused AdamW on a second copy of the same model, right after the trainer's step on the
    same collated batch, so both see the same sequence lengths and the same machine state.

    Args:
        params: the validated params (the workspace's models/base and sft data).
        trl_defaults: time SFTConfig's defaults instead of params.yaml's config.
        steps: optimizer steps; the medians are of steps 6..steps (warm-up excluded).

    Returns:
        {"trainer", "plain_loop", "paired_ratio"}: median seconds per step and median trainer / plain;
        "tokens_per_step" (median attended tokens of a step's batches) and "mean_sequence_tokens" (over the timed
        steps' rows), for the model FLOPs.
    """
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from agentrl.modeling import STAGE_DIRS, load_model, load_tokenizer
    from agentrl.stages import sft
    from agentrl.stages import training as stage

    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"
    batch_size = params.sft.trainer["per_device_train_batch_size"]
    dataset = load_dataset("json", data_files=sft.DATA, split="train").select(range(batch_size * steps))
    plain, optimizer = _plain_twin(params, stage)
    batches: list[dict] = []
    trainer_s: list[float] = []
    plain_s: list[float] = []
    step_rows: list[list[int]] = []  # per step, the attended tokens of each sequence

    class Paired(TrainerCallback):
        last, used = None, 0  # end of the previous step; collated batches already paired

        def on_step_begin(self, *a, **k):
            if self.last is None:  # first step: from its start
                self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            trainer_s.append(time.perf_counter() - self.last)
            plain_s.append(_plain_step(plain, optimizer, batches[self.used :], params.sft.trainer["max_grad_norm"]))
            step_rows.append([int(n) for b in batches[self.used :] for n in b["attention_mask"].sum(-1)])
            self.used = len(batches)
            self.last = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        args = _sft_args(params, trl_defaults, tmp, batch_size, steps)
        trainer = SFTTrainer(
            model=load_model(STAGE_DIRS["base"]),
            args=args,
            train_dataset=dataset,
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
    timed_trainer, timed_plain, timed_rows = trainer_s[SFT_WARMUP:], plain_s[SFT_WARMUP:], step_rows[SFT_WARMUP:]
    return {
        "trainer": statistics.median(timed_trainer),
        "plain_loop": statistics.median(timed_plain),
        "paired_ratio": statistics.median(t / p for t, p in zip(timed_trainer, timed_plain)),
        "tokens_per_step": statistics.median(sum(rows) for rows in timed_rows),
        "mean_sequence_tokens": statistics.mean(n for rows in timed_rows for n in rows),
    }


def _per_side(step_s: list, generation_s: list, tokens: list, merged: list) -> dict:
    """grpo_step_stats' figures per rollout sampler, after the warm-up steps.

    Args:
        step_s, generation_s, tokens, merged: per optimizer step: wall seconds, seconds generating, rollout
            tokens, whether the merged copy sampled.

    Returns:
        {"merged": ..., "adapter": ...} (steps, seconds_per_step, generation_seconds_per_step,
        rollout_tokens_per_second) and the two ratios.
    """
    sides = {
        name: [i for i in range(GRPO_WARMUP, len(step_s)) if merged[i] == flag]
        for name, flag in (("merged", True), ("adapter", False))
    }
    out = {
        name: {
            "steps": len(idx),
            "seconds_per_step": statistics.median(step_s[i] for i in idx),
            "generation_seconds_per_step": statistics.median(generation_s[i] for i in idx),
            "rollout_tokens_per_second": sum(tokens[i] for i in idx) / sum(generation_s[i] for i in idx),
        }
        for name, idx in sides.items()
    }
    out["rollout_tokens_per_second_ratio"] = (
        out["merged"]["rollout_tokens_per_second"] / out["adapter"]["rollout_tokens_per_second"]
    )
    out["seconds_per_step_ratio"] = out["adapter"]["seconds_per_step"] / out["merged"]["seconds_per_step"]
    return out


def _grpo_trainer(params, args, callback):
    """The grpo stage's trainer (grpo.build_trainer) for the project's rollout function, on the workspace's data
    and SFT model.

    Args:
        callback: a TrainerCallback class whose `rollout` attribute is set here to the rollout function.

    Returns:
        (trainer, rollout): rollout is grpo.ToolRollout, which times itself.
    """
    from datasets import load_dataset

    from agentrl.modeling import STAGE_DIRS, load_tokenizer
    from agentrl.stages import grpo

    dataset = load_dataset("json", data_files=grpo.DATA, split="train")
    tok = load_tokenizer(STAGE_DIRS["sft"])
    rollout, factory = grpo.rollout_plan(params, args, tok)
    if rollout is None:
        raise SystemExit("bench: GRPO step timing needs the project's rollout function (not vLLM or chat tools)")
    callback.rollout = rollout
    trainer = grpo.build_trainer(
        params, args, grpo.starting_model(), tok, dataset, [callback()], plan=(rollout, factory)
    )
    return trainer, rollout


def grpo_step_stats(params, steps: int = 12, alternate_merged: bool = False) -> dict:
    """A short run of the stage's trainer with params.yaml's grpo config (nothing written to the workspace),
    timed per step.

    Args:
        params: the validated params (the workspace's models/sft and GRPO data).
        steps: optimizer steps; the figures are of steps 3..steps.
        alternate_merged: the rollouts of odd steps sample from the LoRA merged into a plain copy
            (grpo.merged_rollouts), of even steps from the PEFT model, and the figures come per side.

    Returns:
        seconds_per_step, generation_share, rollout_tokens_per_second, rollout_tokens_per_step (policy-sampled
        tokens, median of the timed steps), tool_use_rate; with `alternate_merged` _per_side's dict instead.
    """
    from transformers import TrainerCallback

    from agentrl.stages import grpo

    step_s: list[float] = []
    generation_s: list[float] = []
    tokens: list[int] = []
    merged: list[bool] = []

    class Timer(TrainerCallback):
        rollout = None  # grpo.ToolRollout, which times itself

        def on_step_begin(self, args, state, control, **k):
            if alternate_merged:
                self.rollout.merged = state.global_step % 2 == 1
            self.t, self.g, self.n = time.perf_counter(), self.rollout.seconds, self.rollout.tokens

        def on_step_end(self, *a, **k):
            step_s.append(time.perf_counter() - self.t)
            generation_s.append(self.rollout.seconds - self.g)
            tokens.append(self.rollout.tokens - self.n)
            merged.append(self.rollout.merged)

    with tempfile.TemporaryDirectory() as tmp:
        args = grpo.grpo_config(params, output_dir=tmp, report_to="none")
        args.max_steps, args.save_strategy, args.logging_steps = steps, "no", 1
        trainer, rollout = _grpo_trainer(params, args, Timer)
        trainer.train()
    if alternate_merged:
        return _per_side(step_s, generation_s, tokens, merged)
    use_rates = [h["tools/tool_use_rate"] for h in trainer.state.log_history if "tools/tool_use_rate" in h]
    return {
        "seconds_per_step": statistics.median(step_s[GRPO_WARMUP:]),
        "generation_share": sum(generation_s[GRPO_WARMUP:]) / sum(step_s[GRPO_WARMUP:]),
        "rollout_tokens_per_second": rollout.tokens / rollout.seconds if rollout.seconds else None,
        "rollout_tokens_per_step": statistics.median(tokens[GRPO_WARMUP:]),
        "tool_use_rate": use_rates[-1] if use_rates else None,  # the stage trainer logs tools/*
    }


def timed_grpo(params, args, model, tok, rows: list[dict], warmup: int, plan: tuple):
    """A short run (`args.max_steps` steps) of the grpo stage's trainer (grpo.build_trainer with `plan`) timed per
    optimizer step after `warmup`: wall seconds of the step, and the seconds, policy-sampled tokens (the ones of
    the returned tool/env mask, or every completion token without one) and completions of the trainer's
    `_generate`, which every rollout path (rollout_func or TRL's own loop) runs inside.

    Args:
        params: the validated params (rewards, LoRA).
        model, tok: the starting policy and its tokenizer.
        plan: (rollout_func, environment_factory), as grpo.rollout_plan gives them.

    Returns:
        (trainer, steps): steps is one dict per timed step (step_s, seconds, tokens, completions).
    """
    from datasets import Dataset
    from transformers import TrainerCallback

    from agentrl.stages import grpo

    clock = {"seconds": 0.0, "tokens": 0, "completions": 0}
    steps: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.at = time.perf_counter(), dict(clock)

        def on_step_end(self, *a, **k):
            steps.append({"step_s": time.perf_counter() - self.t, **{x: clock[x] - self.at[x] for x in clock}})

    trainer = grpo.build_trainer(params, args, model, tok, Dataset.from_list(rows), [StepClock()], plan=plan)
    generate = trainer._generate

    def timed_generate(prompts):
        start = time.perf_counter()
        out = generate(prompts)
        clock["seconds"] += time.perf_counter() - start
        completion_ids, mask = out[1], out[2]
        clock["tokens"] += int(sum(map(sum, mask)) if mask is not None else sum(map(len, completion_ids)))
        clock["completions"] += len(completion_ids)
        return out

    trainer._generate = timed_generate
    try:
        trainer.train()
    finally:
        if trainer.ledger is not None:  # TRL's pooled environments, ended as the stage ends them
            trainer.ledger.close_all()
    return trainer, steps[warmup:]


def merged_rollouts_cost(params, repeats: int, steps: int) -> dict:
    """`scripts/bench.py --merged-rollouts`: what grpo.merged_rollouts saves, on the workspace's params and models.
    One run of the stage's trainer per repeat whose steps alternate between sampling from the PEFT model and from
    the merged copy (the same machine state for both sides) -> metrics/bench_merged_rollouts.json, a summary printed.

    Args:
        params: the validated params (grpo.use_lora must be true).
        steps: timed steps per run (both sides), after 2 warm-up ones.

    Returns:
        What metrics/bench_merged_rollouts.json holds.
    """
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
    ratio, step_ratio = res["rollout_tokens_per_second_ratio"], res["seconds_per_step_ratio"]
    print(
        f"grpo.merged_rollouts on {res['machine']} ({res['threads']} threads, {res['repeats']} runs of "
        f"{res['steps_per_side']} steps per side, medians (min-max)):\n"
        f"  rollout tokens/s merged / adapter: {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})\n"
        f"  GRPO step seconds adapter / merged: {step_ratio['median']:.2f} "
        f"({step_ratio['min']:.2f}-{step_ratio['max']:.2f})\n"
        "  -> metrics/bench_merged_rollouts.json"
    )
    return res


# ---------------------------------------------------------------------------------- a machine shared with another job
# (label, torch threads, GOMP_SPINCOUNT): libgomp's own default when OMP_WAIT_POLICY is unset, agentrl's (set in
# agentrl/__init__.py), threads that sleep at once, and one thread
SHARED_SETTINGS = (
    ("libgomp default", 2, "300000"),
    ("agentrl default", 2, "1000"),
    ("passive", 2, "0"),
    ("one thread", 1, "1000"),
)
SHARED_CHILD = "import sys; from agentrl.benchmarks.training import step_beside_a_competitor as f; f(*sys.argv[1:])"


def _training_step(model: str):
    """A zero-argument training step of `model`: "tiny", the default (full weights, 32 x 128 tokens, SFT's batch),
    or a GGUF file spec such as decoding.SMOLLM2 (LoRA r=16 on every linear layer, 4 x 128 tokens)."""
    import yaml
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if model == "tiny":
        tiny = yaml.safe_load(Path("params.yaml").read_text())["model"]["tiny"]
        net, batch = Qwen3ForCausalLM(Qwen3Config(**tiny)), (32, 128)
    else:
        from peft import LoraConfig, get_peft_model

        from ..gguf_files import load_plain, locate

        net = get_peft_model(load_plain(locate(model))[0], LoraConfig(r=16, target_modules="all-linear"))
        batch = (4, 128)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, net.config.vocab_size, batch)

    def step():
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def step_beside_a_competitor(model: str, threads: str, steps: str) -> dict:
    """(A child of shared_machine_steps, its OpenMP settings in its environment.) The median seconds of a training
    step alone, then beside a process that keeps one core busy (`while True: pass`); printed as JSON."""
    torch.set_num_threads(int(threads))
    step, n = _training_step(model), int(steps)

    def median_seconds() -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    step()  # warm-up
    alone = median_seconds()
    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        shared = median_seconds()
    finally:
        competitor.kill()
        competitor.wait()
    out = {"alone_s": alone, "shared_s": shared, "slowdown": shared / alone}
    print(json.dumps(out))
    return out


def shared_machine_steps(models: dict[str, str], steps: int = 7) -> dict:
    """`make bench-shared`: per model (label -> "tiny" or a GGUF spec) and OpenMP setting (SHARED_SETTINGS), a
    training step's median seconds alone and beside one CPU-bound process, each setting in a fresh process (libgomp
    reads GOMP_SPINCOUNT when it loads)."""
    rows = []
    for label, model in models.items():
        for setting, threads, spin in SHARED_SETTINGS:
            env = {**os.environ, "GOMP_SPINCOUNT": spin}
            argv = [sys.executable, "-c", SHARED_CHILD, model, str(threads), str(steps)]
            out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"model": label, "setting": setting, "threads": threads, "spin_count": spin, **result})
            print(f"{label:8} {setting:16} {result['alone_s']:.3f} s alone, {result['shared_s']:.3f} s shared")
    return {"machine": machine(), "steps": steps, "rows": rows}


def shared_machine_table(result: dict) -> str:
    """docs/benchmarks.md's table of shared_machine_steps."""
    lines = [
        f"{result['machine']}; median of {result['steps']} steps each, one run, nothing else on the machine but the "
        "competitor.",
        "",
        "| model | setting | threads | GOMP_SPINCOUNT | alone s/step | beside a busy process | slowdown |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['setting']} | {r['threads']} | {r['spin_count']} | {r['alone_s']:.3f} | "
            f"{r['shared_s']:.3f} | {r['slowdown']:.2f}x |"
        )
    return "\n".join(lines) + "\n"
