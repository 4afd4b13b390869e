import re

import pytest

from agentrl.config import ParamsError, load_params, validate_params
from conftest import ROOT, raw_params


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

    from agentrl import prepare

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

    from agentrl.tools import Toolset

    sig = inspect.signature(Toolset.__init__).parameters
    assert all(sig[k].default is inspect.Parameter.empty for k in ("max_calls", "max_expression_chars", "timeout_s"))
