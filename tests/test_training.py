"""Short real runs of the stages on a miniature configuration (tiny model, a few steps)."""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from agentrl.common import read_metrics
from agentrl.envs.calculator import Calculator
from conftest import mini_params, tiny_lm, write_params


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """prepare -> base -> sft -> grpo on the miniature config, in a temporary working directory."""
    import os

    from agentrl.config import load_params
    from agentrl.stages import base, grpo, prepare, sft

    wd = tmp_path_factory.mktemp("pipeline")
    old = os.getcwd()
    os.chdir(wd)
    secrets = {"HF_TOKEN": "sk-test-secret-key", "OPENAI_API_KEY": "sk-test-secret-key"}
    # the stages default WANDB_DIR to their working directory with os.environ.setdefault (one process per stage
    # in the pipeline); in this test process an earlier test may have set it: pin it to this run's directory
    # WANDB_MODE too: a stage sets it for its process (tracking.setup), so an earlier test's stage may have left
    # "disabled" behind in this one
    env = {**secrets, "WANDB_DIR": str(wd), "WANDB_MODE": "offline"}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import wandb

    wandb.teardown()  # W&B's process-wide settings (its run directory) from an earlier test's run must not apply
    try:
        p = mini_params()
        p["tracking"]["report_to"] = ["tensorboard", "dvclive", "wandb"]
        # a secret in the params themselves (TRL's hub_token; push_to_hub is off, so it is never used): the W&B
        # config holds the whole validated params, so only tracking.redact keeps it out of the run
        p["sft"]["trainer"]["hub_token"] = "sk-test-secret-key"
        write_params(wd / "params.yaml", p)
        params = load_params()
        prepare.prepare(params)
        base.build_tiny(params)
        sft_metrics = sft.train(params)
        # in the pipeline each stage is its own process, whose exit ends its W&B run; here both run in this one
        wandb.finish()
        before = {k: v.clone() for k, v in grpo.starting_model().state_dict().items()}
        grpo_metrics = grpo.train(params)
        wandb.finish()
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
    assert cfg["r"] == trained["params"].sft.lora["r"]
    model, tok = load_policy("sft")
    enc = tok(["hi"], return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=2)
    assert out.shape[1] > enc["input_ids"].shape[1]  # generate returns the prompt: at least one token more
    base_model, _ = load_policy("base")
    with torch.no_grad():  # the loaded adapter is applied: the SFT policy is not the base model
        assert not torch.allclose(model(**enc).logits, base_model(**enc).logits)
    saved = read_metrics(trained["dir"] / "metrics/sft_train.json")
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
    from agentrl.answers import answers_match, extract_answer
    from agentrl.stages import export
    from agentrl.stages.evaluate import evaluate

    monkeypatch.chdir(trained["dir"])
    params = trained["params"]
    for stage in ("base", "sft", "grpo"):
        m = evaluate(params, stage)
        assert m["num_samples"] == 24
        rows = [json.loads(line) for line in open(f"eval/{stage}/predictions.jsonl")]
        # the accuracy is the share of predictions whose extracted answer matches the ground truth
        assert all(r["extracted"] == extract_answer(r["completion"]) for r in rows)
        assert all(r["correct"] == answers_match(r["extracted"], r["ground_truth"]) for r in rows)
        assert m["accuracy"] == sum(r["correct"] for r in rows) / len(rows)
        assert len(rows) == 24 and {
            "id",
            "question",
            "completion",
            "extracted",
            "ground_truth",
            "correct",
            "reward",
        } <= set(rows[0])
    em = export.export(params)
    assert em["passed"] and em["max_abs_logit_diff"] <= 1e-4 and em["greedy_identical"]
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained("models/merged")
    assert not hasattr(plain, "peft_config") or not plain.peft_config
    loaded = []
    real_load_quantized = export.load_quantized
    monkeypatch.setattr(export, "load_quantized", lambda path: loaded.append(real_load_quantized(path)) or loaded[-1])
    q = export.quantized_eval(params)
    assert q["int8_backend"] == ("bitsandbytes" if torch.cuda.is_available() else "torch_dynamic")
    if not torch.cuda.is_available():  # the int8 evaluation ran on dynamically quantized Linear layers
        assert any(isinstance(mod, torch.ao.nn.quantized.dynamic.Linear) for mod in loaded[0].modules())
    int8 = read_metrics("metrics/eval_merged_int8.json")
    full = read_metrics("metrics/eval_merged.json")
    assert int8["quantize"] == "int8" and full["quantize"] == "none"
    assert q["int8_accuracy"] == int8["accuracy"] and q["merged_accuracy"] == full["accuracy"]
    assert q["accuracy_delta"] == pytest.approx(int8["accuracy"] - full["accuracy"])
    assert q["int8_speed_ratio"] == pytest.approx(int8["samples_per_second"] / full["samples_per_second"])


