"""agentrl.benchmarks' figures added for `make bench-tools` (issue 29 item 7): the decode ceiling (bare batched greedy
decoding with the KV cache) and the chat-format GRPO comparison of our tool loop with TRL's environment loop."""

import copy

import pytest
import torch

from agentrl.benchmarks.bench_tools import chat_loops_side_by_side
from agentrl.benchmarks.decoding import bare_greedy_decode, decode_ceiling
from conftest import make_toolset, mini_params, tiny_lm

QUESTIONS = ["Tom has 3 apples and buys 4 more. How many?", "What is 12*3?", "x", "Sam has 9 pens and 2 more. Total?"]


def messages(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


@pytest.fixture(scope="module")
def lm():
    """A tiny Qwen3 with large random weights: greedy completions that differ from token to token and row to row.
    use_cache off in its config, as the trained stages save it: the decode must ask for the cache itself."""
    tok, model = tiny_lm([q + " 3+4=7 #### 7" for q in QUESTIONS] * 10, 300)
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0, 1.0)
    model.config.use_cache = False
    model.eval()
    return tok, model


def test_decode_ceiling_generates_batch_times_max_new_tokens(lm):
    tok, model = lm
    prompts = [messages(q) for q in QUESTIONS + QUESTIONS[:1]]  # 5 prompts: batches of 2, 2 and 1
    r = decode_ceiling(model, tok, prompts, max_new=7, batch_size=2)
    assert r["tokens"] == len(prompts) * 7
    assert r["tokens_per_second"] > 0 and r["seconds"] > 0


