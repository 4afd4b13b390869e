"""The tool loop: one batched generation function for GRPO rollouts, evaluation and the server.

`generate_with_tools` generates completions for chat prompts. When a row opens a tool call (inline:
it writes `<<48/2=`), that row stops; once the batch pauses, the call runs and its result (`24>>`) is
appended to the row as tokens that are never sampled (env_mask 0), and the row continues from its KV
cache. Rows that make no call are unaffected; with no tools it is plain batched sampling.

How a batch runs (`generate_with_tools` is a short driver over these steps): `_reset_episodes` gives every
completion its own environment episode; per batch, `_start_batch` holds the encoded prompts and one Rollout per
row. Then `_generate_segment` runs one `model.generate` call until every row has either ended (eos), opened a
call, used its token budget, or until PRUNE_SHARE of the rows have stopped (then the rest pause too, so rows
that are waiting for a tool or that have ended do not sit idle while the others decode); `_Stops` records each
row's stop position, so a pad or eos that `generate` writes after a row stopped is never mistaken for the end
of a row that is waiting for a tool. `_settle_rows` then decides each row in turn: it finishes (eos, length,
tool_limit, a serving hook), or the environment's response to its calls is appended (`_respond`: never sampled,
env_mask 0, logprob None; a multi-turn environment's observations come back this way too), or it continues as
it is. `_extend` adds the continuing rows' responses as one right-aligned block (the gap masked out) and drops
the ended rows from the batch and its cache; the next call prefills only the new tokens.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..envs.calculator import Calculator
from ..envs.contract import NOT_TOOLS, EnvironmentLost, not_a_tool
from .tools import Episode, Toolset, split_annotated

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

    @property
    def broken(self) -> Optional[str]:
        """Why the episode's environment failed (reset failed, a tool hung, its server gone), or None: such a
        completion is not the policy's wrong answer (check_broken_episodes)."""
        return self.episode.broken if self.episode is not None else None


class BrokenEnvironmentError(RuntimeError):
    """More episodes than agent.max_broken_share had a broken environment: a stage must not pass them off as the
    policy's wrong answers."""


def check_broken_episodes(broken: int, episodes: int, first: Optional[str], limit: float, where: str) -> None:
    """BrokenEnvironmentError naming the count and the first failure when `broken` of `episodes` exceeds the share
    `limit` (agent.max_broken_share)."""
    if broken and broken > limit * episodes:
        raise BrokenEnvironmentError(
            f"{where}: {broken} of {episodes} episodes had a broken environment (first: {first}); "
            f"agent.max_broken_share={limit:g} allows {int(limit * episodes)}"
        )