def test_evaluate_cli_quantize_int8_evaluates_the_quantized_policy(trained, monkeypatch):
    """`python -m agentrl.stages.evaluate --stage grpo --name grpo_int8 --quantize int8`: the policy goes through
    quantize.quantize_int8 before it generates, and the metrics say so."""
    from agentrl.stages import evaluate, quantize

    monkeypatch.chdir(trained["dir"])
    quantized = []
    real = quantize.quantize_int8
    monkeypatch.setattr(quantize, "quantize_int8", lambda model: quantized.append(real(model)) or quantized[-1])
    monkeypatch.setattr(sys, "argv", ["evaluate", "--stage", "grpo", "--name", "grpo_int8", "--quantize", "int8"])
    evaluate.main()
    assert len(quantized) == 1
    if not torch.cuda.is_available():
        assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in quantized[0].modules())
    m = read_metrics(trained["dir"] / "metrics/eval_grpo_int8.json")
    assert m["quantize"] == "int8" and m["stage"] == "grpo" and m["num_samples"] == 24
    rows = (trained["dir"] / "eval/grpo_int8/predictions.jsonl").read_text().splitlines()
    assert len(rows) == 24


@pytest.fixture
def exported(trained, tmp_path, monkeypatch):
    """A copy of the trained pipeline with a verified models/merged from export, marked so that a test can tell
    whether it is still the previous model (issue 56 item 5)."""
    import shutil

    from agentrl.stages import export

    work = tmp_path / "w"
    shutil.copytree(trained["dir"], work, ignore=shutil.ignore_patterns("wandb", "runs", "checkpoints"))
    monkeypatch.chdir(work)
    export.export(trained["params"])
    (work / "models/merged/PREVIOUS-MODEL").write_text("the model before the export under test\n")
    return work


def assert_previous_model_verified_and_in_place(work) -> None:
    from agentrl.modeling import export_check_problem
    from agentrl.serving.app import check_model_dir

    merged = work / "models/merged"
    assert (merged / "PREVIOUS-MODEL").is_file(), "the previous models/merged was removed or replaced"
    assert json.loads((merged / "export_check.json").read_text())["passed"] is True
    assert export_check_problem(merged) is None
    check_model_dir(str(merged))


def test_export_fails_when_the_merged_model_differs(exported, trained, monkeypatch):
    """The export failure path: a merged model whose logits differ from the adapter model's fails the stage
    (exit status 1), metrics/export.json records why, and (issue 56 item 5) the previous verified models/merged
    stays in place with no unverified copy left behind; it used to be replaced by the unverified model."""
    from agentrl.stages import export

    real_load_model = export.load_model

    def damaged(path, *a, **kw):  # what a broken merge would save: the weights are off
        model = real_load_model(path, *a, **kw)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
        return model

    monkeypatch.setattr(export, "load_model", damaged)
    monkeypatch.setattr(sys, "argv", ["export"])
    with pytest.raises(SystemExit) as exit_info:
        export.main()
    assert exit_info.value.code == 1
    m = read_metrics(exported / "metrics/export.json")
    assert m["passed"] is False and m["max_abs_logit_diff"] > m["tolerance"], m
    assert_previous_model_verified_and_in_place(exported)
    assert not list((exported / "models").glob("*.partial")) and not list((exported / "models").glob("*.previous"))


