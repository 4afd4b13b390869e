"""Helpers the stages and scripts share: logging and process rank, atomic JSON files and each stage's metrics
files (headline metrics and diagnostics, HEADLINE), precision and CPU threads, file and model-directory digests,
and the resumable checkpoint of a training stage (the rest of the training stages' skeleton is in stage.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

import torch


def get_logger(stage: str) -> logging.Logger:
    """A logger whose lines say which stage is talking; only rank 0 logs at INFO."""
    log = logging.getLogger(f"agentrl.{stage}")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"%(asctime)s [{stage}] %(levelname)s %(message)s", "%H:%M:%S"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.INFO if is_main_process() else logging.WARNING)
    return log


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def atomic_write(path: str | Path) -> Iterator[TextIO]:
    """Open `path` for writing UTF-8 text, atomically: the text goes to <path>.tmp, which replaces `path` when
    the block ends (and is removed when it raises), so a crash never leaves a half-written file in its place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            yield f
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | Path, data: Any) -> None:
    """Atomic JSON write so an interrupted stage never leaves a broken metrics file."""
    with atomic_write(path) as f:
        f.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


# Headline metrics: what `dvc metrics show` / `dvc exp show` print (metrics/<name>.json, declared as DVC metrics).
# Everything else a stage measures (timings, memory, histograms, per-pair details) goes to diagnostics/<name>.json,
# a plain output: `dvc metrics show diagnostics/<name>.json` reads it. Dotted keys reach into nested dicts;
# every eval_<name> file (base, sft, grpo, merged, merged_int8, ...) has the evaluation headline.
_EVAL_HEADLINE = (
    "accuracy",
    "accuracy_ci95",
    "average_reward",
    "tool_use_rate",
    "tool_calls_per_problem",
    "tool_error_rate",
    "mean_turns",  # environment episodes (agent.environment): tool calls per episode, and the feedback-use
    "recovered_share",  # figure: share of solved episodes that recovered from a failed try
)
HEADLINE: dict[str, tuple[str, ...]] = {
    "prepare": ("written", "tool_solution_share", "test_ceiling"),
    "base": ("parameters", "pretrain.final_loss"),
    "sft_train": ("final_loss", "steps"),
    "grpo_train": ("reward_last", "reward_mean_last_20pct", "tool_use_rate_last", "steps"),
    "compare": (
        "base_accuracy",
        "sft_accuracy",
        "grpo_accuracy",
        "grpo_minus_sft",
        "ci95",
        "p_value",
        "sft_tool_use_rate",
        "grpo_tool_use_rate",
    ),
    "export": ("max_abs_logit_diff", "passed"),
    "quantize": ("int8_accuracy", "accuracy_delta", "int8_speed_ratio"),
}


def diagnostics_path(metrics_path: str | Path) -> Path:
    """metrics/<name>.json -> diagnostics/<name>.json (a sibling folder of metrics/)."""
    p = Path(metrics_path)
    return p.parent.parent / "diagnostics" / p.name


def split_metrics(name: str, data: dict) -> tuple[dict, dict]:
    """(headline, diagnostics) of one stage's measurements, by HEADLINE[name]; nothing is lost or repeated."""
    keys = HEADLINE.get(name) or (_EVAL_HEADLINE if name.startswith("eval_") else None)
    if keys is None:
        raise KeyError(f"no headline metrics defined for '{name}' (one of {sorted(HEADLINE)}; see common.HEADLINE)")
    rest = json.loads(json.dumps(data))  # a deep copy
    head: dict = {}
    for dotted in keys:
        *parents, leaf = dotted.split(".")
        src, dst = rest, head
        for k in parents:
            if not isinstance(src.get(k), dict):
                break
            src, dst = src[k], dst.setdefault(k, {})
        else:
            if leaf in src:
                dst[leaf] = src.pop(leaf)
    return head, rest


