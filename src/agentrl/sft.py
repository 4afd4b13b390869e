"""Stage `sft`: supervised fine-tuning of models/base with TRL's SFTTrainer and a PEFT LoRA.

Reads data/prepared/sft_train.jsonl (conversational prompt/completion), trains with the loss on
completion tokens only, checkpoints every sft.save_steps into checkpoints/sft/ (a DVC `persist`
out: a killed run resumes from its last checkpoint on the next `dvc repro`), and saves the adapter
and tokenizer to models/sft/ plus metrics/sft_train.json.
"""
from __future__ import annotations

import time

from .common import (
    code_files, configure_cpu_threads, effective_batch, file_digest, fingerprint, get_logger, is_main_process,
    peak_rss_mb, precision_kwargs, resolve_precision, resumable_checkpoint, stage_learning_rate,
)
from .config import Params, load_params_or_exit
from .modeling import STAGE_DIRS, save_stage_result, load_model, load_tokenizer, lora_config

DATA = "data/prepared/sft_train.jsonl"
CHECKPOINTS = "checkpoints/sft"
METRICS = "metrics/sft_train.json"
log = get_logger("sft")


def learning_rate(params: Params) -> float:
    return stage_learning_rate(params.sft, params.distributed)


def sft_config(params: Params, output_dir: str = CHECKPOINTS, **tracking_kwargs):
    """Every sft.* knob -> TRL's SFTConfig (tests check that none is dropped)."""
    from trl import SFTConfig

    s = params.sft
    return SFTConfig(
        output_dir=output_dir,
        learning_rate=learning_rate(params),
        num_train_epochs=s.num_epochs,
        max_steps=s.max_steps,
        per_device_train_batch_size=s.per_device_train_batch_size,
        gradient_accumulation_steps=s.gradient_accumulation_steps,
        warmup_steps=s.warmup_ratio,  # a float < 1 is a ratio of the total steps
        lr_scheduler_type=s.lr_scheduler_type,
        weight_decay=s.weight_decay,
        max_grad_norm=s.max_grad_norm,
        gradient_checkpointing=s.gradient_checkpointing,
        max_length=s.max_length,
        completion_only_loss=True,
        packing=False,
        logging_steps=s.logging_steps,
        save_strategy="steps",
        save_steps=s.save_steps,
        save_total_limit=s.save_total_limit,
        seed=params.seed,
        data_seed=params.seed,
        dataloader_num_workers=0,
        **precision_kwargs(params.model.precision),
        **tracking_kwargs,
    )


def peft_config(params: Params):
    return lora_config(params.sft.lora) if params.sft.use_lora else None


def train(params: Params) -> dict:
    from datasets import load_dataset
    from transformers import set_seed
    from trl import SFTTrainer

    from . import tracking

    set_seed(params.seed)
    configure_cpu_threads()
    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"  # training pads right; generation pads left
    model = load_model(STAGE_DIRS["base"])
    ds = load_dataset("json", data_files=DATA, split="train")
    track = tracking.setup(params, "sft")
    callbacks = track.pop("callbacks")
    args = sft_config(params, **track)
    eff = effective_batch(params.sft.per_device_train_batch_size, params.sft.gradient_accumulation_steps)
    log.info("%d examples; precision %s; effective batch %d (per device %d x %d processes x accum %d); lr %.3g; "
             "lora=%s", len(ds), resolve_precision(params.model.precision), eff,
             params.sft.per_device_train_batch_size, eff // (params.sft.per_device_train_batch_size *
             params.sft.gradient_accumulation_steps), params.sft.gradient_accumulation_steps, args.learning_rate,
             params.sft.use_lora)
    key = fingerprint(params.seed, params.sft.model_dump(), params.model.model_dump(), file_digest(DATA),
                      *(file_digest(p) for p in code_files()),
                      file_digest(STAGE_DIRS["base"] / "model.safetensors"))
    with args.main_process_first(local=False, desc="checkpoint fingerprint"):  # rank 0 clears a stale dir first
        resume = resumable_checkpoint(CHECKPOINTS, key)
    if resume:
        log.info("resuming from %s", resume)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                         peft_config=peft_config(params), callbacks=callbacks)
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
        "seconds_per_step": round(runtime / max(1, out.global_step), 4),
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
        log.info("loss %.3f -> %.3f in %d steps (%.1fs); saved %s", metrics["first_loss"] or 0,
                 metrics["final_loss"] or 0, metrics["steps"], runtime, STAGE_DIRS["sft"])
    return metrics


def main() -> None:
    train(load_params_or_exit())


if __name__ == "__main__":
    main()