class Killed(BaseException):
    """Stands for SIGKILL at a chosen point of export (nothing after it runs)."""


def killed_after(real):
    def hooked(*args, **kwargs):
        real(*args, **kwargs)
        raise Killed

    return hooked


def raise_killed(*args, **kwargs):
    raise Killed


@pytest.mark.parametrize(
    "point",
    [
        "verifying the saved copy",
        "writing GGUF files",
        "after the swap, before removing the old copy",
        "two-rename swap",
    ],
)
def test_a_kill_anywhere_in_export_never_leaves_models_merged_missing_or_unverified(
    point, exported, trained, monkeypatch
):
    """Issue 56 item 5: export used to remove models/merged first, so a kill then lost the previous model. Now a
    kill at any point leaves a verified models/merged (the previous one until the new one has passed), and the
    next export finishes with the uninterrupted run's files and no staging folder left."""
    from agentrl.modeling import export_check_problem
    from agentrl.stages import export

    def digest(folder):
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "PREVIOUS-MODEL"}

    reference = digest(exported / "models/merged")
    with monkeypatch.context() as patch:
        if point == "verifying the saved copy":
            patch.setattr(export, "load_model", raise_killed)
        elif point == "writing GGUF files":
            patch.setattr(export, "export_gguf", raise_killed)
        elif point == "after the swap, before removing the old copy":
            patch.setattr(export, "exchange_names", killed_after(export.exchange_names))
        else:  # no atomic exchange (macOS, some file systems): killed between the two renames
            patch.setattr(export, "exchange_names", lambda a, b: False)
            real_rename = Path.rename

            def rename_then_die_before_the_second(self, target):
                moved = real_rename(self, target)
                if str(target).endswith(".previous"):
                    raise Killed
                return moved

            patch.setattr(Path, "rename", rename_then_die_before_the_second)
        with pytest.raises(Killed):
            export.export(trained["params"])
    merged = exported / "models/merged"
    if point == "two-rename swap":  # the one moment the old copy is only at models/merged.previous
        assert not merged.exists() and (exported / "models/merged.previous/PREVIOUS-MODEL").is_file()
    elif point.startswith("after the swap"):
        assert export_check_problem(merged) is None and digest(merged) == reference  # the new, verified model
    else:
        assert_previous_model_verified_and_in_place(exported)
    export.export(trained["params"])
    assert export_check_problem(merged) is None and digest(merged) == reference
    assert not list((exported / "models").glob("*.partial")) and not list((exported / "models").glob("*.previous"))


def test_serve_refuses_a_model_whose_export_check_did_not_pass(exported):
    """`make serve` loads nothing export did not verify: a copy whose export_check.json says failed or unfinished
    (what a kill inside export leaves in models/merged.partial) is refused, naming the file."""
    import shutil

    from agentrl.serving.app import check_model_dir

    copy = exported / "models/copy"
    shutil.copytree(exported / "models/merged", copy)
    for verdict, says in ((False, "failed"), (None, "did not finish")):
        (copy / "export_check.json").write_text(json.dumps({"passed": verdict}))
        with pytest.raises(ValueError, match=f"export_check.json: export's merge check {says}"):
            check_model_dir(str(copy))


