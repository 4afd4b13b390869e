"""Typed schema of params.yaml: the project's own knobs live here; TRL's and PEFT's are passed through.

Each stage calls `load_params()` first. Unknown keys (typos), wrong types and out-of-range values
stop the stage with one message naming the key path and what was expected, before any data or
model is touched. `sft.trainer` / `grpo.trainer` / `*.lora` hand their keys to trl.SFTConfig /
trl.GRPOConfig / peft.LoraConfig unchanged (PASSTHROUGH); their keys are checked against those
dataclasses' own fields and annotations (an unknown one names the closest valid name), and values the
stage derives (DERIVED) cannot be set there. The YAML is read strictly: a duplicate key is an error,
types are not coerced ("150" is no number, true is no int) and .inf/.nan are rejected.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

PARAMS_FILE = "params.yaml"

PosInt = Field(ge=1)
# `module:function` (tools, rewards) or `module:Class` (agent.environment): checked by form, imported by the stage
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
# distributed.accelerate_config: a YAML file under configs/accelerate/ in plain path characters (it reaches the
# stage's shell command, dvc.yaml's `accelerate launch --config_file ${distributed.accelerate_config}`)
ACCELERATE_CONFIG = re.compile(
    r"configs/accelerate/(?:[A-Za-z0-9_-][A-Za-z0-9_.-]*/)*[A-Za-z0-9_-][A-Za-z0-9_.-]*\.ya?ml"
)
MAX_WEIGHT = 1e6  # |reward weight|, step-distribution weight


class Strict(BaseModel):
    # strict: "150" or true are not numbers, 1 is not a bool; allow_inf_nan: .inf/.nan are no param's value
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_default=True)


# ----------------------------------------------------------------------------------------- data
class SyntheticParams(Strict):
    num_train: int = Field(ge=1, le=10_000_000)
    num_test: int = Field(ge=1, le=1_000_000)
    operand_min: int = Field(ge=0, le=10**9)
    operand_max: int = Field(ge=1, le=10**9)
    max_value: int = Field(ge=2, le=10**12)
    direct_answer_rate: float = Field(ge=0, le=1)
    digit_steps_rate: float = Field(ge=0, le=1)
    operations: list[Literal["+", "-", "*"]] = Field(min_length=1)
    steps: dict[int, float]
    multiplier_max: int = Field(ge=2, le=1000)  # "b times as many": b in 2..multiplier_max
    distractor_rate: float = Field(ge=0, le=1)  # share of problems that mention another person's count
    compare_rate: float = Field(ge=0, le=1)  # ... of which ask "how many more than" that person

    @field_validator("steps")
    @classmethod
    def _steps(cls, steps: dict[int, float]) -> dict[int, float]:
        if not steps:
            raise ValueError("needs at least one entry {number_of_steps: weight}")
        for count, weight in steps.items():
            if not 1 <= count <= 8:
                raise ValueError(f"number of steps must be in 1..8, got {count}")
            if not 0 <= weight <= MAX_WEIGHT:
                raise ValueError(f"weight for {count} steps must be in [0, {MAX_WEIGHT:g}], got {weight}")
        if sum(steps.values()) <= 0:
            raise ValueError("weights must sum to a positive number")
        return steps

    @model_validator(mode="after")
    def _range(self) -> "SyntheticParams":
        if self.operand_min > self.operand_max:
            raise ValueError(f"operand_min ({self.operand_min}) must be <= operand_max ({self.operand_max})")
        if self.max_value < self.operand_max:
            raise ValueError(f"max_value ({self.max_value}) must be >= operand_max ({self.operand_max})")
        return self


class DataParams(Strict):
    source: Literal["synthetic", "gsm8k", "jsonl"]
    train_file: Optional[str]
    test_file: Optional[str]
    hub_dataset: str
    hub_config: str
    hub_revision: Optional[str]
    max_samples: Optional[int] = Field(ge=1, le=100_000_000)
    eval_max_samples: Optional[int] = Field(ge=1, le=10_000_000)
    # GSM8K calculator annotations <<a*b=c>>: 'auto' keeps them when agent.tools or agent.environment is set (they
    # are the tool calls the policy learns), strips them otherwise; true/false force it
    strip_calculator_annotations: Union[Literal["auto"], StrictBool]
    calculator_share: float = Field(ge=0, le=1)  # share of kept-annotation training solutions that call the tool
    on_bad_rows: Literal["error", "drop"]
    system_prompt: str
    synthetic: SyntheticParams

    @model_validator(mode="after")
    def _files(self) -> "DataParams":
        if self.source == "jsonl" and not (self.train_file and self.test_file):
            raise ValueError("source 'jsonl' needs both data.train_file and data.test_file")
        return self


# ---------------------------------------------------------------------------------------- model
class TinyModelParams(Strict):
    vocab_size: int = Field(ge=300, le=1_048_576)
    hidden_size: int = Field(ge=8, le=16384)
    intermediate_size: int = Field(ge=8, le=65536)
    num_hidden_layers: int = Field(ge=1, le=256)
    num_attention_heads: int = Field(ge=1, le=256)
    num_key_value_heads: int = Field(ge=1, le=256)
    head_dim: int = Field(ge=4, le=1024)
    max_position_embeddings: int = Field(ge=32, le=1_048_576)

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelParams":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        return self


class PretrainParams(Strict):
    enabled: bool
    num_arithmetic_facts: int = Field(ge=0, le=100_000_000)
    epochs: float = Field(gt=0, le=10_000)
    learning_rate: float = Field(gt=0, le=1)
    batch_size: int = Field(ge=1, le=65536)
    block_size: int = Field(ge=16, le=1_048_576)


# What the machine can hold: a model whose estimated memory exceeds all of it is refused at validation, before a
# download or an allocation (model.tiny at its maxima is 5.3e12 parameters; a 405B hub id on a CPU machine used to
# start downloading). Estimates are lower bounds; a size that cannot be known offline is not checked.
ALLOW_LARGE_MODEL_ENV = "AGENTRL_ALLOW_LARGE_MODEL"  # =1: skip the check (a machine this code cannot measure)
TRAIN_BYTES_PER_PARAM = 16  # full fp32 training with AdamW: weights, gradients and two moments, 4 bytes each
BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp16": 2}  # a hub model's weights in the training dtype
# a parameter count in a hub id's name: Qwen3-0.6B, Llama-3.1-405B, SmolLM2-135M, Mixtral-8x7B (8 x 7B)
SIZE_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(?:(\d{1,4})x)?(\d{1,6}(?:\.\d{1,4})?)([MBT])(?![A-Za-z0-9])", re.I)
_SIZE_UNITS = {"m": 1e6, "b": 1e9, "t": 1e12}
MAX_SAFETENSORS_HEADER = 100 << 20  # a header claiming more is not a safetensors file


def tiny_parameter_count(tiny: "TinyModelParams") -> int:
    """The parameters of modeling.build_tiny_model's Qwen3 (tied embeddings, no attention bias), from the params.

    Args:
        tiny: the model.tiny section (vocab_size as asked; the trained tokenizer adds at most a few tokens).

    Returns:
        The exact count for a vocabulary of tiny.vocab_size tokens.
    """
    attention = 2 * tiny.hidden_size * tiny.head_dim * (tiny.num_attention_heads + tiny.num_key_value_heads)  # q o, k v
    per_layer = (
        attention + 2 * tiny.head_dim + 3 * tiny.hidden_size * tiny.intermediate_size + 2 * tiny.hidden_size
    )  # + norms
    return tiny.vocab_size * tiny.hidden_size + tiny.num_hidden_layers * per_layer + tiny.hidden_size


def _safetensors_parameters(path: Path) -> Optional[int]:
    """The parameter count a safetensors file's header declares (only the header is read), None if unreadable."""
    import json
    import math

    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_SAFETENSORS_HEADER:
                return None
            header = json.loads(f.read(size))
        return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def known_parameter_count(base_model: str) -> tuple[Optional[int], str]:
    """What can be known offline of a model's size: a local directory's safetensors headers, else a size written in
    the hub id's name (the largest, e.g. Qwen3-30B-A3B -> 30B). (None, reason) when neither says.

    Args:
        base_model: model.base_model (a hub id or a local directory).

    Returns:
        (parameter count or None, where the count comes from).
    """
    path = Path(base_model)
    try:
        is_dir = path.is_dir()
    except OSError:  # a name the filesystem cannot hold (ENAMETOOLONG, ...) is no local copy
        is_dir = False
    if is_dir:
        files = sorted(path.glob("*.safetensors"))
        counts = [_safetensors_parameters(f) for f in files]
        if files and None not in counts:
            return sum(counts), f"the safetensors headers in {path}"
        return None, f"{path} has no readable safetensors files"
    sizes = [
        int(m.group(1) or 1) * float(m.group(2)) * _SIZE_UNITS[m.group(3).lower()]
        for m in SIZE_IN_NAME.finditer(base_model.rsplit("/", 1)[-1])
    ]
    if sizes:
        return int(max(sizes)), "the size in its name"
    return None, "no size in its name and no local copy"


