"""`make bench-tools` (`scripts/bench.py --tools-only`): the tool loop against plain generate and the decode ceiling,
the GRPO step with tools, chat-format GRPO through our loop against TRL's environment loop, and OpenEnv's transport
-> metrics/bench_tools.json and BENCHMARKS-tools.md. The chat-format comparison (chat_loops_side_by_side) runs the
same starting policy, tokenizer and rows through grpo.ToolRollout as rollout_func and through
GRPOTrainer(environment_factory=...), timed per optimizer step."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from agentrl.common import write_json
from agentrl.data import load_jsonl

from .decoding import LOOP_GOAL, LOOP_ROUNDS, tool_loop_speed
from .measure import machine, median_range, stats
from .openenv_transport import openenv_transport
from .training import grpo_step_stats, timed_grpo

TOOL_LOOP_KEYS = (
    "loop_tokens_per_second",
    "loop_sampled_tokens_per_second",
    "plain_tokens_per_second",
    "ratio",
    "ceiling_tokens_per_second",
    "loop_fraction_of_ceiling",
    "loop_sampled_fraction_of_ceiling",
    "plain_fraction_of_ceiling",
)
CHAT_SIDE_KEYS = ("seconds_per_step", "rollout_tokens_per_second", "sampled_tokens_per_completion")


# --------------------------------------------------- chat-format GRPO: our tool loop against TRL's environment loop
CHAT_STEPS, CHAT_WARMUP = 4, 1  # chat-format GRPO steps per trainer, the first left out (~25 s each on 2 cores)


def _side_figures(side: dict) -> None:
    """Add seconds_per_step, rollout_tokens_per_second and sampled_tokens_per_completion to one side's result,
    from its timed steps (timed_grpo's)."""
    steps = side["steps"]
    side["seconds_per_step"] = statistics.median(x["step_s"] for x in steps)
    side["rollout_tokens_per_second"] = sum(x["tokens"] for x in steps) / sum(x["seconds"] for x in steps)
    side["sampled_tokens_per_completion"] = sum(x["tokens"] for x in steps) / sum(x["completions"] for x in steps)


def chat_loops_side_by_side(params, make_model, tok, rows: list[dict], steps: int, warmup: int) -> dict:
    """GRPO in the chat format (params with agent.format chat, in memory) through our tool loop as rollout_func
    (grpo.ToolRollout) and through TRL's own environment loop (what the grpo stage runs for chat), one after the
    other, each the stage's own trainer (grpo.build_trainer).

    Args:
        params: the validated params (agent.tools or agent.environment set).
        make_model: returns a fresh starting policy (called once per side).
        tok: a tokenizer with a tool-calling chat template.
        rows: the GRPO rows (message prompts).
        steps: optimizer steps per side.
        warmup: leading steps left out of the figures.

    Returns:
        {"steps", "warmup_steps", "mean_prompt_tokens", "ours": ..., "trl": ..., "step_time_ratio",
        "rollout_tokens_per_second_ratio"}: per side seconds per step, rollout tokens/s, sampled tokens and tool
        calls per completion; the ratios are ours / TRL's.
    """
    from agentrl.agent.tools import toolset_from_params
    from agentrl.config import Params
    from agentrl.stages import grpo

    p = Params.model_validate({**params.model_dump(), "agent": {**params.agent.model_dump(), "format": "chat"}})
    toolset = toolset_from_params(p.agent, tok.eos_token, p.environments)
    if toolset is None:
        raise SystemExit("bench: the chat-format comparison needs agent.tools or agent.environment")
    kw = toolset.chat_template_kwargs()
    # ToolRollout renders message prompts without the tools (the grpo stage hands chat to TRL): ours gets each prompt
    # rendered as TRL renders it, tools described
    rendered = [
        {**r, "prompt": tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False, **kw)}
        for r in rows
    ]
    prompt_tokens = statistics.mean(len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rendered)
    out: dict = {"steps": steps, "warmup_steps": warmup, "mean_prompt_tokens": prompt_tokens}
    with tempfile.TemporaryDirectory() as tmp:

        def config():
            args = grpo.grpo_config(p, output_dir=tmp, report_to="none")
            args.max_steps, args.save_strategy, args.logging_steps = steps, "no", 1
            return args

        trainer, timed = timed_grpo(p, config(), make_model(), tok, rendered, warmup, (grpo.ToolRollout(toolset), None))
        calls = [
            h["tools/tool_calls_per_problem"] for h in trainer.state.log_history if "tools/tool_calls_per_problem" in h
        ]
        out["ours"] = {"steps": timed, "tool_calls_per_completion": statistics.mean(calls[warmup:])}

        args = config()
        trainer, timed = timed_grpo(p, args, make_model(), tok, rows, warmup, grpo.rollout_plan(p, args, tok))
        calls = [h["tools/call_frequency"] for h in trainer.state.log_history if "tools/call_frequency" in h]
        out["trl"] = {"steps": timed, "tool_calls_per_completion": statistics.mean(calls[warmup:])}
    for side in ("ours", "trl"):
        _side_figures(out[side])
    out["step_time_ratio"] = out["ours"]["seconds_per_step"] / out["trl"]["seconds_per_step"]
    out["rollout_tokens_per_second_ratio"] = (
        out["ours"]["rollout_tokens_per_second"] / out["trl"]["rollout_tokens_per_second"]
    )
    return out


