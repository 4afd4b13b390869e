"""`make gpu-check` (scripts/gpu_check.sh -> scripts/gpu_check.py calls `main`): the recipe's code paths on one CUDA
GPU, offline, in one go, as one table (HELP has the rows); `--cpu-smoke` runs the same sequence on the CPU
(tests/test_gpu_check.py). The helper rows run as `python -m agentrl.benchmarks.gpu_check --_stand-in DIR` and
`--_tool-speed` in the scratch copy (gpu_check_setup.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from agentrl.experiments.scratch import copy_repo

from .gpu_check_setup import ROOT, SIZES, check_params, helper_row, size_of

HELP = """GPU check: the recipe's code paths on one CUDA GPU, offline, in one go, as one table.

    python scripts/gpu_check.py [--out DIR] [--budget SECONDS]      # needs a CUDA GPU (exit 2 without one)
    python scripts/gpu_check.py --cpu-smoke [--out DIR]             # same sequence, tiny model, CPU only
    python scripts/gpu_check.py --cpu-full-size [--out DIR]         # `make rehearse`: the 0.6B-sized model on CPU

Everything runs in a scratch copy (src/, configs/, params.yaml): the repository's params.yaml and outputs are
never touched, and nothing is fetched (HF_HUB_OFFLINE=1; no hub model, no hub data set). The params are
params.yaml with configs/recipes/qwen3-0.6b-gsm8k.yaml applied (the recipe's LoRA, GRPO, chat template and
agent settings), then overridden for a local, short run: `data.source: synthetic`, `model.base_model`: a
randomly initialised Qwen3-0.6B-sized model built here (hidden 1024, 28 layers, 16/8 heads, head_dim 128,
intermediate 3072, tied embeddings, Qwen3-0.6B's 151,936-row vocabulary: the project's tokenizer trained on
the synthetic data, padded with never-produced filler tokens so the embedding, LM head and log-prob costs are
the real model's), `distributed.num_processes: 1`, a few optimizer steps. Rows:

  1. recipe: prepare, stand-in model, `agentrl.stages.base` on the local directory (bf16, sdpa), LoRA SFT and
     GRPO-LoRA (`accelerate launch` of agentrl.stages.sft / .grpo, configs/accelerate/single.yaml), evaluation;
  2. DeepSpeed ZeRO-2 and ZeRO-3 (configs/accelerate/zero2.yaml, zero3.yaml, 1 process): SFT + GRPO;
  3. vLLM colocate rollouts (grpo.trainer.use_vllm, vllm_mode colocate), if `import vllm` works;
  4. export (merge + verify) and the int8 evaluation (bitsandbytes on CUDA, if it imports);
  5. the tool loop's tokens/s (agent.generate_with_tools) against plain `generate` on the same prompts.

Each row has its own timeout and all rows share a time budget (--budget); a failed row never stops the others
(a row whose input a failed row should have made is 'skipped'). Each row's peak RSS is its largest process's
(the kernel's maximum resident set of the row's process tree, os.wait4); the training rows' notes compare it, less
the RSS of an interpreter that imported the same libraries, with the memory plan (`make memory-plan`, device cpu).
The table goes to stdout and to DIR/gpu_check.md + DIR/gpu_check.json, the logs to DIR/logs.tar.gz. Exit code 0
when no row failed, else 1.

--cpu-smoke runs the same sequence on the CPU with a tiny model and tiny step counts, so the script's own logic is
tested without a GPU (tests/test_gpu_check.py); --cpu-full-size (`make rehearse`) runs it with the 0.6B-sized
stand-in in fp32 (2 SFT steps of 2 examples, one GRPO step sampling 2 x 32 tokens). On the CPU the ZeRO rows run
2 processes over gloo, and vLLM is skipped (CUDA-only). The plan is given the data's longest SFT example and
prompt as its sequence lengths.
"""

BASELINE = "baseline: interpreter + libraries"  # its peak RSS is what the training rows' plan comparison subtracts
HELPER = ["-m", "agentrl.benchmarks.gpu_check"]  # the helper rows, run with the scratch copy's src/ on PYTHONPATH


# ------------------------------------------------------------------------------------------ the run
class Check:
    """One GPU check: the scratch copy it runs in, the rows run so far and their table."""

    def __init__(self, args):
        """Make the scratch copy (src/, configs/, dvc.yaml) and the environment every row runs with.

        Args:
            args: the parsed flags (cpu_smoke, out, budget, python).
        """
        self.size_key = size_of(args)
        self.cpu = self.size_key != "gpu"
        self.size = SIZES[self.size_key]
        self.out = Path(args.out).resolve()
        self.logs = self.out / "logs"
        self.deadline = time.time() + (args.budget or self.size["budget"])
        self.py = args.python
        self.rows: list[dict] = []
        self.status: dict[str, str] = {}
        self.planned: dict[str, tuple[str, dict]] = {}  # training row -> (plan phase, its params overrides)
        self.work = Path(tempfile.mkdtemp(prefix="agentrl-gpu-check-"))
        tiny = self.size_key == "cpu"
        self.stand_in = str(self.work / "stand-in" / ("tiny-random" if tiny else "qwen3-0.6b-sized-random"))
        self.params = check_params(self.size_key, self.stand_in)
        # dvc.yaml: the training stages' resume fingerprint hashes the code deps it lists (stage.code_digest)
        copy_repo(ROOT, self.work, only=("src", "configs", "dvc.yaml"))
        self.env = {
            **os.environ,
            "PYTHONPATH": str(self.work / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PATH": str(Path(self.py).parent) + os.pathsep + os.environ.get("PATH", ""),
        }
        if self.cpu:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
            # Peak RSS should count the tensors a step holds, as the memory plan does. glibc raises its mmap threshold
            # each time an mmapped block is freed (mallopt(3)), after which freed activations of up to 32 MiB stay in
            # its heap and later ones are not laid into them: one SFT step of the 0.6B stand-in then peaked 2.1 GiB
            # above its live tensors (docs/rehearsal/probe_results.txt). Setting the threshold (to glibc's default)
            # turns that off: freed blocks go back to the kernel and peak RSS = weights + peak live tensors.
            self.env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
        self.logs.mkdir(parents=True, exist_ok=True)

    def params_with(self, overrides: dict | None = None) -> dict:
        """The check's params with a row's overrides (a copy; the check's own stay as they are).

        Args:
            overrides: dotted key -> value, or None.
        """
        import copy

        from agentrl.experiments.overrides import set_value

        p = copy.deepcopy(self.params)
        for k, v in (overrides or {}).items():
            set_value(p, k, v)
        return p

    def write_params(self, overrides: dict | None = None) -> None:
        """Write the scratch copy's params.yaml: the check's params with a row's overrides.

        Args:
            overrides: dotted key -> value, or None.
        """
        import yaml

        (self.work / "params.yaml").write_text(yaml.safe_dump(self.params_with(overrides), sort_keys=False))

    def metric(self, name: str) -> dict:
        """A stage's headline metrics merged with its diagnostics (common.read_metrics), or this script's own
        metrics/gpu_check_*.json; {} when nothing was written.

        Args:
            name: the metrics file's name without .json (e.g. "sft_train", "gpu_check_stand_in").
        """
        from agentrl.common import diagnostics_path, read_metrics

        f = self.work / "metrics" / f"{name}.json"
        if not f.is_file():
            return {}
        return read_metrics(f) if diagnostics_path(f).is_file() else json.loads(f.read_text())

    def add(self, path, status, seconds=None, tps=None, note="", peak_rss=None) -> None:
        """Record one row of the table and print it.

        Args:
            status: "ok", "fail" or "skipped".
            seconds: its wall time, or None.
            tps: its tokens/s, or None.
            note: what it measured or why it failed ("|" becomes "/": a table cell).
            peak_rss: the peak RSS in bytes of its largest process, or None.
        """
        note = note.replace("|", "/")  # a table cell
        row = {"path": path, "status": status, "seconds": seconds, "tokens_per_s": tps, "peak_rss_bytes": peak_rss}
        self.rows.append({**row, "note": note})
        self.status[path] = status
        sec = "" if seconds is None else f"{seconds:.1f}s"
        rss = "" if peak_rss is None else f"{peak_rss / 2**30:.2f} GiB"
        print(f"[gpu_check] {path}: {status} {sec} {rss} {note}", flush=True)

    def run(self, path, cmd, timeout, needs=(), skip=None, overrides=None, clean=(), after=None) -> None:
        """Run one row: `cmd` in the scratch copy with its own timeout (and the shared budget); `after()` turns
        its metrics into (tokens/s, note). Never raises.

        Args:
            timeout: its own limit in seconds (the budget left may cut it).
            needs: rows that must be "ok" first (else this one is skipped).
            skip: a reason to skip it, or None.
            overrides: the row's params overrides (write_params).
            after: returns (tokens/s, note) from the row's metrics, or None.
        """
        missing = [n for n in needs if self.status.get(n) != "ok"]
        if skip:
            return self.add(path, "skipped", note=skip)
        if missing:
            return self.add(path, "skipped", note=f"needs '{missing[0]}'")
        left = self.deadline - time.time()
        if left < 15:
            return self.add(path, "skipped", note="time budget spent (--budget)")
        timeout = min(timeout, left)
        for c in clean:
            shutil.rmtree(self.work / c, ignore_errors=True)
        self.write_params(overrides)
        log = self.logs / (re.sub(r"[^A-Za-z0-9.-]+", "_", path).strip("_") + ".log")
        t0 = time.time()
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(map(str, cmd)) + "\n")
            fh.flush()
            proc = subprocess.Popen(
                cmd, cwd=self.work, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            rc, rss = wait_with_peak_rss(proc, timeout)
        secs = time.time() - t0
        if rc is None:
            return self.add(path, "fail", secs, note=f"timeout after {timeout:.0f}s (log: {log.name})", peak_rss=rss)
        if rc:
            return self.add(path, "fail", secs, note=f"exit {rc}: {last_error(log)} (log: {log.name})", peak_rss=rss)
        try:
            tps, note = after() if after else (None, "")
        except Exception as e:  # a metrics file missing or malformed: the row ran but did not report
            return self.add(path, "fail", secs, note=f"ran, but its metrics are unreadable: {e!r}", peak_rss=rss)
        self.add(path, "ok", secs, tps, note, peak_rss=rss)

    # ---------------------------------------------------------------------------- rows' metrics
    def mfu_note(self, tokens_per_second, mode: str, context: float) -> str:
        """A row's model FLOPs per token and MFU against the GPU's bf16 matmul peak the stand-in row measured (an
        fp32 one on the CPU with --cpu-smoke), as a note's tail.

        Args:
            tokens_per_second: the row's tokens/s (None: the row reported none, and gets no MFU).
            mode: measure.flops_per_token's mode, or "grpo" (a sampling forward and a training pass per token).
            context: the positions a token attends to (the sequence length when training).

        Returns:
            "; 4.1e+09 FLOPs/token, MFU 12.3% of the bf16 peak", or "".
        """
        from .measure import flops_per_token, mfu

        if not tokens_per_second:
            return ""
        info = self.metric("gpu_check_stand_in")
        dims, peak = info["model_dims"], info["matmul_peak"]
        if mode == "grpo":
            train = "train_frozen" if self.params["grpo"]["use_lora"] else "train"
            flops = flops_per_token(dims, context / 2, "forward") + flops_per_token(dims, context, train)
        else:
            flops = flops_per_token(dims, context, mode)
        share = mfu(tokens_per_second, flops, peak["flops_per_second"])
        return f"; {flops:.3g} FLOPs/token, MFU {share:.1%} of the {peak['dtype']} peak"

    def stand_in_after(self):
        """The stand-in model: parameters and vocabulary (no tokens/s)."""
        return None, "{parameters:,} parameters, vocab {vocab_size:,}".format(**self.metric("gpu_check_stand_in"))

    def base_after(self):
        """The base stage on the local directory: the digest it recorded instead of a hub commit."""
        return None, f"resolved {self.metric('base')['resolved_commit']} (offline, no hub lookup)"

    def sft_after(self):
        """An SFT row: tokens/s = samples/s x mean example tokens; steps, step time, loss, launch."""
        m, info = self.metric("sft_train"), self.metric("gpu_check_stand_in")
        sps = m.get("train_samples_per_second") or 0
        tps = sps * info["mean_sft_tokens"] if info.get("mean_sft_tokens") else None
        train = "train_frozen" if self.params["sft"]["use_lora"] else "train"
        return tps, (
            f"{m['steps']} steps, {m['seconds_per_step']} s/step, loss {fmt(m['first_loss'])} -> "
            f"{fmt(m['final_loss'])}, {launch_kind(m)}; tokens/s = samples/s x mean example tokens"
            + self.mfu_note(tps, train, info.get("mean_sft_tokens"))
        )

    def grpo_after(self):
        """A GRPO row: tokens/s = completion tokens / step time; steps, completions, rollout speed, launch."""
        m = self.metric("grpo_train")
        length = m.get("completion_length_last") or 0
        tps = m["completions_per_step"] * length / m["seconds_per_step"] if m.get("seconds_per_step") else None
        roll = f", rollout {m['rollout_tokens_per_second']:.0f} tok/s" if m.get("rollout_tokens_per_second") else ""
        return tps, (
            f"{m['steps']} steps, {m['seconds_per_step']} s/step, {m['completions_per_step']} completions/step, "
            f"mean length {fmt(length)}{roll}, {launch_kind(m)}; tokens/s = completion tokens / step time"
            + self.mfu_note(tps, "grpo", length)  # prompts left out: a lower bound
        )

    def eval_after(self, name):
        """An evaluation row's (tokens/s, note) reader.

        Args:
            name: the evaluated stage ("grpo").

        Returns:
            A function of no arguments, as Check.run's `after`.
        """

        def after():
            m = self.metric(f"eval_{name}")
            return m["samples_per_second"] * m["mean_completion_tokens"], (
                f"accuracy {m['accuracy']:.3f} on {self.size['eval_n']} problems "
                f"(random weights: ~0 expected), {m['samples_per_second']:.2f} problems/s"
            )

        return after

    def export_after(self):
        """The export row: the merge check (max logit difference, identical greedy completions)."""
        m = self.metric("export")
        same = f"{m['greedy_identical_count']}/{m['num_prompts']}"
        return None, f"merge verified: max abs logit diff {m['max_abs_logit_diff']:.2e}, greedy identical {same}"

    def quant_after(self):
        """The int8 row: int8 against full-precision problems/s and the accuracy delta."""
        q, m8 = self.metric("quantize"), self.metric("eval_merged_int8")
        tps = q["int8_samples_per_second"] * m8.get("mean_completion_tokens", 0)
        return tps, (
            f"{q['int8_backend']}: int8 {q['int8_samples_per_second']:.2f} vs full "
            f"{q['merged_samples_per_second']:.2f} problems/s (ratio {q['int8_speed_ratio']:.2f}), "
            f"accuracy delta {q['accuracy_delta']:+.3f}"
        )

    def tool_after(self):
        """The tool-loop row: the loop's tokens/s against plain generate's."""
        m = json.loads((self.work / "metrics" / "gpu_check_tool_speed.json").read_text())
        return m["loop_tokens_per_second"], (
            f"plain generate {m['plain_tokens_per_second']:.0f} tok/s, ratio {m['ratio']:.2f}, "
            f"{m['tool_calls']} tool calls, {m['problems']} problems, {m['device']}"
            + self.mfu_note(m["loop_tokens_per_second"], "forward", m["mean_prompt_tokens"] + m["mean_loop_tokens"] / 2)
        )

    # --------------------------------------------------------------------------------- the rows
    def sequence(self) -> None:
        """Every row in order: the recipe single-process, export and int8, the tool loop, ZeRO-2/3, vLLM."""
        py = self.py

        def launch(cfg, stage, processes=1):
            return [py, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{cfg}.yaml",
                    "--num_processes", str(processes), "-m", f"agentrl.stages.{stage}"]  # fmt: skip

        smoke = {"cpu": ["--cpu-smoke"], "rehearse": ["--cpu-full-size"], "gpu": []}[self.size_key]
        cuda_only = "CUDA-only (CPU run)" if self.cpu else None
        prepare, stand_in = "recipe: prepare (synthetic)", "recipe: stand-in model (random, local dir)"
        base = f"recipe: base (local dir, {'fp32' if self.cpu else 'bf16'}, sdpa)"
        sft, grpo = "recipe: sft LoRA (single)", "recipe: grpo LoRA (single)"
        export = "export: merge + verify"

        # 0. what an interpreter with the stages' libraries takes before any model: the plan's baseline
        libraries = "import deepspeed, peft, trl, agentrl.stages.sft, agentrl.stages.grpo"
        self.run(BASELINE, [py, "-c", libraries], 180)
        # 1. the recipe's code paths, single process
        self.run(prepare, [py, "-m", "agentrl.stages.prepare"], 180)
        self.run(
            stand_in,
            [py, *HELPER, "--_stand-in", self.stand_in, *smoke],
            240,
            needs=[prepare],
            after=self.stand_in_after,
        )
        self.run(base, [py, "-m", "agentrl.stages.base"], 180, needs=[stand_in], after=self.base_after)
        long = 6 if self.size_key == "rehearse" else 1  # the full-size model on the CPU: minutes per row
        self.planned.update({sft: ("sft", {}), grpo: ("grpo", {})})
        self.run(sft, launch("single", "sft"), 240 * long, needs=[base], clean=["checkpoints"], after=self.sft_after)
        self.run(grpo, launch("single", "grpo"), 300 * long, needs=[sft], after=self.grpo_after)
        evaluate = [py, "-m", "agentrl.stages.evaluate", "--stage", "grpo"]
        self.run("recipe: eval grpo (tool loop)", evaluate, 180 * long, needs=[grpo], after=self.eval_after("grpo"))
        # 4. export, then the int8 evaluation (bitsandbytes on CUDA, torch dynamic int8 on CPU)
        self.run(export, [py, "-m", "agentrl.stages.export"], 240 * long, needs=[grpo], after=self.export_after)
        bnb = None if self.cpu or importable(py, "bitsandbytes", self.env) else "bitsandbytes not installed"
        quantized = [py, "-m", "agentrl.stages.export", "--quantized-eval"]
        self.run("int8: eval merged + int8", quantized, 240 * long, needs=[export], skip=bnb, after=self.quant_after)
        # 5. the tool loop against plain generate
        speed = [py, *HELPER, "--_tool-speed", *smoke]
        self.run("tool loop: generate_with_tools vs generate", speed, 180 * long, needs=[grpo], after=self.tool_after)
        # 2. DeepSpeed ZeRO-2 / ZeRO-3: one process on the one GPU; two over gloo on the CPU
        processes = 2 if self.cpu else 1
        for z in ("zero2", "zero3"):
            over = {"distributed.accelerate_config": f"configs/accelerate/{z}.yaml"}
            over["distributed.num_processes"] = processes
            zsft, zgrpo = f"{z}: sft LoRA", f"{z}: grpo LoRA"
            self.planned.update({zsft: ("sft", over), zgrpo: ("grpo", over)})
            kw = {"overrides": over}
            self.run(
                zsft, launch(z, "sft", processes), 240 * long, needs=[base], clean=["checkpoints"],
                after=self.sft_after, **kw
            )  # fmt: skip
            self.run(zgrpo, launch(z, "grpo", processes), 300 * long, needs=[zsft], after=self.grpo_after, **kw)
        # 3. vLLM colocate rollouts (TRL's generation; the recipe's agent.format chat keeps the calculator), on the
        # last SFT result that was saved
        vllm = cuda_only or (None if importable(py, "vllm", self.env) else "vllm not installed")
        sft_ok = [n for n in ("zero3: sft LoRA", "zero2: sft LoRA", sft) if self.status.get(n) == "ok"]
        over = {
            "grpo.trainer.use_vllm": True,
            "grpo.trainer.vllm_mode": "colocate",
            "grpo.trainer.vllm_gpu_memory_utilization": 0.3,
            "grpo.trainer.vllm_max_model_length": 1024,
        }
        self.run(
            "vllm: grpo LoRA colocate",
            launch("single", "grpo"),
            360,
            needs=sft_ok[:1] or [sft],
            skip=vllm,
            overrides=over,
            clean=["checkpoints/grpo"],
            after=self.grpo_after,
        )

    def compare_with_plan(self) -> list[str]:
        """The memory plan (memory_plan.plan, device cpu; a CUDA run's host RSS is not what it plans, so only on
        the CPU) of each training row that ran, with the data's longest SFT example and GRPO prompt as the
        sequence lengths, against the row's peak RSS less the baseline row's; the error goes into the row
        (plan_bytes, plan_error) and its note.

        Returns:
            A line for the header (the largest error), or [] when nothing was compared.
        """
        from .memory_plan import against_measured, dims_for

        base = next((r["peak_rss_bytes"] for r in self.rows if r["path"] == BASELINE and r["status"] == "ok"), None)
        info = self.metric("gpu_check_stand_in")
        if not self.cpu or not base or "longest_prompt_tokens" not in info:
            return []
        # the plan assumes every sequence at its maximum: here, the data's longest example and prompt
        lengths = {"sft.trainer.max_length": info["longest_sft_tokens"]}
        errors = []
        for row in self.rows:
            if row["path"] not in self.planned or row["status"] != "ok" or not row["peak_rss_bytes"]:
                continue
            phase, over = self.planned[row["path"]]
            tree = self.params_with({**over, **lengths})
            # what the plan reads, kept in the row so that a revised plan can be checked against this run
            # (memory_plan --against)
            plan_inputs = {k: tree[k] for k in ("model", "sft", "grpo", "distributed")}
            plan_inputs.update(
                phase=phase,
                dims=dims_for(tree["model"])[0],
                prompt_tokens=info["longest_prompt_tokens"],
                baseline_bytes=base,
            )
            checked = against_measured(plan_inputs, row["path"], row["peak_rss_bytes"])
            planned, measured, error = checked["planned"]["total"], checked["measured"], checked["error"]
            row.update(plan_bytes=planned, plan_error=error, plan_inputs=plan_inputs)
            row["note"] += (
                f"; memory plan {planned / 2**30:.2f} GiB vs measured {measured / 2**30:.2f} GiB "
                f"(peak RSS - baseline): {error:+.0%}"
            )
            errors.append(error)
        if not errors:
            return []
        worst = max(errors, key=abs)
        return [
            f"Memory plan (make memory-plan, device cpu) against each training row's peak RSS less the baseline "
            f"row's ({base / 2**30:.2f} GiB): errors {min(errors):+.0%} .. {max(errors):+.0%}, largest {worst:+.0%}."
        ]

    def finish(self, header: list[str]) -> int:
        """Write the table (gpu_check.md, gpu_check.json, printed), the failed rows' log tails to stderr and the
        logs to logs.tar.gz; remove the scratch copy.

        Returns:
            The exit code: 1 when a row failed, else 0.
        """
        text = "\n".join(header + [""] + table(self.rows)) + "\n"
        (self.out / "gpu_check.md").write_text(text)
        (self.out / "gpu_check.json").write_text(json.dumps({"header": header, "rows": self.rows}, indent=2) + "\n")
        print("\n" + text, flush=True)
        for r in self.rows:  # the end of each failed row's log, for a caller that sees only the output's tail
            if r["status"] == "fail" and "(log: " in r["note"]:
                log = self.logs / r["note"].rsplit("(log: ", 1)[1].rstrip(")")
                tail = log.read_text(errors="replace").splitlines()[-25:] if log.is_file() else []
                print(f"--- {log.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as t:
            t.add(self.logs, arcname="logs")
        shutil.rmtree(self.logs, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return 1 if any(r["status"] == "fail" for r in self.rows) else 0


def table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table (gpu_check.md; also to re-render a saved gpu_check.json)."""
    lines = ["| path | status | seconds | tokens/s | peak RSS GiB | note |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        sec = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
        tps = "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.3g}"  # CPU rehearsal rows: a few tokens/s
        rss = "" if r.get("peak_rss_bytes") is None else f"{r['peak_rss_bytes'] / 2**30:.2f}"
        lines.append(f"| {r['path']} | {r['status']} | {sec} | {tps} | {rss} | {r['note']} |")
    return lines


def wait_with_peak_rss(proc: subprocess.Popen, timeout: float) -> tuple[int | None, int | None]:
    """Wait for a row's process (killing its process group past `timeout`) and read the peak RSS of the largest
    process in its tree: os.wait4's ru_maxrss is the maximum over the process and every descendant it waited for
    (accelerate's launcher waits for its workers), as the kernel tracked it, not sampled.

    Args:
        proc: the row's process, started with start_new_session (its own process group).

    Returns:
        (exit code, or None after a timeout; peak RSS in bytes, or None where wait4 gave none).
    """
    deadline, timed_out = time.time() + timeout, False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.time() > deadline and not timed_out:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # accelerate's and DeepSpeed's children too
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss * 1024 if usage.ru_maxrss else None  # Linux reports KiB
    return (None if timed_out else proc.returncode), peak


def launch_kind(m: dict) -> str:
    """A training row's launch as its metrics record it, e.g. "no DeepSpeed, 1 process(es)".

    Args:
        m: the stage's metrics (distributed_type, num_processes).
    """
    kind = "no DeepSpeed" if m.get("distributed_type") == "NO" else m.get("distributed_type")
    return f"{kind}, {m.get('num_processes')} process(es)"


def fmt(x) -> str:
    """A number in a note, 3 significant digits ("-" for None).

    Args:
        x: the number or None.
    """
    return "-" if x is None else f"{x:.3g}"


def last_error(log: Path) -> str:
    """The line of a failed row's log that says what went wrong.

    Returns:
        The last line naming an error (not the launcher's CalledProcessError about it), else the last line.
    """
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):  # the stage's own error, not the launcher's CalledProcessError about it
        if ("Error" in ln or "error" in ln or "Exception" in ln) and "CalledProcessError" not in ln:
            return ln[:200].replace("|", "/")
    return (lines[-1][:200] if lines else "no output").replace("|", "/")


def importable(py: str, module: str, env: dict) -> bool:
    """Whether `module` imports under interpreter `py` (optional rows: vllm, bitsandbytes).

    Returns:
        True when `import module` exits 0.
    """
    return subprocess.run([py, "-c", f"import {module}"], env=env, capture_output=True, timeout=300).returncode == 0


def environment(py: str, env: dict) -> list[str]:
    """The table's environment line: the device and the versions of the libraries the rows use.

    Returns:
        [the line].
    """
    code = (
        "import torch, transformers, trl, peft, accelerate, importlib.metadata as md\n"
        "def v(m):\n"
        "    try: return md.version(m)\n"
        "    except Exception: return 'not installed'\n"
        "dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'\n"
        "print(f'{dev}; torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, '"
        "f'peft {peft.__version__}, accelerate {accelerate.__version__}, deepspeed {v(\"deepspeed\")}, '"
        'f\'vllm {v("vllm")}, bitsandbytes {v("bitsandbytes")}\')\n'
    )
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return [r.stdout.strip() or f"(versions unavailable: {r.stderr.strip()[-200:]})"]


def parser() -> argparse.ArgumentParser:
    """scripts/gpu_check.py's flags (and the helper rows' hidden ones).

    Returns:
        The parser (its help is HELP).
    """
    ap = argparse.ArgumentParser(description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--cpu-smoke", action="store_true", help="tiny model, tiny step counts, CPU; vLLM skipped")
    size.add_argument(
        "--cpu-full-size", action="store_true", help="`make rehearse`: the 0.6B-sized model in fp32 on the CPU"
    )
    ap.add_argument("--out", default=str(ROOT / "gpu_check"), help="gpu_check.md, gpu_check.json, logs.tar.gz")
    ap.add_argument(
        "--budget", type=float, default=None, help="seconds for all rows (GPU 570, CPU smoke 900, full size 5400)"
    )
    ap.add_argument("--python", default=sys.executable, help="the interpreter the stages run with")
    ap.add_argument("--_stand-in", dest="stand_in", help=argparse.SUPPRESS)
    ap.add_argument("--_tool-speed", dest="tool_speed", action="store_true", help=argparse.SUPPRESS)
    return ap


def require_cuda(python: str) -> None:
    """SystemExit(2) with what to do instead when `python` sees no CUDA device.

    Args:
        python: the interpreter the stages would run with.
    """
    probe = subprocess.run([python, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
    if probe.returncode:
        print(
            "gpu_check: no CUDA device (torch.cuda.is_available() is false for "
            f"{python}); run it on a GPU machine, or use --cpu-smoke to test the script's logic on the CPU",
            file=sys.stderr,
        )
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    """Run the check (or a helper row) as the flags ask; exits 0 when no row failed, 1 when one did, 2 without
    CUDA (unless --cpu-smoke).

    Args:
        argv: the arguments (None: sys.argv[1:]).
    """
    args = parser().parse_args(argv)
    args.python = shutil.which(args.python) or args.python
    if args.stand_in or args.tool_speed:
        return helper_row(args)
    if not (args.cpu_smoke or args.cpu_full_size):
        require_cuda(args.python)
    check = Check(args)
    t0 = time.time()
    title = {
        "gpu": "# GPU check",
        "cpu": "# GPU check (--cpu-smoke: tiny model on the CPU)",
        "rehearse": "# Rehearsal at full size (--cpu-full-size: the Qwen3-0.6B-sized stand-in, fp32, on the CPU)",
    }[check.size_key]
    from .measure import machine

    header = [title, "", f"{environment(args.python, check.env)[0]}", f"CPU: {machine()}"]
    try:
        check.sequence()
    finally:
        header += check.compare_with_plan()
        header.append(f"Total {time.time() - t0:.0f} s (budget {args.budget or check.size['budget']:.0f} s).")
        peak = check.metric("gpu_check_stand_in").get("matmul_peak")
        if peak:
            header.append(
                f"MFU: model FLOPs/s (measure.flops_per_token, PaLM's accounting) over the measured {peak['dtype']} "
                f"matmul peak, {peak['flops_per_second'] / 1e12:.2f} TFLOP/s ({peak['size']}x{peak['size']} "
                f"`torch.matmul`, median of {peak['runs']}); GRPO leaves the prompts out (a lower bound)."
            )
        rc = check.finish(header)
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