def ram_bytes() -> int:
    """The machine's physical memory, capped by a cgroup v2 limit (a container's) where one is set."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def gpu_bytes() -> int:
    """The memory of every visible CUDA device together (0 without one). Imports torch: called only for a model
    that does not fit in RAM, so validating ordinary params never loads it."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def _allow_large_model() -> bool:
    value = os.environ.get(ALLOW_LARGE_MODEL_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"environment variable {ALLOW_LARGE_MODEL_ENV} must be 1 (skip the check) or 0, got {value!r}")
    return value == "1"


def check_model_fits(model: "ModelParams") -> None:
    """ValueError when the model's estimated memory exceeds all the machine has (RAM, plus the GPUs' memory when
    there are GPUs): model.tiny trained in fp32 with AdamW, or a hub/local model's weights in the training dtype
    (precision auto: fp32 without a GPU, bf16 with one). A size not knowable offline is not checked.

    Args:
        model: the model section of params.
    """
    if _allow_large_model():
        return
    if model.base_model == "tiny":
        parameters = tiny_parameter_count(model.tiny)
        need_with_gpu = need_cpu = parameters * TRAIN_BYTES_PER_PARAM
        what = f"model.tiny: {parameters:,} parameters need ~{need_cpu / 1e9:,.1f} GB to train in fp32 with AdamW"
    else:
        parameters, how = known_parameter_count(model.base_model)
        if parameters is None:
            return
        # precision auto: fp32 on a CPU, bf16 (2 bytes) on a GPU
        bytes_cpu, bytes_gpu = BYTES_PER_PARAM.get(model.precision, 4), BYTES_PER_PARAM.get(model.precision, 2)
        need_cpu, need_with_gpu = parameters * bytes_cpu, parameters * bytes_gpu
        what = (
            f"model.base_model: {model.base_model} has ~{parameters:,.0f} parameters ({how}), "
            f"~{need_cpu / 1e9:,.1f} GB of weights in {model.precision if model.precision != 'auto' else 'fp32'}"
        )
    ram = ram_bytes()
    if need_cpu <= ram:
        return
    gpu = gpu_bytes()
    if gpu and need_with_gpu <= ram + gpu:
        return
    has = f"{ram / 1e9:,.1f} GB of RAM" + (f" and {gpu / 1e9:,.1f} GB of GPU memory" if gpu else " and no GPU")
    raise ValueError(
        f"{what}, more than this machine's {has}; use a smaller model, or on a machine this check cannot "
        f"measure set {ALLOW_LARGE_MODEL_ENV}=1"
    )


