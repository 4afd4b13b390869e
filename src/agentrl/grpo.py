"""Stage `grpo`: reinforcement learning with TRL's GRPOTrainer and a fresh LoRA over the SFT model.

Start point: the SFT adapter is merged into the base weights (models/base + models/sft), then a new
LoRA from grpo.lora.* is trained on top (grpo.use_lora: false trains all weights instead). The
adapter saved in models/grpo/ therefore applies to base+SFT merged; `export` merges both.

Every grpo.* knob reaches GRPOConfig (tests check it): its own learning rate (far below SFT's:
HelloAgents' shared 5e-5 collapsed Qwen3-0.6B from 57.0% to 2.4% on GSM8K), kl_coef -> beta (a
reference model is only created when beta > 0), num_generations, temperature, max_completion_length,
loss_type, scale_rewards, epochs/max_steps, batch sizes, seed. Rewards come from the registry in
rewards.py with the weights in grpo.rewards.
"""
from __future__ import annotations

import time

from .common import (
    code_files, configure_cpu_threads, file_digest, fingerprint, get_logger, is_main_process,
    peak_rss_mb, precision_kwargs, resolve_precision, resumable_checkpoint, stage_learning_rate, world_size,
)
from .config import Params, load_params_or_exit
from .modeling import STAGE_DIRS, save_stage_result, attach, load_model, load_tokenizer, lora_config
from .rewards import build_rewards

DATA = "data/prepared/rl_train.jsonl"
CHECKPOINTS = "checkpoints/grpo"
METRICS = "metrics/grpo_train.json"
log = get_logger("grpo")


class BatchConfigError(ValueError):
    pass


def check_batch(params: Params, num_processes: int | None = None) -> int:
    """The generation batch (completions per optimizer step) must divide into groups of num_generations."""
    g = params.grpo
    n = num_processes or world_size()
    gen_batch = g.per_device_train_batch_size * n * g.gradient_accumulation_steps
    if gen_batch % g.num_generations:
        raise BatchConfigError(
            f"grpo: the generation batch per_device_train_batch_size ({g.per_device_train_batch_size}) x processes "
            f"({n}) x gradient_accumulation_steps ({g.gradient_accumulation_steps}) = {gen_batch} completions must be "
            f"divisible by grpo.num_generations ({g.num_generations}); e.g. set per_device_train_batch_size to a "
            f"multiple of {g.num_generations}"
        )
    return gen_batch


def learning_rate(params: Params) -> float:
    return stage_learning_rate(params.grpo, params.distributed)


def grpo_config(params: Params, output_dir: str = CHECKPOINTS, **tracking_kwargs):
    """Every grpo.* knob -> TRL's GRPOConfig (tests check that none is dropped)."""
    from trl import GRPOConfig

    g = params.grpo
    _, weights = build_rewards(g.rewards, g.reward_kwargs.model_dump())
    return GRPOConfig(
        output_dir=output_dir,
        learning_rate=learning_rate(params),
        beta=g.kl_coef,
        num_generations=g.num_generations,
        temperature=g.temperature,
        top_p=g.top_p,
        top_k=0,
        max_completion_length=g.max_completion_length,
        loss_type=g.loss_type,
        scale_rewards=g.scale_rewards,
        reward_weights=weights,
        num_train_epochs=g.num_epochs,
        max_steps=g.max_steps,
        per_device_train_batch_size=g.per_device_train_batch_size,
        gradient_accumulation_steps=g.gradient_accumulation_steps,
        warmup_steps=g.warmup_ratio,
        lr_scheduler_type=g.lr_scheduler_type,
        weight_decay=g.weight_decay,
        max_grad_norm=g.max_grad_norm,
        gradient_checkpointing=g.gradient_checkpointing,
        logging_steps=g.logging_steps,
        save_strategy="steps",
        save_steps=g.save_steps,
        save_total_limit=g.save_total_limit,
        seed=params.seed,
        data_seed=params.seed,
        log_completions=False,
        dataloader_num_workers=0,
        **precision_kwargs(params.model.precision),
        **tracking_kwargs,
    )


def peft_config(params: Params):
    return lora_config(params.grpo.lora) if params.grpo.use_lora else None


def starting_model():
    """models/base with the SFT result merged in: the policy GRPO starts from."""
    return attach(load_model(STAGE_DIRS["base"]), STAGE_DIRS["sft"], merge=True)