class BrokenEpisodes:
    """Broken episodes in TRL's own multi-turn loop (agent.format chat in grpo: GRPOTrainer(environment_factory=)).
    TRL counts a tool call that raised as a failed call and lets the episode go on, so a server gone mid-run looks
    like a policy that calls tools badly. `track(factory)` gives factories whose instances record here: an episode
    whose tool raised EnvironmentLost is broken (counted once); a reset that raises ends the stage, since TRL's loop
    cannot skip an episode. `check()` applies agent.max_broken_share as the project's own loop does."""

    def __init__(self, max_share: float, where: str = "grpo"):
        self.max_share, self.where = max_share, where
        self.episodes = self.broken = 0
        self.first: Optional[str] = None
        self._since_log = [0, 0]  # (episodes, broken) since the last pop_curves
        self._instances: "weakref.WeakSet" = weakref.WeakSet()  # TRL's pooled instances, for close_all

    def track(self, factory):
        """`factory` (a class, a functools.partial of one, or TRL's {name: factory} dict) made to record here."""
        if isinstance(factory, dict):
            return {name: self.track(f) for name, f in factory.items()}
        if isinstance(factory, functools.partial):
            return functools.partial(self._counted(factory.func), *factory.args, **factory.keywords)
        return self._counted(factory)

    def _counted(self, cls: type) -> type:
        """A subclass of `cls` with the same tools (names, signatures, docstrings: TRL renders them) that records."""
        ledger = self

        def reset(env, **row):
            ledger._instances.add(env)
            ledger.episodes += 1
            ledger._since_log[0] += 1
            env._agentrl_broken = False
            try:
                return cls.reset(env, **row)
            except Exception as error:  # TRL's loop would stop with a traceback: one line naming the cause instead
                raise BrokenEnvironmentError(
                    f"{ledger.where}: an environment's reset failed in TRL's loop (agent.format chat), which cannot "
                    f"skip the episode: {type(error).__name__}: {str(error)[:300]}"
                ) from None

        def counted_tool(name: str, method):
            @functools.wraps(method)
            def tool(env, *args, **kwargs):
                try:
                    return method(env, *args, **kwargs)
                except EnvironmentLost as error:
                    if not getattr(env, "_agentrl_broken", False):
                        env._agentrl_broken = True
                        ledger.broken += 1
                        ledger._since_log[1] += 1
                        ledger.first = ledger.first or f"{name}: {str(error)[:300]}"
                    raise

            return tool

        tools = {
            name: counted_tool(name, method)
            for name, method in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in NOT_TOOLS and not name.startswith("_")
        }
        members = {"reset": reset, **tools, "__module__": cls.__module__}
        if inspect.isfunction(inspect.getattr_static(cls, "close", None)):  # a plain close(): TRL would offer it
            members["close"] = not_a_tool(inspect.getattr_static(cls, "close"))
        return type(cls.__name__, (cls,), members)

    def close_all(self) -> None:
        """Close every instance TRL's loop used (it pools them across episodes and never ends one): their optional
        close(), once training is over."""
        for env in list(self._instances):
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - teardown after training: nothing scored depends on it
                    pass

    def check(self) -> None:
        check_broken_episodes(self.broken, self.episodes, self.first, self.max_share, self.where)

    def pop_curves(self) -> dict[str, float]:
        """tools/broken_episode_rate over the episodes since the last call (the project's loop logs the same)."""
        episodes, broken = self._since_log
        self._since_log = [0, 0]
        return {"tools/broken_episode_rate": broken / episodes} if episodes else {}