class ModelParams(Strict):
    base_model: str
    revision: str
    precision: Literal["auto", "fp32", "bf16", "fp16"]
    # how training loads the model (from_pretrained(attn_implementation=...)); flash_attention_2 needs the
    # flash-attn package and a CUDA GPU
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"]
    # variables baked into a hub tokenizer's chat template by `base` (e.g. Qwen3 {enable_thinking: false}), so
    # SFT, GRPO, evaluation and serving all render the same prompt
    chat_template_kwargs: dict[str, Union[StrictBool, int, float, str, None]]
    tiny: TinyModelParams
    pretrain: PretrainParams

    @model_validator(mode="after")
    def _fits_machine(self) -> "ModelParams":
        # a GGUF file (gguf_files.py) is pinned by its content: a different file changes this param and re-runs base
        if self.base_model.endswith(".gguf") and not re.fullmatch(r"sha256:[0-9a-f]{64}", self.revision):
            raise ValueError(
                f"model.revision: a GGUF base model is pinned by its content, 'sha256:<64 lowercase hex digits>', got "
                f"{self.revision!r} (`python -m agentrl.gguf_files {self.base_model}` prints the file's)"
            )
        check_model_fits(self)
        return self


# ------------------------------------------------------------------------------------ training
# `sft.trainer`, `grpo.trainer` and `*.lora` are pass-through sections: their keys are TRL's / PEFT's own
# arguments, handed to SFTConfig / GRPOConfig / LoraConfig unchanged (see PASSTHROUGH below). They have no
# schema defaults: what params.yaml does not set takes the TRL/PEFT default. Only the project's own keys
# (use_lora, rewards, reward_kwargs) are typed here, without defaults either: params.yaml is their one source.
class SFTParams(Strict):
    use_lora: bool
    lora: dict[str, Any]  # -> peft.LoraConfig(**lora); task_type is set by the stage
    trainer: dict[str, Any]  # -> trl.SFTConfig(**trainer) plus the derived values (DERIVED)