def chat_loops_speed(params, steps: int = CHAT_STEPS, warmup: int = CHAT_WARMUP) -> dict:
    """chat_loops_side_by_side on the policy GRPO starts from (grpo.starting_model) and the first GRPO prompts the
    run needs. The workspace's tokenizer keeps its template when it can render tool calls; otherwise (an inline-format
    pipeline's) it gets Qwen3's in memory, as the base stage gives a chat-format pipeline's tokenizer.

    Args:
        steps: optimizer steps per side.
    """
    from trl.chat_template_utils import qwen3_chat_template, supports_tool_calling

    from agentrl.modeling import STAGE_DIRS, load_tokenizer
    from agentrl.stages import grpo

    tok = load_tokenizer(STAGE_DIRS["sft"])
    if not supports_tool_calling(tok):
        tok.chat_template = qwen3_chat_template
    n = steps * grpo.check_batch(params) // params.grpo.trainer["num_generations"]
    rows = load_jsonl(grpo.DATA)[:n]
    return chat_loops_side_by_side(params, lambda: grpo.starting_model(params), tok, rows, steps, warmup)


def _chat_summary(chat_runs: list[dict]) -> dict:
    """chat_loops_speed's runs summarized: per side the stats of each figure and each run's tool calls per
    completion, and the stats of the two ratios.

    Args:
        chat_runs: one chat_loops_speed result per repeat.

    Returns:
        metrics/bench_tools.json's "chat_grpo".
    """
    return {
        "steps": CHAT_STEPS,
        "warmup_steps": CHAT_WARMUP,
        "mean_prompt_tokens": chat_runs[0]["mean_prompt_tokens"],
        **{
            side: {
                **{k: stats([x[side][k] for x in chat_runs]) for k in CHAT_SIDE_KEYS},
                "tool_calls_per_completion": [x[side]["tool_calls_per_completion"] for x in chat_runs],
            }
            for side in ("ours", "trl")
        },
        **{k: stats([x[k] for x in chat_runs]) for k in ("step_time_ratio", "rollout_tokens_per_second_ratio")},
    }


