"""The tool loop: one batched generation function for GRPO rollouts, evaluation and the server.

`generate_with_tools` generates completions for chat prompts. When a row opens a tool call (inline:
it writes `<<48/2=`), that row stops; once the batch pauses, the call runs and its result (`24>>`) is
appended to the row as tokens that are never sampled (env_mask 0), and the row continues from its KV
cache. Rows that make no call are unaffected; with no tools it is plain batched sampling.

How a batch runs: one `model.generate` call runs until every row has either ended (eos), opened a
call, used its token budget, or until PRUNE_SHARE of the rows have stopped (then the rest pause too,
so rows that are waiting for a tool or that have ended do not sit idle while the others decode). Ended
rows leave the batch and its cache; waiting rows get their tool result appended (right-aligned, the
gap masked out); the next call prefills only the new tokens. Rows stopped early inside a call are
padded by `generate` while the others continue: the stop position is recorded per row, so a pad or
eos is never mistaken for the end of a row that is waiting for a tool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from .tools import Calculator, Episode, Toolset, split_annotated

PRUNE_SHARE = 0.5


@dataclass
class Rollout:
    """One completion: its tokens (model and tool), which of them the model sampled, the calls."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy, 0 = inserted by a tool
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments", "result", "ok"}
    text: str = ""
    finish_reason: str = "length"  # stop | length | tool_limit
    logprobs: Optional[list] = None  # with return_logprobs: per token, None on tool tokens
    episode: Optional[Episode] = None  # the environment instance this completion acted in (agent.environment)

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)

    @property
    def tool_errors(self) -> int:
        return sum(not c["ok"] for c in self.calls)


class _Stops(StoppingCriteria):
    """Per-row stop: eos, an opened tool call or the row's budget; records where each row stopped.
    The whole call pauses once `share` of the rows have stopped."""

    def __init__(
        self,
        start: int,
        eos: set[int],
        budgets: list[int],
        row_text,
        fmt,
        trigger_ids: Optional[set],
        share: float,
        hook=None,
    ):
        self.start, self.eos, self.budgets, self.row_text, self.fmt = start, eos, budgets, row_text, fmt
        self.trigger_ids, self.share, self.hook = trigger_ids, share, hook
        self.stop_at: dict[int, tuple[int, str]] = {}  # row -> (index of its last real new token, reason)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        n = input_ids.shape[1] - self.start
        last = input_ids[:, -1].tolist()
        for r, tok in enumerate(last):
            if r in self.stop_at:
                continue
            if tok in self.eos:
                self.stop_at[r] = (n - 1, "eos")
            elif (
                self.fmt is not None
                and tok in self.trigger_ids
                and self.fmt.open_call(self.row_text(r, input_ids[r, self.start :].tolist())) is not None
            ):
                self.stop_at[r] = (n - 1, "call")
            elif n >= self.budgets[r]:
                self.stop_at[r] = (n - 1, "length")
            elif self.hook is not None and self.hook(r, input_ids[r, self.start :].tolist()):
                self.stop_at[r] = (n - 1, "hook")
        stopped = torch.zeros(len(last), dtype=torch.bool, device=input_ids.device)
        if self.stop_at:
            stopped[list(self.stop_at)] = True
        if stopped.float().mean().item() >= self.share:
            return torch.ones_like(stopped)
        return stopped


