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
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch

from ..agent.linear_kernels import use_linear_kernels
from ..agent.loop import BrokenEnvironmentError, Rollout, check_broken_episodes, generate_with_tools, tool_stats
from ..agent.rewards import build_rewards
from ..agent.tools import toolset_from_params
from ..answers import answers_match, extract_answer, normalize_number
from ..common import get_logger, peak_rss_mb, torch_dtype, write_metrics
from ..config import Params, load_params_or_exit
from ..data import load_jsonl, write_jsonl
from ..envs.openenv_client import OpenEnvError
from ..envs.registry import ImportPathError, check_imports, episode_solved

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
    """Completions as [[(text, n_tokens)] * num_samples] per prompt, through the tool loop (agent.py).

    Args:
        batch_size: prompts per batch.
        temperature: 0 is greedy.
        num_samples: completions per prompt.
        toolset: the tools, or None.

    Returns:
        Per prompt, its samples as (text, n_tokens).
    """
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


def wilson_interval(successes: int, trials: int, z_score: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% with the default z).

    Args:
        trials: how many trials there were; (0, 0) when none.
        z_score: the normal quantile of the interval's confidence.

    Returns:
        (low, high), clipped to [0, 1].
    """
    if trials == 0:
        return (0.0, 0.0)
    share = successes / trials
    z_squared = z_score * z_score
    denominator = 1 + z_squared / trials
    centre = (share + z_squared / (2 * trials)) / denominator
    half_width = z_score * math.sqrt(share * (1 - share) / trials + z_squared / (4 * trials * trials)) / denominator
    return (max(0.0, centre - half_width), min(1.0, centre + half_width))


@dataclasses.dataclass
class _Tally:
    """The running counts score() turns into metrics, over the problems scored so far."""

    correct_first: int = 0  # problems whose first sample is correct
    answer_only: int = 0  # first samples with no worked step before the answer line
    formatted: int = 0  # samples with an extractable final answer
    tokens: list[int] = dataclasses.field(default_factory=list)  # completion tokens, every sample
    rewards: list[float] = dataclasses.field(default_factory=list)  # weighted reward, every sample
    pass_k: int = 0  # problems with at least one correct sample
    majority: int = 0  # problems whose most common final answer is correct
    by_steps: dict[str, list[int]] = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0, 0]))


def _weighted_rewards(funcs: list, weights: list[float], comps: list[str], truth: str, judged: list) -> list[float]:
    """Each sample's reward: the weighted sum of the reward functions (the environment's judgement as `solved`)."""
    extra = {"solved": judged} if any(j is not None for j in judged) else {}
    totals = [0.0] * len(comps)
    for func, weight in zip(funcs, weights):
        for index, value in enumerate(func(comps, ground_truth=[truth] * len(comps), **extra)):
            totals[index] += weight * value
    return totals


def _majority_correct(extracted: list, correct: list, judged: list, truth: str) -> bool:
    """Whether the most common final answer of a problem's samples counts as correct."""
    votes = collections.Counter(answer for answer in extracted if answer is not None)
    top = votes.most_common(1)[0][0] if votes else None
    if any(j is not None for j in judged):  # the environment judged each sample, not the answer against truth:
        # the most common final answer counts when every sample that gave it was solved (countdown: the answer
        # decides, so they agree; gridworld: the claim "goal" must have held in every episode that made it)
        return top is not None and all(ok for answer, ok in zip(extracted, correct) if answer == top)
    return top is not None and answers_match(top, truth)


def _tool_calls(rollout: Rollout) -> list[dict]:
    """A rollout's tool calls as predictions record them (a calculator call by its expression)."""
    return [
        {"expression": call["arguments"].get("expression"), "result": call["result"], "ok": call["ok"]}
        if list(call["arguments"]) == ["expression"]
        else {"name": call["name"], "arguments": call["arguments"], "result": call["result"], "ok": call["ok"]}
        for call in rollout.calls
    ]


