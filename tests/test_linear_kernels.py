"""eval.linear_kernels / grpo.rollout_linear_kernels (agent/linear_kernels.py): a model whose Linear layers run
oneDNN's packed kernels computes what it did (greedy tokens identical through the tool loop, next-token
log-probabilities within float rounding, samples from the same distribution), runs the same way twice, follows
its weights when they are repacked, and is refused where it cannot run. Where each knob takes effect: the
evaluation's model here; the GRPO rollouts' merged copy in test_environments.py (-k onednn)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from agentrl.agent.linear_kernels import LinearKernelsError, OneDNNLinear, use_linear_kernels
from agentrl.agent.loop import generate_with_tools
from agentrl.data import generate_synthetic, messages
from conftest import make_toolset, mini_params, raw_params, tiny_lm
from test_agent import ForceCalls


@pytest.fixture(scope="module")
def calculator_model():
    """(tokenizer, model, prompts): a tiny model with large random weights (completions that differ from prompt to
    prompt) and 24 of the generated task's prompts."""
    train, test = generate_synthetic(2, 300, 24, 1, 99, ["+", "*"], {1: 0.5, 2: 0.5}, max_value=999)
    tok, model = tiny_lm([r["question"] + r["answer"] for r in train], 320, hidden_size=64, num_hidden_layers=2)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 1.0)
    return tok, model.eval(), [messages("", r["question"]) for r in test]


def packed_copy(model, batch_hint: int = 8):
    packed = copy.deepcopy(model)
    assert use_linear_kernels(packed, "onednn", batch_hint, "eval.linear_kernels") > 0
    return packed


def test_a_packed_layer_computes_the_linear_it_replaced_and_follows_a_repack():
    torch.manual_seed(0)
    linear = nn.Linear(48, 80)
    layer = OneDNNLinear(copy.deepcopy(linear), batch_hint=4)
    for x in (torch.randn(5, 48), torch.randn(3, 7, 48)):
        torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    x = torch.randn(3, 48)
    assert torch.allclose(layer(x), linear(x), atol=1e-5)  # the packed weight waits for repack()
    layer.repack()
    torch.testing.assert_close(layer(x), nn.functional.linear(x, -2.0 * linear.weight, layer.bias), atol=1e-5, rtol=0)


def test_every_linear_is_replaced_tied_weights_stay_tied(calculator_model):
    tok, model, _ = calculator_model
    packed = packed_copy(model)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert sum(type(m) is OneDNNLinear for m in packed.modules()) == linears and linears > 1
    assert not any(type(m) is nn.Linear for m in packed.modules())
    if model.config.tie_word_embeddings:
        assert packed.lm_head.weight is packed.get_input_embeddings().weight
    assert use_linear_kernels(copy.deepcopy(model), "aten", 8, "eval.linear_kernels") == 0


def test_greedy_tool_loop_completions_are_the_same_tokens(calculator_model):
    """The tool loop (which calls model.generate) on the packed copy, greedy: every completion's token ids and
    tool tokens are the plain model's, at two batch sizes; without tool calls, and with calls forced (ForceCalls:
    the loop then pauses, inserts results and continues from the KV cache)."""
    from transformers import LogitsProcessorList

    tok, model, prompts = calculator_model
    toolset = make_toolset(["calculator"], "inline", max_calls=3, eos_token=tok.eos_token)
    packed = packed_copy(model)
    for batch_size, forced in ((8, False), (24, False), (8, True)):
        kw = {"logits_processor": LogitsProcessorList([ForceCalls(tok)])} if forced else {}
        want = generate_with_tools(model, tok, prompts, toolset, 32, batch_size=batch_size, **kw)
        got = generate_with_tools(packed, tok, prompts, toolset, 32, batch_size=batch_size, **kw)
        assert [r[0].completion_ids for r in got] == [r[0].completion_ids for r in want]
        assert [r[0].env_mask for r in got] == [r[0].env_mask for r in want]
        assert len({tuple(r[0].completion_ids) for r in want}) > 1  # the completions differ: the check can fail
        assert any(r[0].calls for r in want) is forced