def test_wandb_offline_run_carries_params_and_no_secret(trained, monkeypatch):
    """The offline W&B run of the SFT stage has the validated params in its config, and no secret: neither the
    API keys in the environment nor the hub_token in the params (redacted)."""
    runs = sorted((trained["dir"] / "wandb").glob("offline-run-*"))
    assert runs, "no offline W&B run written"
    text = "".join(p.read_text(errors="ignore") for r in runs for p in r.rglob("*.yaml"))
    blob = b"".join(p.read_bytes() for r in runs for p in r.rglob("*.wandb"))
    assert "learning_rate" in text or b"learning_rate" in blob
    assert b"git_commit" in blob or "git_commit" in text
    assert b"sk-test-secret-key" not in blob and "sk-test-secret-key" not in text
    assert b"<redacted>" in blob or "<redacted>" in text  # the params' hub_token reached W&B only redacted
    # the W&B Report (agentrl.experiments.wandb_report) plots keys the stages really log
    from agentrl.experiments import wandb_report

    logged = [
        k
        for _, keys in wandb_report.training_panels()
        for k in keys
        if k != "train/kl" or trained["params"].grpo.trainer["beta"] > 0
    ]  # TRL logs kl only when beta > 0
    assert logged and all(k.encode() in blob for k in logged), [k for k in logged if k.encode() not in blob]
    # evaluation logged its per-sample predictions as a wandb.Table
    tables = [t for r in runs for t in r.rglob("*.table.json")]
    assert tables, "no predictions table in the offline runs"
    # with each prediction's tool calls (a column W&B's report shows beside the completion)
    assert all(json.loads(t.read_text())["columns"][-1] == "tool_calls" for t in tables)


