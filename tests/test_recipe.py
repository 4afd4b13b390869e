"""configs/recipes/qwen3-0.6b-gsm8k.yaml applied the way `make recipe` applies it (DVC's own `-S` override
mechanism on params.yaml), with a local stand-in for Qwen/Qwen3-0.6B (no hub here): every override reaches
SFTConfig / GRPOConfig / LoraConfig, the model loader or the validated params. Then `recipe.py apply` (the recipe
written into params.yaml for a cluster job) and docs/scaling.md's cluster commands, each of which must exist."""

import re
import shutil
import subprocess
import sys

import pytest
import torch

from agentrl.experiments import recipe
from agentrl.experiments.overrides import get, leaves
from agentrl.experiments.recipe import RecipeError
from agentrl.experiments.scratch import git_commit_all
from conftest import ROOT, tiny_lm

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
    with pytest.raises(RecipeError, match="grpo.trainer.learnig_rate: unknown argument of GRPOConfig"):
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
    with pytest.raises(RecipeError, match=re.escape(f"{bad}: data.system_prompt: ") + ".*interpolation"):
        recipe.overrides(bad)


@pytest.mark.parametrize("preset", sorted((ROOT / "configs/envs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_environment_preset_gives_valid_params(preset):
    """Each `make env ENV=<name>` preset applies to params.yaml and validates (a typo'd key or knob fails here)."""
    recipe.check(preset, ROOT / "params.yaml")


# ------------------------------------------------------------------------ recipe.py apply (a cluster job's step 1)
@pytest.fixture
def clone(tmp_path):
    """A git checkout holding the committed params.yaml, as a fresh clone has it."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    git_commit_all(tmp_path, "clone")
    return tmp_path


def apply_cli(repo, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts/recipe.py"), "apply", *args], cwd=repo, capture_output=True, text=True
    )


def test_apply_writes_the_recipe_prints_the_changes_then_is_a_no_op(clone):
    from agentrl.config import load_yaml

    r = apply_cli(clone, str(RECIPE))
    assert r.returncode == 0, r.stderr
    assert "model.base_model: 'tiny' -> 'Qwen/Qwen3-0.6B'" in r.stdout.splitlines(), r.stdout
    applied = load_yaml(clone / "params.yaml")
    assert all(get(applied, k) == v for k, v in leaves(load_yaml(RECIPE)))
    before = (clone / "params.yaml").read_bytes()
    again = apply_cli(clone, str(RECIPE))  # every node and every stage of a job may run it
    assert again.returncode == 0 and again.stdout.strip() == "params.yaml already has every value of the recipe"
    assert (clone / "params.yaml").read_bytes() == before


def test_a_later_recipe_wins_and_keeps_the_rest_of_the_first(clone):
    from agentrl.config import load_yaml

    site = clone / "site.yaml"
    site.write_text("model:\n  base_model: tiny\n  precision: fp32\n")
    changes = recipe.apply_in_place([RECIPE, site], clone / "params.yaml")
    applied = load_yaml(clone / "params.yaml")
    assert (applied["model"]["base_model"], applied["model"]["precision"]) == ("tiny", "fp32")
    assert applied["data"]["source"] == "gsm8k" and "data.source: 'synthetic' -> 'gsm8k'" in changes
    assert "model.precision: 'auto' -> 'fp32'" in changes and not any(c.startswith("model.base_model") for c in changes)


def test_apply_refuses_uncommitted_edits_unless_forced(clone):
    from agentrl.config import load_yaml

    params = clone / "params.yaml"
    params.write_text(params.read_text().replace("\nseed: 42", "\nseed: 7"))
    edited = params.read_bytes()
    r = apply_cli(clone, str(RECIPE))
    assert r.returncode == 1 and "params.yaml has uncommitted edits (M params.yaml)" in r.stderr, r.stderr
    assert "--force" in r.stderr and params.read_bytes() == edited
    assert apply_cli(clone, str(RECIPE), "--force").returncode == 0
    applied = load_yaml(params)
    assert applied["seed"] == 7 and applied["model"]["base_model"] == "Qwen/Qwen3-0.6B"


def test_apply_outside_git_needs_force(tmp_path):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    with pytest.raises(RecipeError, match="params.yaml: not in a git checkout .*--force"):
        recipe.apply_in_place([RECIPE], tmp_path / "params.yaml")
    assert recipe.apply_in_place([RECIPE], tmp_path / "params.yaml", force=True)


def test_apply_validates_before_it_writes(clone):
    bad = clone / "bad.yaml"
    bad.write_text("grpo:\n  trainer:\n    learnig_rate: 1.0e-6\n")
    git_commit_all(clone, "bad recipe")
    before = (clone / "params.yaml").read_bytes()
    with pytest.raises(
        RecipeError,
        match=r"(?s)bad.yaml: the overridden params are invalid:\n.*/params.yaml:.*grpo.trainer.learnig_rate",
    ):
        recipe.apply_in_place([bad], clone / "params.yaml")
    assert (clone / "params.yaml").read_bytes() == before
    assert not list(clone.glob(".params-*"))  # no scratch file left behind


# ------------------------------------------------------------- docs/scaling.md's cluster commands exist
def cluster_commands() -> list[str]:
    """The commands of the fenced blocks in docs/scaling.md's "Cluster sequence" section, continuations joined,
    comments dropped."""
    text = (ROOT / "docs/scaling.md").read_text()
    section = text.split("\n## Cluster sequence", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = []
    for line in "\n".join(blocks).replace("\\\n", " ").splitlines():
        line = line.split("  #", 1)[0].strip()
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def test_every_cluster_command_in_the_docs_exists():
    from test_makefile import makefile_targets

    commands = cluster_commands()
    assert len(commands) >= 8, commands
    targets, makefile = makefile_targets(), (ROOT / "Makefile").read_text()
    subcommands = re.search(r"choices=\[(.*?)\]", (ROOT / "scripts/recipe.py").read_text()).group(1)
    seen = set()
    for cmd in commands:
        for part in re.split(r"&&|;", cmd):
            words = part.split()
            if words[:1] == ["make"]:
                assert words[1] in targets, (cmd, "no such make target")
                for var in (w.split("=")[0] for w in words[2:] if "=" in w):
                    assert re.search(rf"^{var} \?=", makefile, re.M), (cmd, var, "not a Makefile variable")
            elif "scripts/recipe.py" in words:
                sub = words[words.index("scripts/recipe.py") + 1]
                assert f'"{sub}"' in subcommands and (ROOT / words[words.index("scripts/recipe.py") + 2]).exists(), cmd
            elif words[:2] == [".venv/bin/dvc", "repro"]:
                stages = (ROOT / "dvc.yaml").read_text()
                assert all(re.search(rf"^  {s}:", stages, re.M) for s in words[2:] if not s.startswith("-")), cmd
            elif words[:1] == ["sbatch"] or "sbatch" in words:
                assert (ROOT / words[words.index("sbatch") + 1]).exists(), cmd
            seen.add(words[0].split("=")[0] if "=" in words[0] else words[0])
    assert {"make", ".venv/bin/python", ".venv/bin/dvc"} <= seen, seen
