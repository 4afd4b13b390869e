"""The tool loop (agent.generate_with_tools), the calculator and the SFT/loop token equality."""

from __future__ import annotations

import random
import time

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from agentrl.agent.loop import generate_with_tools, sft_features, tokenize_trace, tool_stats
from agentrl.agent.tools import get_tool, split_annotated
from agentrl.data import generate_synthetic
from agentrl.envs.calculator import calculator
from agentrl.envs.registry import call_tool
from conftest import make_toolset, tiny_lm


# ----------------------------------------------------------------------------------- calculator
@pytest.mark.parametrize(
    "expr,want",
    [
        ("48/2", "24"),
        ("(3+4)*12", "84"),
        ("7/2", "3.5"),
        ("-5+2", "-3"),
        ("1,000*3", "3000"),
        ("2/3", "0.666667"),
        (" 12 - 4 ", "8"),
    ],
)
def test_calculator_values(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(
    "expr,reason",
    [
        ("1/0", "division by zero"),
        ("9**9**9", "unsupported operator"),
        ("2**10", "unsupported operator"),
        ("x+1", "unsupported element 'Name'"),
        ("().__class__", "unsupported element"),
        ("__import__('os').system('true')", "unsupported element"),
        ("1e300*1e300", "out of range"),
        ("9" * 20, "out of range"),
        ("1" * 10_000, "longer than"),
        ("1+", "not an arithmetic expression"),
        ("", "empty"),
        ("[1,2]", "unsupported element"),
        ("'a'*3", "unsupported element"),
        ("7//2", "unsupported"),
    ],
)
def test_calculator_refuses_with_an_error_string(expr, reason):
    out, ok = call_tool(calculator, expr)
    assert not ok and out.startswith("error: ") and reason in out


def test_calculator_fuzz_hostile_input_is_bounded_and_never_raises():
    rng = random.Random(0)
    alphabet = "0123456789+-*/().e ,_xa[]'\"%<>=\n"
    cases = ["(" * 5000 + "1" + ")" * 5000, "-" * 9000 + "1", "1" + "*9" * 3000, "((((1))))" * 100, "\x00", "\ud800"]
    cases += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) for _ in range(3000)]
    t0 = time.perf_counter()
    errors = 0
    for c in cases:
        out, ok = call_tool(calculator, c)
        assert isinstance(out, str) and (ok or out.startswith("error: "))
        errors += not ok
    assert errors > 2500  # almost all random strings are not valid arithmetic
    assert time.perf_counter() - t0 < 20, "3,000 hostile expressions must evaluate in bounded time"


def test_tool_registry_and_custom_tools():
    assert get_tool("calculator") is calculator
    assert get_tool("agentrl.agent.tools:calculator") is calculator
    with pytest.raises(ValueError, match="unknown tool 'calc'.*calculator"):
        get_tool("calc")
    with pytest.raises(ValueError, match="cannot import custom tool"):
        get_tool("agentrl.nope:f")


def test_split_annotated_uses_the_calculator_result():
    segs = split_annotated("48/2=<<48/2=24>>24 clips\nthen 5%=<<5%*2=1>>1\n#### 24")
    assert segs == [("48/2=<<48/2=", True), ("24>>", False), ("24 clips\nthen 5%=1\n#### 24", True)]


# ----------------------------------------------------------------------------------- the loop
@pytest.fixture(scope="module")
def tiny():
    train, test = generate_synthetic(
        1, 300, 12, 1, 99, ["+", "*"], {1: 0.5, 2: 0.5}, max_value=999, distractor_rate=0.5
    )
    tok, model = tiny_lm([r["question"] + r["answer"] for r in train], 320, num_hidden_layers=2)
    torch.manual_seed(0)
    for p in model.parameters():  # large random weights: completions that differ from prompt to prompt
        p.data.normal_(0, 1.0)
    model.eval()
    prompts = [[{"role": "user", "content": r["question"]}] for r in test]
    return tok, model, prompts, test


