import os
import re

import pytest
import yaml

from agentrl.config import ParamsError, load_params, validate_params
from conftest import ROOT, mini_params, raw_params


def test_repository_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.data.source == "synthetic"
    assert p.grpo.trainer["learning_rate"] < p.sft.trainer["learning_rate"]


@pytest.mark.parametrize(
    "mutate, key, expected",
    [
        (lambda p: p["sft"].update(learnig_rate=1e-4), "sft.learnig_rate", "unknown key"),
        (lambda p: p["sft"]["trainer"].update(learnig_rate=1e-4), "sft.trainer.learnig_rate", "unknown argument"),
        (lambda p: p.update(sedd=1), "sedd", "unknown key"),
        (lambda p: p["sft"]["trainer"].update(learning_rate="fast"), "sft.trainer.learning_rate", "expected float"),
        (lambda p: p["sft"]["trainer"].update(learning_rate=0), "sft.trainer.learning_rate", "must be > 0"),
        (lambda p: p["grpo"]["trainer"].update(learning_rate=-1e-5), "grpo.trainer.learning_rate", "must be > 0"),
        (lambda p: p["grpo"].pop("trainer"), "grpo.trainer", "Field required"),
        (lambda p: p.pop("sft"), "sft", "Field required"),
        (lambda p: p["data"].update(max_samples=0), "data.max_samples", "greater than or equal to 1"),
        (lambda p: p["data"].update(source="hub"), "data.source", "synthetic"),
        (lambda p: p["grpo"]["lora"].update(r=0), "grpo.lora.r", "must be > 0"),
        (
            lambda p: p["data"]["synthetic"].update(operand_min=p["data"]["synthetic"]["operand_max"] + 1),
            "data.synthetic",
            "operand_min",
        ),
        (lambda p: p["tracking"].update(report_to=["mlflow"]), "tracking.report_to.0", "tensorboard"),
        (lambda p: p["data"].update(source="jsonl"), "data", "train_file"),
    ],
)
def test_schema_errors_name_the_key(mutate, key, expected):
    p = raw_params()
    mutate(p)
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    msg = str(e.value)
    assert key in msg, msg
    assert expected in msg, msg


def test_stage_exits_before_touching_data(tmp_path, monkeypatch):
    """A typo stops the prepare stage with exit code 2 and writes nothing."""
    import yaml

    from agentrl.stages import prepare

    p = raw_params()
    p["data"]["max_sample"] = 10
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        prepare.main()
    assert e.value.code == 2
    assert not (tmp_path / "data").exists() and not (tmp_path / "metrics").exists()


def test_missing_params_file(tmp_path):
    with pytest.raises(ParamsError, match="file not found"):
        load_params(tmp_path / "nope.yaml")


# ------------------------------------------------------------------------------------ strict YAML and types
def test_duplicate_yaml_key_is_an_error_naming_key_and_line(tmp_path):
    text = (ROOT / "params.yaml").read_text()
    grpo_steps = re.search(r"^grpo:\n(?:.*\n)*?(    max_steps: \d+\n)", text, re.M).group(1)
    assert text.count(grpo_steps) == 1
    text = text.replace(grpo_steps, grpo_steps + "    max_steps: 7\n", 1)
    (tmp_path / "params.yaml").write_text(text)
    line = text.splitlines().index("    max_steps: 7") + 1
    with pytest.raises(
        ParamsError,
        match=rf"params.yaml:{line}: duplicate key 'grpo.trainer.max_steps' "
        rf"\(first on line {line - 1}\)",
    ):
        load_params(tmp_path / "params.yaml")


def test_yaml_exponent_floats_are_numbers(tmp_path):
    """`1e-6` (no dot; how DVC's -S writes floats) is a number, not the string YAML 1.1 makes of it."""
    text = (ROOT / "params.yaml").read_text().replace("    learning_rate: 2.0e-4", "    learning_rate: 1e-6", 1)
    (tmp_path / "params.yaml").write_text(text)
    assert load_params(tmp_path / "params.yaml").grpo.trainer["learning_rate"] == 1e-6


