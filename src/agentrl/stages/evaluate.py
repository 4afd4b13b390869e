"""Stage `eval_<name>`: one evaluation code path for base, sft, grpo and the merged/quantized model.

Batched generation with left padding on the held-out data/prepared/test.jsonl, greedy by default;
answers extracted by the same function the rewards use. Writes metrics/eval_<name>.json and
eval/<name>/predictions.jsonl.

    python -m agentrl.stages.evaluate --stage sft
    python -m agentrl.stages.evaluate --stage merged --quantize int8 --name merged_int8
"""

from __future__ import annotations

import argparse
import collections
import math
import time
from pathlib import Path
from typing import Optional

import torch

from ..agent.loop import Rollout, generate_with_tools, tool_stats
from ..agent.rewards import build_rewards
from ..agent.tools import episode_solved, toolset_from_params
from ..answers import answers_match, extract_answer, normalize_number
from ..common import get_logger, peak_rss_mb, torch_dtype, write_metrics
from ..config import Params, load_params_or_exit
from ..data import load_jsonl, write_jsonl

TEST = "data/prepared/test.jsonl"
log = get_logger("eval")


def generate(
    model,
    tokenizer,
    prompts: list[list[dict]],
    batch_size: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    num_samples: int = 1,
    seed: int = 0,
    desc: str = "generate",
    toolset=None,
) -> list[list[tuple[str, int]]]:
    """Completions as [[(text, n_tokens)] * num_samples] per prompt, through the tool loop (agent.py)."""
    rolls = generate_with_tools(
        model,
        tokenizer,
        prompts,
        toolset,
        max_new_tokens,
        batch_size=batch_size,
        temperature=temperature,
        top_p=top_p,
        num_samples=num_samples,
        seed=seed,
        desc=desc,
    )
    return [[(r.text, r.num_tokens) for r in rs] for rs in rolls]


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def score(
    rows: list[dict],
    samples: list[list[tuple[str, int]]],
    rewards: dict[str, float],
    reward_kwargs: dict,
    rollouts: Optional[list[list[Rollout]]] = None,
) -> tuple[dict, list[dict]]:
    """Metrics + per-sample predictions from test rows and their generated samples (pure; unit-tested).
    With `rollouts` (the tool loop's output for the same samples) predictions record each tool call and
    the metrics add tool_use_rate, tool_calls_per_problem and tool_error_rate (first sample per problem).
    Rollouts that acted in an environment with its own success rule (tools.episode_solved: countdown,
    gridworld, a custom get_reward) are judged by it; the metrics then add turns, failed tries and
    `recovered_share` (solved episodes that recovered from a failed try: the feedback-use figure)."""
    funcs, weights = build_rewards(rewards, reward_kwargs)
    preds, correct_first, fmt, tokens, rew, answer_only = [], 0, 0, [], [], 0
    pass_k, majority = 0, 0
    by_steps: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row, outs in zip(rows, samples):
        truth = normalize_number(row["ground_truth"])
        comps = [t for t, _ in outs]
        judged = (
            [episode_solved(row, c, r.episode.env if r.episode else None) for c, r in zip(comps, rollouts[len(preds)])]
            if rollouts is not None
            else [None] * len(comps)
        )
        extra = {"solved": judged} if any(j is not None for j in judged) else {}
        r_total = [0.0] * len(comps)
        for f, w in zip(funcs, weights):
            for i, v in enumerate(f(comps, ground_truth=[truth] * len(comps), **extra)):
                r_total[i] += w * v
        extracted = [extract_answer(c) if j is None else final_line(c) for c, j in zip(comps, judged)]
        ok = [answers_match(e, truth) if j is None else j for e, j in zip(extracted, judged)]
        correct_first += ok[0]
        answer_only += comps[0].lstrip().startswith("####")  # no worked step before the answer line
        fmt += sum(e is not None for e in extracted)
        tokens += [n for _, n in outs]
        rew += r_total
        pass_k += any(ok)
        votes = collections.Counter(e for e in extracted if e is not None)
        top = votes.most_common(1)[0][0] if votes else None
        if any(j is not None for j in judged):  # the environment judged each sample, not the answer against truth:
            # the most common final answer counts when every sample that gave it was solved (countdown: the answer
            # decides, so they agree; gridworld: the claim "goal" must have held in every episode that made it)
            majority += top is not None and all(o for e, o in zip(extracted, ok) if e == top)
        else:
            majority += top is not None and answers_match(top, truth)
        key = str(row.get("steps", "?"))
        by_steps[key][0] += ok[0]
        by_steps[key][1] += 1
        preds.append(
            {
                "id": row["id"],
                "question": row["question"],
                "completion": comps[0],
                "extracted": extracted[0],
                "ground_truth": truth,
                "correct": bool(ok[0]),
                "reward": round(r_total[0], 6),
                **({"samples": comps[1:], "samples_correct": ok[1:]} if len(comps) > 1 else {}),
                **({"environment": row["environment"]} if "environment" in row else {}),  # a mixture's member
            }
        )
        if rollouts is not None:
            first = rollouts[len(preds) - 1][0]
            preds[-1]["tool_calls"] = [
                {"expression": c["arguments"].get("expression"), "result": c["result"], "ok": c["ok"]}
                if list(c["arguments"]) == ["expression"]
                else {"name": c["name"], "arguments": c["arguments"], "result": c["result"], "ok": c["ok"]}
                for c in first.calls
            ]
            if judged[0] is not None:
                preds[-1]["failed_tries"] = getattr(first.episode.env, "failed_tries", None)
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
    if rollouts is not None:
        metrics.update({k: round(v, 4) for k, v in tool_stats([r[0] for r in rollouts]).items()})
        metrics["accuracy_with_tool"] = _rate([p["correct"] for p in preds if p["tool_calls"]])
        metrics["accuracy_without_tool"] = _rate([p["correct"] for p in preds if not p["tool_calls"]])
        if any("failed_tries" in p for p in preds):  # an environment episode per problem
            solved = [p for p in preds if p["correct"]]
            metrics["mean_turns"] = round(sum(len(p["tool_calls"]) for p in preds) / n, 4)
            metrics["failed_tries_per_episode"] = round(sum(p.get("failed_tries") or 0 for p in preds) / n, 4)
            metrics["recovered_share"] = _rate([bool(p.get("failed_tries")) for p in solved])
    if k > 1:
        metrics[f"pass@{k}"] = pass_k / n
        metrics["majority_vote_accuracy"] = majority / n
    if any("environment" in p for p in preds):  # a mixture of tasks: each task's own accuracy
        metrics["accuracy_by_environment"] = accuracy_by_environment(preds)
    return metrics, preds


