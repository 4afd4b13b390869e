"""Stage `sft`: supervised fine-tuning of models/base with TRL's SFTTrainer and a PEFT LoRA.

Reads data/prepared/sft_train.jsonl (conversational prompt/completion), trains with the loss on
completion tokens only, checkpoints every sft.trainer.save_steps into checkpoints/sft/ (outside DVC: a
killed run resumes from its last checkpoint on the next `dvc repro`), and saves the adapter and tokenizer
to models/sft/ plus metrics/sft_train.json.
"""

from __future__ import annotations

from typing import Optional

from ..agent.loop import sft_features
from ..agent.tools import toolset_from_params
from ..common import file_digest, get_logger, model_files_digest, resolve_precision, torch_dtype
from ..config import Params
from ..data import load_jsonl
from ..envs.openenv_client import OpenEnvError
from ..modeling import STAGE_DIRS, load_model, load_tokenizer
from . import training

DATA = "data/prepared/sft_train.jsonl"
CHECKPOINTS = "checkpoints/sft"
METRICS = "metrics/sft_train.json"
log = get_logger("sft")


def sft_config(params: Params, output_dir: str = CHECKPOINTS, **tracking_kwargs):
    """trl.SFTConfig(**sft.trainer) plus what the stage derives (training.trainer_config).

    Args:
        **tracking_kwargs: report_to, run_name.
    """
    return training.trainer_config(params, "sft", output_dir, **tracking_kwargs)


def dataset(tok, params: Params):
    """data/prepared/sft_train.jsonl tokenized segment by segment as the tool loop produces it: the tool's
    results (`24>>` after `<<48/2=`) are in the input but masked out of the loss (agent.py: sft_features).

    Returns:
        The datasets.Dataset of input_ids and completion_mask.
    """
    from datasets import Dataset

    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    rows = load_jsonl(DATA)
    if not rows:
        raise ValueError(f"{DATA}: no training examples")
    feats = [sft_features(tok, r["prompt"], r["completion"][0]["content"], toolset, r) for r in rows]
    check_lengths(feats, params)
    check_calls([f.pop("tool_calls") for f in feats], rows, params)
    return Dataset.from_list(feats)


def check_lengths(feats: list[dict], params: Params) -> None:
    """Stop before training when sft.trainer.max_length would leave no trainable example: TRL truncates each
    example to max_length and drops those whose completion is then fully masked, and an empty dataset fails
    deep inside the sampler (`num_samples=0`). Names the key, the lengths needed and the cause.

    Args:
        feats: the tokenized examples (sft_features).
    """
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


def check_calls(calls: list[int], rows: list[dict], params: Params) -> Optional[str]:
    """Warn (and return the warning) when demonstrations make more tool calls than agent.max_tool_calls: the loop
    ends a completion at that many calls in evaluation, GRPO and serving, so SFT would teach episodes the policy
    is never let finish (a gridworld with `demo_look` looks before every move: twice the calls).

    Args:
        calls: tool calls per demonstration.
        rows: the SFT rows, in the same order.

    Returns:
        The warning, or None.
    """
    limit = params.agent.max_tool_calls
    over = [(n, r.get("id", i)) for i, (n, r) in enumerate(zip(calls, rows)) if n > limit]
    if not over:
        return None
    most, row = max(over, key=lambda o: o[0])
    msg = (
        f"{len(over)} of {len(calls)} demonstrations in {DATA} make more than agent.max_tool_calls={limit} tool "
        f"calls (most: {most}, row {row}); evaluation, GRPO and the server end a completion at {limit} calls. "
        f"Raise agent.max_tool_calls to {most} to let the policy finish what it is taught"
    )
    log.warning(msg)
    return msg


def train(params: Params) -> dict:
    """Train the SFT stage: TRL's SFTTrainer on the tool-loop-tokenized demonstrations; saves models/sft and
    metrics/sft_train.json.

    Returns:
        The metrics written to metrics/sft_train.json.
    """
    from trl import SFTTrainer

    args, callbacks = training.start(params, "sft", sft_config)
    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"  # training pads right; generation pads left
    model = load_model(
        STAGE_DIRS["base"],
        dtype=torch_dtype(params.model.precision),
        attn_implementation=params.model.attn_implementation,
    )
    ds = dataset(tok, params)
    eff = training.effective_batch(args.per_device_train_batch_size, args.gradient_accumulation_steps)
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
    resume = training.resume_checkpoint(
        args,
        params,
        "sft",
        params.seed,
        params.sft.model_dump(),
        params.model.model_dump(),
        params.agent.model_dump(),
        file_digest(DATA),
        model_files_digest(STAGE_DIRS["base"]),
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        peft_config=training.peft_config(params, "sft"),
        callbacks=callbacks,
    )
    out, run = training.train(trainer, resume)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = {
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "train_loss": out.training_loss,
        "train_samples_per_second": out.metrics.get("train_samples_per_second"),
        "effective_batch": eff,
        "use_lora": params.sft.use_lora,
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        **run,
    }
    training.save(trainer, tok, "sft", METRICS, metrics)
    log.info(
        "loss %.3f -> %.3f in %d steps (%.1fs); saved %s",
        metrics["first_loss"] or 0,
        metrics["final_loss"] or 0,
        metrics["steps"],
        metrics["runtime_s"],
        STAGE_DIRS["sft"],
    )
    return metrics


if __name__ == "__main__":
    training.main("sft", train, OpenEnvError)  # an unreachable agent.environment_url: one line naming it