def _score_problem(
    row: dict, outs: list[tuple[str, int]], funcs: list, weights: list[float], rolls: Optional[list], tally: _Tally
) -> dict:
    """Score one problem's samples into `tally` and return its prediction record.

    Args:
        row: the test row (id, question, ground_truth; optional steps, environment).
        outs: its samples as (text, n_tokens).
        funcs: the reward functions, weighted by `weights`.
        rolls: the tool loop's rollouts of these samples, or None when it ran without tools.
        tally: the running counts, updated in place.

    Returns:
        The prediction written to predictions.jsonl for this problem.
    """
    truth = normalize_number(row["ground_truth"])
    comps = [text for text, _ in outs]
    judged = (
        [episode_solved(row, c, roll.episode.env if roll.episode else None) for c, roll in zip(comps, rolls)]
        if rolls is not None
        else [None] * len(comps)
    )
    reward_totals = _weighted_rewards(funcs, weights, comps, truth, judged)
    extracted = [extract_answer(c) if j is None else final_line(c) for c, j in zip(comps, judged)]
    correct = [answers_match(answer, truth) if j is None else j for answer, j in zip(extracted, judged)]
    tally.correct_first += correct[0]
    tally.answer_only += comps[0].lstrip().startswith("####")  # no worked step before the answer line
    tally.formatted += sum(answer is not None for answer in extracted)
    tally.tokens += [num_tokens for _, num_tokens in outs]
    tally.rewards += reward_totals
    tally.pass_k += any(correct)
    tally.majority += _majority_correct(extracted, correct, judged, truth)
    steps = tally.by_steps[str(row.get("steps", "?"))]
    steps[0] += correct[0]
    steps[1] += 1
    prediction = {
        "id": row["id"],
        "question": row["question"],
        "completion": comps[0],
        "extracted": extracted[0],
        "ground_truth": truth,
        "correct": bool(correct[0]),
        "reward": round(reward_totals[0], 6),
        **({"samples": comps[1:], "samples_correct": correct[1:]} if len(comps) > 1 else {}),
        **({"environment": row["environment"]} if "environment" in row else {}),  # a mixture's member
    }
    if rolls is not None:
        prediction["tool_calls"] = _tool_calls(rolls[0])
        if judged[0] is not None:
            prediction["failed_tries"] = getattr(rolls[0].episode.env, "failed_tries", None)
        for roll in rolls:  # judged and read: each episode's environment may end (its optional close())
            if roll.episode is not None:
                roll.episode.close()
    return prediction