class RewardKwargs(Strict):
    length_max: int = Field(ge=1, le=10_000_000)
    length_weight: float = Field(ge=0, le=MAX_WEIGHT)
    step_bonus: float = Field(ge=0, le=MAX_WEIGHT)
    step_cap: float = Field(ge=0, le=MAX_WEIGHT)


class GRPOParams(Strict):
    use_lora: bool
    lora: dict[str, Any]  # -> peft.LoraConfig(**lora)
    merged_rollouts: StrictBool  # the tool loop samples from a plain copy with the LoRA merged in (grpo.ToolRollout)
    trainer: dict[str, Any]  # -> trl.GRPOConfig(**trainer) plus the derived values (DERIVED)
    rewards: dict[str, float]  # name (or module:function) -> weight; the weights become GRPOConfig.reward_weights
    reward_kwargs: RewardKwargs

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        if not rewards:
            raise ValueError("needs at least one reward {name: weight}")
        for (
            name,
            weight,
        ) in rewards.items():  # checked by form, never imported here (rewards.get_reward names unknown ones)
            if not re.fullmatch(r"[A-Za-z_]\w*", name) and not IMPORT_PATH.fullmatch(name):
                raise ValueError(f"reward '{name}' is neither a registry name nor 'module:function'")
            if abs(weight) > MAX_WEIGHT:
                raise ValueError(f"weight of '{name}' must be in [-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}], got {weight!r}")
        return rewards

    @model_validator(mode="after")
    def _merged_rollouts(self) -> "GRPOParams":
        if self.merged_rollouts and not self.use_lora:
            raise ValueError("merged_rollouts: true merges the GRPO LoRA for generation; it needs use_lora: true")
        return self


class EvalParams(Strict):
    batch_size: int = Field(ge=1, le=65536)
    max_new_tokens: int = Field(ge=1, le=1_048_576)
    temperature: float = Field(ge=0, le=100)
    top_p: float = Field(gt=0, le=1)
    samples_per_problem: int = Field(ge=1, le=1024)

    @model_validator(mode="after")
    def _sampling(self) -> "EvalParams":
        if self.samples_per_problem > 1 and self.temperature == 0:
            raise ValueError("samples_per_problem > 1 needs temperature > 0 (greedy samples are identical)")
        return self


class ExportParams(Strict):
    quantize: Literal["none", "int8"]  # bitsandbytes on CUDA, torch dynamic int8 on CPU (stages/quantize.py)
    max_abs_logit_diff: float = Field(gt=0, le=1e6)
    num_verify_prompts: int = Field(ge=1, le=100_000)
    # the merged model also as GGUF files (models/gguf/model-<type>.gguf), read back and checked: [] | f32, f16, q8_0
    gguf: list[Literal["f32", "f16", "q8_0"]]


class ServeParams(Strict):
    host: str
    port: int = Field(ge=1, le=65535)
    model_path: str
    max_tokens_limit: int = Field(ge=1, le=1_048_576)
    max_batch_size: int = Field(ge=1, le=4096)
    batch_wait_ms: float = Field(ge=0, le=60_000)


class TrackingParams(Strict):
    report_to: list[Literal["tensorboard", "dvclive", "wandb"]]
    wandb_project: str
    wandb_mode: Literal["offline", "online", "disabled"]


