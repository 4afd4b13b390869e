"""`make bench`, `make bench-tools` and `make bench-repro` (scripts/bench.py calls `main`): the command line, and
`make bench`'s own run -> BENCHMARKS.md and metrics/bench.json. `python -m agentrl.benchmarks.bench` is the same
command (bench-repro's child processes run it so)."""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from agentrl.common import peak_rss_mb, write_json
from agentrl.config import load_params
from agentrl.data import load_jsonl

from .decoding import LOOP_GOAL, eval_speed, tool_loop_speed
from .measure import flops_per_token, machine, matmul_peak, median_range, mfu, model_dims, stats
from .training import STEPS, grpo_step_stats, sft_step_times

HELP = """`make bench`: performance measured side by side, as ratios, in one run on one machine.

Writes BENCHMARKS.md (table + how each figure was obtained) and metrics/bench.json. Each figure is the
median of --repeats runs (default 3) with min and max; the pipeline timings (full repro, GRPO-only
change) of --repro-repeats runs, made in a scratch copy of the repository so the workspace is untouched.
Needs a finished `dvc repro` (models/base, models/sft, models/grpo, data/prepared). Goals (reported,
never asserted): SFT ratio <= 1.25 (each trainer step paired with a plain PyTorch step on the same
batch), eval speed-up >= 10 (batched vs one problem at a time, on the SFT and GRPO models), no-op repro
<= 5 s, full repro <= 900 s.

    python scripts/bench.py [--repeats 3] [--repro-repeats 3] [--skip-dvc]
    python scripts/bench.py --merged-rollouts 8    # what grpo.merged_rollouts saves (8 steps per side)
"""

EVAL_STAGES = ("sft", "grpo")  # base runs every completion to eval.max_new_tokens: not the hard case
# BENCHMARKS.md's rows that get the model FLOPs/token and MFU columns: row label -> key of res["mfu"]["rows"]
MFU_ROWS = {
    "SFT step, ours": "sft_ours",
    "SFT step, plain PyTorch loop": "sft_plain_loop",
    "GRPO optimizer step": "grpo_step",
    "GRPO rollout tokens/s": "grpo_rollouts",
    "tool loop, generated tokens/s": "tool_loop",
    "plain `generate`, tokens/s": "plain_generate",
}


def _sft_figures(params, repeats: int) -> dict:
    """SFT step times with params.yaml's config and with TRL's defaults, each paired with a plain loop.

    Args:
        repeats: runs of each.

    Returns:
        metrics/bench.json's sft_step_seconds, sft_paired_ratios and the two headline ratios.
    """
    ours = [sft_step_times(params, False) for _ in range(repeats)]
    trl_default = [sft_step_times(params, True) for _ in range(repeats)]
    res: dict = {
        "sft_step_seconds": {
            "ours": stats([x["trainer"] for x in ours]),
            "plain_loop": stats([x["plain_loop"] for x in ours]),
            "trl_defaults": stats([x["trainer"] for x in trl_default]),
            "plain_loop_beside_trl_defaults": stats([x["plain_loop"] for x in trl_default]),
        },
        "sft_paired_ratios": {
            "ours": stats([x["paired_ratio"] for x in ours]),
            "trl_defaults": stats([x["paired_ratio"] for x in trl_default]),
        },
    }
    res["sft_tokens"] = {
        "tokens_per_step": stats([x["tokens_per_step"] for x in ours]),
        "mean_sequence_tokens": statistics.mean(x["mean_sequence_tokens"] for x in ours),
    }
    res["sft_vs_plain_loop_ratio"] = res["sft_paired_ratios"]["ours"]["median"]
    res["sft_trl_defaults_vs_plain_loop_ratio"] = res["sft_paired_ratios"]["trl_defaults"]["median"]
    return res