def accuracy_by_environment(preds: list[dict]) -> dict[str, dict]:
    """Accuracy per task of a mixture (envs/mixture.py): the predictions grouped by their row's `environment`.

    Args:
        preds: score()'s predictions, each with `id`, `correct` (first sample) and `environment`.

    Returns:
        environment -> {n, accuracy, accuracy_ci95 (Wilson 95%)}, sorted by name. ValueError naming the first
        prediction without an `environment` (a mixture's rows all carry one).
    """
    groups: dict[str, list[bool]] = collections.defaultdict(list)
    for p in preds:
        if "environment" not in p:
            raise ValueError(f"prediction {p.get('id')!r}: no 'environment', while other rows of the test set have one")
        groups[p["environment"]].append(bool(p["correct"]))
    out = {}
    for name, flags in sorted(groups.items()):
        lo, hi = wilson_interval(sum(flags), len(flags))
        accuracy = sum(flags) / len(flags)
        out[name] = {"n": len(flags), "accuracy": accuracy, "accuracy_ci95": [round(lo, 4), round(hi, 4)]}
    return out


def final_line(text: str) -> Optional[str]:
    """The first line after the last `####` (an environment task's final answer, e.g. an expression), or None."""
    if "####" not in text:
        return None
    lines = text.rsplit("####", 1)[1].strip().splitlines()
    return lines[0].strip() if lines else ""