class ForceCalls(LogitsProcessor):
    """Makes each row open a call `<<a+b=` after it has written 2 tokens, with a and b taken from its own
    prompt length, so that rows call at different times and lengths; the rest is the model's greedy choice.
    Depends only on the row's own tokens, so batched and one-by-one runs are forced identically."""

    def __init__(self, tok, calls: int = 1):
        self.tok, self.calls = tok, calls

    def __call__(self, input_ids, scores):
        for r in range(input_ids.shape[0]):
            row = [t for t in input_ids[r].tolist() if t != self.tok.pad_token_id]
            prompt, _, comp = self.tok.decode(row).rpartition("<|im_start|>assistant\n")
            if comp.count(">>") >= self.calls:
                continue
            script = f"<<{len(prompt) % 90 + 2}+{comp.count('>>') * 7 + len(prompt) % 13}="
            tail = comp.rpartition(">>")[2]
            written = tail[tail.index("<<") :] if "<<" in tail else tail[len(tail) :] if len(tail) >= 2 else None
            if written is None or not script.startswith(written) or written == script:
                continue
            scores[r, :] = -1e9
            scores[r, self.tok.convert_tokens_to_ids(script[len(written)])] = 0
        return scores


def test_loop_greedy_batched_equals_one_by_one_and_masks_exactly_the_tool_tokens(tiny):
    tok, model, prompts, _ = tiny
    ts = make_toolset(["calculator"], "inline", max_calls=3)
    lp = LogitsProcessorList([ForceCalls(tok, calls=2)])
    batched = generate_with_tools(model, tok, prompts, ts, 40, batch_size=len(prompts), logits_processor=lp)
    sevens = generate_with_tools(model, tok, prompts, ts, 40, batch_size=7, logits_processor=lp)
    single = [generate_with_tools(model, tok, [p], ts, 40, batch_size=1, logits_processor=lp)[0] for p in prompts]
    called = 0
    for b, s, one in zip(batched, sevens, single):
        b, s, one = b[0], s[0], one[0]
        assert b.completion_ids == one.completion_ids == s.completion_ids
        assert b.env_mask == one.env_mask and b.calls == one.calls
        called += bool(b.calls)
        # env_mask is 0 exactly on the inserted tokens: the tokens of "result>>" after each call
        inserted = []
        for c in b.calls:
            inserted += tok(f"{c['result']}>>", add_special_tokens=False)["input_ids"]
        assert [t for t, m in zip(b.completion_ids, b.env_mask) if m == 0] == inserted
        for c in b.calls:
            a, _, rest = c["arguments"]["expression"].partition("+")
            assert c["ok"] and c["result"] == str(int(a) + int(rest))
        assert len(b.completion_ids) <= 40
    assert called == len(prompts)
    stats = tool_stats([r[0] for r in batched])
    assert stats["tool_use_rate"] == 1.0 and stats["tool_calls_per_problem"] >= 1.5 and stats["tool_error_rate"] == 0


def test_loop_without_calls_is_plain_generation(tiny):
    tok, model, prompts, _ = tiny
    ts = make_toolset(["calculator"], "inline")
    with_tools = generate_with_tools(model, tok, prompts, ts, 24, batch_size=5)
    without = generate_with_tools(model, tok, prompts, None, 24, batch_size=5)
    for a, b in zip(with_tools, without):
        assert not a[0].calls  # the random model never writes '<<'
        assert a[0].completion_ids == b[0].completion_ids and a[0].env_mask == [1] * len(a[0].completion_ids)


def test_growing_kv_cache_gives_the_bytes_of_transformers_dynamic_cache(tiny, monkeypatch):
    """The loop's KV cache (agent._GrowingLayer: written in place, grown by doubling) against transformers' own
    DynamicCache (monkeypatched in): the same completion tokens and logprobs, bit for bit, through tool inserts
    (re-prefill), rows leaving the batch (batch_select_indices) and sampling."""
    import agentrl.agent.loop as agent

    tok, model, prompts, _ = tiny
    ts = make_toolset(["calculator"], "inline", max_calls=3)
    runs = {}
    for name in ("growing", "dynamic"):
        if name == "dynamic":
            monkeypatch.setattr(agent, "_new_cache", lambda model, gen_kw: None)  # generate makes a DynamicCache
        lp = LogitsProcessorList([ForceCalls(tok, calls=2)])
        greedy = generate_with_tools(model, tok, prompts, ts, 40, batch_size=5, logits_processor=lp)
        sampled = generate_with_tools(
            model, tok, prompts, ts, 40, batch_size=5, temperature=1.0, seed=3, num_samples=2, return_logprobs=True
        )
        runs[name] = [(r.completion_ids, r.env_mask, r.logprobs) for rolls in greedy + sampled for r in rolls]
    assert runs["growing"] == runs["dynamic"]
    assert sum(1 for ids, mask, _ in runs["growing"] if 0 in mask) >= len(prompts)  # tool results were inserted