def _eval_stage_figures(params, n: int, stage: str, repeats: int) -> dict:
    """One stage's evaluation speed: batched, one at a time, and the ablation with one `generate` call per batch
    (loop.PRUNE_SHARE 2.0: ended rows never leave the batch).

    Args:
        stage: "sft" or "grpo".
        repeats: runs of each.

    Returns:
        batched, per_sample, batched_one_call_per_batch, speedup and identical_accuracy.
    """
    from agentrl.agent import loop as agent

    runs = [eval_speed(params, n, stage) for _ in range(repeats)]
    share, agent.PRUNE_SHARE = agent.PRUNE_SHARE, 2.0
    try:
        whole = [eval_speed(params, n, stage)["batched"] for _ in range(repeats)]
    finally:
        agent.PRUNE_SHARE = share
    figures = {
        k: {
            "problems_per_second": stats([x[k]["problems_per_second"] for x in runs]),
            "accuracy": runs[0][k]["accuracy"],
            "mean_completion_tokens": runs[0][k]["mean_completion_tokens"],
        }
        for k in ("batched", "per_sample")
    }
    figures["batched_one_call_per_batch"] = {
        "problems_per_second": stats([w["problems_per_second"] for w in whole]),
        "accuracy": whole[0]["accuracy"],
    }
    per_second = {k: figures[k]["problems_per_second"]["median"] for k in ("batched", "per_sample")}
    figures["speedup"] = per_second["batched"] / per_second["per_sample"]
    figures["identical_accuracy"] = all(x["batched"]["accuracy"] == x["per_sample"]["accuracy"] for x in runs) and all(
        w["accuracy"] == runs[0]["batched"]["accuracy"] for w in whole
    )
    return figures


def _loop_and_grpo_figures(params, n: int, repeats: int) -> dict:
    """The tool loop against plain generate, and the GRPO step."""
    loops = [tool_loop_speed(params, n) for _ in range(repeats)]
    res: dict = {
        "tool_loop": {
            k: stats([x[k] for x in loops])
            for k in ("loop_tokens_per_second", "plain_tokens_per_second", "loop_sampled_tokens_per_second", "ratio")
        }
    }
    for k in ("tool_calls", "mean_prompt_tokens", "mean_loop_tokens"):  # greedy: the same in every run
        res["tool_loop"][k] = loops[0][k]
    res["tool_loop_vs_plain_generate_ratio"] = res["tool_loop"]["ratio"]["median"]
    grpo_runs = [grpo_step_stats(params) for _ in range(repeats)]
    res["grpo"] = {
        k: stats([x[k] for x in grpo_runs])
        for k in ("seconds_per_step", "generation_share", "rollout_tokens_per_second", "rollout_tokens_per_step")
    }
    res["grpo"]["completions_per_step"] = (
        params.grpo.trainer["per_device_train_batch_size"] * params.grpo.trainer["gradient_accumulation_steps"]
    )
    return res


def _mfu_figures(params, res: dict) -> dict:
    """Model FLOPs per token and model FLOP utilisation of the SFT steps, decoding and the GRPO step, against this
    machine's fp32 matmul peak timed now (measure.matmul_peak). FLOPs from models/base's config (measure's PaLM
    accounting). The GRPO step counts one forward over prompt + completion to sample (two with a reference model,
    grpo.trainer.beta > 0) and one forward + backward to train, with the tool loop's mean prompt length: a lower
    bound (TRL's extra log-prob passes are left out).

    Args:
        params: the validated params (use_lora, beta, batch sizes).
        res: bench_results' figures so far (SFT, tool loop, GRPO).

    Returns:
        {"matmul_peak", "model_dims", "rows": {key: {"tokens_per_second", "flops_per_token", "mfu"}}}.
    """
    from transformers import AutoConfig

    from agentrl.modeling import STAGE_DIRS

    dims = model_dims(AutoConfig.from_pretrained(STAGE_DIRS["base"]), f"{STAGE_DIRS['base']}/config.json")
    peak = matmul_peak()
    sft_mode = "train_frozen" if params.sft.use_lora else "train"
    grpo_mode = "train_frozen" if params.grpo.use_lora else "train"
    loop, grpo = res["tool_loop"], res["grpo"]
    sft_tokens, sft_context = res["sft_tokens"]["tokens_per_step"]["median"], res["sft_tokens"]["mean_sequence_tokens"]
    decode_context = loop["mean_prompt_tokens"] + loop["mean_loop_tokens"] / 2  # the mean position a token sees
    sft_flops = flops_per_token(dims, sft_context, sft_mode)
    decode_flops = flops_per_token(dims, decode_context, "forward")
    completion = grpo["rollout_tokens_per_step"]["median"] / grpo["completions_per_step"]
    sequence = loop["mean_prompt_tokens"] + completion
    sampling_passes = 2 if params.grpo.trainer.get("beta", 0.0) > 0 else 1
    step_flops = sampling_passes * flops_per_token(dims, sequence / 2, "forward") + flops_per_token(
        dims, sequence, grpo_mode
    )
    throughput = {  # key -> (tokens/s, FLOPs per token)
        "sft_ours": (sft_tokens / res["sft_step_seconds"]["ours"]["median"], sft_flops),
        "sft_plain_loop": (sft_tokens / res["sft_step_seconds"]["plain_loop"]["median"], sft_flops),
        "grpo_step": (grpo["completions_per_step"] * sequence / grpo["seconds_per_step"]["median"], step_flops),
        "grpo_rollouts": (grpo["rollout_tokens_per_second"]["median"], decode_flops),
        "tool_loop": (loop["loop_tokens_per_second"]["median"], decode_flops),
        "plain_generate": (loop["plain_tokens_per_second"]["median"], decode_flops),
    }
    rows = {
        k: {"tokens_per_second": tps, "flops_per_token": f, "mfu": mfu(tps, f, peak["flops_per_second"])}
        for k, (tps, f) in throughput.items()
    }
    return {"matmul_peak": peak, "model_dims": dims, "rows": rows}