def _tool_metrics(preds: list[dict], rollouts: list[list[Rollout]]) -> dict:
    """Tool use (first sample per problem), accuracy with and without a call, and, for environment episodes,
    turns, failed tries and the share of solved episodes that recovered from a failed try."""
    metrics = {key: round(value, 4) for key, value in tool_stats([rolls[0] for rolls in rollouts]).items()}
    metrics["accuracy_with_tool"] = _rate([p["correct"] for p in preds if p["tool_calls"]])
    metrics["accuracy_without_tool"] = _rate([p["correct"] for p in preds if not p["tool_calls"]])
    if any("failed_tries" in p for p in preds):  # an environment episode per problem
        problems = len(preds)
        solved = [p for p in preds if p["correct"]]
        metrics["mean_turns"] = round(sum(len(p["tool_calls"]) for p in preds) / problems, 4)
        metrics["failed_tries_per_episode"] = round(sum(p.get("failed_tries") or 0 for p in preds) / problems, 4)
        metrics["recovered_share"] = _rate([bool(p.get("failed_tries")) for p in solved])
    return metrics


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
    Rollouts that acted in an environment with its own success rule (registry.episode_solved: countdown,
    gridworld, a custom get_reward) are judged by it; the metrics then add turns, failed tries and
    `recovered_share` (solved episodes that recovered from a failed try: the feedback-use figure).

    Args:
        samples: per row, its samples as (text, n_tokens).
        rewards: reward name -> weight (params grpo.rewards), reported as `average_reward` and per prediction.
        reward_kwargs: the reward functions' keyword arguments (params grpo.reward_kwargs).
        rollouts: the tool loop's rollouts of the same samples, or None (no tools).

    Returns:
        (metrics, predictions): metrics/eval_<name>.json's figures and one prediction per row.
    """
    funcs, weights = build_rewards(rewards, reward_kwargs)
    tally = _Tally()
    preds = [
        _score_problem(row, outs, funcs, weights, rollouts[index] if rollouts is not None else None, tally)
        for index, (row, outs) in enumerate(zip(rows, samples))
    ]
    problems = len(rows)
    per_problem = len(samples[0]) if samples else 1
    lo, hi = wilson_interval(tally.correct_first, problems)
    metrics = {
        "accuracy": tally.correct_first / problems if problems else 0.0,
        "accuracy_ci95": [round(lo, 4), round(hi, 4)],
        "average_reward": sum(tally.rewards) / len(tally.rewards) if tally.rewards else 0.0,
        "format_rate": tally.formatted / (problems * per_problem) if problems else 0.0,
        "num_samples": problems,
        "mean_completion_tokens": sum(tally.tokens) / len(tally.tokens) if tally.tokens else 0.0,
        "answer_only_rate": tally.answer_only / problems if problems else 0.0,
        "accuracy_by_steps": {
            steps: round(correct / total, 4) for steps, (correct, total) in sorted(tally.by_steps.items())
        },
    }
    if rollouts is not None:
        metrics.update(_tool_metrics(preds, rollouts))
    if per_problem > 1:
        metrics[f"pass@{per_problem}"] = tally.pass_k / problems
        metrics["majority_vote_accuracy"] = tally.majority / problems
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
    for prediction in preds:
        if "environment" not in prediction:
            raise ValueError(
                f"prediction {prediction.get('id')!r}: no 'environment', while other rows of the test set have one"
            )
        groups[prediction["environment"]].append(bool(prediction["correct"]))
    out = {}
    for name, flags in sorted(groups.items()):
        lo, hi = wilson_interval(sum(flags), len(flags))
        accuracy = sum(flags) / len(flags)
        out[name] = {"n": len(flags), "accuracy": accuracy, "accuracy_ci95": [round(lo, 4), round(hi, 4)]}
    return out


def final_line(text: str) -> Optional[str]:
    """The first line after the last `####` (an environment task's final answer, e.g. an expression), or None.

    Returns:
        The line, or None without a `####`.
    """
    if "####" not in text:
        return None
    lines = text.rsplit("####", 1)[1].strip().splitlines()
    return lines[0].strip() if lines else ""


def _rate(flags: list[bool]) -> Optional[float]:
    return round(sum(flags) / len(flags), 4) if flags else None


class EmptyEvalError(ValueError):
    """No problems to evaluate: the message names the file."""


def _load_for_eval(params: Params, stage: str, quantize: str) -> tuple:
    """The stage's model (int8-quantized on request; on the GPU when there is one and it is not int8) and tokenizer.

    Args:
        params: the run's params (model.precision, eval.linear_kernels).
        stage: base, sft, grpo or merged.
        quantize: none or int8.

    Returns:
        (model, tokenizer).
    """
    from ..modeling import load_policy

    model, tokenizer = load_policy(stage, dtype=torch_dtype(params.model.precision))
    if quantize == "int8":
        from .quantize import quantize_int8

        model = quantize_int8(model)
    if torch.cuda.is_available() and quantize != "int8":
        model = model.cuda()
    kernels = params.eval.linear_kernels
    if quantize == "int8":
        if kernels != "aten":
            log.info("eval.linear_kernels %s: the int8 model's layers run their own (FBGEMM) kernels", kernels)
    elif use_linear_kernels(
        model, kernels, params.eval.batch_size * params.eval.samples_per_problem, "eval.linear_kernels"
    ):
        log.info("eval.linear_kernels %s: the model's Linear layers run on oneDNN's packed kernels", kernels)
    return model, tokenizer


def _generate_rollouts(params: Params, name: str, model, tokenizer, rows: list[dict]) -> tuple[list, Any]:
    """The tool loop's rollouts for every test row, with params.eval's sampling settings.

    Args:
        params: the run's params (eval, agent, environments, seed).
        name: the evaluation's name (logs and the progress bar).
        model: the policy, in eval mode.

    Returns:
        (rollouts per row, the toolset or None when the policy has no tools).
    """
    settings = params.eval
    log.info(
        "%s: %d held-out problems, batch %d, %s, max_new_tokens %d, device %s",
        name,
        len(rows),
        settings.batch_size,
        "greedy" if settings.temperature == 0 else f"T={settings.temperature}",
        settings.max_new_tokens,
        next(model.parameters()).device,
    )
    toolset = toolset_from_params(params.agent, tokenizer.eos_token, params.environments)
    rollouts = generate_with_tools(
        model,
        tokenizer,
        [row["prompt"] for row in rows],
        toolset,
        settings.max_new_tokens,
        batch_size=settings.batch_size,
        temperature=settings.temperature,
        top_p=settings.top_p,
        num_samples=settings.samples_per_problem,
        seed=params.seed,
        desc=f"eval {name}",
        chat_template_kwargs=toolset.chat_template_kwargs() if toolset else None,
        rows=rows,
    )
    return rollouts, toolset


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
    """Evaluate a stage's model on the held-out test set; writes metrics/eval_<name>.json and
    eval/<name>/predictions.jsonl (and logs them to the trackers).

    Args:
        stage: whose model: base, sft, grpo or merged.
        name: the metrics name (default: the stage).
        quantize: none or int8 (the model is quantized before evaluation).
        model: a model already loaded (with `tokenizer`), instead of loading the stage's.
        tokenizer: the tokenizer of `model`.
        limit: evaluate only the first `limit` test rows.
        log_to_trackers: log the metrics and predictions to the trackers (W&B) too.

    Returns:
        The metrics written to metrics/eval_<name>.json.
    """
    name = name or stage
    check_imports(params)  # a typo in a module:attr stops here, before the model is loaded
    rows = load_jsonl(TEST)[:limit] if limit else load_jsonl(TEST)
    if not rows:  # an accuracy over zero problems is not a result
        raise EmptyEvalError(f"{TEST}: no problems to evaluate (the file holds no rows); re-run the prepare stage")
    if model is None:
        model, tokenizer = _load_for_eval(params, stage, quantize)
    model.eval()
    started = time.time()
    rollouts, toolset = _generate_rollouts(params, name, model, tokenizer, rows)
    elapsed = time.time() - started
    episodes = [roll for rolls in rollouts for roll in rolls]
    broken = [roll.broken for roll in episodes if roll.broken is not None]  # before any file is written
    check_broken_episodes(len(broken), len(episodes), next(iter(broken), None), params.agent.max_broken_share, name)
    samples = [[(roll.text, roll.num_tokens) for roll in rolls] for rolls in rollouts]
    metrics, preds = score(
        rows,
        samples,
        params.grpo.rewards,
        params.grpo.reward_kwargs.model_dump(),
        rollouts if toolset is not None else None,
    )
    metrics["tools"] = params.agent.environment or ",".join(params.agent.tools) or "none"
    if toolset is not None:
        metrics["broken_episodes"] = len(broken)  # counted apart from wrong answers; their accuracy is not the policy's
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
    """`python -m agentrl.stages.evaluate --stage STAGE`: exit status 1 with one line when the test set is empty,
    the OpenEnv server cannot be reached, or more episodes than agent.max_broken_share had a broken environment."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", required=True, choices=["base", "sft", "grpo", "merged"])
    ap.add_argument("--name", default=None, help="metrics name (default: the stage)")
    ap.add_argument("--quantize", default="none", choices=["none", "int8"])
    args = ap.parse_args()
    try:
        evaluate(load_params_or_exit(), args.stage, args.name, args.quantize)
    except (EmptyEvalError, BrokenEnvironmentError, OpenEnvError, ImportPathError) as error:  # each names its key/URL
        log.error("%s", error)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
