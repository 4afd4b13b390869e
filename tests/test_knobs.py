"""Every training knob in params.yaml reaches the TRL/PEFT config object that uses it.

One parametrised test per stage: set a distinctive value, build the config the stage builds, and
read the value back. A knob silently dropped on the way (HelloAgents' failure mode) fails here.
The last test checks that the list below covers every key of the sft/grpo schema.
"""
import pytest

from agentrl import grpo, sft
from agentrl.config import GRPOParams, LoraParams, SFTParams, validate_params

from conftest import raw_params

# (params path, value, attribute of the built object, expected value there)
SFT_KNOBS = [
    ("learning_rate", 1.234e-4, "learning_rate", 1.234e-4),
    ("num_epochs", 3.0, "num_train_epochs", 3.0),
    ("max_steps", 17, "max_steps", 17),
    ("per_device_train_batch_size", 3, "per_device_train_batch_size", 3),
    ("gradient_accumulation_steps", 5, "gradient_accumulation_steps", 5),
    ("warmup_ratio", 0.07, "warmup_steps", 0.07),
    ("lr_scheduler_type", "linear", "lr_scheduler_type", "linear"),
    ("weight_decay", 0.013, "weight_decay", 0.013),
    ("max_grad_norm", 0.77, "max_grad_norm", 0.77),
    ("max_length", 77, "max_length", 77),
    ("gradient_checkpointing", True, "gradient_checkpointing", True),
    ("logging_steps", 7, "logging_steps", 7),
    ("save_steps", 13, "save_steps", 13),
    ("save_total_limit", 4, "save_total_limit", 4),
]
GRPO_KNOBS = [
    ("learning_rate", 3.21e-6, "learning_rate", 3.21e-6),
    ("kl_coef", 0.04, "beta", 0.04),
    ("num_generations", 4, "num_generations", 4),
    ("temperature", 0.66, "temperature", 0.66),
    ("top_p", 0.9, "top_p", 0.9),
    ("max_completion_length", 33, "max_completion_length", 33),
    ("loss_type", "dr_grpo", "loss_type", "dr_grpo"),
    ("scale_rewards", "batch", "scale_rewards", "batch"),
    ("num_epochs", 2.0, "num_train_epochs", 2.0),
    ("max_steps", 9, "max_steps", 9),
    ("per_device_train_batch_size", 24, "per_device_train_batch_size", 24),
    ("gradient_accumulation_steps", 2, "gradient_accumulation_steps", 2),
    ("warmup_ratio", 0.05, "warmup_steps", 0.05),
    ("lr_scheduler_type", "cosine", "lr_scheduler_type", "cosine"),
    ("weight_decay", 0.02, "weight_decay", 0.02),
    ("max_grad_norm", 0.5, "max_grad_norm", 0.5),
    ("gradient_checkpointing", True, "gradient_checkpointing", True),
    ("logging_steps", 3, "logging_steps", 3),
    ("save_steps", 11, "save_steps", 11),
    ("save_total_limit", 3, "save_total_limit", 3),
    ("rewards", {"accuracy": 2.0, "format": 0.3, "step": 0.7}, "reward_weights", [2.0, 0.3, 0.7]),
]
LORA_KNOBS = [
    ("r", 7, "r", 7),
    ("alpha", 21, "lora_alpha", 21),
    ("dropout", 0.11, "lora_dropout", 0.11),
    ("target_modules", ["q_proj", "v_proj"], "target_modules", {"q_proj", "v_proj"}),
]


def _params(section, key, value):
    p = raw_params()
    p[section][key] = value
    return validate_params(p)


@pytest.mark.parametrize("key, value, attr, expected", SFT_KNOBS, ids=[k[0] for k in SFT_KNOBS])
def test_sft_knob_reaches_sftconfig(tmp_path, key, value, attr, expected):
    cfg = sft.sft_config(_params("sft", key, value), output_dir=str(tmp_path))
    assert getattr(cfg, attr) == pytest.approx(expected) if isinstance(expected, float) else getattr(cfg, attr) == expected


