"""Stage `compare`: base/sft/grpo accuracy side by side with a paired significance test.

The test pairs the SFT and GRPO predictions on the same held-out problems: exact McNemar (two-sided
binomial test on the discordant pairs) for the p-value, and a seeded paired bootstrap for the 95%
confidence interval of grpo - sft. Writes metrics/compare.json and metrics/accuracy_by_stage.csv
(the accuracy-per-stage plot).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
from pathlib import Path

from ..common import get_logger, read_json, write_metrics
from ..config import load_params_or_exit
from ..data import load_jsonl

STAGES = ("base", "sft", "grpo")
TOOL_KEYS = ("tool_use_rate", "tool_calls_per_problem", "tool_error_rate")
log = get_logger("compare")


def mcnemar_exact(only_before: int, only_after: int) -> float:
    """Two-sided exact McNemar p-value for the discordant pairs (McNemar's b and c).

    Args:
        only_before: pairs right before and wrong after.
        only_after: pairs wrong before and right after.

    Returns:
        The p-value (1.0 without discordant pairs).
    """
    discordant = only_before + only_after
    if discordant == 0:
        return 1.0
    fewer = min(only_before, only_after)
    tail = sum(math.comb(discordant, i) for i in range(fewer + 1)) / 2**discordant
    return min(1.0, 2 * tail)


def paired_bootstrap_ci(before: list[int], after: list[int], seed: int, resamples: int = 2000) -> tuple[float, float]:
    """95% CI of mean(after) - mean(before) over problems resampled with replacement (pairs kept).

    Args:
        before: 1/0 correctness per problem, before.

    Returns:
        (low, high) of the difference in accuracy.
    """
    problems = len(before)
    rng = random.Random(seed)
    diffs = [later - earlier for earlier, later in zip(before, after)]
    stats = sorted(sum(diffs[rng.randrange(problems)] for _ in range(problems)) / problems for _ in range(resamples))
    return stats[int(0.025 * resamples)], stats[int(0.975 * resamples) - 1]


def paired_test(before: dict[str, bool], after: dict[str, bool], seed: int) -> dict:
    """Compare correctness of two systems on the same problem ids.

    Args:
        before: problem id -> correct, the earlier system (e.g. SFT).
        after: problem id -> correct, the later one (e.g. GRPO).

    Returns:
        n, difference, only_before_correct, only_after_correct, p_value (exact McNemar), ci95 (paired bootstrap),
        test. ValueError when the two share no problem id.
    """
    ids = sorted(set(before) & set(after))
    if not ids:
        raise ValueError("no common problem ids between the two prediction files")
    was = [int(before[i]) for i in ids]
    now = [int(after[i]) for i in ids]
    only_before = sum(1 for earlier, later in zip(was, now) if earlier and not later)
    only_after = sum(1 for earlier, later in zip(was, now) if later and not earlier)
    lo, hi = paired_bootstrap_ci(was, now, seed)
    return {
        "n": len(ids),
        "difference": (sum(now) - sum(was)) / len(ids),
        "only_before_correct": only_before,
        "only_after_correct": only_after,
        "p_value": mcnemar_exact(only_before, only_after),
        "ci95": [round(lo, 4), round(hi, 4)],
        "test": "exact McNemar; paired bootstrap CI (2000 resamples)",
    }


def read_predictions(path: str | Path, required: tuple[str, ...] = ("id", "correct")) -> list[dict]:
    """The rows of an evaluation's predictions file (`eval/<stage>/predictions.jsonl`, or a copy gzipped as
    `.jsonl.gz`, as docs/envs keeps them), each a JSON object with at least the `required` keys. A bad line is a
    ValueError naming the file and the line (what scripts/paired_test.py and scripts/gridworld_failures.py read).

    Args:
        path: the predictions file (.jsonl or .jsonl.gz).
        required: the keys every row must have.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None
            if not isinstance(row, dict) or any(k not in row for k in required):
                raise ValueError(f"{path}:{number}: expected a JSON object with {', '.join(map(repr, required))}")
            rows.append(row)
    return rows