def test_growing_layer_matches_dynamic_layer_operation_by_operation():
    from transformers.cache_utils import DynamicLayer

    from agentrl.agent.loop import _GrowingLayer

    torch.manual_seed(0)
    grow, dyn = _GrowingLayer(), DynamicLayer()

    def same():
        assert grow.get_seq_length() == dyn.get_seq_length()
        assert torch.equal(grow.keys, dyn.keys) and torch.equal(grow.values, dyn.values)

    batch = 4
    for step, n in enumerate([7, 1, 1, 3, 1, 1, 1, 1, 9, 1]):  # a prefill, decode steps, inserted blocks
        k, v = torch.randn(batch, 2, n, 8), torch.randn(batch, 2, n, 8)
        out_g, out_d = grow.update(k, v), dyn.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(out_g, out_d))
        same()
        if step == 4:
            for layer in (grow, dyn):
                layer.batch_select_indices(torch.tensor([0, 2, 3]))
            batch = 3
            same()
        if step == 6:
            for layer in (grow, dyn):
                layer.crop(-2)
            same()
    for layer in (grow, dyn):
        layer.batch_repeat_interleave(2)
    same()
    k, v = torch.randn(6, 2, 1, 8), torch.randn(6, 2, 1, 8)
    assert all(torch.equal(a, b) for a, b in zip(grow.update(k, v), dyn.update(k, v)))
    assert grow._k.shape[-2] >= grow.get_seq_length()  # room to spare, filled part viewed


class Script(LogitsProcessor):
    """Forces each row to write the model tokens of a given trace (tool tokens come from the loop)."""

    def __init__(self, tok, expected: list[list[int]], prompt_lens: list[int]):
        self.tok, self.expected, self.prompt_lens = tok, expected, prompt_lens

    def __call__(self, input_ids, scores):
        for r in range(input_ids.shape[0]):
            row = [t for t in input_ids[r].tolist() if t != self.tok.pad_token_id]
            k = next(i for i, n in enumerate(self.prompt_lens) if row[:n] == self.want_prompts[i])
            pos = len(row) - self.prompt_lens[k]
            scores[r, :] = -1e9
            scores[r, self.expected[k][pos] if pos < len(self.expected[k]) else self.tok.eos_token_id] = 0
        return scores


def test_sft_tokenization_equals_the_loop_tokens_for_the_same_trace(tiny):
    tok, model, prompts, test = tiny
    traces = [tokenize_trace(tok, p, split_annotated(r["answer"])) for p, r in zip(prompts, test)]
    proc = Script(tok, [t["completion_ids"] for t in traces], [len(t["prompt_ids"]) for t in traces])
    proc.want_prompts = [t["prompt_ids"] for t in traces]
    ts = make_toolset(["calculator"], "inline")
    out = generate_with_tools(model, tok, prompts, ts, 200, batch_size=5, logits_processor=LogitsProcessorList([proc]))
    for t, r, p, row in zip(traces, out, prompts, test):
        roll = r[0]
        assert roll.prompt_ids == t["prompt_ids"]
        assert roll.completion_ids == t["completion_ids"] and roll.env_mask == t["env_mask"]
        assert roll.finish_reason == "stop" and len(roll.calls) == row["answer"].count("<<")
        feats = sft_features(tok, p, row["answer"], ts)
        assert feats["input_ids"] == t["prompt_ids"] + t["completion_ids"]
        assert feats["completion_mask"] == [0] * len(t["prompt_ids"]) + t["env_mask"]
    assert 0 in traces[0]["env_mask"]


