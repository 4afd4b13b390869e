"""scripts/bench.py's figures added for `make bench-tools` (issue 29 item 7): the decode ceiling (bare batched greedy
decoding with the KV cache) and the chat-format GRPO comparison of our tool loop with TRL's environment loop."""

import copy
import sys

import pytest
import torch

from conftest import ROOT, make_toolset, mini_params, tiny_lm

sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402

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
    r = bench.decode_ceiling(model, tok, prompts, max_new=7, batch_size=2)
    assert r["tokens"] == len(prompts) * 7
    assert r["tokens_per_second"] > 0 and r["seconds"] > 0


def test_bare_greedy_decode_matches_generate_greedy_without_stopping(lm):
    """The ceiling decodes what `generate` would (left padding and positions included), only without its logic."""
    tok, model = lm
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(messages(q), add_generation_prompt=True, tokenize=False) for q in QUESTIONS]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"] == 0).any(), "the prompts should need padding"
    ids = bench.bare_greedy_decode(model, enc["input_ids"], enc["attention_mask"], 12)
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
    r = bench.chat_loops_side_by_side(params, lambda: copy.deepcopy(model), tok, rows, steps=2, warmup=1)
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
