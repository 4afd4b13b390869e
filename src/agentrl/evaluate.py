"""Stage `eval_<name>`: one evaluation code path for base, sft, grpo and the merged/quantized model.

Batched generation with left padding on the held-out data/prepared/test.jsonl, greedy by default;
answers extracted by the same function the rewards use. Writes metrics/eval_<name>.json and
eval/<name>/predictions.jsonl.

    python -m agentrl.evaluate --stage sft
    python -m agentrl.evaluate --stage merged --quantize int8 --name merged_int8
"""
from __future__ import annotations

import argparse
import collections
import math
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from .common import get_logger, peak_rss_mb, torch_dtype, write_json
from .config import Params, load_params_or_exit
from .data import load_jsonl, write_jsonl
from .rewards import answers_match, build_rewards, extract_answer, normalize_number

TEST = "data/prepared/test.jsonl"
log = get_logger("eval")


PRUNE_SHARE = 0.5  # a generate call returns once this share of its rows has ended; they leave the batch


class _RowsEnded(StoppingCriteria):
    """Stops a `generate` call once `share` of its rows have produced eos since token `start`."""

    def __init__(self, start: int, eos: int, share: float):
        self.start, self.eos, self.share = start, eos, share

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        ended = (input_ids[:, self.start:] == self.eos).any(dim=1)
        return torch.full_like(ended, bool(ended.float().mean() >= self.share))


@torch.inference_mode()
def generate(model, tokenizer, prompts: list[list[dict]], batch_size: int, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, num_samples: int = 1, seed: int = 0,
             desc: str = "generate") -> list[list[tuple[str, int]]]:
    """Completions for chat prompts: [[(text, n_tokens)] * num_samples] per prompt, in input order.

    Prompts are sorted by length and batched with left padding; greedy when temperature == 0. `generate`
    alone keeps computing every row of a batch until its longest completion ends; here a call returns
    once PRUNE_SHARE of its rows have ended, those rows leave the batch and its KV cache, and the rest go
    on from the cache. Greedy output is the same as one `generate` call per batch (tested).
    """
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out: list[Optional[list]] = [None] * len(texts)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    torch.manual_seed(seed)
    gen_kw = dict(do_sample=temperature > 0, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
                  return_dict_in_generate=True)
    if temperature > 0:
        gen_kw.update(temperature=temperature, top_p=top_p, top_k=0)
    for start in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        idx = order[start:start + batch_size]
        enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        ids, mask, cache = enc["input_ids"], enc["attention_mask"], None
        prompt_len = ids.shape[1]
        rows = list(range(len(idx) * num_samples))  # row r: sample r % k of prompt idx[r // k]
        ended: dict[int, list[int]] = {}
        made = 0
        while True:
            res = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                                 max_new_tokens=max_new_tokens - made,
                                 num_return_sequences=num_samples if cache is None else 1,
                                 stopping_criteria=StoppingCriteriaList([_RowsEnded(ids.shape[1], eos, PRUNE_SHARE)]),
                                 **gen_kw)
            seqs, cache = res.sequences, res.past_key_values
            new = seqs[:, ids.shape[1]:]
            made += new.shape[1]
            if mask.shape[0] != seqs.shape[0]:  # the first call expanded each prompt into its samples
                mask = mask.repeat_interleave(num_samples, dim=0)
            done = (new == eos).any(dim=1) | (made >= max_new_tokens)
            for j in torch.nonzero(done).flatten().tolist():
                ended[rows[j]] = seqs[j, prompt_len:].tolist()
            keep = torch.nonzero(~done).flatten()
            if keep.numel() == 0:
                break
            # a kept row has not ended, so all its new tokens are real: extend its mask; drop ended rows
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], new.shape[1])], dim=1)[keep]
            ids, rows = seqs[keep], [rows[j] for j in keep.tolist()]
            cache.batch_select_indices(keep)
        for j, i in enumerate(idx):
            samples = []
            for k in range(num_samples):
                toks = ended[j * num_samples + k]
                n = toks.index(eos) + 1 if eos in toks else len(toks)
                samples.append((tokenizer.decode(toks[:n], skip_special_tokens=True), n))
            out[i] = samples
    return out  # type: ignore[return-value]


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def score(rows: list[dict], samples: list[list[tuple[str, int]]], rewards: dict[str, float],
          reward_kwargs: dict) -> tuple[dict, list[dict]]:
    """Metrics + per-sample predictions from test rows and their generated samples (pure; unit-tested)."""
    funcs, weights = build_rewards(rewards, reward_kwargs)
    preds, correct_first, fmt, tokens, rew, answer_only = [], 0, 0, [], [], 0
    pass_k, majority = 0, 0
    by_steps: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row, outs in zip(rows, samples):
        truth = normalize_number(row["ground_truth"])
        comps = [t for t, _ in outs]
        r_total = [0.0] * len(comps)
        for f, w in zip(funcs, weights):
            for i, v in enumerate(f(comps, ground_truth=[truth] * len(comps))):
                r_total[i] += w * v
        extracted = [extract_answer(c) for c in comps]
        ok = [answers_match(e, truth) for e in extracted]
        correct_first += ok[0]
        answer_only += comps[0].lstrip().startswith("####")  # no worked step before the answer line
        fmt += sum(e is not None for e in extracted)
        tokens += [n for _, n in outs]
        rew += r_total
        pass_k += any(ok)
        votes = collections.Counter(e for e in extracted if e is not None)
        majority += bool(votes) and answers_match(votes.most_common(1)[0][0], truth)
        key = str(row.get("steps", "?"))
        by_steps[key][0] += ok[0]
        by_steps[key][1] += 1
        preds.append({"id": row["id"], "question": row["question"], "completion": comps[0], "extracted": extracted[0],
                      "ground_truth": truth, "correct": bool(ok[0]), "reward": round(r_total[0], 6),
                      **({"samples": comps[1:], "samples_correct": ok[1:]} if len(comps) > 1 else {})})
    n = len(rows)
    k = len(samples[0]) if samples else 1
    lo, hi = wilson_interval(correct_first, n)
    metrics = {
        "accuracy": correct_first / n if n else 0.0,
        "accuracy_ci95": [round(lo, 4), round(hi, 4)],
        "average_reward": sum(rew) / len(rew) if rew else 0.0,
        "format_rate": fmt / (n * k) if n else 0.0,
        "num_samples": n,
        "mean_completion_tokens": sum(tokens) / len(tokens) if tokens else 0.0,
        "answer_only_rate": answer_only / n if n else 0.0,
        "accuracy_by_steps": {s: round(c / t, 4) for s, (c, t) in sorted(by_steps.items())},
    }
    if k > 1:
        metrics[f"pass@{k}"] = pass_k / n
        metrics["majority_vote_accuracy"] = majority / n
    return metrics, preds


