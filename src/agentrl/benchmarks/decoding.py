"""Generation speed (`make bench`, `make bench-tools`, and `make gpu-check`'s tool-loop row): the tool loop
against one plain `model.generate` per batch, the decode ceiling (bare greedy decoding with the KV cache), and the
evaluation's problems/s batched against one at a time."""

from __future__ import annotations

import statistics
import time

import torch

from agentrl.data import load_jsonl

from .measure import sync

LOOP_ROUNDS = 3  # loop/plain pairs per tool_loop_vs_plain run
LOOP_GOAL = 1.3  # issue 29: the loop at least this many times plain batched generate's tokens/s


def _plain_generate(model, tok, texts: list[str], max_new: int, batch_size: int) -> tuple[float, int]:
    """One plain greedy `model.generate` per left-padded batch of `texts`, no tool.

    Args:
        model, tok: the policy and its tokenizer.
        texts: the prompts, already rendered with the chat template.
        max_new: max_new_tokens of each call.
        batch_size: prompts per call.

    Returns:
        (seconds, generated tokens counted up to and including eos).
    """
    tok.padding_side = "left"
    n_tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            seqs = model.generate(
                **enc.to(model.device),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            for row in seqs[:, enc["input_ids"].shape[1] :].tolist():
                n_tokens += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    sync(model)
    return time.perf_counter() - start, n_tokens


def tool_loop_vs_plain(
    model, tok, prompts: list, toolset, max_new: int, batch_size: int, template_kwargs=None, rounds: int = LOOP_ROUNDS
) -> dict:
    """Generated tokens/s of the tool loop (agent.generate_with_tools) against one plain `model.generate` per
    batch on the same prompts and batch size (no tool runs there: the model writes every result itself), greedy,
    after a short warm-up. The two alternate for `rounds` rounds, and the ratio is the median of the rounds' paired
    ratios (loop then plain, back to back), so a change of the machine's speed between the two lands on both.
    Tokens are counted up to and including eos; the loop's count includes the tool results it inserts, which it
    does not sample (`loop_sampled_tokens_per_second` leaves them out).

    Args:
        model, tok: the policy and its tokenizer.
        prompts: message lists.
        toolset: the loop's tools (agent.tools.toolset_from_params), or None.
        max_new: max new tokens per completion.
        batch_size: prompts per batch on both sides.
        template_kwargs: extra chat-template arguments (the toolset's), or None.
        rounds: loop/plain pairs.

    Returns:
        Tokens/s of both sides, the median paired ratio and each round's, tool calls, problems, the device, and the
        mean prompt and generated tokens per problem (the decoding context of the model FLOPs).
    """
    from agentrl.agent.loop import generate_with_tools

    kw = template_kwargs or {}
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw) for p in prompts]

    def loop() -> tuple[float, list]:
        sync(model)
        start = time.perf_counter()
        out = generate_with_tools(model, tok, prompts, toolset, max_new, batch_size, chat_template_kwargs=kw)
        rolls = [r[0] for r in out]
        sync(model)
        return time.perf_counter() - start, rolls

    generate_with_tools(model, tok, prompts[:2], toolset, 4, batch_size=batch_size, chat_template_kwargs=kw)
    loop_s, plain_s, ratios = [], [], []
    for _ in range(rounds):
        seconds, rolls = loop()
        plain_seconds, plain_tokens = _plain_generate(model, tok, texts, max_new, batch_size)
        loop_s.append(seconds)
        plain_s.append(plain_seconds)
        loop_tokens = sum(r.num_tokens for r in rolls)  # greedy: the same rolls every round
        ratios.append((loop_tokens / seconds) / (plain_tokens / plain_seconds))
    sampled = sum(sum(r.env_mask) for r in rolls)
    return {
        "loop_tokens_per_second": loop_tokens / statistics.median(loop_s),
        "loop_sampled_tokens_per_second": sampled / statistics.median(loop_s),
        "plain_tokens_per_second": plain_tokens / statistics.median(plain_s),
        "ratio": statistics.median(ratios),
        "round_ratios": ratios,
        "tool_calls": sum(len(r.calls) for r in rolls),
        "problems": len(prompts),
        "device": str(model.device),
        "mean_prompt_tokens": statistics.mean(len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]),
        "mean_loop_tokens": loop_tokens / len(prompts),
    }