def test_sampling_runs_the_same_twice_and_draws_from_the_same_distribution(calculator_model):
    """Same seed, same samples (twice on the packed copy); every next-token log-probability within 1e-5 of the
    plain model's; and a chi-square test of 4,000 first tokens sampled through the loop from the packed copy
    against the plain model's probabilities does not reject (at the 0.1% level)."""
    tok, model, prompts = calculator_model
    packed = packed_copy(model, 64)

    def sample(m, n, seed, max_new=16):
        rolls = generate_with_tools(m, tok, prompts[:1], None, max_new, temperature=1.0, num_samples=n, seed=seed)
        return [r.completion_ids for r in rolls[0]]

    assert sample(packed, 16, seed=5) == sample(packed, 16, seed=5)
    text = tok.apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        want, got = (torch.log_softmax(m(ids).logits[0], -1) for m in (model, packed))
    assert (want - got).abs().max().item() < 1e-5
    first = [c[0] for c in sample(packed, 4000, seed=11, max_new=1)]
    probs = want[-1].exp()
    counts = torch.bincount(torch.tensor(first), minlength=len(probs)).float()
    expected = probs * len(first)
    common = expected >= 5  # the rest pooled into one cell, as a chi-square test asks
    observed = torch.cat([counts[common], counts[~common].sum().reshape(1)])
    expected = torch.cat([expected[common], expected[~common].sum().reshape(1)])
    statistic = ((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum().item()
    df = len(observed) - 1
    assert df >= 3  # enough cells for the test to mean something
    # Wilson-Hilferty: the chi-square quantile at 1 - 0.001 (z = 3.09) with df degrees of freedom
    critical = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert statistic < critical, (statistic, critical)
    skewed = (probs.roll(1) * len(first)).clamp(min=1e-9)  # the same test does reject another distribution
    assert ((counts - skewed) ** 2 / skewed).sum().item() > critical


@pytest.mark.parametrize(
    "dtype, kernels, message",
    [
        (
            torch.bfloat16,
            "onednn",
            "eval.linear_kernels: onednn runs fp32 weights on the CPU; layer .* is torch.bfloat16",
        ),
        (torch.float32, "mkl", "eval.linear_kernels: expected one of aten, onednn, got 'mkl'"),
    ],
)
def test_what_onednn_cannot_run_is_refused_by_the_knob_s_name(calculator_model, dtype, kernels, message):
    _, model, _ = calculator_model
    target = copy.deepcopy(model).to(dtype)
    with pytest.raises(LinearKernelsError, match=message):
        use_linear_kernels(target, kernels, 8, "eval.linear_kernels")
    assert not any(type(m) is OneDNNLinear for m in target.modules())  # refused before anything changed


def test_params_refuse_onednn_where_it_would_not_be_honoured():
    from agentrl.config import ParamsError, validate_params

    p = raw_params()
    p["reproducibility"]["mode"] = "portable"
    p["eval"]["linear_kernels"] = "onednn"
    with pytest.raises(ParamsError, match="eval.linear_kernels: onednn picks its code per CPU.*portable"):
        validate_params(p)
    p = raw_params()
    p["grpo"].update(merged_rollouts=False, rollout_linear_kernels="onednn")
    with pytest.raises(ParamsError, match="rollout_linear_kernels: onednn .* needs merged_rollouts: true"):
        validate_params(p)
    p["grpo"]["merged_rollouts"] = True
    assert validate_params(p).grpo.rollout_linear_kernels == "onednn"


@pytest.mark.parametrize("kernels, quantize, packed", [("onednn", "none", True), ("aten", "none", False),
                                                       ("onednn", "int8", False)])  # fmt: skip
def test_the_evaluation_runs_the_kernels_eval_linear_kernels_names(calculator_model, monkeypatch, kernels, quantize,
                                                                   packed):  # fmt: skip
    """stages.evaluate loads the stage's model and puts eval.linear_kernels in place before it generates; the int8
    model keeps its own quantized layers."""
    from agentrl import modeling
    from agentrl.config import validate_params
    from agentrl.stages import evaluate

    tok, model, _ = calculator_model
    monkeypatch.setattr(modeling, "load_policy", lambda stage, dtype: (copy.deepcopy(model), tok))
    p = mini_params()
    p["eval"]["linear_kernels"] = kernels
    loaded, _ = evaluate._load_for_eval(validate_params(p), "sft", quantize)
    assert any(type(m) is OneDNNLinear for m in loaded.modules()) is packed
