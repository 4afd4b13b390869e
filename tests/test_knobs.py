"""TRL's and PEFT's own arguments pass through params unchanged, and mistakes in them are named.

`sft.trainer` -> trl.SFTConfig, `grpo.trainer` -> trl.GRPOConfig, `*.lora` -> peft.LoraConfig. The tests set
knobs that no project code names and read them back from the objects the stages build (for GRPO from a real
GRPOTrainer), check the typo / derived-key / type errors, and pin the default pipeline's values (the
translation of the old keys must not change the embedded default's numbers).
"""

import copy
from types import SimpleNamespace

import pytest
import torch

from agentrl.config import ParamsError, validate_params
from agentrl.passthrough import DERIVED, PassthroughError
from agentrl.stages import grpo, sft
from agentrl.stages.training import peft_config
from conftest import mini_params, raw_params, tiny_lm


def _with(section: str, sub: str, **values):
    p = raw_params()
    p[section][sub].update(values)
    return validate_params(p)


def _error(p: dict) -> str:
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    return str(e.value)


# ------------------------------------------------------------------------------------ pass-through
def test_sftconfig_pass_through(tmp_path):
    knobs = {
        "neftune_noise_alpha": 5.0,
        "adam_beta2": 0.97,
        "optim": "adamw_torch",
        "max_length": 77,
        "eval_strategy": "no",
        "lr_scheduler_kwargs": {"num_cycles": 0.25},
        "assistant_only_loss": False,
    }
    cfg = sft.sft_config(_with("sft", "trainer", **knobs), output_dir=str(tmp_path))
    assert {k: getattr(cfg, k) for k in knobs} == knobs


@pytest.fixture
def tiny_model_and_tokenizer():

    tok, model = tiny_lm(["Tom has 3 apples and buys 4 more. 3+4=7 #### 7"] * 20, 300)
    return model, tok


def test_grpoconfig_knobs_no_code_names_reach_the_trainer(tmp_path, tiny_model_and_tokenizer):
    """Three GRPOConfig knobs that appear nowhere in src/: set in grpo.trainer, read back from the stage's own
    trainer (grpo.build_trainer) built on the miniature config."""
    from datasets import Dataset

    knobs = {"num_iterations": 3, "epsilon_high": 0.28, "mask_truncated_completions": True}
    p = mini_params()
    p["grpo"]["trainer"].update(knobs)
    params = validate_params(p)
    model, tok = tiny_model_and_tokenizer
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": "2"}] * 8)
    trainer = grpo.build_trainer(params, grpo.grpo_config(params, output_dir=str(tmp_path)), model, tok, ds)
    assert {k: getattr(trainer.args, k) for k in knobs} == knobs
    # ... and the trainer itself runs with them
    assert (trainer.num_iterations, trainer.epsilon_high, trainer.mask_truncated_completions) == (3, 0.28, True)
    assert trainer.args.num_generations == p["grpo"]["trainer"]["num_generations"]
    assert trainer.model.peft_config["default"].r == p["grpo"]["lora"]["r"]


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_loraconfig_pass_through(stage):
    knobs = {
        "r": 7,
        "lora_alpha": 21,
        "lora_dropout": 0.11,
        "target_modules": ["q_proj", "v_proj"],
        "use_rslora": True,
        "bias": "lora_only",
        "modules_to_save": ["lm_head"],
    }
    p = raw_params()
    p[stage]["use_lora"] = True
    p[stage]["lora"] = knobs
    cfg = peft_config(validate_params(p), stage)
    got = {k: getattr(cfg, k) for k in knobs}
    got["target_modules"] = sorted(got["target_modules"])
    assert got == {**knobs, "target_modules": ["q_proj", "v_proj"]}
    assert cfg.task_type == "CAUSAL_LM"


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_use_lora_false_means_full_finetuning(stage):
    p = raw_params()
    p[stage]["use_lora"] = False
    assert peft_config(validate_params(p), stage) is None


