"""Typed schema of params.yaml: every knob of every stage lives here.

Each stage calls `load_params()` first. Unknown keys (typos), wrong types and out-of-range values
stop the stage with one message naming the key path and what was expected, before any data or
model is touched.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PARAMS_FILE = "params.yaml"

PosInt = Field(ge=1)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, validate_default=True)


# ----------------------------------------------------------------------------------------- data
class SyntheticParams(Strict):
    num_train: int = Field(12000, ge=1)
    num_test: int = Field(500, ge=1)
    operand_min: int = Field(1, ge=0)
    operand_max: int = Field(19, ge=1)
    max_value: int = Field(99, ge=2)
    direct_answer_rate: float = Field(0.0, ge=0, le=1)
    digit_steps_rate: float = Field(0.0, ge=0, le=1)
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    steps: dict[int, float] = Field(default_factory=lambda: {1: 0.35, 2: 0.45, 3: 0.2})

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: dict[int, float]) -> dict[int, float]:
        if not v:
            raise ValueError("needs at least one entry {number_of_steps: weight}")
        for k, w in v.items():
            if not 1 <= k <= 8:
                raise ValueError(f"number of steps must be in 1..8, got {k}")
            if w < 0:
                raise ValueError(f"weight for {k} steps must be >= 0, got {w}")
        if sum(v.values()) <= 0:
            raise ValueError("weights must sum to a positive number")
        return v

    @model_validator(mode="after")
    def _range(self) -> "SyntheticParams":
        if self.operand_min > self.operand_max:
            raise ValueError(f"operand_min ({self.operand_min}) must be <= operand_max ({self.operand_max})")
        if self.max_value < self.operand_max:
            raise ValueError(f"max_value ({self.max_value}) must be >= operand_max ({self.operand_max})")
        return self


class DataParams(Strict):
    source: Literal["synthetic", "gsm8k", "jsonl"] = "synthetic"
    train_file: Optional[str] = None
    test_file: Optional[str] = None
    hub_dataset: str = "openai/gsm8k"
    hub_config: str = "main"
    hub_revision: Optional[str] = None
    max_samples: Optional[int] = Field(None, ge=1)
    eval_max_samples: Optional[int] = Field(500, ge=1)
    strip_calculator_annotations: bool = True
    on_bad_rows: Literal["error", "drop"] = "error"
    system_prompt: str = "Solve the math problem step by step. End with '#### <number>'."
    synthetic: SyntheticParams = Field(default_factory=SyntheticParams)

    @model_validator(mode="after")
    def _files(self) -> "DataParams":
        if self.source == "jsonl" and not (self.train_file and self.test_file):
            raise ValueError("source 'jsonl' needs both data.train_file and data.test_file")
        return self


# ---------------------------------------------------------------------------------------- model
class TinyModelParams(Strict):
    vocab_size: int = Field(512, ge=300)
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    head_dim: int = Field(32, ge=4)
    max_position_embeddings: int = Field(512, ge=32)

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelParams":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class PretrainParams(Strict):
    enabled: bool = True
    num_arithmetic_facts: int = Field(30000, ge=0)
    epochs: float = Field(2, gt=0)
    learning_rate: float = Field(3e-3, gt=0, le=1)
    batch_size: int = Field(32, ge=1)
    block_size: int = Field(128, ge=16)


class ModelParams(Strict):
    base_model: str = "tiny"
    revision: str = "main"
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    tiny: TinyModelParams = Field(default_factory=TinyModelParams)
    pretrain: PretrainParams = Field(default_factory=PretrainParams)


# ------------------------------------------------------------------------------------ training
class LoraParams(Strict):
    r: int = Field(16, ge=1)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
    )


class TrainCommon(Strict):
    use_lora: bool = True
    lora: LoraParams = Field(default_factory=LoraParams)
    learning_rate: float = Field(gt=0, le=1)
    num_epochs: float = Field(1, gt=0)
    max_steps: int = Field(-1, ge=-1)
    per_device_train_batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    lr_scheduler_type: str = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    # TRL turns gradient checkpointing on by default; it trades ~30% more compute for activation memory,
    # a loss on a tiny model or CPU. Turn it on for large models on small GPUs.
    gradient_checkpointing: bool = False
    logging_steps: int = Field(10, ge=1)
    save_steps: int = Field(100, ge=1)
    save_total_limit: int = Field(2, ge=1)

    @field_validator("max_steps")
    @classmethod
    def _max_steps(cls, v: int) -> int:
        if v == 0:
            raise ValueError("must be -1 (use num_epochs) or a positive number of steps")
        return v


class SFTParams(TrainCommon):
    learning_rate: float = Field(2e-4, gt=0, le=1)
    max_length: int = Field(512, ge=16)


class RewardKwargs(Strict):
    length_max: int = Field(96, ge=1)
    length_weight: float = Field(0.5, ge=0)
    step_bonus: float = Field(0.1, ge=0)
    step_cap: float = Field(0.3, ge=0)


class GRPOParams(TrainCommon):
    learning_rate: float = Field(1e-5, gt=0, le=1)
    lr_scheduler_type: str = "constant"
    kl_coef: float = Field(0.0, ge=0)
    num_generations: int = Field(8, ge=2)
    temperature: float = Field(0.8, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_completion_length: int = Field(256, ge=1)
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    rewards: dict[str, float] = Field(default_factory=lambda: {"accuracy": 1.0, "format": 0.1})
    reward_kwargs: RewardKwargs = Field(default_factory=RewardKwargs)

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, v: dict[str, float]) -> dict[str, float]:
        if not v:
            raise ValueError("needs at least one reward {name: weight}")
        return v


class EvalParams(Strict):
    batch_size: int = Field(64, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    samples_per_problem: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _sampling(self) -> "EvalParams":
        if self.samples_per_problem > 1 and self.temperature == 0:
            raise ValueError("samples_per_problem > 1 needs temperature > 0 (greedy samples are identical)")
        return self


class ExportParams(Strict):
    quantize: Literal["none", "int8"] = "none"
    max_abs_logit_diff: float = Field(1e-4, gt=0)
    num_verify_prompts: int = Field(8, ge=1)


class ServeParams(Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    model_path: str = "models/merged"
    max_tokens_limit: int = Field(512, ge=1)
    max_batch_size: int = Field(8, ge=1)
    batch_wait_ms: float = Field(5, ge=0)


class TrackingParams(Strict):
    report_to: list[Literal["tensorboard", "dvclive", "wandb"]] = Field(
        default_factory=lambda: ["tensorboard", "dvclive", "wandb"]
    )
    wandb_project: str = "agentic-rl"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"


class DistributedParams(Strict):
    accelerate_config: str = "configs/accelerate/single.yaml"
    num_processes: int = Field(1, ge=1)
    scale_lr: Literal["none", "sqrt", "linear"] = "none"
    reference_batch: int = Field(32, ge=1)


class Params(Strict):
    seed: int = Field(42, ge=0)
    data: DataParams = Field(default_factory=DataParams)
    model: ModelParams = Field(default_factory=ModelParams)
    sft: SFTParams = Field(default_factory=SFTParams)
    grpo: GRPOParams = Field(default_factory=GRPOParams)
    eval: EvalParams = Field(default_factory=EvalParams)
    export: ExportParams = Field(default_factory=ExportParams)
    serve: ServeParams = Field(default_factory=ServeParams)
    tracking: TrackingParams = Field(default_factory=TrackingParams)
    distributed: DistributedParams = Field(default_factory=DistributedParams)


class ParamsError(ValueError):
    """params.yaml is invalid; the message names every offending key path."""


def _describe(err: dict[str, Any]) -> str:
    path = ".".join(str(p) for p in err["loc"]) or "<root>"
    if err["type"] == "extra_forbidden":
        return f"{path}: unknown key (typo?); remove it or use one of the documented keys"
    got = err.get("input")
    got_s = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    return f"{path}: {err['msg']}{got_s}"


def validate_params(raw: Any, source: str = PARAMS_FILE) -> Params:
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ParamsError(f"invalid {source}:\n  " + "\n  ".join(lines)) from None


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: file not found (run from the repository root)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None
    return validate_params(raw, str(path))


def load_params_or_exit(path: str | Path = PARAMS_FILE) -> Params:
    """For stage entry points: print the error and exit 2 instead of a traceback."""
    try:
        return load_params(path)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