def time_rollouts(trainer) -> list[float]:
    """Wrap the trainer's rollout generation with a timer; the returned one-element list accumulates the
    seconds spent generating (the generation share of a step; also used by scripts/bench.py)."""
    seconds = [0.0]
    generate_once = trainer._generate_single_turn

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        try:
            return generate_once(*a, **kw)
        finally:
            seconds[0] += time.perf_counter() - t

    trainer._generate_single_turn = timed_generate
    return seconds


def _series(history: list[dict], key: str) -> list[float]:
    return [h[key] for h in history if key in h]


def train(params: Params) -> dict:
    from datasets import load_dataset
    from transformers import set_seed
    from trl import GRPOTrainer

    from . import tracking

    gen_batch = check_batch(params)
    set_seed(params.seed)
    configure_cpu_threads()
    g = params.grpo
    funcs, _ = build_rewards(g.rewards, g.reward_kwargs.model_dump())
    tok = load_tokenizer(STAGE_DIRS["sft"])
    model = starting_model()
    ds = load_dataset("json", data_files=DATA, split="train")
    track = tracking.setup(params, "grpo")
    callbacks = track.pop("callbacks")
    args = grpo_config(params, **track)
    log.info("%d prompts; precision %s; %d completions per step (%d prompts x %d generations); lr %.3g; beta %g; "
             "rewards %s; lora=%s", len(ds), resolve_precision(params.model.precision), gen_batch,
             gen_batch // g.num_generations, g.num_generations, args.learning_rate, args.beta, g.rewards, g.use_lora)
    key = fingerprint(params.seed, g.model_dump(), file_digest(DATA), *(file_digest(p) for p in code_files()),
                      file_digest(STAGE_DIRS["base"] / "model.safetensors"),
                      *(file_digest(p) for p in sorted(STAGE_DIRS["sft"].glob("*.safetensors"))))
    with args.main_process_first(local=False, desc="checkpoint fingerprint"):  # rank 0 clears a stale dir first
        resume = resumable_checkpoint(CHECKPOINTS, key)
    if resume:
        log.info("resuming from %s", resume)
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=ds, processing_class=tok,
                          peft_config=peft_config(params), callbacks=callbacks)
    gen_seconds = time_rollouts(trainer)
    t0 = time.time()
    out = trainer.train(resume_from_checkpoint=resume)
    runtime = time.time() - t0
    hist = trainer.state.log_history
    rewards, kls = _series(hist, "reward"), _series(hist, "kl")
    lengths = _series(hist, "completions/mean_length")
    k = max(1, len(rewards) // 5)
    metrics = {
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_mean_first_20pct": sum(rewards[:k]) / k if rewards else None,
        "reward_mean_last_20pct": sum(rewards[-k:]) / k if rewards else None,
        "kl_last": kls[-1] if kls else None,
        "completion_length_first": lengths[0] if lengths else None,
        "completion_length_last": lengths[-1] if lengths else None,
        "steps": out.global_step,
        "runtime_s": round(runtime, 2),
        "seconds_per_step": round(runtime / max(1, out.global_step), 4),
        "completions_per_step": gen_batch,
        "generation_seconds": round(gen_seconds[0], 2),
        "generation_seconds_share": round(gen_seconds[0] / runtime, 4) if runtime else None,
        # tokens estimated from the logged mean completion length x completions generated
        "rollout_tokens_per_second": round(sum(lengths) / len(lengths) * gen_batch * out.global_step
                                           / gen_seconds[0], 1) if lengths and gen_seconds[0] else None,
        "learning_rate": args.learning_rate,
        "beta": args.beta,
        "resumed_from": resume,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
    }
    metrics["peak_rss_mb"] = peak_rss_mb()
    save_stage_result(trainer, tok, STAGE_DIRS["grpo"], METRICS, metrics)
    if is_main_process():
        log.info("reward %.3f -> %.3f over %d steps (%.1fs); saved %s", metrics["reward_mean_first_20pct"] or 0,
                 metrics["reward_mean_last_20pct"] or 0, metrics["steps"], runtime, STAGE_DIRS["grpo"])
    return metrics


def main() -> None:
    params = load_params_or_exit()
    try:
        train(params)
    except BatchConfigError as e:
        log.error("%s", e)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