class DistributedParams(Strict):
    accelerate_config: str
    num_processes: int = Field(ge=1, le=4096)
    scale_lr: Literal["none", "sqrt", "linear"]
    reference_batch: int = Field(ge=1, le=10_000_000)

    @field_validator("accelerate_config")
    @classmethod
    def _accelerate_config(cls, value: str) -> str:
        if not ACCELERATE_CONFIG.fullmatch(value) or "/." in value:
            raise ValueError(
                "must be a .yaml file under configs/accelerate/ (letters, digits, '_', '-', '.'; no '..'), "
                f"got {value[:200]!r}"
            )
        return value


class ReproducibilityParams(Strict):
    # portable: the CPU kernels pinned (ATen AVX2, MKL COMPATIBLE, FBGEMM AVX2) for the same bytes on any x86-64
    # CPU with AVX2 | native: the CPU's own (fastest) kernels. reproducibility.py; docs/reproducibility.md
    mode: Literal["portable", "native"]
    threads: int = Field(ge=1, le=1024)  # portable: intra-op threads per process (the bytes depend on it)


class AgentParams(Strict):
    tools: list[str]  # [] = no tools; names or module:function
    format: Literal["inline", "chat"]  # inline: <<expr=  result>> ; chat: <tool_call> JSON turns
    max_tool_calls: int = Field(ge=1, le=1000)  # per completion; a completion that asks for more is ended
    max_expression_chars: int = Field(ge=1, le=10000)
    # an environment (TRL environment_factory shape) instead of agent.tools: calculator | countdown | gridworld
    # | module:Class; null = the tools in agent.tools (plain functions, one stateless environment)
    environment: Optional[str]
    tool_timeout_s: float = Field(gt=0, le=600)  # a tool call that takes longer is an error result
    # agent.environment played over OpenEnv (envs/openenv_client.py): null = in-process | "http://host:port" (a
    # `make env-server`) | serve (the stage starts one on a free 127.0.0.1 port); data and solved rule stay its own
    environment_url: Optional[str]

    @field_validator("environment_url")
    @classmethod
    def _environment_url(cls, value: Optional[str]) -> Optional[str]:
        if value is None or value == "serve" or re.fullmatch(r"(https?|wss?)://[^\s/]+(:\d+)?/?", value):
            return value
        raise ValueError(f"environment_url must be null, 'serve' or a URL like 'http://127.0.0.1:8000', got {value!r}")

    @model_validator(mode="after")
    def _url_needs_environment(self) -> "AgentParams":
        if self.environment_url and (not self.environment or self.environment == "mixture"):
            raise ValueError(
                "agent.environment_url plays agent.environment over OpenEnv: set agent.environment (one environment, "
                f"not a mixture), got {self.environment!r}"
            )
        return self

    @field_validator("environment")
    @classmethod
    def _environment(cls, value: Optional[str]) -> Optional[str]:
        from .envs.registry import ENVIRONMENTS

        if value is None or value in ENVIRONMENTS:
            return value
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):  # checked by form here, imported by the stage
            raise ValueError(
                f"unknown environment '{value}'; known: {', '.join(sorted(ENVIRONMENTS))} "
                "(or a custom one as 'module:Class')"
            )
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[str]) -> list[str]:
        from .envs.registry import TOOLS

        for name in value:  # checked by form, never imported here (validation runs no module's code); the stage imports
            if name not in TOOLS and not IMPORT_PATH.fullmatch(name):
                known = ", ".join(sorted(TOOLS))
                raise ValueError(f"unknown tool '{name}'; known: {known} (or a custom one as 'module:function')")
        if len(set(value)) != len(value):
            raise ValueError("a tool is listed twice")
        return value