@pytest.mark.parametrize(
    "mutate, key, expected",
    [
        (lambda p: p["eval"].update(temperature=float("inf")), "eval.temperature", "finite number"),
        (lambda p: p["grpo"]["trainer"].update(beta=float("inf")), "grpo.trainer.beta", "finite number"),
        (lambda p: p["grpo"]["trainer"].update(temperature=float("nan")), "grpo.trainer.temperature", "finite number"),
        (lambda p: p["grpo"]["rewards"].update(accuracy=float("inf")), "grpo.rewards.accuracy", "finite number"),
        (lambda p: p.update(seed=2**32), "seed", "less than or equal to 4294967295"),
        (lambda p: p.update(seed=-1), "seed", "greater than or equal to 0"),
        (lambda p: p["eval"].update(batch_size="150"), "eval.batch_size", "valid integer"),
        (lambda p: p["eval"].update(batch_size=True), "eval.batch_size", "valid integer"),
        (lambda p: p["eval"].update(max_new_tokens=96.0), "eval.max_new_tokens", "valid integer"),
        (lambda p: p["sft"].update(use_lora=1), "sft.use_lora", "valid boolean"),
        (lambda p: p["distributed"].update(num_processes="2"), "distributed.num_processes", "valid integer"),
        (lambda p: p["sft"]["trainer"].update(max_steps="150"), "sft.trainer.max_steps", "expected int"),
        (lambda p: p["sft"]["trainer"].update(max_steps=True), "sft.trainer.max_steps", "expected int"),
    ],
)
def test_strict_types_and_finite_numbers(mutate, key, expected):
    p = raw_params()
    mutate(p)
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    assert f"{key}: " in str(e.value) and expected in str(e.value), str(e.value)


def test_largest_seed_is_valid():
    p = raw_params()
    p["seed"] = 2**32 - 1
    assert validate_params(p).seed == 2**32 - 1


def _fields(model, path=""):
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        where = f"{path}.{name}" if path else name
        yield where, field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _fields(field.annotation, where)


def test_params_yaml_is_the_one_place_a_default_lives():
    """No schema field has a default (params.yaml holds every value; TRL/PEFT defaults apply to what the
    pass-through sections leave out), so a key missing from a params file is an error naming it."""
    from agentrl.config import Params

    fields = dict(_fields(Params))
    assert len(fields) > 80, len(fields)  # the walk reached the nested sections
    assert [where for where, f in fields.items() if not f.is_required()] == []
    raw = raw_params()
    del raw["agent"]["tool_timeout_s"], raw["data"]["synthetic"]["steps"]
    with pytest.raises(ParamsError) as e:
        validate_params(raw)
    assert "agent.tool_timeout_s: Field required" in str(e.value)
    assert "data.synthetic.steps: Field required" in str(e.value)
    # the tool loop's knobs reach Toolset from params only (it had its own defaults once)
    import inspect

    from agentrl.agent.tools import Toolset

    sig = inspect.signature(Toolset.__init__).parameters
    assert all(sig[k].default is inspect.Parameter.empty for k in ("max_calls", "max_expression_chars", "timeout_s"))


# --------------------------------------------------------------- params bounded by the machine (issue 45, item 10)
MAX_TINY = dict(
    vocab_size=1_048_576,
    hidden_size=16384,
    intermediate_size=65536,
    num_hidden_layers=256,
    num_attention_heads=256,
    num_key_value_heads=256,
    head_dim=1024,
)


@pytest.fixture
def cpu_machine(monkeypatch):
    """A CPU-only machine with 64 GB of RAM, whatever machine runs the test (the GPU memory can be set per test)."""
    from agentrl import sizing

    monkeypatch.delenv(sizing.ALLOW_LARGE_MODEL_ENV, raising=False)
    monkeypatch.setattr(sizing, "ram_bytes", lambda: 64 * 10**9)
    monkeypatch.setattr(sizing, "gpu_bytes", lambda: 0)
    return monkeypatch


def test_tiny_model_at_its_maxima_is_refused_unless_allowed(cpu_machine):
    """model.tiny at every maximum (5.2e12 parameters) used to pass validation and fail at allocation."""
    p = raw_params()
    p["model"]["tiny"].update(MAX_TINY)
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    msg = str(e.value)
    assert "model.tiny: 5,239,869,030,400 parameters need ~83,837.9 GB to train" in msg, msg
    assert "64.0 GB of RAM and no GPU" in msg and "AGENTRL_ALLOW_LARGE_MODEL=1" in msg, msg
    cpu_machine.setenv("AGENTRL_ALLOW_LARGE_MODEL", "1")
    assert validate_params(p).model.tiny.hidden_size == 16384


def test_tiny_parameter_estimate_is_the_built_model_count():
    from agentrl.config import TinyModelParams
    from agentrl.modeling import build_tiny_model
    from agentrl.sizing import tiny_parameter_count

    for dims in (raw_params()["model"]["tiny"], {**raw_params()["model"]["tiny"], "num_key_value_heads": 4}):
        t = TinyModelParams(**dims)
        # build_tiny_model reads the vocabulary size and the special ids from the tokenizer
        tokenizer = type("Tok", (), {"__len__": lambda self, n=t.vocab_size: n, "pad_token_id": 0, "eos_token_id": 1})()
        model = build_tiny_model(tokenizer, t, seed=0)
        assert tiny_parameter_count(t) == sum(x.numel() for x in model.parameters())