class _GrowingLayer(DynamicLayer):
    """A KV-cache layer that writes each step's keys and values into a buffer with room to spare (doubled when
    full) instead of concatenating the whole cache every step, as transformers' DynamicLayer does. Attention reads
    the same values through a view of the filled part, so the outputs are the same bytes (tests/test_agent.py);
    the loop generates ~10% faster with it on 2 CPU cores (docs/benchmarks.md)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self._len = 0

    def _view(self) -> None:
        self.keys, self.values = self._k[..., : self._len, :], self._v[..., : self._len, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        filled = self._len + key_states.shape[-2]
        if self._k is None or filled > self._k.shape[-2]:
            cap = max(filled, 2 * self._len)
            keys = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
            values = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
            if self._len:
                keys[..., : self._len, :], values[..., : self._len, :] = self.keys, self.values
            self._k, self._v = keys, values
        self._k[..., self._len : filled, :] = key_states
        self._v[..., self._len : filled, :] = value_states
        self._len = filled
        self._view()
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self._k is not None:
            self._len = self.keys.shape[-2]
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized and self._len:
            self._k, self._v = self._k.repeat_interleave(repeats, dim=0), self._v.repeat_interleave(repeats, dim=0)
            self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized and self._len:
            self._k, self._v = self._k[indices, ...], self._v[indices, ...]
            self._view()


def _new_cache(model, gen_kw: dict):
    """An empty KV cache for a batch of the loop: the DynamicCache `generate` would make for the model, with its
    full-attention layers as _GrowingLayers (sliding-window and other layer kinds as they are); None (`generate`
    makes its own) when the model, its generation config or the caller's kwargs ask for another kind of cache."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    implementation = gen_kw.get("cache_implementation", getattr(model.generation_config, "cache_implementation", None))
    if (
        implementation not in (None, "dynamic")
        or gen_kw.get("use_cache") is False
        or (supports is not None and not supports())
    ):
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = _GrowingLayer
    cache.layers = [_GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@dataclass
class _Batch:
    """A batch in flight. Batch row r is `rolls[active[r]]`; `ids` and `mask` (left-padded) are what the next
    `generate` call continues from, `cache` its KV cache. Per roll: its token budget and (prompt index, sample)."""

    rolls: list[Rollout]
    limits: list[int]
    keys: list[tuple[int, int]]
    ids: torch.Tensor
    mask: torch.Tensor
    active: list[int]
    cache: object = None


class _Stops(StoppingCriteria):
    """Per-row stop: eos, an opened tool call, the row's budget or `row_hook`; records where each row stopped.
    The whole call pauses once `share` of the rows have stopped. What it needs of the batch (each row's budget
    left, its completion so far, its (prompt index, sample) for the hook) is read when the segment starts."""

    def __init__(self, batch: _Batch, eos: set[int], tokenizer, fmt, trigger_ids: Optional[set], share: float, hook):
        self.start = batch.ids.shape[1]
        self.budgets = [batch.limits[a] - batch.rolls[a].num_tokens for a in batch.active]
        self.prefixes = [batch.rolls[a].completion_ids for a in batch.active]
        self.keys = [batch.keys[a] for a in batch.active]
        self.eos, self.tokenizer, self.fmt, self.trigger_ids = eos, tokenizer, fmt, trigger_ids
        self.share, self.hook = share, hook
        self.stop_at: dict[int, tuple[int, str]] = {}  # row -> (index of its last real new token, reason)

    def _completion(self, row: int, input_ids: torch.LongTensor) -> list[int]:
        """The row's completion so far: the earlier segments' tokens, then this segment's."""
        return self.prefixes[row] + input_ids[row, self.start :].tolist()

    def _reason(self, row: int, tok: int, generated: int, input_ids: torch.LongTensor) -> Optional[str]:
        """Why the row stops after its latest token `tok` (`generated` tokens into this segment), or None."""
        if tok in self.eos:
            return "eos"
        if self.fmt is not None and tok in self.trigger_ids:
            text = self.tokenizer.decode(self._completion(row, input_ids), skip_special_tokens=False)
            if self.fmt.open_call(text) is not None:
                return "call"
        if generated >= self.budgets[row]:
            return "length"
        if self.hook is not None and self.hook(*self.keys[row], self._completion(row, input_ids)):
            return "hook"
        return None

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.start
        last = input_ids[:, -1].tolist()
        for row, tok in enumerate(last):
            reason = None if row in self.stop_at else self._reason(row, tok, generated, input_ids)
            if reason is not None:
                self.stop_at[row] = (generated - 1, reason)
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


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int))


# --------------------------------------------------------------------- the steps of generate_with_tools
def _reset_episodes(toolset: Optional[Toolset], prompts: list, rows: Optional[list[dict]], num_samples: int):
    """One environment episode per completion, reset with its prompt's row -> (prompts, episodes, per_sample).
    An observation that `reset` returns is appended to the prompt's last message, as TRL's environment_factory loop
    does for each rollout. When the samples of a prompt observe the same (or nothing), episodes[prompt][sample];
    when they differ (a reset that draws at random), every sample becomes a prompt of its own with its own
    observation: per_sample True, episodes[prompt * num_samples + sample] == [its episode]. Episodes are None
    without a toolset. The caller's list is not changed."""
    if toolset is None:
        return prompts, None, False
    episodes: list[list[Episode]] = [
        [toolset.episode(rows[i] if rows is not None else None) for _ in range(num_samples)]
        for i in range(len(prompts))
    ]
    per_sample = any(len({e.observation for e in eps}) > 1 for eps in episodes)
    if per_sample:
        prompts = [p for p in prompts for _ in range(num_samples)]
        episodes = [[e] for eps in episodes for e in eps]
    out = list(prompts)
    for i, eps in enumerate(episodes):
        obs = eps[0].observation
        if obs is not None:
            if not (isinstance(prompts[i], list) and prompts[i] and isinstance(prompts[i][-1], dict)):
                raise ValueError("an environment whose reset() returns an observation needs chat-message prompts")
            last = prompts[i][-1]
            out[i] = prompts[i][:-1] + [{**last, "content": last["content"] + obs}]
    return out, episodes, per_sample


