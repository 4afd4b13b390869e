#!/usr/bin/env python
"""`make bench`: performance measured side by side, as ratios, in one run on one machine.

Writes BENCHMARKS.md (table + how each figure was obtained) and metrics/bench.json. Each figure is the
median of --repeats runs (default 3) with min and max. Needs a finished `dvc repro` (models/base,
models/sft, data/prepared). Goals (reported, never asserted): SFT ratio <= 1.25, eval speed-up >= 10,
no-op repro <= 5 s, full repro <= 900 s.

    python scripts/bench.py [--repeats 3] [--skip-full-repro]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from agentrl.common import write_json  # noqa: E402
from agentrl.config import load_params  # noqa: E402
from agentrl.data import load_jsonl  # noqa: E402

STEPS = 20


def stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": len(xs)}


def sft_trainer_step_time(params, trl_defaults: bool) -> float:
    """Seconds per optimizer step of SFTTrainer (steps 5..STEPS, warm-up excluded)."""
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from agentrl import sft
    from agentrl.modeling import STAGE_DIRS, load_model, load_tokenizer

    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"
    ds = load_dataset("json", data_files=sft.DATA, split="train").select(range(params.sft.per_device_train_batch_size * STEPS))
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as tmp:
        if trl_defaults:  # what a plain TRL script gets: library defaults except batch/steps
            args = SFTConfig(output_dir=tmp, per_device_train_batch_size=params.sft.per_device_train_batch_size,
                             max_steps=STEPS, report_to="none", save_strategy="no", logging_steps=1000,
                             use_cpu=not torch.cuda.is_available())  # bf16 stays at TRL's default
        else:
            args = sft.sft_config(params, output_dir=tmp, report_to="none")
            args.max_steps, args.save_strategy, args.logging_steps = STEPS, "no", 1000
        trainer = SFTTrainer(model=load_model(STAGE_DIRS["base"]), args=args, train_dataset=ds,
                             processing_class=tok, peft_config=sft.peft_config(params), callbacks=[Timer()])
        trainer.train()
    return statistics.median(times[5:])


def plain_loop_step_time(params) -> float:
    """The floor: forward/backward/AdamW step on the same model, same batches, no trainer."""
    from agentrl.modeling import STAGE_DIRS, load_model, load_tokenizer

    tok = load_tokenizer(STAGE_DIRS["base"])
    tok.padding_side = "right"
    model = load_model(STAGE_DIRS["base"])
    if params.sft.use_lora:
        from peft import get_peft_model

        from agentrl.sft import peft_config

        model = get_peft_model(model, peft_config(params))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=params.sft.learning_rate)
    rows = load_jsonl("data/prepared/sft_train.jsonl")
    bs = params.sft.per_device_train_batch_size
    times = []
    for step in range(STEPS):
        batch = rows[step * bs:(step + 1) * bs]
        texts = [tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=False) for r in batch]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        t = time.perf_counter()
        loss = model(**enc, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), params.sft.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times[5:])


def eval_speed(params, n: int) -> dict:
    from agentrl.evaluate import generate, score
    from agentrl.modeling import load_policy

    model, tok = load_policy("sft")
    model.eval()
    rows = load_jsonl("data/prepared/test.jsonl")[:n]
    prompts = [r["prompt"] for r in rows]
    out = {}
    for name, bs in (("batched", params.eval.batch_size), ("per_sample", 1)):
        t = time.perf_counter()
        samples = generate(model, tok, prompts, bs, params.eval.max_new_tokens, desc=name)
        dt = time.perf_counter() - t
        m, _ = score(rows, samples, {"accuracy": 1.0}, {})
        out[name] = {"problems_per_second": n / dt, "accuracy": m["accuracy"]}
    return out


def timed(cmd: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--eval-problems", type=int, default=64)
    ap.add_argument("--skip-dvc", action="store_true",
                    help="skip the dvc timings (no-op repro, GRPO-only change); report the rest")
    a = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    params = load_params()
    R = range(a.repeats)
    res: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                            f"torch {torch.__version__}", "repeats": a.repeats}

    ours = [sft_trainer_step_time(params, False) for _ in R]
    trl_default = [sft_trainer_step_time(params, True) for _ in R]
    plain = [plain_loop_step_time(params) for _ in R]
    res["sft_step_seconds"] = {"ours": stats(ours), "trl_defaults": stats(trl_default), "plain_loop": stats(plain)}
    res["sft_vs_plain_loop_ratio"] = statistics.median(ours) / statistics.median(plain)
    res["sft_trl_defaults_vs_plain_loop_ratio"] = statistics.median(trl_default) / statistics.median(plain)

    ev = [eval_speed(params, a.eval_problems) for _ in R]
    res["eval"] = {k: {"problems_per_second": stats([e[k]["problems_per_second"] for e in ev]),
                       "accuracy": ev[0][k]["accuracy"]} for k in ("batched", "per_sample")}
    res["eval_batched_vs_per_sample_speedup"] = (res["eval"]["batched"]["problems_per_second"]["median"]
                                                 / res["eval"]["per_sample"]["problems_per_second"]["median"])
    res["eval_identical_accuracy"] = all(e["batched"]["accuracy"] == e["per_sample"]["accuracy"] for e in ev)

    g = json.loads(Path("metrics/grpo_train.json").read_text()) if Path("metrics/grpo_train.json").exists() else {}
    if g:
        res["grpo"] = {k: g.get(k) for k in ("seconds_per_step", "completions_per_step", "generation_seconds_share",
                                             "rollout_tokens_per_second")}

    dvc = str(Path(sys.executable).parent / "dvc")
    if not a.skip_dvc:
        res["noop_repro_seconds"] = stats([timed([dvc, "repro"])[0] for _ in R])
    if not a.skip_dvc:
        with tempfile.TemporaryDirectory() as tmp:  # GRPO-only change, on a copy of params
            backup = Path(tmp) / "params.yaml"
            shutil.copy("params.yaml", backup)
            try:
                text = Path("params.yaml").read_text()
                lr = params.grpo.learning_rate
                Path("params.yaml").write_text(text.replace(f"learning_rate: {lr:.1e}".replace("e-0", "e-"),
                                                            f"learning_rate: {lr * 1.5:.2e}"))
                secs, out = timed([dvc, "repro"])
                res["grpo_change_repro"] = {"seconds": secs, "stages_rerun": [ln.split("'")[1] for ln in out.splitlines()
                                                                              if ln.startswith("Running stage")]}
            finally:
                shutil.copy(backup, "params.yaml")
                timed([dvc, "repro"])
    rt = {}
    for stage, f in (("base", "base"), ("sft", "sft_train"), ("grpo", "grpo_train")):
        p = Path(f"metrics/{f}.json")
        if p.exists():
            rt[stage] = json.loads(p.read_text()).get("runtime_s")
    res["stage_runtime_seconds"] = rt
    res["peak_rss_mb_bench_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    write_json("metrics/bench.json", res)

    s = res["sft_step_seconds"]
    lines = [
        "# Benchmarks", "", f"Measured by `make bench` on {res['machine']}; each figure is the median of "
        f"{a.repeats} runs (min–max).", "",
        "| figure | value | how |", "|---|---|---|",
        f"| SFT step, ours | {s['ours']['median']:.3f} s ({s['ours']['min']:.3f}–{s['ours']['max']:.3f}) | SFTTrainer with params.yaml's config, median of steps 6–{STEPS} |",
        f"| SFT step, TRL defaults | {s['trl_defaults']['median']:.3f} s | SFTConfig defaults (bf16 autocast where supported) |",
        f"| SFT step, plain PyTorch loop | {s['plain_loop']['median']:.3f} s | forward/backward/AdamW on the same model and batch size |",
        f"| **sft_vs_plain_loop_ratio** | {res['sft_vs_plain_loop_ratio']:.2f} (goal ≤ 1.25) | ours / plain loop |",
        f"| TRL defaults / plain loop | {res['sft_trl_defaults_vs_plain_loop_ratio']:.2f} | |",
        f"| eval batched | {res['eval']['batched']['problems_per_second']['median']:.1f} problems/s | `eval.batch_size` with left padding, greedy |",
        f"| eval one at a time | {res['eval']['per_sample']['problems_per_second']['median']:.1f} problems/s | batch 1 (HelloAgents' way) |",
        f"| **eval_batched_vs_per_sample_speedup** | {res['eval_batched_vs_per_sample_speedup']:.1f}× (goal ≥ 10) | identical accuracy: {res['eval_identical_accuracy']} |",
    ]
    if "noop_repro_seconds" in res:
        lines += [
            f"| **noop_repro_seconds** | {res['noop_repro_seconds']['median']:.2f} s (goal ≤ 5) | `dvc repro` with nothing changed |",
            f"| GRPO-only change | {res['grpo_change_repro']['seconds']:.1f} s, re-ran {', '.join(res['grpo_change_repro']['stages_rerun'])} | `grpo.learning_rate` × 1.5, then `dvc repro` |",
        ]
    if g:
        lines.append(f"| GRPO step | {g.get('seconds_per_step')} s, {g.get('completions_per_step')} completions | metrics/grpo_train.json |")
    lines += ["", "Stage runtimes of the last `dvc repro` (s): " + json.dumps(rt), ""]
    Path("BENCHMARKS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
