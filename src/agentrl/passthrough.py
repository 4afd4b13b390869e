"""The pass-through sections of params.yaml (`sft.trainer`, `grpo.trainer`, `sft.lora`, `grpo.lora`): their keys are
TRL's and PEFT's own arguments, handed to trl.SFTConfig / trl.GRPOConfig / peft.LoraConfig unchanged. Checked key
by key against those dataclasses' fields and annotations (an unknown key names the closest valid one), with the
values the stage derives (DERIVED) refused there and sizes bounded (PASSTHROUGH_BOUNDS); built by the stages."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ConfigDict, ValidationError


class PassthroughError(ValueError):
    """A pass-through section TRL/PEFT rejects, or that sets what the stage derives; the message names the key."""


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
    """The TRL/PEFT class a pass-through section builds (imported on first use)."""
    import importlib

    module, name = PASSTHROUGH[path]
    return getattr(importlib.import_module(module), name)


def _init_fields(cls: type) -> dict:
    import dataclasses

    return {f.name: f for f in dataclasses.fields(cls) if f.init}


_ADAPTERS: dict = {}


def _annotation_error(cls: type, name: str, value: Any) -> Optional[str]:
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
            elif (msg := _annotation_error(cls, key, value)) is not None:
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
            except PassthroughError as e:
                errors.append(str(e))
    return errors


def build_passthrough(path: str, values: dict, **derived):
    """`cls(**values, **derived)` for the pass-through section `path` (a deep copy of the values: the
    dataclass never edits params). A value the dataclass rejects is a PassthroughError naming the section."""
    import copy

    cls = passthrough_class(path)
    if cls.__name__ == "LoraConfig":
        derived = {"task_type": "CAUSAL_LM", **derived}
    clash = sorted(set(values) & set(derived))
    if clash:
        raise PassthroughError(f"{path}.{clash[0]}: {DERIVED[path].get(clash[0], 'set by the stage')}; remove it here")
    try:
        return cls(**copy.deepcopy(values), **derived)
    except (TypeError, ValueError) as e:
        raise PassthroughError(f"{path}: {cls.__name__} rejected the configuration: {e}") from None


def passthrough_value(path: str, values: dict, name: str) -> Any:
    """A pass-through argument as the dataclass will see it: the params value, else the dataclass default."""
    import dataclasses

    if name in values:
        return values[name]
    field = _init_fields(passthrough_class(path))[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default