def _prompt_inputs(tokenizer, prompts: list, chat_kw: dict) -> list:
    """Each prompt as token ids or text: ids and strings as given, chat messages rendered with the generation prompt."""
    return [
        p
        if isinstance(p, str) or _is_ids(p)
        else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **chat_kw)
        for p in prompts
    ]


def _eos_ids(tokenizer, model) -> set[int]:
    """The tokenizer's eos ids and the model's generation_config ones."""
    eos_ids = tokenizer.eos_token_id
    eos = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids or [])
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    eos |= {gen_eos} if isinstance(gen_eos, int) else set(gen_eos or [])
    return eos


def _generate_kwargs(
    temperature: float, top_p: float, top_k: int, pad: int, eos: set[int], return_logprobs: bool, extra: dict
) -> dict:
    """The arguments every `generate` call of the loop shares."""
    kw = dict(
        do_sample=temperature > 0, pad_token_id=pad, eos_token_id=sorted(eos), return_dict_in_generate=True, **extra
    )
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p, top_k=top_k)
    if return_logprobs:
        kw["output_scores"] = True
    return kw


def _encode_batch(tokenizer, inputs: list, pad: int) -> dict:
    """input_ids and attention_mask, left-padded. A batch of token-id prompts is taken as it is; one that mixes
    them with text is tokenized from text."""
    if all(isinstance(x, list) for x in inputs):
        width = max(len(x) for x in inputs)
        return {
            "input_ids": torch.tensor([[pad] * (width - len(x)) + x for x in inputs]),
            "attention_mask": torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in inputs]),
        }
    return tokenizer(
        [x if isinstance(x, str) else tokenizer.decode(x) for x in inputs],
        return_tensors="pt",
        padding=True,
        add_special_tokens=False,
    )


