"""Model loading in one place: the tiny Qwen3 + tokenizer builder, hub loading, LoRA configs,
and loading the policy of any stage (base, sft, grpo, merged) for evaluation and export.

Stage chain on disk:
  models/base/    full model + tokenizer (tiny: built here; hub: from_pretrained at model.revision)
  models/sft/     LoRA adapter over models/base (or a full model when sft.use_lora is false)
  models/grpo/    LoRA adapter over base+SFT merged (the SFT adapter is merged first, then a new
                  LoRA is trained; see README)
  models/merged/  base+SFT+GRPO merged, plain transformers model
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from .config import TinyModelParams
from .passthrough import build_passthrough

MODELS = Path("models")
STAGE_DIRS = {"base": MODELS / "base", "sft": MODELS / "sft", "grpo": MODELS / "grpo", "merged": MODELS / "merged"}
EXPORT_CHECK = "export_check.json"  # export's verdict on the model files beside it (stages/export.py)


def export_check_problem(directory: str | Path) -> Optional[str]:
    """Why a model directory that export wrote must not be used: its export_check.json says the merge check failed
    or never finished (a kill inside export leaves models/merged.partial so); None for a verified model or a
    directory export did not write (no such file)."""
    import json

    record = Path(directory) / EXPORT_CHECK
    if not record.is_file():
        return None
    try:
        passed = json.loads(record.read_text()).get("passed")
    except (ValueError, AttributeError):
        passed = None
    if passed is True:
        return None
    return f"{record}: export's merge check {'failed' if passed is False else 'did not finish'}; not a verified model"


CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ------------------------------------------------------------------------------- tiny builder
def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with every digit its own token, Qwen-style chat template, pad/eos set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok) -> PreTrainedTokenizerFast:
    """A `tokenizers.Tokenizer` with SPECIAL_TOKENS as the project's transformers tokenizer: eos <|im_end|>,
    pad <|endoftext|>, no bos/unk, the Qwen-style chat template, left padding."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    fast.model_max_length = 4096
    return fast


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, tiny: TinyModelParams, seed: int) -> Qwen3ForCausalLM:
    """The default model: a Qwen3-architecture model of `tiny`'s shape, initialised from `seed`."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        head_dim=tiny.head_dim,
        max_position_embeddings=tiny.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
    )
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


# ---------------------------------------------------------------------------------- loading
def load_tokenizer(path: str | Path, revision: Optional[str] = None) -> PreTrainedTokenizerFast:
    """A saved tokenizer (a directory, or a hub name at `revision`) with a pad token and left padding."""
    tok = AutoTokenizer.from_pretrained(str(path), revision=revision)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def bake_chat_template_kwargs(tokenizer, kwargs: dict):
    """Fix chat-template variables (model.chat_template_kwargs, e.g. Qwen3's enable_thinking: false) inside
    the template itself, so every apply_chat_template call (SFT, GRPO, evaluation, serving) renders alike."""
    import json

    if not kwargs:
        return tokenizer
    if not tokenizer.chat_template:
        raise ValueError("model.chat_template_kwargs is set but the tokenizer has no chat template")
    literal = {True: "true", False: "false", None: "none"}
    lines = "".join(
        f"{{%- set {k} = {literal[v] if v is None or isinstance(v, bool) else json.dumps(v)} %}}"
        for k, v in kwargs.items()
    )
    tokenizer.chat_template = lines + tokenizer.chat_template
    return tokenizer


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    revision: Optional[str] = None,
    attn_implementation: Optional[str] = None,
):
    """from_pretrained straight into `dtype` (no fp32 load then cast). Training stages call it after their
    TRL config exists, so under DeepSpeed ZeRO-3 (zero3_init_flag) the weights are partitioned as they load.
    attn_implementation: model.attn_implementation (None: transformers' default)."""
    kw = {"revision": revision} if revision else {}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kw)


def _zero3_gathered(model):
    """Under DeepSpeed ZeRO-3 (partitioned at load) the full weights are gathered for an in-place edit such
    as a LoRA merge, and re-partitioned afterwards; otherwise a no-op."""
    from contextlib import nullcontext

    from transformers.integrations import is_deepspeed_zero3_enabled

    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not (is_deepspeed_zero3_enabled() and partitioned):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)


def is_adapter(path: str | Path) -> bool:
    """Whether a saved model folder holds a LoRA adapter (not whole weights)."""
    return (Path(path) / "adapter_config.json").exists()


def attach(model, path: str | Path, merge: bool):
    """Apply a stage's result on top of `model`: a LoRA adapter (merged or kept) or a full model."""
    if is_adapter(path):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(path))
        if not merge:
            return model
        with _zero3_gathered(model):
            return model.merge_and_unload()
    return load_model(path, dtype=model.dtype, attn_implementation=model.config._attn_implementation)


def load_policy(stage: str, dtype: torch.dtype = torch.float32, merge: bool = True):
    """(model, tokenizer) of a stage's policy: base, sft, grpo (chain of adapters) or merged."""
    chains = {"base": ["base"], "merged": ["merged"], "sft": ["base", "sft"], "grpo": ["base", "sft", "grpo"]}
    if stage not in chains:
        raise ValueError(f"unknown stage '{stage}'; expected base, sft, grpo or merged")
    for needed in chains[stage]:
        if not (Path(STAGE_DIRS[needed]) / "config.json").exists() and not is_adapter(STAGE_DIRS[needed]):
            producer = "export" if needed == "merged" else needed
            raise FileNotFoundError(
                f"{STAGE_DIRS[needed]} holds no model or adapter: run the '{producer}' stage "
                f"first (dvc repro {producer})"
            )
    if stage in ("base", "merged"):
        return load_model(STAGE_DIRS[stage], dtype), load_tokenizer(STAGE_DIRS[stage])
    model = load_model(STAGE_DIRS["base"], dtype)
    model = attach(model, STAGE_DIRS["sft"], merge=(stage == "grpo") or merge)
    if stage == "grpo":
        model = attach(model, STAGE_DIRS["grpo"], merge=merge)
    return model, load_tokenizer(STAGE_DIRS[stage])


def lora_config(lora: dict, path: str):
    """peft.LoraConfig(**<stage>.lora) with task_type CAUSAL_LM (the one value the stage sets)."""
    return build_passthrough(path, lora)


def save_stage_result(trainer, tokenizer, out_dir: Path, metrics_path: str, metrics: dict) -> None:
    """Save a training stage's model (adapter or full), tokenizer and metrics into a clean out_dir.

    save_model runs on every rank (ZeRO-3 gathers the shards there); the rest on rank 0 only."""
    import shutil

    from .common import is_main_process, write_metrics

    if is_main_process() and out_dir.exists():
        shutil.rmtree(out_dir)  # no stale adapter/full-model files from an earlier run
    trainer.save_model(str(out_dir))
    if is_main_process():
        tokenizer.padding_side = "left"  # generation pads left
        tokenizer.save_pretrained(out_dir)
        write_metrics(metrics_path, metrics)