def tools_results(params, repeats: int, n: int) -> dict:
    """Every figure of `make bench-tools`, medians of `repeats` runs (OpenEnv's transport: one run of LOOP_ROUNDS
    paired rounds).

    Args:
        repeats: runs of each figure.

    Returns:
        What metrics/bench_tools.json holds.
    """
    runs = range(repeats)
    loops = [tool_loop_speed(params, n, ceiling=True) for _ in runs]
    grpo_runs = [grpo_step_stats(params) for _ in runs]
    chat_runs = [chat_loops_speed(params) for _ in runs]
    transport = openenv_transport(params)
    res = {
        "machine": machine(),
        "repeats": repeats,
        "problems": n,
        "tools": list(params.agent.tools),
        "tool_loop": {k: stats([x[k] for x in loops]) for k in TOOL_LOOP_KEYS},
        "tool_calls": loops[0]["tool_calls"],
        "grpo": {
            k: stats([x[k] for x in grpo_runs])
            for k in ("seconds_per_step", "generation_share", "rollout_tokens_per_second")
        },
        "chat_grpo": _chat_summary(chat_runs),
    }
    res["tool_loop"]["round_ratios"] = [r for x in loops for r in x["round_ratios"]]
    res["tool_loop_vs_plain_generate_ratio"] = res["tool_loop"]["ratio"]["median"]
    res["tool_loop_fraction_of_decode_ceiling"] = res["tool_loop"]["loop_fraction_of_ceiling"]["median"]
    res["plain_generate_fraction_of_decode_ceiling"] = res["tool_loop"]["plain_fraction_of_ceiling"]["median"]
    res["chat_grpo_step_time_ours_over_trl"] = res["chat_grpo"]["step_time_ratio"]["median"]
    res["chat_grpo_rollout_tokens_per_second_ours_over_trl"] = res["chat_grpo"]["rollout_tokens_per_second_ratio"][
        "median"
    ]
    res["openenv_transport"] = transport
    res["openenv_rollout_time_over_in_process"] = transport["ratio"]
    return res


def _tool_loop_rows(res: dict, params) -> list[str]:
    """BENCHMARKS-tools.md's rows on the tool loop, the GRPO step with tools and the decode ceiling."""
    t, g, mm = res["tool_loop"], res["grpo"], median_range
    return [
        f"| tool loop, tokens/s | {mm(t['loop_tokens_per_second'], '{:.0f}')} (sampled only: "
        f"{mm(t['loop_sampled_tokens_per_second'], '{:.0f}')}) | `agent.generate_with_tools`, {res['tool_calls']} "
        "calculator calls, each result appended to the KV cache |",
        f"| plain `generate`, tokens/s | {mm(t['plain_tokens_per_second'], '{:.0f}')} | one `model.generate` call "
        "per batch on the same prompts, no tool |",
        f"| **tool_loop_vs_plain_generate_ratio** | {mm(t['ratio'], '{:.2f}')} (goal ≥ {LOOP_GOAL}) | loop tokens/s ÷ "
        f"plain tokens/s: per run the median of {LOOP_ROUNDS} rounds of loop then plain, back to back (all rounds' "
        f"ratios: {', '.join(f'{x:.2f}' for x in t['round_ratios'])}) |",
        f"| GRPO optimizer step with tools | {mm(g['seconds_per_step'])} s | GRPOTrainer + the tool loop as "
        "rollout_func, params.yaml's config, steps 3–12 |",
        f"| GRPO share of a step spent generating | {mm(g['generation_share'], '{:.2f}')} | |",
        f"| GRPO rollout tokens/s | {mm(g['rollout_tokens_per_second'], '{:.0f}')} | tokens the policy sampled / "
        "rollout time |",
        f"| decode ceiling, tokens/s | {mm(t['ceiling_tokens_per_second'], '{:.0f}')} | bare batched greedy decode "
        "on the same model, prompts and batch: one prefill, then one forward per token with the KV cache and an "
        f"argmax, every prompt to {params.eval.max_new_tokens} tokens (no stopping, no tool) |",
        f"| **tool loop / decode ceiling** | {mm(t['loop_fraction_of_ceiling'], '{:.2f}')} (sampled only: "
        f"{mm(t['loop_sampled_fraction_of_ceiling'], '{:.2f}')}) | loop tokens/s ÷ ceiling tokens/s |",
        f"| plain `generate` / decode ceiling | {mm(t['plain_fraction_of_ceiling'], '{:.2f}')} | plain tokens/s ÷ "
        "ceiling tokens/s |",
    ]