def _rate(flags: list[bool]) -> Optional[float]:
    return round(sum(flags) / len(flags), 4) if flags else None


class EmptyEvalError(ValueError):
    """No problems to evaluate: the message names the file."""


def evaluate(
    params: Params,
    stage: str,
    name: Optional[str] = None,
    quantize: str = "none",
    model=None,
    tokenizer=None,
    limit: Optional[int] = None,
    log_to_trackers: bool = True,
) -> dict:
    from ..modeling import load_policy

    name = name or stage
    e = params.eval
    rows = load_jsonl(TEST)[:limit] if limit else load_jsonl(TEST)
    if not rows:  # an accuracy over zero problems is not a result
        raise EmptyEvalError(f"{TEST}: no problems to evaluate (the file holds no rows); re-run the prepare stage")
    if model is None:
        dtype = torch_dtype(params.model.precision)
        model, tokenizer = load_policy(stage, dtype=dtype)
        if quantize == "int8":
            from .quantize import quantize_int8

            model = quantize_int8(model)
        if torch.cuda.is_available() and quantize != "int8":
            model = model.cuda()
    model.eval()
    log.info(
        "%s: %d held-out problems, batch %d, %s, max_new_tokens %d, device %s",
        name,
        len(rows),
        e.batch_size,
        "greedy" if e.temperature == 0 else f"T={e.temperature}",
        e.max_new_tokens,
        next(model.parameters()).device,
    )
    toolset = toolset_from_params(params.agent, tokenizer.eos_token, params.environments)
    t0 = time.time()
    rollouts = generate_with_tools(
        model,
        tokenizer,
        [r["prompt"] for r in rows],
        toolset,
        e.max_new_tokens,
        batch_size=e.batch_size,
        temperature=e.temperature,
        top_p=e.top_p,
        num_samples=e.samples_per_problem,
        seed=params.seed,
        desc=f"eval {name}",
        chat_template_kwargs=toolset.chat_template_kwargs() if toolset else None,
        rows=rows,
    )
    elapsed = time.time() - t0
    samples = [[(r.text, r.num_tokens) for r in rs] for rs in rollouts]
    metrics, preds = score(
        rows,
        samples,
        params.grpo.rewards,
        params.grpo.reward_kwargs.model_dump(),
        rollouts if toolset is not None else None,
    )
    metrics["tools"] = params.agent.environment or ",".join(params.agent.tools) or "none"
    metrics.update(
        {
            "samples_per_second": round(len(rows) / elapsed, 3),
            "eval_seconds": round(elapsed, 2),
            "stage": stage,
            "quantize": quantize,
        }
    )
    write_jsonl(Path("eval") / name / "predictions.jsonl", preds)
    metrics["peak_rss_mb"] = peak_rss_mb()
    write_metrics(f"metrics/eval_{name}.json", metrics)
    if log_to_trackers:
        from ..tracking import log_eval_to_wandb

        log_eval_to_wandb(params, name, metrics, preds)
    log.info(
        "%s: accuracy %.3f (95%% CI %.3f-%.3f), format %.3f, %.1f problems/s",
        name,
        metrics["accuracy"],
        *metrics["accuracy_ci95"],
        metrics["format_rate"],
        metrics["samples_per_second"],
    )
    return metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", required=True, choices=["base", "sft", "grpo", "merged"])
    ap.add_argument("--name", default=None, help="metrics name (default: the stage)")
    ap.add_argument("--quantize", default="none", choices=["none", "int8"])
    a = ap.parse_args()
    try:
        evaluate(load_params_or_exit(), a.stage, a.name, a.quantize)
    except EmptyEvalError as e:
        log.error("%s", e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
