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


def _token_counts(batches: list[dict]) -> dict:
    """One step's collated batches: the attended tokens of each row, the tokens computed (padding included) and
    the tokens with a label (the ones the loss scores)."""
    return {
        "rows": [int(n) for b in batches for n in b["attention_mask"].sum(-1)],
        "padded": sum(b["input_ids"].numel() for b in batches),
        "labelled": sum(int((b["labels"] != -100).sum()) for b in batches),
    }


def sft_step_times(params, trl_defaults: bool, steps: int = STEPS, warmup: int = SFT_WARMUP) -> dict:
    """Seconds per optimizer step of SFTTrainer, each paired with a plain PyTorch step on the same batch.

    The trainer's step is the wall time from the end of one step to the end of the next (data loading,
    collation, forward/backward, clipping, optimizer and scheduler, logging: everything it does per step),
    less the plain step run in between. The plain step runs forward (HF loss on the collated labels),
    backward, clip, fused AdamW on a second copy of the same model, right after the trainer's step on the
    same collated batch, so both see the same sequence lengths and the same machine state.

    Args:
        params: the validated params (the workspace's models/base and sft data).
        trl_defaults: time SFTConfig's defaults instead of params.yaml's config.
        steps: optimizer steps; the medians are of the steps after the first `warmup`.

    Returns:
        {"trainer", "plain_loop", "paired_ratio"}: median seconds per step and median trainer / plain;
        "tokens_per_step" (median attended tokens of a step's batches) and "mean_sequence_tokens" (over the timed
        steps' rows), for the model FLOPs; "padded_tokens_per_step" (the tokens computed, padding included) and
        "labelled_tokens_per_step" (those the loss scores).
    """
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from agentrl.modeling import STAGE_DIRS, load_model, load_tokenizer
    from agentrl.stages import sft
    from agentrl.stages import training as stage

    stage.fused_lm_head_positions(params.model.lm_head_positions)
    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"
    dataset = sft.dataset(tok, params)  # what the stage trains on, tokenized as the tool loop produces it
    plain, optimizer = _plain_twin(params, stage)
    batches: list[dict] = []
    trainer_s: list[float] = []
    plain_s: list[float] = []
    counted: list[dict] = []  # per step, _token_counts of its batches

    class Paired(TrainerCallback):
        last, used = None, 0  # end of the previous step; collated batches already paired

        def on_step_begin(self, *a, **k):
            if self.last is None:  # first step: from its start
                self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            trainer_s.append(time.perf_counter() - self.last)
            plain_s.append(_plain_step(plain, optimizer, batches[self.used :], params.sft.trainer["max_grad_norm"]))
            counted.append(_token_counts(batches[self.used :]))
            self.used = len(batches)
            self.last = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        args = _sft_args(params, trl_defaults, tmp, params.sft.trainer["per_device_train_batch_size"], steps)
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
    timed, pairs = counted[warmup:], list(zip(trainer_s[warmup:], plain_s[warmup:]))
    return {
        "trainer": statistics.median(t for t, _ in pairs),
        "plain_loop": statistics.median(p for _, p in pairs),
        "paired_ratio": statistics.median(t / p for t, p in pairs),
        "tokens_per_step": statistics.median(sum(c["rows"]) for c in timed),
        "mean_sequence_tokens": statistics.mean(n for c in timed for n in c["rows"]),
        "padded_tokens_per_step": statistics.median(c["padded"] for c in timed),
        "labelled_tokens_per_step": statistics.median(c["labelled"] for c in timed),
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


GRPO_PHASES = (  # timed_grpo's clock: key -> what it times
    ("seconds", "sampling (the trainer's _generate: the rollout function or TRL's own generation)"),
    ("reward_s", "reward functions (_calculate_rewards)"),
    ("logprob_forward_s", "log-prob forward passes without gradient (old/reference policy)"),
    ("training_forward_s", "the loss's forward pass (with gradient)"),
    ("backward_s", "backward (accelerator.backward)"),
    ("optimizer_s", "optimizer step"),
)


def _clocked(clock: dict, fn, key):
    """`fn` adding its wall seconds to clock[key] (`key` a string, or a function of fn's arguments giving one)."""

    def run(*args, **kwargs):
        name = key(*args, **kwargs) if callable(key) else key
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[name] += time.perf_counter() - start

    return run


def _clock_phases(trainer, clock: dict) -> None:
    """Wrap the trainer's phases (GRPO_PHASES but sampling) so that they add their seconds to `clock`, and the
    tokens of its log-prob passes to clock["logprob_tokens"] / clock["training_tokens"]."""

    def logprob_key(model, input_ids, attention_mask, *args, **kwargs) -> str:
        grad = torch.is_grad_enabled()
        clock["training_tokens" if grad else "logprob_tokens"] += int(attention_mask.sum())
        return "training_forward_s" if grad else "logprob_forward_s"

    trainer._calculate_rewards = _clocked(clock, trainer._calculate_rewards, "reward_s")
    trainer._get_per_token_logps_and_entropies = _clocked(
        clock, trainer._get_per_token_logps_and_entropies, logprob_key
    )
    trainer.accelerator.backward = _clocked(clock, trainer.accelerator.backward, "backward_s")


def timed_grpo(params, args, model, tok, rows: list[dict], warmup: int, plan: tuple):
    """A short run (`args.max_steps` steps) of the grpo stage's trainer (grpo.build_trainer with `plan`) timed per
    optimizer step after `warmup`: wall seconds of the step, and the seconds, policy-sampled tokens (the ones of
    the returned tool/env mask, or every completion token without one), completions and prompt + completion tokens
    of the trainer's `_generate`, which every rollout path (rollout_func or TRL's own loop) runs inside; and the
    seconds of the step's other phases (GRPO_PHASES) with the tokens its log-prob passes computed.

    Args:
        params: the validated params (rewards, LoRA).
        model, tok: the starting policy and its tokenizer.
        plan: (rollout_func, environment_factory), as grpo.rollout_plan gives them.

    Returns:
        (trainer, steps): steps is one dict per timed step (step_s, the GRPO_PHASES keys, tokens, completions,
        sequence_tokens, completion_tokens, logprob_tokens, training_tokens).
    """
    from datasets import Dataset
    from transformers import TrainerCallback

    from agentrl.stages import grpo

    counters = ("tokens", "completions", "sequence_tokens", "completion_tokens", "logprob_tokens", "training_tokens")
    clock = {**{key: 0.0 for key, _ in GRPO_PHASES}, **dict.fromkeys(counters, 0)}
    steps: list[dict] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t, self.at = time.perf_counter(), dict(clock)

        def on_pre_optimizer_step(self, *a, **k):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            clock["optimizer_s"] += time.perf_counter() - self.optimizer_start

        def on_step_end(self, *a, **k):
            steps.append({"step_s": time.perf_counter() - self.t, **{x: clock[x] - self.at[x] for x in clock}})

    trainer = grpo.build_trainer(params, args, model, tok, Dataset.from_list(rows), [StepClock()], plan=plan)
    generate = trainer._generate
    _clock_phases(trainer, clock)

    def timed_generate(prompts):
        start = time.perf_counter()
        out = generate(prompts)
        clock["seconds"] += time.perf_counter() - start
        prompt_ids, completion_ids, mask = out[0], out[1], out[2]
        clock["tokens"] += int(sum(map(sum, mask)) if mask is not None else sum(map(len, completion_ids)))
        clock["completions"] += len(completion_ids)
        clock["completion_tokens"] += sum(map(len, completion_ids))
        clock["sequence_tokens"] += sum(map(len, prompt_ids)) + sum(map(len, completion_ids))
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


# ------------------------------------------------------- the real model's SFT and GRPO steps (make bench-real-steps)
AS_SHIPPED = {"model.lm_head_positions": "all"}  # TRL 1.16's own CPU path: its fused LM head scores every position
LABELLED = {"model.lm_head_positions": "labelled"}
SFT_VARIANTS = (  # (label, params changes): TRL as shipped, then each lever added
    (
        "TRL as shipped: random batches, every position scored",
        {**AS_SHIPPED, "sft.trainer.train_sampling_strategy": "random"},
    ),
    (
        "labelled positions scored (model.lm_head_positions)",
        {**LABELLED, "sft.trainer.train_sampling_strategy": "random"},
    ),
    (
        "labelled, batches grouped by length (train_sampling_strategy)",
        {**LABELLED, "sft.trainer.train_sampling_strategy": "group_by_length"},
    ),
)
PEFT_ROLLOUTS = {"grpo.merged_rollouts": False, "grpo.rollout_linear_kernels": "aten"}  # sampling from the PEFT model
GRPO_SIDES = (  # (label, the project's rollout function?, params changes)
    ("TRL as shipped: its own generation, every position scored", False, {**AS_SHIPPED, **PEFT_ROLLOUTS}),
    ("TRL's own generation, labelled positions scored", False, {**LABELLED, **PEFT_ROLLOUTS}),
    ("our tool loop on the PEFT model", True, {**LABELLED, **PEFT_ROLLOUTS}),
    ("our tool loop on the merged copy, onednn (the recipe's sampling)", True,
     {**LABELLED, "grpo.merged_rollouts": True, "grpo.rollout_linear_kernels": "onednn"}),
)  # fmt: skip
START_SFT_STEPS = 12  # SFT steps before the GRPO sides: SmolLM2 writes the '####' answer form after ~6


def _variant(tree: dict, changes: dict):
    """Validated params from a params tree with dotted-key `changes` applied."""
    import copy

    from agentrl.config import validate_params
    from agentrl.experiments.overrides import set_value

    tree = copy.deepcopy(tree)
    for dotted, value in changes.items():
        set_value(tree, dotted, value)
    return validate_params(tree)


def grpo_phase_figures(steps: list[dict], dims: dict, adapted_layers: int, peak: float) -> dict:
    """One side's GRPO step by phase (timed_grpo's steps): mean seconds per step of each phase, its model FLOPs and
    MFU against `peak`. Sampling computes a forward pass at every position (the LM head at sampled tokens only);
    the loss's forward pass every position (the LM head at completion tokens only); backward the activation
    gradients of the LoRA-adapted upper `adapted_layers` layers and the LM head (no weight gradient for frozen
    weights; the adapters' own FLOPs are left out, so each MFU is a lower bound)."""
    from .measure import flops_per_token

    mean = {k: statistics.mean(s[k] for s in steps) for k in steps[0]}
    context = mean["sequence_tokens"] / mean["completions"]
    head = 2 * dims["vocab_size"] * dims["hidden_size"]  # the LM head's FLOPs per position it scores
    body = flops_per_token(dims, context, "forward") - head
    upper = {**dims, "num_hidden_layers": adapted_layers}
    backward_body = flops_per_token(upper, context, "train_frozen") - flops_per_token(upper, context, "forward") - head
    sampling_body = flops_per_token(dims, context / 2, "forward") - head
    completion_share = mean["completion_tokens"] / mean["sequence_tokens"]  # the positions the loss scores
    flops = {
        "seconds": mean["sequence_tokens"] * sampling_body + mean["tokens"] * head,
        "logprob_forward_s": mean["logprob_tokens"] * (body + completion_share * head),
        "training_forward_s": mean["training_tokens"] * (body + completion_share * head),
        "backward_s": mean["training_tokens"] * (backward_body + completion_share * head),
    }
    phases = {
        key: {
            "seconds": mean[key],
            "flops": flops.get(key),
            "mfu": flops[key] / mean[key] / peak if key in flops and mean[key] > 0 else None,
        }
        for key, _ in GRPO_PHASES
    }
    return {
        "steps": len(steps),
        "seconds_per_step": statistics.median(s["step_s"] for s in steps),
        "mean_step_s": mean["step_s"],
        "phases": phases,
        "other_s": mean["step_s"] - sum(mean[key] for key, _ in GRPO_PHASES),
        "step_mfu": sum(flops.values()) / mean["step_s"] / peak,
        "completions_per_step": mean["completions"],
        "sampled_tokens_per_completion": mean["tokens"] / mean["completions"],
        "sequence_tokens_per_completion": context,
        "sampled_tokens_per_second": mean["tokens"] / mean["seconds"],
    }


def _sft_flops(run: dict, dims: dict, peak: float) -> dict:
    """An SFT step's model FLOPs per attended token and MFU (sft_step_times' run): LoRA training of every layer at
    every attended token, the LM head's (forward and activation gradient) at the labelled ones only."""
    from .measure import flops_per_token

    head = 2 * dims["vocab_size"] * dims["hidden_size"]
    flops = run["tokens_per_step"] * (flops_per_token(dims, run["mean_sequence_tokens"], "train_frozen") - 2 * head)
    flops += run["labelled_tokens_per_step"] * 2 * head
    return {"flops_per_token": flops / run["tokens_per_step"], "mfu": flops / run["trainer"] / peak}


def _grpo_side(params, rollout_func: bool, tok, rows: list[dict], steps: int, warmup: int) -> tuple[list, dict]:
    """timed_grpo's steps for one of GRPO_SIDES, the policy loaded afresh (models/base with models/sft merged), and
    what ran: the positions TRL's LM head scored; {"rollout_func": false} for TRL's own generation, else the
    ToolRollout's merged flag and kernels and the Linear layers of the copy it sampled from that ran on oneDNN (none
    for the PEFT model)."""
    import trl.trainer.utils as trl_utils

    from agentrl.agent.linear_kernels import OneDNNLinear
    from agentrl.stages import grpo

    with tempfile.TemporaryDirectory() as out:
        args = grpo.grpo_config(params, output_dir=out, report_to="none")
        args.max_steps, args.save_strategy, args.logging_steps = steps + warmup, "no", 1
        rollout = grpo.rollout_plan(params, args, tok)[0] if rollout_func else None
        timed = timed_grpo(params, args, grpo.starting_model(params), tok, rows, warmup, (rollout, None))[1]
    compact = trl_utils._use_triton(torch.device("cpu"))  # what TRL's fused LM head scored, as build_trainer set it
    ran = {"lm_head_positions": "labelled" if compact else "all", "rollout_func": rollout is not None}
    if rollout is not None:
        packed = 0 if rollout.plain is None else sum(isinstance(m, OneDNNLinear) for m in rollout.plain.modules())
        ran.update(merged=rollout.merged, kernels=rollout.kernels, onednn_layers=packed)
    return timed, ran


def real_training_steps(
    recipe: Path, sft_steps: int, grpo_steps: int, rounds: int, start_sft_steps: int = START_SFT_STEPS
) -> dict:
    """`make bench-real-steps`: the recipe's SFT step (per SFT_VARIANTS) and GRPO step (per GRPO_SIDES, taking turns
    for `rounds` rounds) on its real model, in a scratch workspace (the prepare and base stages, then `start_sft_steps`
    of the sft stage for the policy GRPO starts from), against the fp32 GEMM peak measured in the same run (at the
    start, in the middle and at the end: the highest)."""
    import contextlib

    import yaml
    from transformers import AutoConfig

    from agentrl.data import load_jsonl
    from agentrl.experiments.recipe import applied_text
    from agentrl.modeling import STAGE_DIRS, load_tokenizer
    from agentrl.stages import base, grpo, prepare, sft

    from .measure import matmul_peak, model_dims

    tree = yaml.safe_load(applied_text(Path("params.yaml").read_text(), [recipe]))
    params = _variant(tree, {})
    # every variant validated before any work
    sft_params = {label: _variant(tree, changes) for label, changes in SFT_VARIANTS}
    grpo_params = {label: (rollout_func, _variant(tree, changes)) for label, rollout_func, changes in GRPO_SIDES}
    layers = params.grpo.lora.get("layers_to_transform")
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        prepare.prepare(params)
        base.from_gguf(params)
        dims = model_dims(AutoConfig.from_pretrained(STAGE_DIRS["base"]), str(recipe))
        peaks = [matmul_peak()["flops_per_second"]]
        sft_runs = {label: sft_step_times(variant, False, sft_steps + 2, 2) for label, variant in sft_params.items()}
        # the policy GRPO starts from, trained by the stage (its trackers off: W&B would keep a log handler on
        # this scratch directory after it is gone)
        sft.train(_variant(tree, {"sft.trainer.max_steps": start_sft_steps, "tracking.report_to": []}))
        peaks.append(matmul_peak()["flops_per_second"])
        tok, rows = load_tokenizer(STAGE_DIRS["sft"]), load_jsonl(grpo.DATA)
        timed: dict[str, list] = {label: [] for label in grpo_params}
        ran: dict[str, dict] = {}
        for _ in range(rounds):
            for label, (rollout_func, variant) in grpo_params.items():
                steps, ran[label] = _grpo_side(variant, rollout_func, tok, rows, grpo_steps, 1)
                timed[label] += steps
        peaks.append(matmul_peak()["flops_per_second"])
    peak = max(peaks)  # the machine's peak: a measurement disturbed by the VM's neighbours only lowers it
    for run in sft_runs.values():
        run.update(_sft_flops(run, dims, peak))
    adapted = len(layers) if layers else dims["num_hidden_layers"]
    sides = {
        label: {**grpo_phase_figures(steps, dims, adapted, peak), "ran": ran[label]} for label, steps in timed.items()
    }
    stock = sides[GRPO_SIDES[0][0]]["mean_step_s"]  # TRL as shipped
    for side in sides.values():
        side["speedup_over_stock"] = stock / side["mean_step_s"]
    return {
        "machine": machine(),
        "threads": torch.get_num_threads(),
        "recipe": str(recipe),
        "matmul_peak_flops_per_second": peak,
        "matmul_peaks_measured": peaks,
        "sft": sft_runs,
        "grpo_rounds": rounds,
        "grpo": sides,
    }


def real_steps_table(result: dict) -> str:
    """BENCHMARKS-real.md's training section from real_training_steps' result."""
    peak = result["matmul_peak_flops_per_second"]
    lines = [
        "## Training steps (`make bench-real-steps`)",
        "",
        f"Measured in one run on {result['machine']}, {result['threads']} torch threads, alone on the machine; "
        f"`{result['recipe']}`'s SFT and GRPO configs on its model, in a scratch workspace. MFU: model FLOPs over the "
        f"fp32 GEMM peak measured in the same run ({peak / 1e9:.1f} GFLOP/s, the highest of "
        + ", ".join(f"{x / 1e9:.1f}" for x in result["matmul_peaks_measured"])
        + " at its start, middle and end); tokens are the attended ones (padding is computed, not counted); the "
        "LM head's FLOPs are counted at the positions the loss scores.",
        "",
        "| SFT step | trainer s/step | plain PyTorch s/step | tokens/step (computed) | GFLOP/token | MFU |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, run in result["sft"].items():
        lines.append(
            f"| {label} | {run['trainer']:.2f} | {run['plain_loop']:.2f} | {run['tokens_per_step']:.0f} "
            f"({run['padded_tokens_per_step']:.0f}) | {run['flops_per_token'] / 1e9:.2f} | {run['mfu']:.0%} |"
        )
    lines += [
        "",
        f"GRPO step ({result['grpo_rounds']} rounds, the sides taking turns, each from the same SFT policy): mean "
        "seconds per step by phase, each phase's MFU in brackets; `other`: the rest of the step (tokenizing, "
        "advantages, logging).",
        "",
        "| GRPO step | s/step | " + " | ".join(label.split(" (")[0] for _, label in GRPO_PHASES) + " | other | "
        "sampled tokens/completion | sampled tok/s | step MFU | vs TRL as shipped |",
        "|---|" + "---:|" * (len(GRPO_PHASES) + 6),
    ]
    for label, side in result["grpo"].items():
        cells = [
            f"{p['seconds']:.2f}" + (f" ({p['mfu']:.0%})" if p["mfu"] is not None else "")
            for p in side["phases"].values()
        ]
        lines.append(
            f"| {label} | {side['mean_step_s']:.2f} | " + " | ".join(cells) + f" | {side['other_s']:.2f} | "
            f"{side['sampled_tokens_per_completion']:.1f} | {side['sampled_tokens_per_second']:.1f} | "
            f"{side['step_mfu']:.0%} | {side['speedup_over_stock']:.2f}x |"
        )
    return "\n".join(lines) + "\n"