def _start_batch(
    enc, idx: list[int], num_samples: int, device, episodes, budgets: list[int], return_logprobs: bool
) -> _Batch:
    """The batch of prompts `idx` (encoded as `enc`), each repeated num_samples times, one Rollout per row."""
    ids = enc["input_ids"].repeat_interleave(num_samples, dim=0).to(device)
    mask = enc["attention_mask"].repeat_interleave(num_samples, dim=0).to(device)
    keys = [(idx[r // num_samples], r % num_samples) for r in range(ids.shape[0])]
    rolls = [
        Rollout(
            prompt_ids=[t for t, m in zip(ids[r].tolist(), mask[r].tolist()) if m],
            logprobs=[] if return_logprobs else None,
            episode=episodes[i][s] if episodes is not None else None,
        )
        for r, (i, s) in enumerate(keys)
    ]
    return _Batch(rolls, [budgets[i] for i, _ in keys], keys, ids, mask, list(range(len(rolls))))


def _generate_segment(model, batch: _Batch, stops: _Stops, gen_kw: dict, return_logprobs: bool):
    """One `generate` call from the batch's tokens and cache until `stops` pauses it -> (sequences, the new
    tokens, per row the log-probability of each new token under the sampling distribution or None)."""
    res = model.generate(
        input_ids=batch.ids,
        attention_mask=batch.mask,
        past_key_values=batch.cache if batch.cache is not None else _new_cache(model, gen_kw),
        max_new_tokens=max(stops.budgets),
        stopping_criteria=StoppingCriteriaList([stops]),
        **gen_kw,
    )
    batch.cache = res.past_key_values
    new = res.sequences[:, stops.start :]
    if not return_logprobs:
        return res.sequences, new, None
    # log-softmax of the (processed) scores at each step, at the sampled token
    steps = torch.stack([torch.log_softmax(sc.float(), dim=-1) for sc in res.scores], dim=1)
    return res.sequences, new, steps.gather(2, new[:, : steps.shape[1]].unsqueeze(-1)).squeeze(-1).tolist()


def _append(roll: Rollout, toks: list[int], sampled: bool, logprobs: Optional[list] = None) -> None:
    """Tokens at the end of a completion: sampled by the policy (env_mask 1, with their logprobs) or inserted by
    the environment (env_mask 0, logprob None)."""
    roll.completion_ids += toks
    roll.env_mask += [int(sampled)] * len(toks)
    if roll.logprobs is not None:
        roll.logprobs += logprobs if sampled else [None] * len(toks)


def _opened_calls(roll: Rollout, reason: str, tokenizer, fmt) -> list:
    """The calls a row's segment ended on: inline, the call it stopped at; chat, every call of the turn it ended."""
    if reason not in ("call", "eos"):
        return []
    body = roll.completion_ids[:-1] if reason == "eos" else roll.completion_ids
    return fmt.open_calls(tokenizer.decode(body, skip_special_tokens=False), at_eos=(reason == "eos"))


def _respond(roll: Rollout, calls: list, limit: int, tokenizer, toolset: Toolset) -> Optional[list[int]]:
    """Runs the calls in the row's episode, in order (chat: every call of the turn, as TRL's loop runs them), and
    appends the environment's response (never sampled), cut at the row's budget -> its tokens, or None when the row
    ends: more calls than max_calls (tool_limit, none of them runs) or its budget is used up (length)."""
    if len(roll.calls) + len(calls) > toolset.max_calls:
        roll.finish_reason = "tool_limit"
        return None
    results = []
    for call in calls:
        result, ok = roll.episode.run(call)
        name = call.name or toolset.names[0]
        roll.calls.append({"name": name, "arguments": call.arguments, "result": result, "ok": ok})
        results.append(result)
    ins = _encode(tokenizer, toolset.format.render_results(results))[: limit - roll.num_tokens]
    _append(roll, ins, sampled=False)
    if roll.num_tokens >= limit:
        roll.finish_reason = "length"
        return None
    return ins


def _next(roll: Rollout, reason: str, limit: int, tokenizer, toolset: Optional[Toolset]) -> Optional[list[int]]:
    """After a row's segment ended with `reason`: None when the row finishes (finish_reason set), else the tokens
    to insert before it continues: the environment's response to the calls it made, or [] (it paused, or stopped
    at a call that is not complete yet)."""
    if reason == "hook":
        roll.finish_reason = "stop"
        return None
    calls = _opened_calls(roll, reason, tokenizer, toolset.format) if toolset is not None else []
    if calls:
        return _respond(roll, calls, limit, tokenizer, toolset)
    if reason == "eos":
        roll.finish_reason = "stop"
        return None
    if reason == "length" or roll.num_tokens >= limit:  # stopped at its budget, or paused on its last token
        roll.finish_reason = "length"
        return None
    return []


def _settle_rows(batch: _Batch, stops: _Stops, new: torch.Tensor, lp: Optional[list], tokenizer, toolset):
    """Each row's tokens of the segment go to its Rollout (up to where it stopped: `generate` pads a stopped row
    while the others go on), then the row finishes or gets its insert (`_next`), in row order -> (the batch rows
    that continue, their inserts, the segment's attention mask: 0 after each row's stop)."""
    n_new = new.shape[1]
    new_mask = batch.mask.new_ones(len(batch.active), n_new)
    keep, inserts = [], []
    for row, rollout_index in enumerate(batch.active):
        roll = batch.rolls[rollout_index]
        last, reason = stops.stop_at.get(row, (n_new - 1, "paused"))
        toks = new[row, : last + 1].tolist()
        new_mask[row, last + 1 :] = 0
        _append(roll, toks, sampled=True, logprobs=lp[row][: len(toks)] if lp is not None else None)
        ins = _next(roll, reason, batch.limits[rollout_index], tokenizer, toolset)
        if ins is not None:
            keep.append(row)
            inserts.append(ins)
    return keep, inserts, new_mask


def _extend(batch: _Batch, seqs: torch.Tensor, new_mask: torch.Tensor, keep: list[int], inserts: list, pad: int):
    """The rows in `keep` continue from the segment's tokens and their inserts, added as one right-aligned block
    (the gap before each insert masked out); the rows that finished leave the batch and its cache."""
    ids, device = batch.ids, batch.ids.device
    width = max(len(x) for x in inserts)
    if width:
        # Every row's latest token must sit in the last column (generate continues from there). A row
        # without a tool result moves its latest token (sampled, not yet in the cache) to the end.
        for j, row in enumerate(keep):
            if not inserts[j]:
                inserts[j] = [int(seqs[row, -1])]
                new_mask[row, -1] = 0
                seqs[row, -1] = pad  # what logits processors see in the gap, as in left padding
    block = torch.full((len(keep), width), pad, dtype=ids.dtype, device=device)
    block_mask = torch.zeros((len(keep), width), dtype=batch.mask.dtype, device=device)
    for j, ins in enumerate(inserts):
        if ins:  # right-aligned; the gap before it is masked out
            block[j, width - len(ins) :] = torch.tensor(ins, dtype=ids.dtype, device=device)
            block_mask[j, width - len(ins) :] = 1
    keep_t = torch.tensor(keep, device=device)
    batch.mask = torch.cat([batch.mask, new_mask], dim=1)[keep_t]
    batch.ids = seqs[keep_t]
    if width:
        batch.ids = torch.cat([batch.ids, block], dim=1)
        batch.mask = torch.cat([batch.mask, block_mask], dim=1)
    if len(keep) < len(batch.active):
        batch.cache.batch_select_indices(keep_t)
    batch.active = [batch.active[r] for r in keep]


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
    returns is appended to the prompt's last message, each sample's own, as TRL's environment_factory loop does.
    Long because the Args: below document each of its generation knobs; the body is some 50 lines.

    Args:
        model: the policy (a transformers causal LM).
        tokenizer: its tokenizer (set to left padding here).
        prompts: chat message lists, rendered strings or token id lists.
        toolset: the tools and call format, or None for plain generation.
        max_new_tokens: the completion budget, tool tokens included: one int, or one per prompt.
        batch_size: prompts per generate call.
        temperature: sampling temperature; 0 is greedy.
        top_k: top-k sampling (0: off).
        num_samples: completions per prompt.
        seed: torch's seed before sampling (None: left as it is).
        desc: a progress-bar label (None: no bar).
        chat_template_kwargs: extra arguments of apply_chat_template (e.g. the chat format's tools).
        return_logprobs: record each sampled token's log-probability.
        row_hook: called after every sampled token of a row; True ends the row.
        rows: one dataset row per prompt, to reset each completion's environment.
        **generate_kwargs: passed on to model.generate (e.g. min_p, repetition_penalty).

    Returns:
        `num_samples` Rollouts per prompt, in input order.
    """
    tokenizer.padding_side = "left"
    if rows is not None and len(rows) != len(prompts):
        raise ValueError(f"generate_with_tools: {len(rows)} rows for {len(prompts)} prompts")
    budgets = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    prompts, episodes, per_sample = _reset_episodes(toolset, prompts, rows, num_samples)
    group = num_samples if per_sample else 1  # each sample its own prompt (its own observation): regrouped at the end
    if per_sample:
        budgets = [b for b in budgets for _ in range(group)]
        hook = row_hook
        row_hook = None if hook is None else (lambda i, s, ids: hook(i // group, i % group, ids))
        batch_size, num_samples = batch_size * group, 1
    inputs = _prompt_inputs(tokenizer, prompts, chat_template_kwargs or {})
    # by length (a token counts as 4 characters), so that a batch pads little
    order = sorted(range(len(prompts)), key=lambda i: len(inputs[i]) * (4 if isinstance(inputs[i], list) else 1))
    device = next(model.parameters()).device
    eos = _eos_ids(tokenizer, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    fmt = toolset.format if toolset is not None else None
    # inline calls complete on a token containing '='; chat calls end the turn, so they are checked at eos
    trigger_ids = None if fmt is None else _trigger_ids(tokenizer, fmt.trigger) if fmt.name == "inline" else set()
    if seed is not None:
        torch.manual_seed(seed)
    gen_kw = _generate_kwargs(temperature, top_p, top_k, pad, eos, return_logprobs, generate_kwargs)
    out: list[list[Rollout]] = [[] for _ in prompts]
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc=desc, leave=False) if desc else starts:
        idx = order[start : start + batch_size]
        enc = _encode_batch(tokenizer, [inputs[i] for i in idx], pad)
        batch = _start_batch(enc, idx, num_samples, device, episodes, budgets, return_logprobs)
        for (i, _), roll in zip(batch.keys, batch.rolls):
            out[i].append(roll)
        while batch.active:
            stops = _Stops(batch, eos, tokenizer, fmt, trigger_ids, PRUNE_SHARE, row_hook)
            seqs, new, lp = _generate_segment(model, batch, stops, gen_kw, return_logprobs)
            keep, inserts, new_mask = _settle_rows(batch, stops, new, lp, tokenizer, toolset)
            if not keep:
                break
            _extend(batch, seqs, new_mask, keep, inserts, pad)
        for roll in batch.rolls:
            roll.text = tokenizer.decode(roll.completion_ids, skip_special_tokens=True)
    if group > 1:
        out = [[rolls[0] for rolls in out[i : i + group]] for i in range(0, len(out), group)]
    return out


def tokenize_trace(
    tokenizer, prompt, segments: list[tuple[str, bool]], eos: bool = True, chat_template_kwargs: Optional[dict] = None
) -> dict:
    """Token ids of a prompt and a completion given as (text, is_model_text) segments, tokenized segment by
    segment exactly as `generate_with_tools` produces them: {prompt_ids, completion_ids, env_mask}.

    Args:
        prompt: the prompt: a rendered string or chat messages.
        segments: the completion as (text, is_model_text) pieces.
        eos: end the completion with the eos token.

    Returns:
        {prompt_ids, completion_ids, env_mask}, env_mask 1 on the model's tokens and 0 on tool tokens.
    """
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
    """Share of completions with >= 1 call, calls per completion, share of calls that failed, share of episodes
    whose environment failed.

    Args:
        rollouts: one Rollout per completion.

    Returns:
        {tool_use_rate, tool_calls_per_problem, tool_error_rate, broken_episode_rate}; zeros for no rollouts or
        no calls.
    """
    count = len(rollouts)
    calls = sum(len(r.calls) for r in rollouts)
    errors = sum(r.tool_errors for r in rollouts)
    return {
        "tool_use_rate": sum(bool(r.calls) for r in rollouts) / count if count else 0.0,
        "tool_calls_per_problem": calls / count if count else 0.0,
        "tool_error_rate": errors / calls if calls else 0.0,
        "broken_episode_rate": sum(r.broken is not None for r in rollouts) / count if count else 0.0,
    }


def sft_features(tokenizer, prompt, completion: str, toolset: Optional[Toolset], row: Optional[dict] = None) -> dict:
    """One SFT example as the tool loop would produce it: {input_ids, completion_mask}, where the prompt and
    every tool-inserted token have mask 0 (labels -100: the policy is not trained to write tool results).
    `toolset` None (agent.tools empty) keeps the completion as plain text. For an environment other than the
    calculator, the demonstration's calls are replayed in a fresh episode reset with `row`, so the results
    the policy reads in training are exactly what the environment answers.

    Args:
        prompt: the prompt (chat messages or a rendered string).
        completion: the demonstration, with `<<expr=result>>` annotations where it calls a tool.
        toolset: the tools and call format, or None (the text is all model text).
        row: the dataset row, to replay the annotations in its environment's episode.

    Returns:
        {input_ids, completion_mask, tool_calls}: the ids, the mask of the tokens trained on, the number of calls.
    """
    if toolset is None:
        segments, kw = [(completion, True)], {}
    else:
        episode = None if toolset.env_class is Calculator else toolset.episode(row)
        if episode is not None and episode.observation is not None:
            prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + episode.observation}]
        segments = split_annotated(completion, toolset.format.name, tokenizer.eos_token, episode)
        kw = toolset.chat_template_kwargs()
    trace = tokenize_trace(tokenizer, prompt, segments, chat_template_kwargs=kw)
    return {
        "input_ids": trace["prompt_ids"] + trace["completion_ids"],
        "completion_mask": [0] * len(trace["prompt_ids"]) + trace["env_mask"],
        "tool_calls": sum(not model_text for _, model_text in segments),  # sft.check_calls; not a training column
    }