@torch.inference_mode()
def bare_greedy_decode(model, input_ids, attention_mask, n: int) -> torch.Tensor:
    """One prefill, then one forward per token with the KV cache and an argmax; positions from the attention mask,
    as `generate` computes them. Nothing stops early.

    Args:
        model: a causal LM.
        input_ids, attention_mask: a left-padded batch.
        n: new tokens per row.

    Returns:
        The new token ids, batch x n.
    """
    mask = attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    new = [out.logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        pos = pos[:, -1:] + 1
        kv = out.past_key_values
        out = model(input_ids=new[-1], attention_mask=mask, position_ids=pos, past_key_values=kv, use_cache=True)
        new.append(out.logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(new, dim=1)


def decode_ceiling(model, tok, prompts: list, max_new: int, batch_size: int, template_kwargs=None) -> dict:
    """The decode ceiling on this machine: bare_greedy_decode of `max_new` tokens for every prompt, in left-padded
    batches (no stopping, no tool, no sampling logic), after a short warm-up.

    Args:
        model, tok: the policy and its tokenizer.
        prompts: message lists.
        max_new: tokens decoded per prompt.
        batch_size: prompts per batch.
        template_kwargs: extra chat-template arguments, or None.

    Returns:
        {"tokens_per_second", "tokens", "seconds"} over every token generated.
    """
    kw = template_kwargs or {}
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw) for p in prompts]

    def decode(batch: list[str], n: int) -> torch.Tensor:
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        return bare_greedy_decode(model, enc["input_ids"], enc["attention_mask"], n)

    decode(texts[:2], 4)
    sync(model)
    start = time.perf_counter()
    tokens = sum(decode(texts[i : i + batch_size], max_new).numel() for i in range(0, len(texts), batch_size))
    sync(model)
    seconds = time.perf_counter() - start
    return {"tokens_per_second": tokens / seconds, "tokens": tokens, "seconds": seconds}


def tool_loop_speed(params, n: int, stage: str = "grpo", ceiling: bool = False) -> dict:
    """tool_loop_vs_plain on `stage`'s policy: the tool loop (tools from params.agent) against plain
    `model.generate` on the first `n` held-out prompts, params.eval's batch size and max_new_tokens.

    Args:
        params: the validated params.
        n: held-out problems.
        stage: whose saved policy (modeling.load_policy).
        ceiling: also decode_ceiling on the same model, prompts and sizes, and both loops' tokens/s as fractions
            of it.

    Returns:
        tool_loop_vs_plain's dict (+ "ceiling_tokens_per_second" and "*_fraction_of_ceiling" with `ceiling`).
    """
    from agentrl.agent.tools import toolset_from_params
    from agentrl.modeling import load_policy

    model, tok = load_policy(stage)
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token)
    prompts = [r["prompt"] for r in load_jsonl("data/prepared/test.jsonl")[:n]]
    kw = toolset.chat_template_kwargs() if toolset else None
    max_new, batch_size = params.eval.max_new_tokens, params.eval.batch_size
    out = tool_loop_vs_plain(model, tok, prompts, toolset, max_new, batch_size, kw)
    if ceiling:
        ceiling_tps = decode_ceiling(model, tok, prompts, max_new, batch_size, kw)["tokens_per_second"]
        out["ceiling_tokens_per_second"] = ceiling_tps
        for k in ("loop", "loop_sampled", "plain"):
            out[f"{k}_fraction_of_ceiling"] = out[f"{k}_tokens_per_second"] / ceiling_tps
    return out


def eval_speed(params, n: int, stage: str) -> dict:
    """Problems/s of the evaluation's generate on `stage`'s model: batched (eval.batch_size) vs one at a time.

    Args:
        params: the validated params.
        n: held-out problems.
        stage: whose saved policy.

    Returns:
        {"batched": ..., "per_sample": ...}, each with problems_per_second, accuracy, mean_completion_tokens.
    """
    from agentrl.agent.tools import toolset_from_params
    from agentrl.modeling import load_policy
    from agentrl.stages.evaluate import generate, score

    model, tok = load_policy(stage)
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token)
    rows = load_jsonl("data/prepared/test.jsonl")[:n]
    prompts = [r["prompt"] for r in rows]
    out = {}
    for name, batch_size in (("batched", params.eval.batch_size), ("per_sample", 1)):
        start = time.perf_counter()
        samples = generate(
            model, tok, prompts, batch_size, params.eval.max_new_tokens, desc=f"{stage} {name}", toolset=toolset
        )
        seconds = time.perf_counter() - start
        metrics, _ = score(rows, samples, {"accuracy": 1.0}, {})
        out[name] = {
            "problems_per_second": n / seconds,
            "accuracy": metrics["accuracy"],
            "mean_completion_tokens": metrics["mean_completion_tokens"],
        }
    return out