def _chat_and_transport_rows(res: dict) -> list[str]:
    """BENCHMARKS-tools.md's rows on the chat-format comparison and OpenEnv's transport."""
    c, oe, mm = res["chat_grpo"], res["openenv_transport"], median_range
    timed_steps = f"steps {CHAT_WARMUP + 1}–{CHAT_STEPS}"
    return [
        f"| chat format, GRPO step: ours / TRL's | {mm(c['step_time_ratio'], '{:.2f}')} (ours "
        f"{mm(c['ours']['seconds_per_step'], '{:.1f}')} s, TRL's {mm(c['trl']['seconds_per_step'], '{:.1f}')} s) | "
        "params.yaml's grpo config with agent.format chat, the policy GRPO starts from and the same prompts; ours: "
        "the tool loop as rollout_func (grpo.ToolRollout), TRL's: GRPOTrainer(environment_factory=...); seconds "
        f"per optimizer step, {timed_steps} of each |",
        f"| chat format, rollout tokens/s: ours / TRL's | {mm(c['rollout_tokens_per_second_ratio'], '{:.2f}')} "
        f"(ours {mm(c['ours']['rollout_tokens_per_second'], '{:.0f}')}, TRL's "
        f"{mm(c['trl']['rollout_tokens_per_second'], '{:.0f}')}) | tokens the policy sampled ÷ seconds in the "
        f"trainer's `_generate` (both loops run inside it), {timed_steps}; "
        f"{c['ours']['sampled_tokens_per_completion']['median']:.0f} vs "
        f"{c['trl']['sampled_tokens_per_completion']['median']:.0f} sampled tokens per completion |",
        f"| **OpenEnv transport: rollout time over OpenEnv / in-process** | {oe['ratio']:.2f} (rounds: "
        f"{', '.join(f'{x:.2f}' for x in oe['round_ratios'])}; in-process {mm(oe['in_process_seconds'], '{:.2f}')} s, "
        f"OpenEnv {mm(oe['openenv_seconds'], '{:.2f}')} s) | `agent.generate_with_tools` on {oe['rollouts']} held-out "
        f"{oe['environment']} rows ({oe['tool_calls']} calls), the episodes in-process vs over OpenEnv "
        "(`agent.environment_url: serve`: a server subprocess on 127.0.0.1, one WebSocket session per completion); "
        "a params.model.tiny-sized policy forced to write the demonstrations, greedy, one torch thread; one run, "
        f"{LOOP_ROUNDS} rounds back to back, median of the paired ratios |",
    ]


def _chat_footnote(chat: dict) -> str:
    """The paragraph under the table: prompt length and each run's tool calls per completion in the chat format."""
    calls = {side: ", ".join(f"{x:.2f}" for x in chat[side]["tool_calls_per_completion"]) for side in ("ours", "trl")}
    no_calls = not any(x for side in ("ours", "trl") for x in chat[side]["tool_calls_per_completion"])
    return (
        f"Chat format: prompts of {chat['mean_prompt_tokens']:.0f} tokens on average (Qwen3's tool description; the "
        "base stage trains the tokenizer on it only when the pipeline runs in the chat format). Tool calls per "
        f"completion, one figure per run: ours: {calls['ours']}; TRL's: {calls['trl']}"
        + (
            ". Neither loop ran a tool here (a policy trained in the inline format does not write chat tool calls): "
            "this compares chat-format generation and the GRPO step, not tool turns."
            if no_calls
            else "."
        )
    )


def tools_only(params, repeats: int, n: int) -> None:
    """`make bench-tools`: tools_results -> metrics/bench_tools.json, and the table -> BENCHMARKS-tools.md and
    stdout.

    Args:
        repeats: runs of each figure.
    """
    res = tools_results(params, repeats, n)
    write_json("metrics/bench_tools.json", res)
    lines = [
        "# Benchmarks: the tool loop",
        "",
        f"Measured by `make bench-tools` on {res['machine']}; medians of {repeats} runs (min–max), on the GRPO "
        f"model and {n} held-out problems, greedy, batch {params.eval.batch_size}.",
        "",
        "| figure | value | how |",
        "|---|---|---|",
        *_tool_loop_rows(res, params),
        *_chat_and_transport_rows(res),
        "",
        _chat_footnote(res["chat_grpo"]),
    ]
    Path("BENCHMARKS-tools.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
