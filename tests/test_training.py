"""Short real runs of the stages on a miniature configuration (tiny model, a few steps)."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import mini_params, write_params


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """prepare -> base -> sft -> grpo on the miniature config, in a temporary working directory."""
    import os

    from agentrl import base, grpo, prepare, sft
    from agentrl.config import load_params

    wd = tmp_path_factory.mktemp("pipeline")
    old = os.getcwd()
    os.chdir(wd)
    secrets = {"HF_TOKEN": "sk-test-secret-key", "OPENAI_API_KEY": "sk-test-secret-key"}
    saved_env = {k: os.environ.get(k) for k in secrets}
    os.environ.update(secrets)
    try:
        p = mini_params()
        p["tracking"]["report_to"] = ["tensorboard", "dvclive", "wandb"]
        write_params(wd / "params.yaml", p)
        params = load_params()
        prepare.prepare(params)
        base.build_tiny(params)
        sft_metrics = sft.train(params)
        before = {k: v.clone() for k, v in grpo.starting_model().state_dict().items()}
        grpo_metrics = grpo.train(params)
        yield {"dir": wd, "params": params, "sft": sft_metrics, "grpo": grpo_metrics, "before": before}
    finally:
        os.chdir(old)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_sft_lowers_loss_and_writes_loadable_adapter(trained, monkeypatch):
    from agentrl.modeling import load_policy

    monkeypatch.chdir(trained["dir"])
    m = trained["sft"]
    assert m["steps"] == 6
    assert m["final_loss"] < m["first_loss"]
    assert (trained["dir"] / "models/sft/adapter_config.json").exists()
    cfg = json.loads((trained["dir"] / "models/sft/adapter_config.json").read_text())
    assert cfg["r"] == trained["params"].sft.lora.r
    model, tok = load_policy("sft")
    out = model.generate(**tok(["hi"], return_tensors="pt"), max_new_tokens=2)
    assert out.shape[1] >= 1
    saved = json.loads((trained["dir"] / "metrics/sft_train.json").read_text())
    assert saved["steps"] == 6 and saved["runtime_s"] > 0
    # DVCLive's x axis is the optimizer step (logging_steps 1 here: steps 1..6, not log indices 0..5)
    rows = (trained["dir"] / "dvclive/sft/plots/metrics/loss.tsv").read_text().splitlines()[1:]
    assert [int(r.split("\t")[0]) for r in rows] == list(range(1, 7))


def test_grpo_changes_adapter_and_logs_rewards(trained, monkeypatch):
    from agentrl.modeling import load_policy

    monkeypatch.chdir(trained["dir"])
    m = trained["grpo"]
    assert m["steps"] == 2
    assert m["reward_first"] is not None and math.isfinite(m["reward_first"])
    assert (trained["dir"] / "models/grpo/adapter_config.json").exists()
    merged, _ = load_policy("grpo")
    after = merged.state_dict()
    changed = [k for k, v in trained["before"].items() if not torch.equal(v, after[k])]
    assert changed, "GRPO did not change any weight"
    # rewards were logged to the trackers (dvclive plots, tensorboard events)
    assert (trained["dir"] / "dvclive/grpo/plots/metrics/reward.tsv").exists()
    assert list((trained["dir"] / "runs/grpo").rglob("events.out.tfevents*"))


def test_evaluation_and_export_on_trained_model(trained, monkeypatch):
    from agentrl import export
    from agentrl.evaluate import evaluate

    monkeypatch.chdir(trained["dir"])
    params = trained["params"]
    for stage in ("base", "sft", "grpo"):
        m = evaluate(params, stage)
        assert m["num_samples"] == 24
        assert 0.0 <= m["accuracy"] <= 1.0
        rows = [json.loads(line) for line in open(f"eval/{stage}/predictions.jsonl")]
        assert len(rows) == 24 and {"id", "question", "completion", "extracted", "ground_truth", "correct",
                                    "reward"} <= set(rows[0])
    em = export.export(params)
    assert em["passed"] and em["max_abs_logit_diff"] <= 1e-4 and em["greedy_identical"]
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained("models/merged")
    assert not hasattr(plain, "peft_config") or not plain.peft_config
    q = export.quantized_eval(params)
    assert "int8_accuracy" in q and q["int8_speed_ratio"] > 0


def test_wandb_offline_run_carries_params_and_no_secret(trained, monkeypatch):
    """The offline W&B run of the SFT stage has the validated params in its config, and no API key."""
    runs = sorted((trained["dir"] / "wandb").glob("offline-run-*"))
    assert runs, "no offline W&B run written"
    text = "".join(p.read_text(errors="ignore") for r in runs for p in r.rglob("*.yaml"))
    blob = b"".join(p.read_bytes() for r in runs for p in r.rglob("*.wandb"))
    assert "learning_rate" in text or b"learning_rate" in blob
    assert b"git_commit" in blob or "git_commit" in text
    assert b"sk-test-secret-key" not in blob and "sk-test-secret-key" not in text
    # the W&B Report (scripts/wandb_report.py) plots keys the stages really log
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import wandb_report

    logged = [k for _, keys in wandb_report.TRAINING_PANELS for k in keys
              if k != "train/kl" or trained["params"].grpo.kl_coef > 0]  # TRL logs kl only when beta > 0
    assert logged and all(k.encode() in blob for k in logged), [k for k in logged if k.encode() not in blob]
    # evaluation logged its per-sample predictions as a wandb.Table
    assert [t for r in runs for t in r.rglob("*.table.json")], "no predictions table in the offline runs"


def test_hub_base_model_path_records_resolved_commit(workdir, monkeypatch):
    """model.base_model: <hub id> goes through from_pretrained at model.revision (patched: no hub here)
    and writes the resolved commit to metrics/base.json."""
    from agentrl import base
    from agentrl.config import TinyModelParams, validate_params
    from agentrl.modeling import build_tiny_model, train_tokenizer

    tok = train_tokenizer(["Tom has 3 apples. 3+4=7 #### 7"] * 20, 300)
    model = build_tiny_model(tok, TinyModelParams(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16), 0)
    model.config._commit_hash = "0123456789abcdef0123456789abcdef01234567"
    calls = []

    def fake_model(name, dtype=None, revision=None):
        calls.append(("model", name, revision))
        return model

    def fake_tok(name, revision=None):
        calls.append(("tokenizer", name, revision))
        return tok

    monkeypatch.setattr(base, "load_model", lambda path, revision=None: fake_model(path, revision=revision))
    monkeypatch.setattr(base, "load_tokenizer_hub", fake_tok)
    p = mini_params()
    p["model"].update(base_model="Qwen/Qwen3-0.6B", revision="v1.0")
    info = base.from_hub(validate_params(p))
    assert ("model", "Qwen/Qwen3-0.6B", "v1.0") in calls and ("tokenizer", "Qwen/Qwen3-0.6B", "v1.0") in calls
    assert info["resolved_commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert (workdir / "models/base/config.json").exists()