# ------------------------------------------------------------------------------------ mistakes named
@pytest.mark.parametrize(
    "path, typo, cls, suggestion",
    [
        ("sft.trainer", "learnig_rate", "SFTConfig", "learning_rate"),
        ("grpo.trainer", "learnig_rate", "GRPOConfig", "learning_rate"),
        ("grpo.trainer", "num_generation", "GRPOConfig", "num_generations"),
        ("sft.lora", "lora_alfa", "LoraConfig", "lora_alpha"),
        ("grpo.lora", "target_module", "LoraConfig", "target_modules"),
    ],
)
def test_typo_names_full_path_class_and_closest_name(path, typo, cls, suggestion):
    p = raw_params()
    section, sub = path.split(".")
    p[section][sub][typo] = 1
    assert f"{path}.{typo}: unknown argument of {cls} (did you mean {suggestion}?)" in _error(p)


def test_unknown_key_without_close_match_has_no_suggestion():
    p = raw_params()
    p["grpo"]["trainer"]["zzzqqq"] = 1
    msg = _error(p)
    assert "grpo.trainer.zzzqqq: unknown argument of GRPOConfig" in msg and "did you mean" not in msg


@pytest.mark.parametrize("path, key", [(path, key) for path, keys in DERIVED.items() for key in keys])
def test_derived_value_set_by_hand_says_which_param(path, key):
    p = raw_params()
    section, sub = path.split(".")
    p[section][sub][key] = "x"
    msg = _error(p)
    assert f"{path}.{key}: set by the " in msg, msg


def test_derived_messages_point_to_the_param():
    p = raw_params()
    p["grpo"]["trainer"].update(seed=3, bf16=True, report_to=["wandb"], reward_weights=[1.0])
    msg = _error(p)
    for line in (
        "grpo.trainer.seed: set by the stage from 'seed'",
        "grpo.trainer.bf16: set by the stage from 'model.precision'",
        "grpo.trainer.report_to: set by the stage from 'tracking.report_to'",
        "grpo.trainer.reward_weights: set by the stage from 'grpo.rewards'",
    ):
        assert line in msg, msg


@pytest.mark.parametrize(
    "path, key, value, expected",
    [
        ("sft.trainer", "max_steps", "150", "expected int"),
        ("sft.trainer", "max_steps", True, "expected int"),
        ("grpo.trainer", "beta", "0.1", "expected float"),
        ("grpo.trainer", "beta", float("inf"), "finite"),
        ("grpo.trainer", "temperature", float("nan"), "finite"),
        ("grpo.trainer", "use_vllm", "yes", "expected bool"),
        ("sft.lora", "r", 8.0, "expected int"),
        ("grpo.lora", "lora_dropout", "0.1", "expected float"),
        ("grpo.trainer", "learning_rate", 0, "must be > 0"),
        ("grpo.lora", "r", 0, "must be > 0"),
    ],
)
def test_pass_through_types_are_strict(path, key, value, expected):
    p = raw_params()
    section, sub = path.split(".")
    p[section][sub][key] = value
    msg = _error(p)
    assert f"{path}.{key}: " in msg and expected in msg, msg


def test_value_the_dataclass_rejects_is_named_by_section_before_any_work(workdir):
    """Cross-field checks live in TRL's __post_init__: the stage builds its config before it loads anything,
    so they stop it naming the section (here with no model on disk at all)."""
    p = mini_params()
    p["grpo"]["trainer"].update(generation_batch_size=8, steps_per_generation=1)
    with pytest.raises(PassthroughError, match=r"grpo.trainer: GRPOConfig rejected the configuration: .*generation"):
        grpo.train(validate_params(p))
    p = mini_params()
    p["sft"]["trainer"]["lr_scheduler_type"] = "not_a_schedule"
    with pytest.raises(PassthroughError, match=r"sft.trainer: SFTConfig rejected the configuration"):
        sft.train(validate_params(p))
    assert not (workdir / "models").exists()


# ------------------------------------------------------------------------------------ derived values
def test_seed_and_precision_reach_configs(tmp_path):
    p = raw_params()
    p["seed"] = 1234
    p["model"]["precision"] = "fp32"
    params = validate_params(p)
    for cfg in (sft.sft_config(params, output_dir=str(tmp_path)), grpo.grpo_config(params, output_dir=str(tmp_path))):
        assert cfg.seed == 1234 and cfg.data_seed == 1234
        assert cfg.bf16 is False and cfg.fp16 is False
        assert cfg.output_dir == str(tmp_path)