class Params(Strict):
    seed: int = Field(ge=0, le=2**32 - 1)  # numpy seeds are 32-bit
    data: DataParams
    model: ModelParams
    sft: SFTParams  # no defaults: pass-through sections, params.yaml is their one source
    grpo: GRPOParams
    eval: EvalParams
    export: ExportParams
    serve: ServeParams
    tracking: TrackingParams
    distributed: DistributedParams
    agent: AgentParams
    reproducibility: ReproducibilityParams
    # knobs of the built-in environments: environments.<name>.<knob> (generation: num_train, num_test and the
    # module's GEN_DEFAULTS; runtime: its ENV_DEFAULTS); agent.environment picks which one runs
    environments: dict[str, dict[str, Any]]  # no default: params.yaml is its one source

    @field_validator("environments")
    @classmethod
    def _environments(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from .envs.registry import TASKS

        for name, knobs in value.items():
            if name not in TASKS:
                raise ValueError(f"unknown environment '{name}'; built-ins with knobs: {', '.join(sorted(TASKS))}")
            defaults = {"num_train": 1, "num_test": 1, **TASKS[name].GEN_DEFAULTS, **TASKS[name].ENV_DEFAULTS}
            missing = sorted({"num_train", "num_test"} - set(knobs or {}))
            if missing:
                raise ValueError(f"{name}: missing {', '.join(missing)} (how many train / held-out instances)")
            for k, val in (knobs or {}).items():
                if k not in defaults:
                    raise ValueError(f"{name}.{k}: unknown knob; known: {', '.join(sorted(defaults))}")
                want = type(defaults[k])
                ok = (
                    isinstance(val, bool)
                    if want is bool
                    else isinstance(val, (int, float)) and not isinstance(val, bool)
                    if want in (int, float)
                    else isinstance(val, want)
                )
                if not ok or (want is int and not isinstance(val, int)):
                    raise ValueError(f"{name}.{k}: expected {want.__name__}, got {val!r}")
                if k in ("num_train", "num_test") and not 1 <= val <= 1_000_000:
                    raise ValueError(f"{name}.{k}: must be in 1..1000000, got {val}")
            if callable(check_knobs := getattr(TASKS[name], "check_knobs", None)):  # the module's own deeper checks
                check_knobs(knobs or {})  # (envs/contract.py KnobCheckingTask): ValueError naming environments.<name>.*
        return value

    @model_validator(mode="after")
    def _agent(self) -> "Params":
        if self.agent.environment and self.agent.tools:
            raise ValueError(
                "agent.environment and agent.tools are both set: an environment brings its own tools "
                "(set agent.tools: [] with agent.environment)"
            )
        if self.agent.format == "inline" and len(self.agent.tools) > 1:
            raise ValueError("agent.format 'inline' (<<expr=) drives one tool; list one in agent.tools or use 'chat'")
        from .envs.registry import TASKS

        env = self.agent.environment
        if env in TASKS and env not in self.environments:  # its rows come from that section (prepare reads num_*)
            raise ValueError(f"agent.environment '{env}' generates its rows from environments.{env}: add that section")
        return self


class ParamsError(ValueError):
    """params.yaml is invalid; the message names every offending key path."""


# ------------------------------------------------------------------------- pass-through sections
# Each of these params sections is handed to a TRL/PEFT dataclass as keyword arguments, unchanged.
PASSTHROUGH = {
    "sft.trainer": ("trl", "SFTConfig"),
    "grpo.trainer": ("trl", "GRPOConfig"),
    "sft.lora": ("peft", "LoraConfig"),
    "grpo.lora": ("peft", "LoraConfig"),
}
# Arguments the stage derives from other params. Setting one in the pass-through section is an error that
# says where it comes from. (`learning_rate` is not here: the trainer's value is the reference learning
# rate that distributed.scale_lr scales for the effective batch.)
_TRAINER_DERIVED = {
    "output_dir": "set by the stage (checkpoints/<stage>/; the result is saved to models/<stage>/)",
    "seed": "set by the stage from 'seed'",
    "data_seed": "set by the stage from 'seed'",
    "bf16": "set by the stage from 'model.precision'",
    "fp16": "set by the stage from 'model.precision'",
    "use_cpu": "set by the stage from the device and 'distributed.*' (multi-process CPU runs)",
    "ddp_backend": "set by the stage from the device and 'distributed.*' (gloo on CPU)",
    "report_to": "set by the stage from 'tracking.report_to'",
    "run_name": "set by the stage from the DVC experiment name (see 'tracking')",
    "logging_dir": "set by the stage (runs/<stage>/; see 'tracking.report_to')",
    "deepspeed": "set by the launcher from 'distributed.accelerate_config'",
    "fsdp": "set by the launcher from 'distributed.accelerate_config'",
    "fsdp_config": "set by the launcher from 'distributed.accelerate_config'",
    "resume_from_checkpoint": "set by the stage (it resumes checkpoints/<stage>/ when the run's fingerprint matches)",
    "model_init_kwargs": (
        "set by the stage, which loads the model, from 'model.precision' and 'model.attn_implementation'"
    ),
}
# Upper bounds (absolute value) on the pass-through arguments that size a run: steps, batches, lengths, rates.
# TRL/PEFT accept any number; 1e15 steps or a learning rate of 1e308 is a typo or an attack, not a run.
PASSTHROUGH_BOUNDS = {
    "max_steps": 10_000_000,
    "num_train_epochs": 10_000,
    "warmup_steps": 10_000_000,
    "logging_steps": 10_000_000,
    "save_steps": 10_000_000,
    "eval_steps": 10_000_000,
    "save_total_limit": 10_000,
    "per_device_train_batch_size": 65_536,
    "per_device_eval_batch_size": 65_536,
    "gradient_accumulation_steps": 65_536,
    "steps_per_generation": 65_536,
    "generation_batch_size": 1_048_576,
    "num_generations": 4096,
    "num_iterations": 10_000,
    "max_length": 1_048_576,
    "max_prompt_length": 1_048_576,
    "max_completion_length": 1_048_576,
    "dataloader_num_workers": 256,
    "learning_rate": 10.0,
    "weight_decay": 1000.0,
    "max_grad_norm": 1e6,
    "temperature": 100.0,
    "top_k": 1_000_000,
    "beta": 1e6,
    "r": 65_536,
    "lora_alpha": 1e6,
}
DERIVED = {
    "sft.trainer": _TRAINER_DERIVED,
    "grpo.trainer": {**_TRAINER_DERIVED, "reward_weights": "set by the stage from 'grpo.rewards'"},
    "sft.lora": {"task_type": "set by the stage (CAUSAL_LM)"},
    "grpo.lora": {"task_type": "set by the stage (CAUSAL_LM)"},
}


def passthrough_class(path: str) -> type:
    import importlib

    module, name = PASSTHROUGH[path]
    return getattr(importlib.import_module(module), name)


def _init_fields(cls: type) -> dict:
    import dataclasses

    return {f.name: f for f in dataclasses.fields(cls) if f.init}


_ADAPTERS: dict = {}


def _type_error(cls: type, name: str, value: Any) -> Optional[str]:
    """None when `value` fits the dataclass field's annotation (strictly: "150" is no int, true no number)."""
    import typing

    from pydantic import TypeAdapter

    key = (cls, name)
    if key not in _ADAPTERS:
        try:
            hint = typing.get_type_hints(cls)[name]
            _ADAPTERS[key] = (
                hint,
                TypeAdapter(hint, config=ConfigDict(strict=True, allow_inf_nan=False, arbitrary_types_allowed=True)),
            )
        except Exception:  # an annotation pydantic cannot check: the dataclass itself checks it at build time
            _ADAPTERS[key] = (None, None)
    hint, adapter = _ADAPTERS[key]
    if adapter is None:
        return None
    try:
        adapter.validate_python(value)
    except ValidationError:
        shown = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        return f"expected {shown}, as {cls.__name__} declares it (got {value!r})"
    return None


def _non_finite(value: Any, path: str) -> list[str]:
    import math

    if isinstance(value, float) and not math.isfinite(value):
        return [f"{path}: must be a finite number (got {value!r})"]
    if isinstance(value, dict):
        return [e for k, v in value.items() for e in _non_finite(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [e for i, v in enumerate(value) for e in _non_finite(v, f"{path}.{i}")]
    return []


def passthrough_errors(raw: dict) -> list[str]:
    """Key-by-key check of the pass-through sections: derived keys, unknown keys (with the closest valid
    name), value types from the dataclass's own annotations, finite numbers; LoraConfig is also built (cheap,
    no side effects). SFTConfig/GRPOConfig are built by the stage first thing (building one initialises the
    accelerate state), so their cross-field checks stop the stage before it loads anything."""
    import difflib

    errors = []
    for path in PASSTHROUGH:
        section, sub = path.split(".")
        values = (raw.get(section) or {}).get(sub) if isinstance(raw.get(section), dict) else None
        if not isinstance(values, dict):
            continue  # missing or not a mapping: the schema reports it
        cls = passthrough_class(path)
        fields = _init_fields(cls)
        before = len(errors)
        for key, value in values.items():
            where = f"{path}.{key}"
            if key in DERIVED[path]:
                errors.append(f"{where}: {DERIVED[path][key]}; remove it here")
            elif key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                errors.append(f"{where}: unknown argument of {cls.__name__}{hint}")
            elif nf := _non_finite(value, where):
                errors += nf
            elif (msg := _type_error(cls, key, value)) is not None:
                errors.append(f"{where}: {msg}")
            elif (
                key in PASSTHROUGH_BOUNDS
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and abs(value) > PASSTHROUGH_BOUNDS[key]
            ):
                errors.append(f"{where}: must be at most {PASSTHROUGH_BOUNDS[key]:,} in size (got {value!r})")
        for key in ("learning_rate", "r"):  # zero trains nothing (lr) or fails deep inside PEFT (r); TRL/PEFT accept it
            setting = values.get(key)
            if len(errors) == before and isinstance(setting, (int, float)) and setting <= 0:
                errors.append(f"{path}.{key}: must be > 0 (got {setting!r})")
        if len(errors) == before and cls.__name__ == "LoraConfig":
            try:
                build_passthrough(path, values)
            except ParamsError as e:
                errors.append(str(e))
    return errors


def build_passthrough(path: str, values: dict, **derived):
    """`cls(**values, **derived)` for the pass-through section `path` (a deep copy of the values: the
    dataclass never edits params). A value the dataclass rejects is a ParamsError naming the section."""
    import copy

    cls = passthrough_class(path)
    if cls.__name__ == "LoraConfig":
        derived = {"task_type": "CAUSAL_LM", **derived}
    clash = sorted(set(values) & set(derived))
    if clash:
        raise ParamsError(f"{path}.{clash[0]}: {DERIVED[path].get(clash[0], 'set by the stage')}; remove it here")
    try:
        return cls(**copy.deepcopy(values), **derived)
    except (TypeError, ValueError) as e:
        raise ParamsError(f"{path}: {cls.__name__} rejected the configuration: {e}") from None


def passthrough_value(path: str, values: dict, name: str) -> Any:
    """A pass-through argument as the dataclass will see it: the params value, else the dataclass default."""
    import dataclasses

    if name in values:
        return values[name]
    field = _init_fields(passthrough_class(path))[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


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
    lines, params = [], None
    try:
        params = Params.model_validate(raw)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
    lines += passthrough_errors(raw)
    if lines:
        raise ParamsError(f"invalid {source}:\n  " + "\n  ".join(lines))
    return params


# ------------------------------------------------------------------------------------ strict YAML
class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` as a number (YAML 1.2, as DVC's `-S` writes floats; YAML 1.1
    would make it the string "1e-6")."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _duplicate_keys(node, source: str, path: str = "") -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            where = f"{path}.{key}" if path else str(key)
            if key is not None and key_node.tag != "tag:yaml.org,2002:merge":
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ParamsError(
                        f"{source}:{line}: duplicate key '{where}' (first on line {seen[key]}); "
                        f"YAML would silently keep the last value"
                    )
                seen[key] = line
            _duplicate_keys(value_node, source, where)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _duplicate_keys(item, source, f"{path}.{i}")


def load_yaml(path: str | Path) -> Any:
    """A params-style YAML file read strictly: duplicate keys are an error naming the key and line."""
    path = Path(path)
    text = path.read_text()
    try:
        _duplicate_keys(yaml.compose(text, Loader=_Loader), str(path))
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {e}") from None


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: file not found (run from the repository root)")
    params = validate_params(load_yaml(path), str(path))
    from .reproducibility import apply, verify

    try:  # the CPU kernels this process computes with (agentrl/__init__.py set them already from the same file)
        apply(params.reproducibility.mode, params.reproducibility.threads)
    except ValueError as e:
        raise ParamsError(f"{path}: {e}") from None
    if "torch" in sys.modules:
        verify(params.reproducibility.mode)
    return params


def load_params_or_exit(path: str | Path = PARAMS_FILE) -> Params:
    """For stage entry points: print the error and exit 2 instead of a traceback."""
    try:
        return load_params(path)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