def bench_results(params, repeats: int, repro_repeats: int, skip_dvc: bool, n: int) -> dict:
    """Every figure of `make bench`.

    Args:
        repeats: runs of each figure.
        repro_repeats: runs of the GRPO-change and full repros.
        n: held-out problems for the evaluation and the tool loop.

    Returns:
        What metrics/bench.json holds.
    """
    res: dict = {"machine": machine(), "repeats": repeats, "repro_repeats": 0 if skip_dvc else repro_repeats}
    res.update(_sft_figures(params, repeats))
    res["eval_problems"] = n
    res["eval"] = {stage: _eval_stage_figures(params, n, stage, repeats) for stage in EVAL_STAGES}
    res["eval_batched_vs_per_sample_speedup"] = min(e["speedup"] for e in res["eval"].values())
    res.update(_loop_and_grpo_figures(params, n, repeats))
    res["mfu"] = _mfu_figures(params, res)
    res["peak_rss_mb_bench_process"] = peak_rss_mb()
    if not skip_dvc:
        from .pipeline import dvc_timings

        res.update(dvc_timings(params, repeats, repro_repeats))
    return res


def _sft_rows(res: dict) -> list[str]:
    """BENCHMARKS.md's SFT rows."""
    s, mm = res["sft_step_seconds"], median_range
    return [
        f"| SFT step, ours | {mm(s['ours'])} s | "
        "SFTTrainer with params.yaml's config: wall time from one step's end to the next "
        f"(data loading, collation, logging included), steps 6–{STEPS} |",
        f"| SFT step, plain PyTorch loop | {mm(s['plain_loop'])} s | "
        "forward (HF loss on the same collated labels) / backward / clip / fused AdamW on a second copy of the model, "
        "run on the same batch right after each trainer step |",
        f"| **sft_vs_plain_loop_ratio** | {mm(res['sft_paired_ratios']['ours'], '{:.2f}')} (goal ≤ 1.25) | "
        "median over steps of trainer step / paired plain step |",
        "| SFT step, TRL defaults | "
        f"{mm(s['trl_defaults'])} s (plain beside it {mm(s['plain_loop_beside_trl_defaults'])} s) | "
        "SFTConfig defaults (bf16 autocast where supported, gradient checkpointing on), same pairing |",
        f"| TRL defaults / plain loop | {mm(res['sft_paired_ratios']['trl_defaults'], '{:.2f}')} | |",
    ]


def _eval_rows(res: dict, params) -> list[str]:
    """BENCHMARKS.md's evaluation rows, four per stage and the headline speed-up."""
    n, mm, lines = res["eval_problems"], median_range, []
    for stage, e in res["eval"].items():
        lines += [
            f"| eval {stage}, batched | {mm(e['batched']['problems_per_second'], '{:.1f}')} problems/s | "
            f"{n} held-out problems, `eval.batch_size` {params.eval.batch_size}, left padding, greedy, "
            f"ended rows leave the batch; {e['batched']['mean_completion_tokens']:.1f} tokens per completion |",
            f"| eval {stage}, batched, one `generate` call per batch | "
            f"{mm(e['batched_one_call_per_batch']['problems_per_second'], '{:.1f}')} problems/s | "
            "ablation: every row computed until the batch's longest ends |",
            f"| eval {stage}, one at a time | {mm(e['per_sample']['problems_per_second'], '{:.1f}')} problems/s | "
            f"the same {n} problems at batch 1 (HelloAgents' way) |",
            f"| eval {stage} speed-up | {e['speedup']:.1f}× | identical accuracy: {e['identical_accuracy']} |",
        ]
    lines.append(
        f"| **eval_batched_vs_per_sample_speedup** | {res['eval_batched_vs_per_sample_speedup']:.1f}× (goal ≥ 10) | "
        "the smaller of the stages' speed-ups |"
    )
    return lines