def test_hub_base_model_path_records_resolved_commit(workdir, monkeypatch):
    """model.base_model: <hub id> goes through from_pretrained at model.revision (patched: no hub here)
    and writes the resolved commit to metrics/base.json."""
    from agentrl.config import validate_params
    from agentrl.stages import base

    tok, model = tiny_lm(["Tom has 3 apples. 3+4=7 #### 7"] * 20, 300)
    model.config._commit_hash = "0123456789abcdef0123456789abcdef01234567"
    calls = []

    def fake_model(name, dtype=None, revision=None, attn_implementation=None):
        calls.append(("model", name, revision, dtype, attn_implementation))
        return model

    def fake_tok(name, revision=None):
        calls.append(("tokenizer", name, revision))
        return tok

    monkeypatch.setattr(base, "load_model", fake_model)
    monkeypatch.setattr(base, "load_tokenizer_hub", fake_tok)
    p = mini_params()
    p["model"].update(base_model="Qwen/Qwen3-0.6B", revision="v1.0")
    params = validate_params(p)
    info = base.from_hub(params)
    # loaded straight into the training dtype with the training attention (no fp32 load then cast)
    from agentrl.common import torch_dtype

    loaded = ("model", "Qwen/Qwen3-0.6B", "v1.0", torch_dtype(params.model.precision), params.model.attn_implementation)
    assert loaded in calls and ("tokenizer", "Qwen/Qwen3-0.6B", "v1.0") in calls
    assert info["resolved_commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert (workdir / "models/base/config.json").exists()


SEEN_TOOL_KWARGS: list[dict] = []


def record_tool_use(completions, tool_calls, tool_errors, **kwargs):
    """A custom reward (grpo.rewards 'test_training:record_tool_use'): the rollout's tool counts reach it."""
    SEEN_TOOL_KWARGS.append(
        {"completions": list(completions), "tool_calls": list(tool_calls), "tool_errors": list(tool_errors)}
    )
    return [0.1 * c for c in tool_calls]


@pytest.mark.parametrize("merged_rollouts", [False, True])
def test_grpo_rollouts_call_the_tool_and_train_on_model_tokens_only(trained, monkeypatch, merged_rollouts):
    """GRPO through the tool loop: rollouts that call the calculator (forced here: a 6-step SFT model does
    not call yet) reach the trainer with env_mask 0 on the tool's tokens, the reward functions receive the
    tool counts, tool use is logged, and the adapter changes. grpo.merged_rollouts: the loop samples from a plain
    (non-PEFT) model, the adapter's PEFT model otherwise. Each episode is reset with its batch's own row, which the
    trainer hands the rollout (not a lookup by prompt text)."""
    from transformers import LogitsProcessorList

    from agentrl.agent import loop as agent
    from agentrl.config import validate_params
    from agentrl.modeling import load_policy, load_tokenizer
    from agentrl.stages import grpo
    from test_agent import ForceCalls

    monkeypatch.chdir(trained["dir"])
    p = mini_params()
    p["grpo"]["trainer"].update(max_steps=2, max_completion_length=24)
    p["grpo"]["rewards"] = {"accuracy": 1.0, "length_penalty": 1.0, "test_training:record_tool_use": 1.0}
    p["grpo"]["merged_rollouts"] = merged_rollouts
    params = validate_params(p)
    tok = load_tokenizer("models/sft")
    real = agent.generate_with_tools
    seen_masks, sampled_from_peft = [], []

    def forced(model, tokenizer, prompts, toolset, *a, **kw):
        # the merged copy computes with its class forward, not a patched one (TRL fused LM head: the PEFT model)
        sampled_from_peft.append(hasattr(model, "peft_config") or "forward" in model.__dict__)
        rows_seen.append((prompts, kw["rows"], rows_from_batch[-1]))
        out = real(
            model, tokenizer, prompts, toolset, *a, logits_processor=LogitsProcessorList([ForceCalls(tok)]), **kw
        )
        seen_masks.extend((r[0].completion_ids, r[0].env_mask, r[0].calls) for r in out)
        return out

    rows_seen, rows_from_batch = [], []
    real_take = grpo.ToolRollout.take_batch_rows

    def take_batch_rows(self, prompts):
        rows_from_batch.append(self.batch_rows is not None)
        return real_take(self, prompts)

    monkeypatch.setattr(grpo.ToolRollout, "take_batch_rows", take_batch_rows)
    monkeypatch.setattr(agent, "generate_with_tools", forced)
    SEEN_TOOL_KWARGS.clear()
    before = {k: v.clone() for k, v in grpo.starting_model().state_dict().items()}
    m = grpo.train(params)
    assert m["steps"] == 2 and m["tool_use_rate_first"] == 1.0 and m["tool_error_rate_last"] == 0.0
    assert m["generation_seconds"] > 0 and m["rollout_tokens_per_second"] > 0
    assert seen_masks and all(calls for _, _, calls in seen_masks)
    assert sampled_from_peft == [not merged_rollouts] * 2  # one rollout batch per step
    assert [from_batch for _, _, from_batch in rows_seen] == [True, True]
    assert all(row["prompt"] == prompt for prompts, rows, _ in rows_seen for prompt, row in zip(prompts, rows))
    for ids, mask, calls in seen_masks:
        inserted = [t for t, k in zip(ids, mask) if k == 0]
        want = sum((tok(f"{c['result']}>>", add_special_tokens=False)["input_ids"] for c in calls), [])
        assert inserted == want[: len(inserted)] and inserted  # the tool's tokens, and only they, are masked
    assert SEEN_TOOL_KWARGS and all(c >= 1 for s in SEEN_TOOL_KWARGS for c in s["tool_calls"])
    # rewards see the whole trace (conversational completions: [{"role": "assistant", "content": ...}])
    assert all(">>" in c[0]["content"] for s in SEEN_TOOL_KWARGS for c in s["completions"])
    merged, _ = load_policy("grpo")
    after = merged.state_dict()
    assert [k for k, v in before.items() if not torch.equal(v, after[k])], "GRPO did not change any weight"
    rows = (trained["dir"] / "dvclive/grpo/plots/metrics/tools/tool_use_rate.tsv").read_text().splitlines()[1:]
    assert rows and float(rows[0].split("\t")[-1]) == 1.0


def test_bench_merged_rollouts_alternates_the_two_samplers(trained, monkeypatch):
    """scripts/bench.py --merged-rollouts (agentrl.benchmarks.training): after 2 warm-up steps, GRPO steps alternate
    between the PEFT model and the merged copy (odd steps merged), and each side's figures come from its own steps."""
    from agentrl.benchmarks.training import grpo_step_stats

    monkeypatch.chdir(trained["dir"])
    r = grpo_step_stats(trained["params"], steps=6, alternate_merged=True)
    assert r["merged"]["steps"] == r["adapter"]["steps"] == 2
    for side in ("merged", "adapter"):
        assert r[side]["seconds_per_step"] >= r[side]["generation_seconds_per_step"] > 0
    want = r["merged"]["rollout_tokens_per_second"] / r["adapter"]["rollout_tokens_per_second"]
    assert r["rollout_tokens_per_second_ratio"] == pytest.approx(want) and want > 0


def test_bench_grpo_steps_run_the_stage_trainer_on_its_rows(trained, monkeypatch):
    """The benchmarks' GRPO step timing (agentrl.benchmarks.training; `make bench`, `make bench-tools`) times the
    stage's own trainer (grpo.build_trainer -> EpisodeRowsGRPOTrainer, which hands each batch's rows to the rollout)
    on the stage's dataset: an environment such as countdown resets each episode with its row (without them its
    episodes would have no numbers and target, and the timing would be of a different task)."""
    from datasets import load_dataset

    from agentrl.benchmarks.training import grpo_step_stats
    from agentrl.stages import grpo

    monkeypatch.chdir(trained["dir"])
    built, build = [], grpo.build_trainer

    class Stop(Exception):
        pass

    def recording(*args, **kwargs):
        built.append(build(*args, **kwargs))
        raise Stop

    monkeypatch.setattr(grpo, "build_trainer", recording)
    with pytest.raises(Stop):
        grpo_step_stats(trained["params"], steps=1)
    trainer = built[0]
    assert type(trainer) is grpo.EpisodeRowsGRPOTrainer and isinstance(trainer.tool_rollout, grpo.ToolRollout)
    assert list(trainer.train_dataset) == list(load_dataset("json", data_files=grpo.DATA, split="train"))


def test_chat_format_pipeline_runs_trl_native_tool_loop(tmp_path, monkeypatch):
    """agent.format chat: the tiny model gets Qwen3's chat template (tool calls and tool turns), SFT data
    carries the calls as <tool_call> turns, and GRPO runs TRL's own multi-turn loop
    (GRPOTrainer(tools=[calculator])) for a few steps; evaluation runs the same calls through our loop."""
    from trl.chat_template_utils import qwen3_chat_template

    from agentrl.config import load_params
    from agentrl.modeling import load_tokenizer
    from agentrl.stages import base, grpo, prepare, sft
    from agentrl.stages.evaluate import evaluate

    monkeypatch.chdir(tmp_path)
    p = mini_params()
    p["agent"]["format"] = "chat"
    p["data"]["synthetic"].update(num_train=60, num_test=6)
    p["sft"]["trainer"].update(max_steps=2, max_length=1024)
    p["grpo"]["trainer"].update(max_steps=2, max_completion_length=24)
    write_params(tmp_path / "params.yaml", p)
    params = load_params()
    prepare.prepare(params)
    base.build_tiny(params)
    tok = load_tokenizer("models/base")
    assert tok.chat_template == qwen3_chat_template
    feats = sft.dataset(tok, params)
    text = tok.decode(feats[0]["input_ids"])
    assert '"name": "calculator"' in text and "<tool_call>" in text and "<tool_response>" in text
    sft.train(params)
    seen = {}
    import trl

    orig = trl.GRPOTrainer.__init__

    def spy(self, *a, **kw):
        seen.update(tools=kw.get("tools"), rollout_func=kw.get("rollout_func"), factory=kw.get("environment_factory"))
        orig(self, *a, **kw)
        seen["response_template"] = getattr(self.processing_class, "response_template", None)
        seen["env_tools"] = {name: [t.__name__ for t in ts] for name, ts in self._env_tools.items()}
        seen["trainer"] = self

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", spy)
    m = grpo.train(params)
    assert m["steps"] == 2 and m["generation_seconds"] is None  # TRL generated: no project rollout timer
    # TRL's own loop, with the calculator environment: one instance per rollout, its method the one tool
    assert seen["tools"] is None and seen["rollout_func"] is None
    assert isinstance(seen["factory"](), Calculator) and seen["env_tools"] == {None: ["calculator"]}
    assert seen["response_template"] is not None  # TRL recognised Qwen3's template and can parse tool calls
    assert (tmp_path / "models/grpo/adapter_config.json").exists()
    e = evaluate(params, "grpo")
    assert e["num_samples"] == 6 and "tool_use_rate" in e and e["tools"] == "calculator"
    # issue 56 item 1 in TRL's loop: broken episodes are logged, and a reset that fails ends the stage in one line
    # naming it (TRL's loop would stop with a traceback, or count a lost server as the policy's failed calls)
    history = seen["trainer"].state.log_history
    logged = [log["tools/broken_episode_rate"] for log in history if "tools/broken_episode_rate" in log]
    assert logged and set(logged) == {0.0}, history
    from agentrl.agent.loop import BrokenEnvironmentError

    def gone(self, **row):
        raise ConnectionError("server gone")

    monkeypatch.setattr(Calculator, "reset", gone)
    shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
    with pytest.raises(BrokenEnvironmentError, match="reset failed in TRL's loop .*ConnectionError: server gone"):
        grpo.train(params)


@pytest.fixture
def restore_lm_head_positions():
    yield
    from agentrl.stages.training import fused_lm_head_positions

    fused_lm_head_positions(mini_params()["model"]["lm_head_positions"])  # the process-wide default again


def test_lm_head_positions_labelled_scores_the_labelled_positions_with_the_same_bits(restore_lm_head_positions):
    """model.lm_head_positions on TRL's fused LM head (the SFT/GRPO loss): 'all' scores every position (TRL 1.16 on
    CPU), 'labelled' only those with a label (TRL's GPU branch); the log-probabilities, entropies and LoRA gradients
    are the same bits either way."""
    from peft import LoraConfig, get_peft_model
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import add_fused_lm_head

    from agentrl.stages.training import fused_lm_head_positions

    tok, model = tiny_lm(["3+4=7 #### 7", "12*3=36 #### 36"] * 20, 300, num_hidden_layers=2)
    add_fused_lm_head(model, temperature=0.8, outputs=("log_probs", "entropy"))
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"])).train()
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 20))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding, then ragged completions
    mask[1, 15:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :12] = -100  # the prompt: no label
    rows, real_apply = [], ChunkedLogProbFunction.apply

    def counted(hidden, *args):
        rows.append(hidden.shape[0])
        return real_apply(hidden, *args)

    def run(choice: str):
        fused_lm_head_positions(choice)
        peft.zero_grad(set_to_none=True)
        out = peft(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        (-out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
        grads = {n: p.grad.clone() for n, p in peft.named_parameters() if p.grad is not None}
        return out.log_probs.detach(), out.entropy.detach(), grads

    import trl.trainer.utils

    trl.trainer.utils._ChunkedLogProbFunction = type("Counted", (), {"apply": staticmethod(counted)})
    try:
        every, labelled = run("all"), run("labelled")
    finally:
        trl.trainer.utils._ChunkedLogProbFunction = ChunkedLogProbFunction
    assert rows == [3 * 19, int((labels[:, 1:] != -100).sum())]  # shifted: 19 next-token positions per row
    assert torch.equal(every[0], labelled[0]) and torch.equal(every[1], labelled[1])
    assert every[2].keys() == labelled[2].keys() and len(every[2]) == 8  # 2 layers x 2 modules x (A, B)
    assert all(torch.equal(every[2][k], labelled[2][k]) for k in every[2])
    with pytest.raises(ValueError, match="model.lm_head_positions: expected 'labelled' or 'all', got 'some'"):
        fused_lm_head_positions("some")


def test_the_training_stages_apply_lm_head_positions(workdir, restore_lm_head_positions):
    """training.start (both stages) sets TRL's switch from params (grpo.build_trainer too, for the benchmarks:
    tests/test_gguf.py -k bench_real_steps reads it back after each side)."""
    import trl.trainer.utils as trl_utils

    from agentrl.config import load_params
    from agentrl.stages import training

    cpu = torch.device("cpu")
    for choice, compact in (("all", False), ("labelled", True), ("all", False)):
        p = mini_params()
        p["model"]["lm_head_positions"] = choice
        write_params(workdir / "params.yaml", p)
        training.start(load_params(), "sft", lambda params, **kw: None)
        assert trl_utils._use_triton(cpu) is compact, choice