def test_tool_call_limit_ends_the_completion_and_errors_are_counted(tiny):
    tok, model, prompts, _ = tiny

    class Bad(LogitsProcessor):  # every row writes '<<1/0=' over and over
        def __call__(self, input_ids, scores):
            for r in range(input_ids.shape[0]):
                comp = tok.decode([t for t in input_ids[r].tolist() if t != tok.pad_token_id]).split("assistant\n")[-1]
                tail = comp.split(">>")[-1]
                nxt = "<<1/0="[len(tail)] if len(tail) < 6 else None
                if nxt:
                    scores[r, :] = -1e9
                    scores[r, tok.convert_tokens_to_ids(nxt)] = 0
            return scores

    ts = make_toolset(["calculator"], "inline", max_calls=2)
    out = generate_with_tools(
        model, tok, prompts[:3], ts, 80, batch_size=3, logits_processor=LogitsProcessorList([Bad()])
    )
    for r in out:
        roll = r[0]
        assert roll.finish_reason == "tool_limit" and len(roll.calls) == 2 and roll.tool_errors == 2
        assert all(c["result"] == "error: division by zero" for c in roll.calls)
    assert tool_stats([r[0] for r in out])["tool_error_rate"] == 1.0


def test_chat_format_loop_runs_qwen3_style_tool_calls(tiny):
    """agent.format chat: a `<tool_call>` JSON ends the turn, the result comes back as a `<tool_response>` turn
    (Qwen3's template, as TRL's GRPOTrainer(tools=...) renders it) and the policy continues."""
    from trl.chat_template_utils import qwen3_chat_template

    tok, model, prompts, _ = tiny
    saved = tok.chat_template
    tok.chat_template = qwen3_chat_template
    try:
        ts = make_toolset(["calculator"], "chat", max_calls=2)
        rendered = tok.apply_chat_template(
            prompts[0], add_generation_prompt=True, tokenize=False, **ts.chat_template_kwargs()
        )
        assert '"name": "calculator"' in rendered  # the tool is described in the prompt
        call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
        script = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

        class Once(LogitsProcessor):  # the first turn is the call; afterwards the model is free
            def __call__(self, input_ids, scores):
                for r in range(input_ids.shape[0]):
                    row = [t for t in input_ids[r].tolist() if t != tok.pad_token_id]
                    text = tok.decode(row)
                    turn = text.rpartition("<|im_start|>assistant\n")[2]
                    if "<tool_response>" in text:
                        continue
                    k = len(tok(turn, add_special_tokens=False)["input_ids"]) if turn else 0
                    scores[r, :] = -1e9
                    scores[r, script[k] if k < len(script) else tok.eos_token_id] = 0
                return scores

        lp = LogitsProcessorList([Once()])
        kw = ts.chat_template_kwargs()
        batched = generate_with_tools(
            model, tok, prompts[:2], ts, 160, batch_size=4, logits_processor=lp, chat_template_kwargs=kw
        )
        single = [
            generate_with_tools(model, tok, [p], ts, 160, batch_size=1, logits_processor=lp, chat_template_kwargs=kw)[0]
            for p in prompts[:2]
        ]
        for b, s in zip(batched, single):
            b, s = b[0], s[0]
            assert b.completion_ids == s.completion_ids and b.env_mask == s.env_mask
            assert b.calls == [{"name": "calculator", "arguments": {"expression": "6*7"}, "result": "42", "ok": True}]
            inserted = tok.decode([t for t, m in zip(b.completion_ids, b.env_mask) if m == 0])
            assert (
                inserted
                == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            )
            # what the loop inserted is what Qwen3's template renders for the tool turn
            conv = prompts[0] + [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
                    ],
                },
                {"role": "tool", "name": "calculator", "content": "42"},
            ]
            assert "<tool_response>\n42\n</tool_response><|im_end|>\n" in tok.apply_chat_template(conv, tokenize=False)
    finally:
        tok.chat_template = saved


def test_prepare_keeps_tool_calls_only_with_tools_and_mixes_them_by_share(workdir):
    """data.strip_calculator_annotations auto: GSM8K's <<a*b=c>> annotations stay when agent.tools is set
    (in data.calculator_share of the annotated training solutions; the rest do the arithmetic in text),
    and are stripped everywhere when agent.tools is []."""
    import json

    from agentrl.config import validate_params
    from agentrl.stages import prepare
    from conftest import mini_params

    p = mini_params()
    p["data"]["calculator_share"] = 0.6
    m = prepare.prepare(validate_params(p))
    comps = [json.loads(line)["completion"][0]["content"] for line in open("data/prepared/sft_train.jsonl")]
    with_calls = sum("<<" in c for c in comps) / len(comps)
    assert m["calculator_annotations"] == "kept" and abs(m["tool_solution_share"] - with_calls) < 1e-3
    assert 0.45 < with_calls < 0.75  # 200 rows drawn with p = 0.6
    for c in comps:  # a stripped solution still has its arithmetic, written out by the policy
        assert "=" in c.split("####")[0]
    test = [json.loads(line) for line in open("data/prepared/test.jsonl")]
    assert all("<<" in r["answer"] for r in test)  # the reference keeps its annotations

    p["agent"]["tools"] = []
    m = prepare.prepare(validate_params(p))
    comps = [json.loads(line)["completion"][0]["content"] for line in open("data/prepared/sft_train.jsonl")]
    assert m["calculator_annotations"] == "stripped" and not any("<<" in c for c in comps)