def _grpo_and_loop_rows(res: dict, params) -> list[str]:
    """BENCHMARKS.md's GRPO and tool-loop rows."""
    g, loop, n, mm = res["grpo"], res["tool_loop"], res["eval_problems"], median_range
    return [
        f"| GRPO optimizer step | {mm(g['seconds_per_step'])} s, {g['completions_per_step']} completions | "
        "the grpo stage's trainer (grpo.build_trainer) with params.yaml's config, steps 3–12 |",
        f"| GRPO share of a step spent generating | {mm(g['generation_share'], '{:.2f}')} | rollout time / step time |",
        f"| GRPO rollout tokens/s | {mm(g['rollout_tokens_per_second'], '{:.0f}')} | "
        "tokens the policy sampled / rollout time (tool loop) |",
        "| tool loop, generated tokens/s | "
        f"{mm(loop['loop_tokens_per_second'], '{:.0f}')} "
        f"({mm(loop['loop_sampled_tokens_per_second'], '{:.0f}')} sampled) | "
        f"`agent.generate_with_tools` on the GRPO model, {n} held-out problems, batch {params.eval.batch_size}, "
        f"greedy, {loop['tool_calls']} tool calls |",
        f"| plain `generate`, tokens/s | {mm(loop['plain_tokens_per_second'], '{:.0f}')} | "
        "one `model.generate` call per batch on the same prompts, no tool |",
        f"| **tool_loop_vs_plain_generate_ratio** | {mm(loop['ratio'], '{:.2f}')} (goal ≥ {LOOP_GOAL}) | "
        "a call appends its result to the KV cache; nothing is re-encoded |",
    ]


def _dvc_rows(res: dict) -> list[str]:
    """BENCHMARKS.md's pipeline rows and the peak RSS and accuracy lines under the table."""
    change, mm = res["grpo_change_repro"], median_range
    change_over_full = change["seconds"]["median"] / res["full_repro_seconds"]["median"]
    return [
        f"| **noop_repro_seconds** | {mm(res['noop_repro_seconds'], '{:.2f}')} s (goal ≤ 5) | "
        "`dvc repro` with nothing changed |",
        f"| GRPO-only change | {mm(change['seconds'], '{:.0f}')} s; re-ran {', '.join(change['stages_rerun'])} | "
        "new `grpo.trainer.learning_rate`, then `dvc repro` |",
        f"| **full_repro_seconds** | {mm(res['full_repro_seconds'], '{:.0f}')} s (goal ≤ 900) | "
        "`dvc repro --force`: every stage, set-up excluded |",
        f"| GRPO-only change / full repro | {change_over_full:.2f} | |",
        "",
        "Peak RSS per stage (MiB, max over the full repros; each stage records its own): "
        + ", ".join(f"{k} {v:.0f}" for k, v in res["peak_rss_mb_per_stage"].items()),
        "",
        "Accuracies of the full repros (base / SFT / GRPO): "
        + "; ".join(
            f"{a['base_accuracy']:.3f} / {a['sft_accuracy']:.3f} / {a['grpo_accuracy']:.3f}"
            for a in res["full_repro_accuracies"]
        ),
    ]


def _with_mfu_columns(lines: list[str], res: dict) -> list[str]:
    """The table's rows with the model FLOPs/token and MFU cells appended (empty where a row has no throughput).

    Args:
        lines: table rows ("| label | value | how |") and, after the table, text lines (left as they are).

    Returns:
        The lines, each row with two more cells.
    """
    out = []
    for line in lines:
        if not line.startswith("| "):
            out.append(line)
            continue
        key = MFU_ROWS.get(line.split(" | ")[0].removeprefix("| "))
        row = res["mfu"]["rows"].get(key)
        out.append(line + (f" {row['flops_per_token']:.3g} | {row['mfu']:.2%} |" if row else "  |  |"))
    return out


