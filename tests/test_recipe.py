"""configs/recipes/qwen3-0.6b-gsm8k.yaml applied the way `make recipe` applies it (DVC's own `-S` override
mechanism on params.yaml), with a local stand-in for Qwen/Qwen3-0.6B (no hub here): every override reaches
SFTConfig / GRPOConfig / LoraConfig, the model loader or the validated params."""

import re
import shutil
import sys

import pytest
import torch

from agentrl.experiments.overrides import get, leaves
from conftest import ROOT, tiny_lm

sys.path.insert(0, str(ROOT / "scripts"))
import recipe

RECIPE = ROOT / "configs/recipes/qwen3-0.6b-gsm8k.yaml"
# Qwen3's chat template branch for thinking off (the real template carries the same test)
QWEN3_TEMPLATE_TAIL = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture
def stand_in(tmp_path):
    """A tiny randomly initialised Qwen3 + tokenizer with a Qwen3-style template, saved like a hub snapshot."""
    from agentrl.modeling import CHAT_TEMPLATE

    tok, model = tiny_lm(["Natalia sold 48 clips. 48/2=24 #### 72"] * 20, 300)
    tok.chat_template = CHAT_TEMPLATE.split("{%- if add_generation_prompt")[0] + QWEN3_TEMPLATE_TAIL
    d = tmp_path / "Qwen3-0.6B-stand-in"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_recipe_overrides_reach_every_config(tmp_path, stand_in):
    from agentrl.config import load_params, load_yaml
    from agentrl.modeling import bake_chat_template_kwargs, load_model
    from agentrl.stages import grpo, sft
    from agentrl.stages import training as stage
    from agentrl.stages.base import load_tokenizer_hub

    params_file = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params_file)
    recipe.apply(params_file, RECIPE)  # exactly what `dvc exp run -S ++k=v ...` does to params.yaml
    applied = load_yaml(params_file)
    recipe_leaves = leaves(load_yaml(RECIPE))
    assert recipe_leaves and all(get(applied, k) == v for k, v in recipe_leaves), [
        (k, v, get(applied, k)) for k, v in recipe_leaves if get(applied, k) != v
    ]
    assert applied["model"]["base_model"] == "Qwen/Qwen3-0.6B" and len(applied["model"]["revision"]) == 40

    # the stand-in replaces the hub model; bf16 TrainingArguments need a GPU, so configs are built in fp32 here
    text = params_file.read_text().replace("Qwen/Qwen3-0.6B", str(stand_in))
    if not torch.cuda.is_available():
        text = text.replace("precision: bf16", "precision: fp32")
    params_file.write_text(text)
    params = load_params(params_file)

    built = {
        "sft.trainer": sft.sft_config(params, output_dir=str(tmp_path / "s")),
        "grpo.trainer": grpo.grpo_config(params, output_dir=str(tmp_path / "g")),
        "sft.lora": stage.peft_config(params, "sft"),
        "grpo.lora": stage.peft_config(params, "grpo"),
    }
    checked = 0
    for key, _value in recipe_leaves:
        section = next((s for s in built if key.startswith(s + ".")), None)
        if section is None:
            continue
        attr = key[len(section) + 1 :].split(".")[0]
        got = getattr(built[section], attr)
        want = get(load_yaml(RECIPE), section + "." + attr)
        got = got.value if hasattr(got, "value") else got  # enums (lr_scheduler_type)
        if isinstance(want, list):
            got, want = sorted(got), sorted(want)
        assert got == want, (key, got, want)
        checked += 1
    assert checked >= 30  # every trainer/lora leaf of the recipe (36 today) was compared
    # the reference learning rates reach the configs unscaled (scale_lr: none in the recipe)
    assert built["grpo.trainer"].learning_rate == 1e-6 and built["grpo.trainer"].beta == 0.001
    assert built["grpo.trainer"].use_vllm and built["grpo.trainer"].vllm_mode == "colocate"
    # per-device 16 x 4 GPUs = 64 completions = 8 prompts x 8 generations
    assert grpo.check_batch(params, num_processes=params.distributed.num_processes) == 64

    # project keys: the model loader, the chat template, data and distributed settings
    model = load_model(
        params.model.base_model,
        dtype=torch.bfloat16,
        revision=None,
        attn_implementation=params.model.attn_implementation,
    )
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "sdpa"
    tok = bake_chat_template_kwargs(
        load_tokenizer_hub(params.model.base_model, params.model.revision), params.model.chat_template_kwargs
    )
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered.endswith("<think>\n\n</think>\n\n"), rendered
    assert (params.data.source, params.data.hub_dataset, params.data.eval_max_samples) == (
        "gsm8k",
        "openai/gsm8k",
        None,
    )
    assert params.distributed.accelerate_config == "configs/accelerate/zero2.yaml"
    assert params.distributed.num_processes == 4


def test_recipe_typo_is_caught_before_dvc_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(RECIPE.read_text().replace("    beta: 0.001", "    beta: 0.001\n    learnig_rate: 1.0e-6"))
    with pytest.raises(SystemExit, match="grpo.trainer.learnig_rate: unknown argument of GRPOConfig"):
        recipe.check(bad, ROOT / "params.yaml")


def test_hydra_values_round_trip(tmp_path):
    params_file = tmp_path / "params.yaml"
    params_file.write_text("a: {b: 1, s: x}\n")
    tricky = {"a": {"b": 1e-6, "s": "End with '#### <n>'.", "l": ["q_proj", "v_proj"], "n": None, "t": True}}
    (tmp_path / "r.yaml").write_text(__import__("yaml").safe_dump(tricky))
    recipe.apply(params_file, tmp_path / "r.yaml")
    from agentrl.config import load_yaml

    assert load_yaml(params_file) == tricky


def test_a_value_dvc_would_not_write_as_given_is_refused(tmp_path):
    """An interpolation would be resolved by `dvc exp run -S` (here: the environment): refused, naming the key."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  system_prompt: 'home is ${oc.env:HOME}'\n")
    with pytest.raises(SystemExit, match=re.escape(f"{bad}: data.system_prompt: ") + ".*interpolation"):
        recipe.overrides(bad)


@pytest.mark.parametrize("preset", sorted((ROOT / "configs/envs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_environment_preset_gives_valid_params(preset):
    """Each `make env ENV=<name>` preset applies to params.yaml and validates (a typo'd key or knob fails here)."""
    recipe.check(preset, ROOT / "params.yaml")
