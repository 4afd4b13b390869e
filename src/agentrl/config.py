"""Typed schema of params.yaml and its strict loader: the project's own knobs live here; TRL's and PEFT's pass
through (passthrough.py), and whether the model fits the machine is sizing.py's.

Each stage calls `load_params()` first. Unknown keys (typos), wrong types and out-of-range values stop the stage
with one message naming the key path and what was expected, before any data or model is touched. The YAML is read
strictly: a duplicate key is an error, types are not coerced ("150" is no number, true is no int) and .inf/.nan are
rejected.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator, model_validator

from .passthrough import passthrough_errors
from .sizing import check_model_fits

PARAMS_FILE = "params.yaml"

PosInt = Field(ge=1)
# distributed.accelerate_config: a YAML file under configs/accelerate/ in plain path characters (it reaches the
# stage's shell command, dvc.yaml's `accelerate launch --config_file ${distributed.accelerate_config}`)
ACCELERATE_CONFIG = re.compile(
    r"configs/accelerate/(?:[A-Za-z0-9_-][A-Za-z0-9_.-]*/)*[A-Za-z0-9_-][A-Za-z0-9_.-]*\.ya?ml"
)
# the built-in rewards (= agent/rewards.py REGISTRY, a test keeps them equal): a misspelt one is refused at validation
REWARD_NAMES = ("accuracy", "format", "length_penalty", "step")
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
    # an environment's held-out instances must not be trained on (prepare refuses them, naming the first); true
    # lets such rows through, counted in metrics/prepare.json's overlap
    allow_test_overlap: StrictBool
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


class ModelParams(Strict):
    base_model: str
    revision: str
    precision: Literal["auto", "fp32", "bf16", "fp16"]
    # how training loads the model (from_pretrained(attn_implementation=...)); flash_attention_2 needs the
    # flash-attn package and a CUDA GPU
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"]
    # the positions TRL's fused LM head scores in SFT's and GRPO's losses on CPU (stages/training.py:
    # fused_lm_head_positions): the labelled ones, as TRL does on GPUs, or every one, as TRL 1.16 does on CPU
    lm_head_positions: Literal["labelled", "all"]
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
    # the merged copy's Linear kernels on the CPU: aten | onednn (agent/linear_kernels.py)
    rollout_linear_kernels: Literal["aten", "onednn"]
    trainer: dict[str, Any]  # -> trl.GRPOConfig(**trainer) plus the derived values (DERIVED)
    rewards: dict[str, float]  # name (or module:function) -> weight; the weights become GRPOConfig.reward_weights
    reward_kwargs: RewardKwargs

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, rewards: dict[str, float]) -> dict[str, float]:
        from .envs.registry import IMPORT_PATH

        if not rewards:
            raise ValueError("needs at least one reward {name: weight}")
        for name, weight in rewards.items():  # a module:function is checked by form, imported by the stage
            if name not in REWARD_NAMES and not IMPORT_PATH.fullmatch(name):
                known = ", ".join(REWARD_NAMES)
                raise ValueError(f"unknown reward '{name}'; known: {known} (or a custom one as 'module:function')")
            if abs(weight) > MAX_WEIGHT:
                raise ValueError(f"weight of '{name}' must be in [-{MAX_WEIGHT:g}, {MAX_WEIGHT:g}], got {weight!r}")
        return rewards

    @model_validator(mode="after")
    def _merged_rollouts(self) -> "GRPOParams":
        if self.merged_rollouts and not self.use_lora:
            raise ValueError("merged_rollouts: true merges the GRPO LoRA for generation; it needs use_lora: true")
        if self.rollout_linear_kernels == "onednn" and not self.merged_rollouts:
            raise ValueError(
                "rollout_linear_kernels: onednn packs the weights of the merged copy the rollouts sample from; "
                "it needs merged_rollouts: true"
            )
        return self


class EvalParams(Strict):
    batch_size: int = Field(ge=1, le=65536)
    max_new_tokens: int = Field(ge=1, le=1_048_576)
    temperature: float = Field(ge=0, le=100)
    top_p: float = Field(gt=0, le=1)
    samples_per_problem: int = Field(ge=1, le=1024)
    linear_kernels: Literal["aten", "onednn"]  # the evaluated model's Linear kernels on the CPU

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
    # the share of a stage's episodes whose environment may fail (reset failed, a tool hung, its server gone) before
    # the stage fails naming the first failure; below it they are counted (broken_episode_rate), never scored wrong
    max_broken_share: float = Field(ge=0, le=1)

    @field_validator("environment_url")
    @classmethod
    def _environment_url(cls, value: Optional[str]) -> Optional[str]:
        if value is None or value == "serve" or re.fullmatch(r"(https?|wss?)://[^\s/]+(:\d+)?/?", value):
            return value
        raise ValueError(f"environment_url must be null, 'serve' or a URL like 'http://127.0.0.1:8000', got {value!r}")

    @model_validator(mode="after")
    def _url_needs_environment(self) -> "AgentParams":
        from .envs.registry import check_environment_url

        check_environment_url(self.environment, self.environment_url)
        return self

    @field_validator("environment")
    @classmethod
    def _environment(cls, value: Optional[str]) -> Optional[str]:
        from .envs.registry import check_environment_name

        return check_environment_name(value)

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[str]) -> list[str]:
        from .envs.registry import check_tool_names

        return check_tool_names(value)


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
        from .envs.registry import check_environment_knobs

        for name, knobs in value.items():
            check_environment_knobs(name, knobs or {})
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
        from .envs.registry import environment_spec

        environment_spec(self.agent.environment, self.environments)  # a built-in's rows need its section
        return self

    @model_validator(mode="after")
    def _linear_kernels(self) -> "Params":
        if self.reproducibility.mode == "portable":
            for knob, kernels in (
                ("eval.linear_kernels", self.eval.linear_kernels),
                ("grpo.rollout_linear_kernels", self.grpo.rollout_linear_kernels),
            ):
                if kernels == "onednn":
                    raise ValueError(
                        f"{knob}: onednn picks its code per CPU, which reproducibility.mode portable does not pin "
                        f"(it pins ATen, MKL and FBGEMM): set {knob}: aten, or mode: native"
                    )
        return self


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
    """params checked section by section; ParamsError naming every offending key path (`source` names the file)."""
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
    """params.yaml read strictly and validated, and its `reproducibility` applied to this process's kernels."""
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