def bench(params, repeats: int, repro_repeats: int, skip_dvc: bool, n: int) -> dict:
    """`make bench`: bench_results -> metrics/bench.json, and the table -> BENCHMARKS.md and stdout.

    Args and Returns: bench_results'.
    """
    res = bench_results(params, repeats, repro_repeats, skip_dvc, n)
    write_json("metrics/bench.json", res)
    text = bench_markdown(res, params)
    Path("BENCHMARKS.md").write_text(text)
    print(text)
    return res


def bench_markdown(res: dict, params) -> str:
    """BENCHMARKS.md from bench_results' figures (metrics/bench.json) and the params they were measured with."""
    peak = res["mfu"]["matmul_peak"]
    repros = res["repro_repeats"]
    timed = "no pipeline timings (--skip-dvc)" if not repros else (
        f"the full and GRPO-change repros run {repros} time{'s' if repros > 1 else ''} each, in a scratch copy of "
        "the repository"
    )  # fmt: skip
    lines = [
        "# Benchmarks",
        "",
        f"Measured by `make bench` on {res['machine']}. Each figure is the median of {res['repeats']} runs "
        f"(min–max); {timed}. Regenerate with `make bench`.",
        "",
        f"MFU: the model FLOPs a row's tokens/s achieves over this machine's fp32 matmul peak, measured in the same "
        f"run: {peak['flops_per_second'] / 1e9:.1f} GFLOP/s, a {peak['size']}×{peak['size']} `torch.matmul` "
        f"(median of {peak['runs']}). Model FLOPs/token from models/base's config, PaLM's accounting: 2N + attention "
        "per forward token, 6N (4N with LoRA: no weight gradients for frozen weights) + 3× attention per trained "
        "one; the GRPO step counts sampling and training over prompt + completion (a lower bound).",
        "",
        "| figure | value | how | model FLOPs/token | MFU |",
        "|---|---|---|---|---|",
        *_with_mfu_columns(
            [
                *_sft_rows(res),
                *_eval_rows(res, params),
                *_grpo_and_loop_rows(res, params),
                *(_dvc_rows(res) if repros else []),
            ],
            res,
        ),
    ]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """scripts/bench.py's flags.

    Returns:
        The parser (its help is HELP).
    """
    ap = argparse.ArgumentParser(description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--repro-repeats", type=int, default=3, help="runs of the full and GRPO-change repros")
    ap.add_argument("--eval-problems", type=int, default=None, help="default: the whole held-out set")
    ap.add_argument(
        "--skip-dvc", action="store_true", help="skip the dvc timings (no-op repro, GRPO-only change, full repro)"
    )
    ap.add_argument(
        "--tools-only",
        action="store_true",
        help="only the tool-loop figures (loop vs plain generate, GRPO step with tools): metrics/bench_tools.json",
    )
    ap.add_argument(
        "--reproducibility",
        action="store_true",
        help="only the cost of reproducibility.mode portable vs native (SFT and GRPO step times): "
        "metrics/bench_reproducibility.json",
    )
    ap.add_argument(
        "--merged-rollouts",
        type=int,
        metavar="STEPS",
        help="only what grpo.merged_rollouts saves: GRPO steps alternating between sampling from the PEFT model and "
        "from the LoRA merged into a plain copy, STEPS per side: metrics/bench_merged_rollouts.json",
    )
    ap.add_argument("--reproducibility-child", choices=["native", "portable"], help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> None:
    """Run what the flags ask for (see HELP).

    Args:
        argv: the arguments (None: sys.argv[1:]).
    """
    from .reproducibility import reproducibility_child, reproducibility_cost

    args = parser().parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.reproducibility_child:
        reproducibility_child(args.reproducibility_child)
        return
    if args.reproducibility:
        reproducibility_cost(args.repeats)
        return
    params = load_params()
    if args.merged_rollouts:
        from .training import merged_rollouts_cost

        merged_rollouts_cost(params, args.repeats, 2 * args.merged_rollouts)
        return
    n = args.eval_problems or len(load_jsonl("data/prepared/test.jsonl"))
    if args.tools_only:
        from .bench_tools import tools_only

        tools_only(params, args.repeats, n)
        return
    bench(params, args.repeats, args.repro_repeats, args.skip_dvc, n)


if __name__ == "__main__":
    main()