def evaluate(params: Params, stage: str, name: Optional[str] = None, quantize: str = "none",
             model=None, tokenizer=None, limit: Optional[int] = None, log_to_trackers: bool = True) -> dict:
    from .modeling import load_policy

    name = name or stage
    e = params.eval
    rows = load_jsonl(TEST)[:limit] if limit else load_jsonl(TEST)
    if model is None:
        dtype = torch_dtype(params.model.precision)
        model, tokenizer = load_policy(stage, dtype=dtype)
        if quantize == "int8":
            from .export import quantize_int8

            model = quantize_int8(model)
        if torch.cuda.is_available() and quantize != "int8":
            model = model.cuda()
    model.eval()
    log.info("%s: %d held-out problems, batch %d, %s, max_new_tokens %d, device %s", name, len(rows), e.batch_size,
             "greedy" if e.temperature == 0 else f"T={e.temperature}", e.max_new_tokens,
             next(model.parameters()).device)
    t0 = time.time()
    samples = generate(model, tokenizer, [r["prompt"] for r in rows], e.batch_size, e.max_new_tokens,
                       e.temperature, e.top_p, e.samples_per_problem, params.seed, desc=f"eval {name}")
    elapsed = time.time() - t0
    metrics, preds = score(rows, samples, params.grpo.rewards, params.grpo.reward_kwargs.model_dump())
    metrics.update({"samples_per_second": round(len(rows) / elapsed, 3), "eval_seconds": round(elapsed, 2),
                    "stage": stage, "quantize": quantize})
    write_jsonl(Path("eval") / name / "predictions.jsonl", preds)
    metrics["peak_rss_mb"] = peak_rss_mb()
    write_json(f"metrics/eval_{name}.json", metrics)
    if log_to_trackers:
        from .tracking import log_eval_to_wandb

        log_eval_to_wandb(params, name, metrics, preds)
    log.info("%s: accuracy %.3f (95%% CI %.3f-%.3f), format %.3f, %.1f problems/s", name, metrics["accuracy"],
             *metrics["accuracy_ci95"], metrics["format_rate"], metrics["samples_per_second"])
    return metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", required=True, choices=["base", "sft", "grpo", "merged"])
    ap.add_argument("--name", default=None, help="metrics name (default: the stage)")
    ap.add_argument("--quantize", default="none", choices=["none", "int8"])
    a = ap.parse_args()
    evaluate(load_params_or_exit(), a.stage, a.name, a.quantize)


if __name__ == "__main__":
    main()