def write_metrics(path: str | Path, data: dict) -> None:
    """Write a stage's measurements: headline keys to `path` (metrics/<name>.json), the rest to diagnostics/."""
    head, rest = split_metrics(Path(path).stem, data)
    write_json(diagnostics_path(path), rest)
    write_json(path, head)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_metrics(path: str | Path) -> dict:
    """A stage's headline metrics and diagnostics as one dict (what `write_metrics` was given)."""
    diag = diagnostics_path(path)
    if not diag.exists():
        raise FileNotFoundError(f"{diag}: missing (written with {path} by the stage that makes it; run `dvc repro`)")
    return _merge(read_json(diag), read_json(path))


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB); each stage records it in its metrics."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def resolve_precision(precision: str) -> str:
    """'auto' -> fp32 on CPU (TRL's bf16 autocast is ~10x slower there), bf16 on GPUs that
    support it, fp16 on older GPUs. Explicit values are honoured."""
    if precision != "auto":
        return precision
    if not torch.cuda.is_available():
        return "fp32"
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def precision_kwargs(precision: str) -> dict:
    """TrainingArguments flags for a resolved precision, plus the CPU process-group settings.

    Several CPU processes need telling: DDP must run as accelerate's MULTI_CPU (use_cpu, gloo) or the
    processes silently train alone; DeepSpeed must keep use_cpu off but name the gloo backend, or
    accelerate leaves it with a world size of 1."""
    p = resolve_precision(precision)
    kw = {"bf16": p == "bf16", "fp16": p == "fp16"}
    if not torch.cuda.is_available() and world_size() > 1:
        kw["ddp_backend"] = "gloo"
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
            kw["use_cpu"] = True
    return kw


def torch_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[resolve_precision(precision)]


def file_digest(path: str | Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def model_files_digest(directory: str | Path) -> str:
    """One digest over every file of a model directory (every weight shard: *.safetensors, *.bin, ..., and
    the configs, adapter and tokenizer files next to them), by relative path and content. Part of a
    checkpoint's fingerprint: a run resumes only on the very input model it started from, sharded or not.
    A missing directory, or one with no weight file, is an error naming it (never a hub lookup)."""
    import hashlib

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: model directory not found (run the stage that writes it first)")
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    if not any(p.match(pat) for p in files for pat in WEIGHT_PATTERNS):
        raise FileNotFoundError(f"{directory}: no weight file ({', '.join(WEIGHT_PATTERNS)}) in the model directory")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(directory).as_posix()}\0{file_digest(p)}\0".encode())
    return h.hexdigest()[:16]


def resumable_checkpoint(output_dir: str | Path, key: str) -> Optional[str]:
    """The last checkpoint in output_dir if it was written by a run with the same fingerprint `key` and
    training had not finished there; otherwise the directory is cleared: a changed config must not resume a
    stale run, and a finished checkpoint (global_step >= max_steps in its trainer_state.json) is no run to
    resume: the Trainer would take one step past max_steps and record it. The stage then trains from the start.

    With several processes call it inside `args.main_process_first(local=False)`: rank 0 clears a stale
    directory and writes the new fingerprint before the other ranks look, so all ranks agree."""
    import shutil

    from transformers.trainer_utils import get_last_checkpoint

    output_dir = Path(output_dir)
    stamp = output_dir / "fingerprint.txt"
    stale = output_dir.exists() and (not stamp.exists() or stamp.read_text().strip() != key)
    last = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() and not stale else None
    state = Path(last or output_dir) / "trainer_state.json"
    if last and state.is_file():
        s = json.loads(state.read_text())
        if 0 < int(s.get("max_steps") or 0) <= int(s.get("global_step") or 0):
            msg = "%s ends a finished run (max_steps reached): training from the start"
            logging.getLogger("agentrl").info(msg, last)
            stale = True
    if stale and is_main_process():
        shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    if is_main_process():
        stamp.write_text(key + "\n")
    return get_last_checkpoint(str(output_dir))


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS keeps one (taskset, a container's or a
    SLURM job's cpuset), at most os.cpu_count() (the machine's cores)."""
    total = os.cpu_count() or 1
    try:
        return max(1, min(total, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):  # no affinity API (macOS, Windows)
        return total


def configure_cpu_threads() -> int:
    """On CPU, give each process its share of the cores it may run on (usable_cpus). `accelerate launch` pins
    OMP_NUM_THREADS=1 for non-CPU configs, which halves a 2-core machine's speed for a single process, so that
    variable is not read; a process started under `taskset -c 0` gets one thread, not one per core of the machine
    (which would oversubscribe the one core it has)."""
    if torch.cuda.is_available():
        return torch.get_num_threads()
    from .reproducibility import fixed_threads

    # reproducibility.mode portable: its fixed count (the bytes depend on it), else the process's share of the cores
    n = fixed_threads() or max(1, usable_cpus() // world_size())
    torch.set_num_threads(n)
    return n