def test_scale_lr_scales_the_reference_learning_rate(tmp_path):
    p = raw_params()
    p["distributed"].update(scale_lr="linear", reference_batch=16)
    p["sft"]["trainer"].update(per_device_train_batch_size=32, gradient_accumulation_steps=1, learning_rate=1e-3)
    assert sft.sft_config(validate_params(p), output_dir=str(tmp_path)).learning_rate == pytest.approx(2e-3)
    p["distributed"]["scale_lr"] = "sqrt"
    assert sft.sft_config(validate_params(p), output_dir=str(tmp_path)).learning_rate == pytest.approx(1e-3 * 2**0.5)
    p["distributed"]["scale_lr"] = "none"
    del p["sft"]["trainer"]["learning_rate"]  # unset: TRL's default is the reference
    from trl import SFTConfig

    assert (
        sft.sft_config(validate_params(p), output_dir=str(tmp_path)).learning_rate
        == SFTConfig.__dataclass_fields__["learning_rate"].default
    )


def test_reward_weights_come_from_grpo_rewards(tmp_path):
    p = raw_params()
    p["grpo"]["rewards"] = {"accuracy": 2.0, "format": 0.3, "step": 0.7}
    assert grpo.grpo_config(validate_params(p), output_dir=str(tmp_path)).reward_weights == [2.0, 0.3, 0.7]


def test_reward_kwargs_reach_reward_functions():
    p = raw_params()
    p["grpo"]["rewards"] = {"length_penalty": 1.0}
    p["grpo"]["reward_kwargs"].update(length_max=4, length_weight=2.0)
    params = validate_params(p)
    from agentrl.agent.rewards import build_rewards

    funcs, _ = build_rewards(params.grpo.rewards, params.grpo.reward_kwargs.model_dump())
    assert funcs[0](["12345678"]) == [pytest.approx(-2.0 * 4 / 4)]