@pytest.mark.parametrize("key, value, attr, expected", GRPO_KNOBS, ids=[k[0] for k in GRPO_KNOBS])
def test_grpo_knob_reaches_grpoconfig(tmp_path, key, value, attr, expected):
    cfg = grpo.grpo_config(_params("grpo", key, value), output_dir=str(tmp_path))
    got = getattr(cfg, attr)
    assert got == pytest.approx(expected) if isinstance(expected, (float, list)) else got == expected


@pytest.mark.parametrize("stage", ["sft", "grpo"])
@pytest.mark.parametrize("key, value, attr, expected", LORA_KNOBS, ids=[k[0] for k in LORA_KNOBS])
def test_lora_knob_reaches_loraconfig(stage, key, value, attr, expected):
    p = raw_params()
    p[stage]["use_lora"] = True
    p[stage]["lora"][key] = value
    module = sft if stage == "sft" else grpo
    cfg = module.peft_config(validate_params(p))
    got = getattr(cfg, attr)
    assert (set(got) if isinstance(expected, set) else got) == expected


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_use_lora_false_means_full_finetuning(stage):
    p = raw_params()
    p[stage]["use_lora"] = False
    module = sft if stage == "sft" else grpo
    assert module.peft_config(validate_params(p)) is None


def test_seed_and_precision_reach_configs(tmp_path):
    p = raw_params()
    p["seed"] = 1234
    p["model"]["precision"] = "fp32"
    params = validate_params(p)
    for cfg in (sft.sft_config(params, output_dir=str(tmp_path)), grpo.grpo_config(params, output_dir=str(tmp_path))):
        assert cfg.seed == 1234 and cfg.data_seed == 1234
        assert cfg.bf16 is False and cfg.fp16 is False


def test_scale_lr_rule_applied(tmp_path):
    p = raw_params()
    p["distributed"].update(scale_lr="linear", reference_batch=16)
    p["sft"].update(per_device_train_batch_size=32, gradient_accumulation_steps=1, learning_rate=1e-3)
    cfg = sft.sft_config(validate_params(p), output_dir=str(tmp_path))
    assert cfg.learning_rate == pytest.approx(2e-3)
    p["distributed"]["scale_lr"] = "sqrt"
    assert sft.sft_config(validate_params(p), output_dir=str(tmp_path)).learning_rate == pytest.approx(1e-3 * 2 ** 0.5)


def test_reward_kwargs_reach_reward_functions():
    p = raw_params()
    p["grpo"]["rewards"] = {"length_penalty": 1.0}
    p["grpo"]["reward_kwargs"].update(length_max=4, length_weight=2.0)
    params = validate_params(p)
    from agentrl.rewards import build_rewards

    funcs, _ = build_rewards(params.grpo.rewards, params.grpo.reward_kwargs.model_dump())
    assert funcs[0](["12345678"]) == [pytest.approx(-2.0 * 4 / 4)]


def test_grpo_batch_must_divide_by_num_generations():
    p = raw_params()
    p["grpo"].update(per_device_train_batch_size=10, num_generations=4, gradient_accumulation_steps=1)
    with pytest.raises(grpo.BatchConfigError, match="divisible by grpo.num_generations"):
        grpo.check_batch(validate_params(p), num_processes=1)
    assert grpo.check_batch(validate_params(p), num_processes=2) == 20


def test_knob_lists_cover_the_schema():
    """Adding a training knob to the schema without a test here fails."""
    common_untested = {"use_lora", "lora"}  # tested above
    sft_keys = set(SFTParams.model_fields) - common_untested
    grpo_keys = set(GRPOParams.model_fields) - common_untested - {"reward_kwargs"}  # reward_kwargs: test above
    assert sft_keys == {k[0] for k in SFT_KNOBS}
    assert grpo_keys == {k[0] for k in GRPO_KNOBS}
    assert set(LoraParams.model_fields) == {k[0] for k in LORA_KNOBS}