@pytest.mark.parametrize(
    "base_model, gpu_gb, refused",
    [
        ("meta-llama/Llama-3.1-405B-Instruct", 0, "405,000,000,000 parameters (the size in its name), ~1,620.0 GB"),
        ("meta-llama/Llama-3.1-405B-Instruct", 640, "and 640.0 GB of GPU memory"),  # 810 GB in bf16: no machine here
        ("meta-llama/Llama-3.1-70B", 0, "~280.0 GB of weights in fp32, more than this machine's 64.0 GB of RAM"),
        ("meta-llama/Llama-3.1-70B", 640, None),  # bf16 on 8 x 80 GB
        ("mistralai/Mixtral-8x22B-v0.1", 0, "176,000,000,000 parameters"),
        ("Qwen/Qwen3-0.6B", 0, None),  # the GPU recipe's model fits a laptop's RAM
        ("openai-community/gpt2", 0, None),  # no size knowable offline: not checked (documented)
    ],
)
def test_hub_models_too_big_for_the_machine_are_refused_offline(cpu_machine, base_model, gpu_gb, refused):
    """A 405B hub id on a CPU machine used to validate and start a download; the size in the name refuses it."""
    from agentrl import sizing

    cpu_machine.setattr(sizing, "gpu_bytes", lambda: gpu_gb * 10**9)
    p = raw_params()
    p["model"]["base_model"] = base_model
    if refused is None:
        assert validate_params(p).model.base_model == base_model
        return
    with pytest.raises(ParamsError) as e:
        validate_params(p)
    assert f"model.base_model: {base_model} has ~" in str(e.value) and refused in str(e.value), str(e.value)


def test_local_model_size_is_read_from_its_safetensors_headers(cpu_machine, tmp_path):
    import json as _json

    def weights(path, shape):
        header = _json.dumps({"w": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}}).encode()
        path.write_bytes(len(header).to_bytes(8, "little") + header)  # the header only: nothing else is read

    (tmp_path / "big").mkdir()
    weights(tmp_path / "big" / "model-00001.safetensors", [100_000, 1_000_000])
    weights(tmp_path / "big" / "model-00002.safetensors", [1000, 1000])
    p = raw_params()
    p["model"].update(base_model=str(tmp_path / "big"), precision="bf16")
    with pytest.raises(ParamsError, match=r"has ~100,001,000,000 parameters \(the safetensors headers in"):
        validate_params(p)
    (tmp_path / "small").mkdir()
    weights(tmp_path / "small" / "model.safetensors", [1000, 1000])
    p["model"]["base_model"] = str(tmp_path / "small")
    assert validate_params(p).model.precision == "bf16"


def test_allow_large_model_variable_takes_only_0_or_1(cpu_machine):
    cpu_machine.setenv("AGENTRL_ALLOW_LARGE_MODEL", "yes")
    with pytest.raises(ParamsError, match="AGENTRL_ALLOW_LARGE_MODEL must be 1"):
        validate_params(raw_params())


def test_a_misspelt_reward_is_refused_when_params_load_naming_the_known_ones():
    """Issue 54 item 4: reward names were checked by form only, so `accuarcy` passed validation and failed at
    eval_base or grpo. The built-in names (config.REWARD_NAMES, kept equal to agent/rewards.py's REGISTRY) are
    listed; a module:function is still checked by form and imported by the stage."""
    from agentrl.agent.rewards import REGISTRY
    from agentrl.config import REWARD_NAMES

    assert set(REWARD_NAMES) == set(REGISTRY)
    p = raw_params()
    p["grpo"]["rewards"] = {"accuarcy": 1.0}
    with pytest.raises(ParamsError, match=r"unknown reward 'accuarcy'; known: accuracy, format, length_penalty, step"):
        validate_params(p)
    p["grpo"]["rewards"] = {"accuracy": 1.0, "my_rewards:score": 0.5}
    assert validate_params(p).grpo.rewards["my_rewards:score"] == 0.5


@pytest.mark.parametrize(
    "stage, section, values, message",
    [
        ("base", "model", {"base_model": "models/nothing-here"}, "model.base_model: 'models/nothing-here'"),
        ("sft", "agent", {"tools": ["no_such_module_q:fn"]}, "agent.tools: cannot import custom tool"),
        ("grpo", "grpo", {"rewards": {"accuracy": 1.0, "no_such_module_q:fn": 0.5}}, "grpo.rewards: cannot import"),
        ("sft", "agent", {"tools": [], "environment": "no_such_module_q:Env"}, "agent.environment: cannot import"),
    ],
)
def test_a_users_error_ends_the_stage_in_one_line(workdir, stage, section, values, message):
    """Issue 56 item 8: a model id that is neither a folder nor on a reachable hub, and a `module:attr` in params
    that does not import, ended `base` / `sft` / `grpo` in a traceback. Now: a non-zero exit and one line naming
    the key, no traceback (the stage stops before reading any data or model)."""
    import subprocess
    import sys

    params = mini_params()
    params[section].update(values)
    (workdir / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    run = subprocess.run(
        [sys.executable, "-m", f"agentrl.stages.{stage}"], cwd=workdir, capture_output=True, text=True, env=env
    )
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and message in errors[0], run.stderr[-3000:]