def test_default_pipeline_values_unchanged(tmp_path):
    """The old typed keys, translated into pass-through sections, build the same objects as before the change
    (compared field by field when it was made; same seed -> same numbers). Pinned here: the values the stage
    used to hard-code, now in params.yaml (a change to one changes the embedded default's numbers), and that
    every params.yaml trainer value arrives unchanged."""
    raw = raw_params()
    params = validate_params(raw)
    s = sft.sft_config(params, output_dir=str(tmp_path))
    g = grpo.grpo_config(params, output_dir=str(tmp_path))
    for cfg, section in ((s, "sft"), (g, "grpo")):
        for key, value in raw[section]["trainer"].items():
            got = getattr(cfg, key)
            assert (got.value if hasattr(got, "value") else got) == value, (section, key)
    fixed_sft = {
        "completion_only_loss": True,
        "packing": False,
        "dataloader_num_workers": 0,
        "activation_checkpointing": False,
        "warmup_steps": 0.03,
        "num_train_epochs": 1.0,
    }
    fixed_grpo = {
        "top_k": 0,
        "log_completions": False,
        "dataloader_num_workers": 0,
        "activation_checkpointing": False,
        "warmup_steps": 0.0,
        "num_train_epochs": 1.0,
        "use_vllm": False,
        "beta": 0.0,
        "reward_weights": [1.0, 0.1],
    }
    assert {k: getattr(s, k) for k in fixed_sft} == fixed_sft
    assert {k: getattr(g, k) for k in fixed_grpo} == fixed_grpo
    assert s.save_strategy.value == g.save_strategy.value == "steps"
    assert (s.learning_rate, g.learning_rate) == (2e-3, 2e-4)  # distributed.scale_lr: none
    assert (s.seed, s.data_seed, g.seed, g.data_seed) == (42, 42, 42, 42)
    if not torch.cuda.is_available():
        assert (s.bf16, s.fp16, g.bf16, g.fp16) == (False, False, False, False)  # model.precision auto: fp32 on CPU
    for stage in ("sft", "grpo"):
        p = raw_params()
        p[stage]["use_lora"] = True
        lc = peft_config(validate_params(p), stage)
        assert (lc.r, lc.lora_alpha, lc.lora_dropout, lc.bias, lc.task_type) == (32, 64, 0.0, "none", "CAUSAL_LM")
        assert set(lc.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


# ------------------------------------------------------------------------------------ batch, vLLM, loading
def test_grpo_batch_must_divide_by_num_generations():
    p = raw_params()
    p["grpo"]["trainer"].update(per_device_train_batch_size=10, num_generations=4, gradient_accumulation_steps=1)
    with pytest.raises(grpo.GRPOSettingsError, match="divisible by grpo.trainer.num_generations"):
        grpo.check_batch(validate_params(p), num_processes=1)
    assert grpo.check_batch(validate_params(p), num_processes=2) == 20
    p["grpo"]["trainer"].update(steps_per_generation=2)  # TRL's generation batch: per device x processes x steps
    assert grpo.check_batch(validate_params(p), num_processes=1) == 20
    p["grpo"]["trainer"].update(steps_per_generation=None, generation_batch_size=12)
    assert grpo.check_batch(validate_params(p), num_processes=1) == 12


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_vllm_is_reachable_and_refused_on_cpu(tmp_path):
    p = raw_params()
    p["grpo"]["trainer"].update(use_vllm=True, vllm_mode="server", vllm_server_port=8123)
    args = grpo.grpo_config(validate_params(p), output_dir=str(tmp_path))
    assert (args.use_vllm, args.vllm_mode, args.vllm_server_port) == (True, "server", 8123)
    with pytest.raises(ParamsError, match="grpo.trainer.use_vllm: vLLM generation needs a CUDA GPU"):
        grpo.check_generation(args)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_model_is_created_after_the_trl_config_in_its_dtype(stage, workdir, monkeypatch):
    """ZeRO-3 partitions at load only if the TRL/DeepSpeed config exists when the model is created."""
    from accelerate.state import PartialState

    events = []
    module = sft if stage == "sft" else grpo
    build = getattr(module, f"{stage}_config")
    monkeypatch.setattr(module, f"{stage}_config", lambda *a, **k: events.append("config") or build(*a, **k))
    monkeypatch.setattr(module, "load_tokenizer", lambda *a, **k: events.append("tokenizer") or SimpleNamespace())

    def fake_load_model(path, **kw):
        events.append(("model", str(path), kw))
        assert PartialState._shared_state, "model created before the TRL config set up the launch state"
        raise _Stop

    monkeypatch.setattr(module, "load_model", fake_load_model)
    p = mini_params()
    p["model"].update(precision="fp32", attn_implementation="eager")
    with pytest.raises(_Stop):
        module.train(validate_params(p))
    assert events[0] == "config"
    assert events[-1] == ("model", "models/base", {"dtype": torch.float32, "attn_implementation": "eager"})


def test_grpo_builds_its_rewards_once(tmp_path, monkeypatch, tiny_model_and_tokenizer):
    """The stage builds the reward functions once (a custom one imports its module): GRPOConfig's reward_weights
    are grpo.rewards' weights, not a second build, and the trainer gets the one build."""
    from datasets import Dataset

    built = []
    real = grpo.build_rewards
    monkeypatch.setattr(grpo, "build_rewards", lambda *a: built.append(a) or real(*a))
    params = validate_params(mini_params())
    model, tok = tiny_model_and_tokenizer
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": "2"}] * 8)
    trainer = grpo.build_trainer(params, grpo.grpo_config(params, output_dir=str(tmp_path)), model, tok, ds)
    assert len(built) == 1 and len(trainer.reward_funcs) == len(params.grpo.rewards)


def test_load_model_in_target_dtype_and_attention(tmp_path, tiny_model_and_tokenizer):
    from agentrl.modeling import load_model

    model, _ = tiny_model_and_tokenizer
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16, attn_implementation="eager")
    assert loaded.dtype == torch.bfloat16 and loaded.config._attn_implementation == "eager"
    assert load_model(tmp_path, dtype=torch.float32, attn_implementation="sdpa").config._attn_implementation == "sdpa"


def test_pass_through_values_are_not_shared_with_params(tmp_path):
    params = validate_params(raw_params())
    before = copy.deepcopy(params.grpo.trainer)
    grpo.grpo_config(params, output_dir=str(tmp_path))
    assert params.grpo.trainer == before