def test_bare_greedy_decode_matches_generate_greedy_without_stopping(lm):
    """The ceiling decodes what `generate` would (left padding and positions included), only without its logic."""
    tok, model = lm
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(messages(q), add_generation_prompt=True, tokenize=False) for q in QUESTIONS]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"] == 0).any(), "the prompts should need padding"
    ids = bare_greedy_decode(model, enc["input_ids"], enc["attention_mask"], 12)
    assert ids.shape == (len(QUESTIONS), 12)
    assert len(set(ids.flatten().tolist())) > 3, "degenerate completions test nothing"
    ref = model.generate(**enc, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    assert ids.tolist() == ref[:, enc["input_ids"].shape[1] :].tolist()


def test_chat_loops_side_by_side_runs_both_trainers():
    """Both GRPO trainers (our ToolRollout, TRL's environment_factory loop) run 2 steps in the chat format on a tiny
    model whose tokenizer has Qwen3's template; one warm-up step, one timed step each."""
    from trl.chat_template_utils import qwen3_chat_template

    from agentrl.config import validate_params
    from agentrl.modeling import train_tokenizer

    params = validate_params(mini_params())
    probe = train_tokenizer(["x"], 300)
    probe.chat_template = qwen3_chat_template
    kw = make_toolset(["calculator"], "chat").chat_template_kwargs()
    header = probe.apply_chat_template(messages(QUESTIONS[0]), add_generation_prompt=True, tokenize=False, **kw)
    tok, model = tiny_lm([header] * 4 + [q + " 3+4=7 #### 7" for q in QUESTIONS] * 4, 400)
    tok.chat_template = qwen3_chat_template
    rows = [{"prompt": messages(q), "ground_truth": "7"} for q in QUESTIONS]  # mini params: 2 prompts x 4 per step
    r = chat_loops_side_by_side(params, lambda: copy.deepcopy(model), tok, rows, steps=2, warmup=1)
    assert r["mean_prompt_tokens"] > 0
    for side in ("ours", "trl"):
        s = r[side]
        assert len(s["steps"]) == 1, f"{side}: one timed step after the warm-up"
        assert s["steps"][0]["completions"] == 8  # mini params: 8 completions per step
        assert s["seconds_per_step"] > 0 and s["rollout_tokens_per_second"] > 0
        assert 0 < s["sampled_tokens_per_completion"] <= 16  # mini params: max_completion_length 16
        assert s["tool_calls_per_completion"] >= 0
    assert r["step_time_ratio"] == r["ours"]["seconds_per_step"] / r["trl"]["seconds_per_step"]
    assert r["rollout_tokens_per_second_ratio"] > 0


def test_bench_cli_is_the_package_module_the_repro_children_run():
    """`make bench-repro` starts each side as `python -m agentrl.benchmarks.bench --reproducibility-child MODE`:
    that module path runs and takes the hidden flag; scripts/bench.py only calls the same `main`."""
    import subprocess
    import sys

    from agentrl.benchmarks.bench import parser
    from conftest import ROOT

    assert parser().parse_args(["--reproducibility-child", "portable"]).reproducibility_child == "portable"
    with pytest.raises(SystemExit):  # argparse refuses a mode that is not native or portable
        parser().parse_args(["--reproducibility-child", "fast"])
    r = subprocess.run(
        [sys.executable, "-m", "agentrl.benchmarks.bench", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--merged-rollouts STEPS" in r.stdout and "--reproducibility-child" not in r.stdout
    assert "from agentrl.benchmarks.bench import main" in (ROOT / "scripts/bench.py").read_text()


def test_tool_loop_vs_plain_reports_the_decoding_context(lm):
    """The mean prompt and generated tokens per problem `make bench` computes the decoding FLOPs from."""
    from agentrl.benchmarks.decoding import tool_loop_vs_plain

    tok, model = lm
    prompts = [messages(q) for q in QUESTIONS]
    r = tool_loop_vs_plain(model, tok, prompts, None, max_new=6, batch_size=2, rounds=1)
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert r["mean_prompt_tokens"] == pytest.approx(sum(lengths) / len(lengths))
    assert 0 < r["mean_loop_tokens"] <= 6


def _bench_res() -> dict:
    """bench_results' figures the MFU reads, made up: 1000 tokens per SFT step of 50-token rows, a 0.5 s step."""
    return {
        "sft_tokens": {"tokens_per_step": {"median": 1000}, "mean_sequence_tokens": 50.0},
        "sft_step_seconds": {"ours": {"median": 0.5}, "plain_loop": {"median": 0.25}},
        "tool_loop": {
            "mean_prompt_tokens": 20.0,
            "mean_loop_tokens": 10.0,
            "loop_tokens_per_second": {"median": 300.0},
            "plain_tokens_per_second": {"median": 200.0},
        },
        "grpo": {
            "completions_per_step": 8,
            "rollout_tokens_per_step": {"median": 80},
            "seconds_per_step": {"median": 2.0},
            "rollout_tokens_per_second": {"median": 100.0},
        },
    }


def test_bench_mfu_is_achieved_model_flops_over_the_measured_peak(tmp_path, monkeypatch):
    """SFT (full fine-tuning: 6N), decoding (2N) and the GRPO step (LoRA: a sampling forward + 4N training) against
    the matmul peak bench measures, with models/base's config."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from agentrl.benchmarks import bench
    from agentrl.benchmarks.measure import flops_per_token, model_dims
    from agentrl.modeling import STAGE_DIRS

    cfg = Qwen3Config(
        vocab_size=100, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path)
    monkeypatch.setitem(STAGE_DIRS, "base", tmp_path)
    monkeypatch.setattr(bench, "matmul_peak", lambda: {"flops_per_second": 1e9, "size": 2048, "runs": 7})
    params = SimpleNamespace(
        sft=SimpleNamespace(use_lora=False), grpo=SimpleNamespace(use_lora=True, trainer={"beta": 0.0})
    )
    rows = bench._mfu_figures(params, _bench_res())["rows"]
    dims = model_dims(cfg, "test")
    sft_flops = flops_per_token(dims, 50.0, "train")
    assert rows["sft_ours"]["flops_per_token"] == sft_flops
    assert rows["sft_ours"]["mfu"] == pytest.approx(1000 / 0.5 * sft_flops / 1e9)
    assert rows["sft_plain_loop"]["mfu"] == pytest.approx(2 * rows["sft_ours"]["mfu"])
    assert rows["tool_loop"]["mfu"] == pytest.approx(300 * flops_per_token(dims, 20 + 5, "forward") / 1e9)
    sequence = 20 + 80 / 8  # prompt + completion tokens
    step_flops = flops_per_token(dims, sequence / 2, "forward") + flops_per_token(dims, sequence, "train_frozen")
    assert rows["grpo_step"]["flops_per_token"] == step_flops
    assert rows["grpo_step"]["mfu"] == pytest.approx(8 * sequence / 2.0 * step_flops / 1e9)


def test_bench_table_appends_the_mfu_columns_and_keeps_the_others():
    from agentrl.benchmarks.bench import _with_mfu_columns

    res = {"mfu": {"rows": {"sft_ours": {"flops_per_token": 12345.0, "mfu": 0.0123}}}}
    lines = ["| SFT step, ours | 0.5 s | how |", "| eval sft speed-up | 9× | x |", "", "Peak RSS per stage: 1"]
    out = _with_mfu_columns(lines, res)
    assert out[0] == "| SFT step, ours | 0.5 s | how | 1.23e+04 | 1.23% |"
    assert out[1] == "| eval sft speed-up | 9× | x |  |  |"
    assert out[2:] == lines[2:]


def test_benchmarks_md_is_what_the_committed_bench_json_renders_to():
    """BENCHMARKS.md is bench_markdown of metrics/bench.json (no figure typed by hand); the pipeline rows are there
    when the run timed the pipeline and left out, with the header saying so, when it did not (--skip-dvc)."""
    import json
    from pathlib import Path

    from agentrl.benchmarks.bench import bench_markdown
    from agentrl.config import load_yaml, validate_params

    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "metrics/bench.json").read_text())
    params = validate_params(load_yaml(root / "params.yaml"), "params.yaml")
    text = bench_markdown(res, params)
    assert text == (root / "BENCHMARKS.md").read_text(), "BENCHMARKS.md was edited by hand or is stale"
    assert ("| **full_repro_seconds** |" in text) == (res["repro_repeats"] > 0)
    skipped = bench_markdown({**res, "repro_repeats": 0}, params)
    assert "no pipeline timings (--skip-dvc)" in skipped and "full_repro_seconds" not in skipped


def test_shared_machine_step_times_a_step_alone_and_beside_a_busy_process(capsys):
    """`make bench-shared`'s child (run in-process here, one step each): the tiny default's training step timed
    alone and with a `while True` process started and ended around the second timing; the table has its row."""
    import json

    import psutil

    from agentrl.benchmarks.training import shared_machine_table, step_beside_a_competitor

    before = {p.pid for p in psutil.Process().children()}
    out = step_beside_a_competitor("tiny", "1", "1")
    assert out["alone_s"] > 0 and out["shared_s"] > 0 and out["slowdown"] == out["shared_s"] / out["alone_s"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert {p.pid for p in psutil.Process().children()} == before, "the competitor was left running"
    row = {"model": "tiny", "setting": "one thread", "threads": 1, "spin_count": "1000", **out}
    table = shared_machine_table({"machine": "cpu", "steps": 1, "rows": [row]})
    assert f"| tiny | one thread | 1 | 1000 | {out['alone_s']:.3f} |" in table