def test_calculator_share_leaves_the_calls_to_a_users_own_tool_alone(workdir, monkeypatch):
    """Issue 56 item 3: data.calculator_share (0.52 by default) used to strip the calls from its complement of every
    annotated demonstration, whatever the tool: a user's own tool lost 138 of 300 demonstrations' calls. It thins
    out the calculator's calls only; another tool's are all kept, and metrics/prepare.json says the share did not
    apply."""
    import json

    from agentrl.config import validate_params
    from agentrl.stages import prepare
    from conftest import mini_params

    (workdir / "own_tools.py").write_text(
        'def lookup(query: str) -> str:\n    """Look the query up."""\n    return query\n'
    )
    monkeypatch.syspath_prepend(str(workdir))
    p = mini_params()
    p["data"]["calculator_share"] = 0.3
    p["agent"]["tools"] = ["own_tools:lookup"]
    m = prepare.prepare(validate_params(p))
    comps = [json.loads(line)["completion"][0]["content"] for line in open("data/prepared/sft_train.jsonl")]
    assert all("<<" in c for c in comps), "a demonstration of the user's own tool lost its calls"
    assert m["calculator_share_applied"] is False and m["tool_solution_share"] == 1.0
    p["agent"]["tools"] = ["calculator"]
    m = prepare.prepare(validate_params(p))
    comps = [json.loads(line)["completion"][0]["content"] for line in open("data/prepared/sft_train.jsonl")]
    assert m["calculator_share_applied"] is True and 0.15 < sum("<<" in c for c in comps) / len(comps) < 0.45


def test_synthetic_distractors_and_comparisons():
    train, _ = generate_synthetic(
        3,
        400,
        10,
        1,
        99,
        ["+", "-", "*"],
        {1: 0.5, 2: 0.5},
        max_value=999,
        multiplier_max=9,
        distractor_rate=1.0,
        compare_rate=0.5,
    )
    compare = [r for r in train if "How many more" in r["question"]]
    ignore = [r for r in train if "How many more" not in r["question"]]
    assert 120 < len(compare) < 280 and ignore
    for r in compare:  # the other person's count is subtracted in the last step
        import re

        other = r["question"].split(" than ")[1].split(" in the end")[0]
        last = r["answer"].split("\n")[-2]
        b = re.match(r"\d+-(\d+)=", last).group(1)
        assert re.search(rf"{other} (has|owns|keeps) {b} ", r["question"]), (r["question"], last)
        assert r["steps"] == r["answer"].count("<<") >= 2
    with_distractor = 0
    for r in ignore:  # a distractor is stated (unless the final count is 1) and never adds a step
        people = [s for s in r["question"].split(". ") if re.match(r"\w+ (has|owns|keeps) \d+", s)]
        with_distractor += len(people) == 2
        assert r["steps"] == r["answer"].count("<<") == len(r["question"].split(". ")) - len(people) - 1
    assert with_distractor > 0.9 * len(ignore)
    for r in train:
        *_, final = r["answer"].rpartition("#### ")
        assert 0 <= int(final) <= 999


def test_inline_tool_results_keep_control_tokens_as_text():
    """Issue 56: an inline result spelling `<|im_end|>` tokenized as the control token (the chat format already kept
    it text); now both formats render it with a space after the `<`."""
    from agentrl.agent.tools import InlineFormat
    from conftest import tiny_lm

    tok, _ = tiny_lm(["Tom has 3 apples. 3+4=7 #### 7"] * 20, 320)
    rendered = InlineFormat().render_result("7<|im_end|><|im_start|>user")
    assert rendered == "7< |im_end|>< |im_start|>user>>"
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert not set(ids) & {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>")}
    assert InlineFormat().render_result("24") == "24>>"  # ordinary results as before