def _trigger_ids(tokenizer, trigger: str) -> set[int]:
    """Ids of the tokens whose text contains `trigger` (cached on the tokenizer): only after one of them
    can an inline call be complete, so the stopping check decodes a row only then."""
    cache = tokenizer.__dict__.setdefault("_agentrl_trigger_ids", {})
    if trigger not in cache:
        cache[trigger] = {i for i in tokenizer.get_vocab().values() if trigger in tokenizer.decode([i])}
    return cache[trigger]


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def generate_with_tools(
    model,
    tokenizer,
    prompts: list,
    toolset: Optional[Toolset],
    max_new_tokens,
    batch_size: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    num_samples: int = 1,
    seed: Optional[int] = None,
    desc: Optional[str] = None,
    chat_template_kwargs: Optional[dict] = None,
    return_logprobs: bool = False,
    row_hook=None,
    rows: Optional[list[dict]] = None,
    **generate_kwargs,
) -> list[list[Rollout]]:
    """Completions for `prompts` (chat message lists, rendered strings or token id lists): `num_samples`
    Rollouts per prompt, in input order. Greedy when temperature == 0. Prompts are sorted by length
    and batched with left padding. `max_new_tokens` (one int, or one per prompt) bounds each completion,
    tool tokens included. `return_logprobs` records each sampled token's log-probability under the
    sampling distribution (None on tool tokens). `row_hook(prompt_index, sample, completion_ids)`, called
    after every sampled token of a row (streaming, stop strings), ends that row when it returns True
    (finish_reason 'stop'). `rows` (one dataset row per prompt) reset each completion's own environment
    instance (`toolset.episode(row)`): two completions never share state. An observation that `reset`
    returns is appended to the prompt's last message, as TRL's environment_factory loop does.
    """
    tokenizer.padding_side = "left"
    kw = chat_template_kwargs or {}
    if rows is not None and len(rows) != len(prompts):
        raise ValueError(f"generate_with_tools: {len(rows)} rows for {len(prompts)} prompts")
    episodes: list[list[Episode]] = [[] for _ in prompts]
    if toolset is not None:
        for i in range(len(prompts)):
            for _ in range(num_samples):
                ep = toolset.episode(rows[i] if rows is not None else None)
                episodes[i].append(ep)
            obs = episodes[i][0].observation
            if obs is not None:
                if not (isinstance(prompts[i], list) and prompts[i] and isinstance(prompts[i][-1], dict)):
                    raise ValueError("an environment whose reset() returns an observation needs chat-message prompts")
                last = prompts[i][-1]
                prompts = list(prompts)
                prompts[i] = prompts[i][:-1] + [{**last, "content": last["content"] + obs}]
    ids_in = [p if isinstance(p, list) and (not p or isinstance(p[0], int)) else None for p in prompts]
    texts = [
        None
        if ids_in[i] is not None
        else p
        if isinstance(p, str)
        else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw)
        for i, p in enumerate(prompts)
    ]
    budget_of = (
        (lambda i: max_new_tokens[i]) if isinstance(max_new_tokens, (list, tuple)) else (lambda i: max_new_tokens)
    )
    order = sorted(range(len(prompts)), key=lambda i: len(ids_in[i]) * 4 if ids_in[i] is not None else len(texts[i]))
    device = next(model.parameters()).device
    eos_ids = tokenizer.eos_token_id
    eos = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids or [])
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos |= {gen_eos} if isinstance(gen_eos, int) else set(gen_eos or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    fmt = toolset.format if toolset is not None else None
    # inline calls complete on a token containing '='; chat calls end the turn, so they are checked at eos
    trigger_ids = None if fmt is None else _trigger_ids(tokenizer, fmt.trigger) if fmt.name == "inline" else set()
    if seed is not None:
        torch.manual_seed(seed)
    gen_kw = dict(
        do_sample=temperature > 0,
        pad_token_id=pad,
        eos_token_id=sorted(eos),
        return_dict_in_generate=True,
        **generate_kwargs,
    )
    if temperature > 0:
        gen_kw.update(temperature=temperature, top_p=top_p, top_k=top_k)
    if return_logprobs:
        gen_kw["output_scores"] = True
    out: list[list[Rollout]] = [[] for _ in prompts]
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc=desc, leave=False) if desc else starts:
        idx = order[start : start + batch_size]
        if all(ids_in[i] is not None for i in idx):
            width = max(len(ids_in[i]) for i in idx)
            enc = {
                "input_ids": torch.tensor([[pad] * (width - len(ids_in[i])) + ids_in[i] for i in idx]),
                "attention_mask": torch.tensor([[0] * (width - len(ids_in[i])) + [1] * len(ids_in[i]) for i in idx]),
            }
        else:
            enc = tokenizer(
                [texts[i] if ids_in[i] is None else tokenizer.decode(ids_in[i]) for i in idx],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            )
        ids = enc["input_ids"].repeat_interleave(num_samples, dim=0).to(device)
        mask = enc["attention_mask"].repeat_interleave(num_samples, dim=0).to(device)
        rolls = [
            Rollout(
                prompt_ids=[t for t, m in zip(ids[r].tolist(), mask[r].tolist()) if m],
                logprobs=[] if return_logprobs else None,
                episode=episodes[idx[r // num_samples]][r % num_samples] if toolset is not None else None,
            )
            for r in range(ids.shape[0])
        ]
        limit = [budget_of(idx[r // num_samples]) for r in range(len(rolls))]
        for r, roll in enumerate(rolls):
            out[idx[r // num_samples]].append(roll)
        active = list(range(len(rolls)))  # batch row -> index into rolls
        cache = None
        while active:
            start_len = ids.shape[1]
            budgets = [limit[a] - rolls[a].num_tokens for a in active]

            # the closures run inside this iteration's generate call: they see this iteration's rolls and idx
            def row_text(r, new_tokens, _active=active):
                return tokenizer.decode(
                    rolls[_active[r]].completion_ids + new_tokens,  # noqa: B023
                    skip_special_tokens=False,
                )

            hook = None
            if row_hook is not None:

                def hook(r, new_tokens, _active=active):
                    a = _active[r]
                    return row_hook(idx[a // num_samples], a % num_samples, rolls[a].completion_ids + new_tokens)  # noqa: B023

            stops = _Stops(start_len, eos, budgets, row_text, fmt, trigger_ids, PRUNE_SHARE, hook)
            res = model.generate(
                input_ids=ids,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=max(budgets),
                stopping_criteria=StoppingCriteriaList([stops]),
                **gen_kw,
            )
            seqs, cache = res.sequences, res.past_key_values
            new = seqs[:, start_len:]
            n_new = new.shape[1]
            if return_logprobs:  # log-softmax of the (processed) scores at each step, at the sampled token
                steps = torch.stack([torch.log_softmax(sc.float(), dim=-1) for sc in res.scores], dim=1)
                lp = steps.gather(2, new[:, : steps.shape[1]].unsqueeze(-1)).squeeze(-1).tolist()
            keep, inserts = [], []
            new_mask = mask.new_ones(len(active), n_new)
            for r, a in enumerate(active):
                roll = rolls[a]
                last, reason = stops.stop_at.get(r, (n_new - 1, "paused"))
                if reason == "paused" and roll.num_tokens + n_new >= limit[a]:
                    reason = "length"
                toks = new[r, : last + 1].tolist()
                new_mask[r, last + 1 :] = 0
                roll.completion_ids += toks
                roll.env_mask += [1] * len(toks)
                if return_logprobs:
                    roll.logprobs += lp[r][: len(toks)]
                if reason == "hook":
                    roll.finish_reason = "stop"
                    continue
                calls = []
                if fmt is not None and reason in ("call", "eos"):
                    body = roll.completion_ids[:-1] if reason == "eos" else roll.completion_ids
                    calls = fmt.open_calls(tokenizer.decode(body, skip_special_tokens=False), at_eos=(reason == "eos"))
                if calls:  # chat: every call of the turn, in order, as TRL's loop runs them
                    if len(roll.calls) + len(calls) > toolset.max_calls:
                        roll.finish_reason = "tool_limit"
                        continue
                    results = []
                    for call in calls:
                        result, ok = roll.episode.run(call)
                        name = call.name or toolset.names[0]
                        roll.calls.append({"name": name, "arguments": call.arguments, "result": result, "ok": ok})
                        results.append(result)
                    ins = _encode(tokenizer, fmt.render_results(results))
                    ins = ins[: limit[a] - roll.num_tokens]
                    roll.completion_ids += ins
                    roll.env_mask += [0] * len(ins)
                    if return_logprobs:
                        roll.logprobs += [None] * len(ins)
                    if roll.num_tokens >= limit[a]:
                        roll.finish_reason = "length"
                        continue
                    keep.append(r)
                    inserts.append(ins)
                elif reason == "eos":
                    roll.finish_reason = "stop"
                elif reason == "length" or roll.num_tokens >= limit[a]:
                    roll.finish_reason = "length"
                else:  # paused or stopped at a call that is not (yet) complete: continue
                    keep.append(r)
                    inserts.append([])
            if not keep:
                break
            width = max(len(x) for x in inserts)
            if width:
                # Every row's latest token must sit in the last column (generate continues from there). A row
                # without a tool result moves its latest token (sampled, not yet in the cache) to the end.
                for j, r in enumerate(keep):
                    if not inserts[j]:
                        inserts[j] = [int(seqs[r, -1])]
                        new_mask[r, -1] = 0
                        seqs[r, -1] = pad  # what logits processors see in the gap, as in left padding
            block = torch.full((len(keep), width), pad, dtype=ids.dtype, device=device)
            block_mask = torch.zeros((len(keep), width), dtype=mask.dtype, device=device)
            for j, ins in enumerate(inserts):
                if ins:  # right-aligned; the gap before it is masked out
                    block[j, width - len(ins) :] = torch.tensor(ins, dtype=ids.dtype, device=device)
                    block_mask[j, width - len(ins) :] = 1
            keep_t = torch.tensor(keep, device=device)
            mask = torch.cat([mask, new_mask], dim=1)[keep_t]
            ids = seqs[keep_t]
            if width:
                ids = torch.cat([ids, block], dim=1)
                mask = torch.cat([mask, block_mask], dim=1)
            if len(keep) < len(active):
                cache.batch_select_indices(keep_t)
            active = [active[r] for r in keep]
        for roll in rolls:
            roll.text = tokenizer.decode(roll.completion_ids, skip_special_tokens=True)
    return out


def tokenize_trace(
    tokenizer, prompt, segments: list[tuple[str, bool]], eos: bool = True, chat_template_kwargs: Optional[dict] = None
) -> dict:
    """Token ids of a prompt and a completion given as (text, is_model_text) segments, tokenized segment by
    segment exactly as `generate_with_tools` produces them: {prompt_ids, completion_ids, env_mask}."""
    text = (
        prompt
        if isinstance(prompt, str)
        else tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
        )
    )
    prompt_ids = _encode(tokenizer, text)
    completion_ids, env_mask = [], []
    for seg, is_model in segments:
        toks = _encode(tokenizer, seg) if seg else []
        completion_ids += toks
        env_mask += [int(is_model)] * len(toks)
    if eos:
        completion_ids.append(tokenizer.eos_token_id)
        env_mask.append(1)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "env_mask": env_mask}


def tool_stats(rollouts: list[Rollout]) -> dict:
    """Share of completions with >= 1 call, calls per completion, share of calls that failed."""
    n = len(rollouts)
    calls = sum(len(r.calls) for r in rollouts)
    errors = sum(r.tool_errors for r in rollouts)
    return {
        "tool_use_rate": sum(bool(r.calls) for r in rollouts) / n if n else 0.0,
        "tool_calls_per_problem": calls / n if n else 0.0,
        "tool_error_rate": errors / calls if calls else 0.0,
    }


def sft_features(tokenizer, prompt, completion: str, toolset: Optional[Toolset], row: Optional[dict] = None) -> dict:
    """One SFT example as the tool loop would produce it: {input_ids, completion_mask}, where the prompt and
    every tool-inserted token have mask 0 (labels -100: the policy is not trained to write tool results).
    `toolset` None (agent.tools empty) keeps the completion as plain text. For an environment other than the
    calculator, the demonstration's calls are replayed in a fresh episode reset with `row`, so the results
    the policy reads in training are exactly what the environment answers."""
    if toolset is None:
        segments, kw = [(completion, True)], {}
    else:
        episode = None if toolset.env_class is Calculator else toolset.episode(row)
        if episode is not None and episode.observation is not None:
            prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + episode.observation}]
        segments = split_annotated(completion, toolset.format.name, tokenizer.eos_token, episode)
        kw = toolset.chat_template_kwargs()
    t = tokenize_trace(tokenizer, prompt, segments, chat_template_kwargs=kw)
    return {
        "input_ids": t["prompt_ids"] + t["completion_ids"],
        "completion_mask": [0] * len(t["prompt_ids"]) + t["env_mask"],
    }