def correctness(stage: str) -> dict[str, bool]:
    """problem id -> correct, from a stage's eval/<stage>/predictions.jsonl.

    Args:
        stage: base, sft or grpo.
    """
    return {r["id"]: bool(r["correct"]) for r in load_jsonl(Path("eval") / stage / "predictions.jsonl")}


def paired_by_environment(before: list[dict], after: list[dict], seed: int) -> dict[str, dict]:
    """The paired test per task of a mixture (envs/mixture.py): predictions grouped by their `environment`.

    Args:
        before: the SFT predictions (`id`, `correct`, `environment`).
        after: the GRPO predictions of the same problems.

    Returns:
        environment -> paired_test's result on its problems plus `sft_accuracy` and `grpo_accuracy` over them;
        {} when the predictions carry no `environment` (a single task).
    """
    names = sorted({r["environment"] for r in before + after if "environment" in r})
    out = {}
    for name in names:
        was = {r["id"]: bool(r["correct"]) for r in before if r.get("environment") == name}
        now = {r["id"]: bool(r["correct"]) for r in after if r.get("environment") == name}
        ids = set(was) & set(now)
        test = paired_test(was, now, seed)
        out[name] = {
            "sft_accuracy": sum(was[i] for i in ids) / len(ids),
            "grpo_accuracy": sum(now[i] for i in ids) / len(ids),
            **test,
        }
    return out


def main() -> None:
    """The compare stage: accuracy per stage and the paired tests -> metrics/compare.json."""
    params = load_params_or_exit()
    evals = {s: read_json(f"metrics/eval_{s}.json") for s in STAGES}
    acc = {s: evals[s]["accuracy"] for s in STAGES}
    sft_vs_grpo = paired_test(correctness("sft"), correctness("grpo"), params.seed)
    base_vs_sft = paired_test(correctness("base"), correctness("sft"), params.seed)
    out = {
        **{f"{s}_accuracy": acc[s] for s in STAGES},
        "sft_minus_base": acc["sft"] - acc["base"],
        "grpo_minus_sft": acc["grpo"] - acc["sft"],
        # as text in scientific notation: `dvc metrics show` / `dvc exp show` round numbers to 0.0 (4e-69 -> 0.0);
        # the number is diagnostics/compare.json's grpo_vs_sft.p_value
        "p_value": f"{sft_vs_grpo['p_value']:.2e}",
        "ci95": sft_vs_grpo["ci95"],
        "grpo_vs_sft": sft_vs_grpo,
        "sft_vs_base": base_vs_sft,
        "grpo_vs_base": paired_test(correctness("base"), correctness("grpo"), params.seed),
        # tool use before/after GRPO (absent when the pipeline runs without tools)
        **{f"{s}_{k}": evals[s][k] for s in ("sft", "grpo") for k in TOOL_KEYS if k in evals[s]},
    }
    preds = {s: load_jsonl(Path("eval") / s / "predictions.jsonl") for s in ("sft", "grpo")}
    if by_task := paired_by_environment(preds["sft"], preds["grpo"], params.seed):  # a mixture: per task
        out["grpo_vs_sft_by_environment"] = by_task
    write_metrics("metrics/compare.json", out)
    with open("metrics/accuracy_by_stage.csv", "w", newline="") as table:
        writer = csv.writer(table)
        writer.writerow(["stage", "accuracy"])
        for stage in STAGES:
            writer.writerow([stage, round(acc[stage], 4)])
    log.info(
        "accuracy base %.3f -> sft %.3f -> grpo %.3f; grpo-sft %+.3f (95%% CI %+.3f..%+.3f, p=%.2g)",
        acc["base"],
        acc["sft"],
        acc["grpo"],
        out["grpo_minus_sft"],
        *out["ci95"],
        sft_vs_grpo["p_value"],
    )
    if "grpo_tool_use_rate" in out:
        log.info(
            "tool use sft %.3f -> grpo %.3f (calls per problem %.2f -> %.2f)",
            out["sft_tool_use_rate"],
            out["grpo_tool_use_rate"],
            out["sft_tool_calls_per_problem"],
            out["grpo_tool_calls_per_problem"],
        )


if __name__ == "__main__":
    main()
