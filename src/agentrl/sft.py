"""Stage `sft`: supervised fine-tuning of models/base with TRL's SFTTrainer and a PEFT LoRA.

Reads data/prepared/sft_train.jsonl (conversational prompt/completion), trains with the loss on
completion tokens only, checkpoints every sft.trainer.save_steps into checkpoints/sft/ (a DVC `persist`
out: a killed run resumes from its last checkpoint on the next `dvc repro`), and saves the adapter
and tokenizer to models/sft/ plus metrics/sft_train.json.
"""

from __future__ import annotations

import time

from .agent import sft_features
from .common import (
    checkpoint_step,
    code_files,
    configure_cpu_threads,
    effective_batch,
    file_digest,
    fingerprint,
    get_logger,
    is_main_process,
    model_files_digest,
    peak_rss_mb,
    precision_kwargs,
    resolve_precision,
    resumable_checkpoint,
    run_environment_digest,
    stage_learning_rate,
    torch_dtype,
)
from .config import Params, ParamsError, build_passthrough, load_params_or_exit
from .data import load_jsonl
from .modeling import STAGE_DIRS, load_model, load_tokenizer, lora_config, save_stage_result
from .tools import toolset_from_params

DATA = "data/prepared/sft_train.jsonl"
CHECKPOINTS = "checkpoints/sft"
METRICS = "metrics/sft_train.json"
log = get_logger("sft")


def learning_rate(params: Params) -> float:
    """sft.trainer.learning_rate (the reference) after distributed.scale_lr for the effective batch."""
    return stage_learning_rate("sft", params.sft.trainer, params.distributed)


def sft_config(params: Params, output_dir: str = CHECKPOINTS, **tracking_kwargs):
    """trl.SFTConfig(**sft.trainer) plus what the stage derives (config.DERIVED): output_dir, the scaled
    learning rate, seed/data_seed, the precision flags and the tracking arguments."""
    return build_passthrough(
        "sft.trainer",
        {**params.sft.trainer, "learning_rate": learning_rate(params)},  # the reference lr, scaled
        output_dir=output_dir,
        seed=params.seed,
        data_seed=params.seed,
        **precision_kwargs(params.model.precision),
        **tracking_kwargs,
    )


def peft_config(params: Params):
    return lora_config(params.sft.lora, "sft.lora") if params.sft.use_lora else None


def dataset(tok, params: Params):
    """data/prepared/sft_train.jsonl tokenized segment by segment as the tool loop produces it: the tool's
    results (`24>>` after `<<48/2=`) are in the input but masked out of the loss (agent.py: sft_features)."""
    from datasets import Dataset

    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    rows = load_jsonl(DATA)
    if not rows:
        raise ValueError(f"{DATA}: no training examples")
    feats = [sft_features(tok, r["prompt"], r["completion"][0]["content"], toolset, r) for r in rows]
    check_lengths(feats, params)
    return Dataset.from_list(feats)


def check_lengths(feats: list[dict], params: Params) -> None:
    """Stop before training when sft.trainer.max_length would leave no trainable example: TRL truncates each
    example to max_length and drops those whose completion is then fully masked, and an empty dataset fails
    deep inside the sampler (`num_samples=0`). Names the key, the lengths needed and the cause."""
    max_length = params.sft.trainer.get("max_length")
    if not max_length:
        return
    prompt_lens = [m.index(1) if 1 in m else len(m) for m in (f["completion_mask"] for f in feats)]
    trainable = sum(p < max_length for p in prompt_lens)
    if trainable == 0:
        lens = sorted(len(f["input_ids"]) for f in feats)
        raise ValueError(
            f"sft.trainer.max_length={max_length} leaves no trainable example: every prompt is at least "
            f"{min(prompt_lens)} tokens before the first completion token (whole examples: median "
            f"{lens[len(lens) // 2]}, max {lens[-1]} tokens"
            + (", the chat format's tool descriptions included" if params.agent.format == "chat" else "")
            + f"). Raise sft.trainer.max_length to at least {lens[len(lens) // 2]} or shorten the prompts"
        )
    if trainable < len(feats):
        log.warning(
            "sft.trainer.max_length=%d: %d of %d examples have no completion token within it and are dropped",
            max_length,
            len(feats) - trainable,
            len(feats),
        )


def train(params: Params) -> dict:
    from transformers import set_seed
    from trl import SFTTrainer

    from . import tracking

    set_seed(params.seed)
    configure_cpu_threads()
    # the TRL config first: it stops on a bad sft.trainer value before any work, and it registers the
    # DeepSpeed config, so the model below is created ZeRO-3-partitioned (zero3_init_flag) in its target dtype
    track = tracking.setup(params, "sft")
    callbacks = track.pop("callbacks")
    args = sft_config(params, **track)
    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"  # training pads right; generation pads left
    model = load_model(
        STAGE_DIRS["base"],
        dtype=torch_dtype(params.model.precision),
        attn_implementation=params.model.attn_implementation,
    )
    ds = dataset(tok, params)
    eff = effective_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)
    log.info(
        "%d examples; precision %s; effective batch %d (per device %d x %d processes x accum %d); lr %.3g; lora=%s",
        len(ds),
        resolve_precision(params.model.precision),
        eff,
        args.per_device_train_batch_size,
        eff // (args.per_device_train_batch_size * args.gradient_accumulation_steps),
        args.gradient_accumulation_steps,
        args.learning_rate,
        params.sft.use_lora,
    )
    key = fingerprint(
        params.seed,
        params.sft.model_dump(),
        params.model.model_dump(),
        params.agent.model_dump(),
        file_digest(DATA),
        *(file_digest(p) for p in code_files()),
        model_files_digest(STAGE_DIRS["base"]),
        run_environment_digest(params),
    )
    with args.main_process_first(local=False, desc="checkpoint fingerprint"):  # rank 0 clears a stale dir first
        resume = resumable_checkpoint(CHECKPOINTS, key)
    if resume:
        log.info("resuming from %s", resume)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        peft_config=peft_config(params),
        callbacks=callbacks,
    )
    t0 = time.time()
    out = trainer.train(resume_from_checkpoint=resume)
    runtime = time.time() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = {
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "train_loss": out.training_loss,
        "steps": out.global_step,
        "runtime_s": round(runtime, 2),
        "train_samples_per_second": out.metrics.get("train_samples_per_second"),
        "steps_this_run": out.global_step - checkpoint_step(resume),  # a resumed run starts at its checkpoint
        "seconds_per_step": round(runtime / max(1, out.global_step - checkpoint_step(resume)), 4),
        "effective_batch": eff,
        "learning_rate": args.learning_rate,
        "resumed_from": resume,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        "use_lora": params.sft.use_lora,
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }
    metrics["peak_rss_mb"] = peak_rss_mb()
    save_stage_result(trainer, tok, STAGE_DIRS["sft"], METRICS, metrics)
    if is_main_process():
        log.info(
            "loss %.3f -> %.3f in %d steps (%.1fs); saved %s",
            metrics["first_loss"] or 0,
            metrics["final_loss"] or 0,
            metrics["steps"],
            runtime,
            STAGE_DIRS["sft"],
        )
    return metrics


def main() -> None:
    params = load_params_or_exit()
    try:
        train(params)
    except ParamsError as e:  # a value SFTConfig rejects (cross-field checks), named by its section
        log.error("%s", e)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
