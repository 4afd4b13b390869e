import pytest

from agentrl.config import ParamsError, load_params, validate_params

from conftest import ROOT, raw_params


def test_repository_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.data.source == "synthetic"
    assert p.grpo.learning_rate < p.sft.learning_rate


@pytest.mark.parametrize(
    "mutate, key, expected",
    [
        (lambda p: p["sft"].update(learnig_rate=1e-4), "sft.learnig_rate", "unknown key"),
        (lambda p: p.update(sedd=1), "sedd", "unknown key"),
        (lambda p: p["sft"].update(learning_rate="fast"), "sft.learning_rate", "valid number"),
        (lambda p: p["sft"].update(learning_rate=0), "sft.learning_rate", "greater than 0"),
        (lambda p: p["grpo"].update(learning_rate=-1e-5), "grpo.learning_rate", "greater than 0"),
        (lambda p: p["sft"].update(per_device_train_batch_size=0), "sft.per_device_train_batch_size", "greater than or equal to 1"),
        (lambda p: p["data"].update(max_samples=0), "data.max_samples", "greater than or equal to 1"),
        (lambda p: p["data"].update(source="hub"), "data.source", "synthetic"),
        (lambda p: p["grpo"]["lora"].update(r=0), "grpo.lora.r", "greater than or equal to 1"),
        (lambda p: p["data"]["synthetic"].update(operand_min=30), "data.synthetic", "operand_min"),
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
