"""Helpers the stages and scripts share: logging and process rank, atomic JSON files and each stage's metrics
files (headline metrics and diagnostics, HEADLINE), precision and CPU threads, file and model-directory digests,
and the resumable checkpoint of a training stage (the rest of the training stages' skeleton is in
stages/training.py)."""

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
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [{stage}] %(levelname)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if is_main_process() else logging.WARNING)
    return log


def is_main_process() -> bool:
    """Whether this is rank 0 of a distributed launch (or the only process)."""
    return int(os.environ.get("RANK", "0")) == 0


def world_size() -> int:
    """The launch's number of processes (WORLD_SIZE, 1 outside a distributed launch)."""
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
    """The JSON value in a file."""
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
    "broken_episodes",  # episodes whose environment failed (agent.max_broken_share): not the policy's wrong answers
    "mean_turns",  # environment episodes (agent.environment): tool calls per episode, and the feedback-use
    "recovered_share",  # figure: share of solved episodes that recovered from a failed try
    "accuracy_by_environment",  # a mixture of tasks (envs/mixture.py): n, accuracy and CI per task
)
HEADLINE: dict[str, tuple[str, ...]] = {
    "prepare": ("written", "tool_solution_share", "test_ceiling"),
    "base": ("parameters", "pretrain.final_loss", "revision", "gguf_file_type"),  # the last two: GGUF base models
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
        "grpo_vs_sft_by_environment",  # a mixture of tasks: the paired test per task
    ),
    "export": ("max_abs_logit_diff", "passed"),
    "quantize": ("int8_accuracy", "accuracy_delta", "int8_speed_ratio"),
}


def diagnostics_path(metrics_path: str | Path) -> Path:
    """metrics/<name>.json -> diagnostics/<name>.json (a sibling folder of metrics/)."""
    metrics_file = Path(metrics_path)
    return metrics_file.parent.parent / "diagnostics" / metrics_file.name


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


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
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
    resolved = resolve_precision(precision)
    kw = {"bf16": resolved == "bf16", "fp16": resolved == "fp16"}
    if not torch.cuda.is_available() and world_size() > 1:
        kw["ddp_backend"] = "gloo"
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
            kw["use_cpu"] = True
    return kw


def torch_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a model.precision value (auto resolved for this machine)."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[resolve_precision(precision)]


def file_sha256(path: str | Path) -> str:
    """A file's sha256, read in chunks."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_digest(path: str | Path) -> str:
    """A short digest of the file's bytes (the first 16 hex digits of its sha256), for fingerprints."""
    return file_sha256(path)[:16]


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
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    if not any(path.match(pat) for path in files for pat in WEIGHT_PATTERNS):
        raise FileNotFoundError(f"{directory}: no weight file ({', '.join(WEIGHT_PATTERNS)}) in the model directory")
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(directory).as_posix()}\0{file_digest(path)}\0".encode())
    return digest.hexdigest()[:16]


# A checkpoint counts for resuming only once it is complete. Why validate rather than write atomically:
# transformers' Trainer._save_checkpoint writes straight into checkpoint-<step>/ and offers no temporary name,
# config or hook before it rotates older checkpoints away, so an atomic rename would mean overriding a private
# Trainer method in both TRL trainers; a completion marker written from an on_save callback comes only after
# that rotation (with save_total_limit 1 a kill in between would leave nothing to resume) and needs a barrier
# across ranks. Checking what the Trainer's resume reads works for any checkpoint, however it was cut short.
# The Trainer writes the weights, optimizer.pt and scheduler.pt (or DeepSpeed's global_step*/ shards),
# scaler.pt, rng_state*.pth and trainer_state.json last; a kill before that last file leaves no parseable
# trainer_state.json, and a file cut short (a kill inside a write, a full disk) fails its own check below.
# Missing files matter even when the Trainer does not refuse them: without optimizer.pt, scheduler.pt or the
# RNG state it resumes "successfully" with a fresh optimizer or other random draws, and other final weights.


def _safetensors_problem(path: Path) -> Optional[str]:
    """Why a .safetensors file is not whole (its 8-byte header length, JSON header and the data the header
    lays out must all be there), or None."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "ends before its header"
        header_len = int.from_bytes(head, "little")
        if 8 + header_len > size:
            return "ends inside its header"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return "has a header that is not JSON"
    try:
        data_end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, IndexError):
        return "has a header that lays out no tensors"
    return None if size >= 8 + header_len + data_end else f"holds {size} bytes, its header lays out more"


def _torch_file_problem(path: Path) -> Optional[str]:
    """Why a torch.save file (a zip archive) is not whole, or None. The zip's central directory is written
    last, at the end of the file, so a file cut short anywhere has none; each member must lie inside the file."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return "is cut short (no zip central directory at its end)"
    size = path.stat().st_size
    if not members or any(member.header_offset + member.compress_size > size for member in members):
        return "is cut short (its members reach past its end)"
    return None


def file_problem(path: Path) -> Optional[str]:
    """Why a checkpoint file is not whole, judged by its format (.safetensors, torch.save's .pt/.pth/.bin,
    .json), or None; a file of another kind counts when it exists.

    Returns:
        "<name> <what is wrong>", or None.
    """
    if not path.is_file():
        return f"{path.name} is missing"
    if path.suffix == ".safetensors":
        problem = _safetensors_problem(path)
    elif path.suffix in (".pt", ".pth", ".bin"):
        problem = _torch_file_problem(path)
    elif path.suffix == ".json":
        try:
            json.loads(path.read_bytes())
            problem = None
        except ValueError:
            problem = "is cut short or not JSON"
    else:
        problem = None
    return f"{path.name} {problem}" if problem else None


def _weight_problem(checkpoint: Path) -> Optional[str]:
    """Why the checkpoint holds no model weights the Trainer can load (_load_from_checkpoint accepts a weights
    file, a sharded index whose shards are all there, adapter weights in the folder or a subfolder, or an FSDP
    state), or None; a DeepSpeed checkpoint keeps its weights in its global_step*/ folder instead."""
    from transformers.trainer import FSDP_MODEL_NAME
    from transformers.utils import (
        ADAPTER_SAFE_WEIGHTS_NAME,
        ADAPTER_WEIGHTS_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    for index in (checkpoint / SAFE_WEIGHTS_INDEX_NAME, checkpoint / WEIGHTS_INDEX_NAME):
        if index.is_file() and not file_problem(index):
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            missing = [s for s in shards if not (checkpoint / s).is_file()]
            return f"{index.name} lists missing shards {missing}" if missing else None
    names = (SAFE_WEIGHTS_NAME, WEIGHTS_NAME, ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
    if any((checkpoint / n).is_file() for n in names) or any(checkpoint.glob(f"*/{ADAPTER_SAFE_WEIGHTS_NAME}")):
        return None
    if any(checkpoint.glob(f"{FSDP_MODEL_NAME}*")) or any(checkpoint.glob("global_step*")):
        return None
    return f"no model weights ({', '.join(names)}, a sharded index or an FSDP state)"


def _optimizer_problem(checkpoint: Path) -> Optional[str]:
    """Why the optimizer and scheduler state is not all there, or None: DeepSpeed's is the global_step*/ folder
    its `latest` file names; otherwise optimizer.pt (or optimizer.bin, or an FSDP optimizer folder) and
    scheduler.pt."""
    from transformers.trainer import OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME

    if any(checkpoint.glob("global_step*")):
        latest = checkpoint / "latest"  # DeepSpeed writes it after its model and optimizer files
        if not latest.is_file() or not (checkpoint / latest.read_text().strip()).is_dir():
            return "DeepSpeed's `latest` file is missing or names no global_step folder"
        return None
    has_optimizer = any((checkpoint / n).is_file() for n in (OPTIMIZER_NAME, OPTIMIZER_NAME_BIN)) or any(
        d.is_dir() for d in checkpoint.glob("optimizer*")
    )
    if not has_optimizer:
        return f"{OPTIMIZER_NAME} is missing"
    return None if (checkpoint / SCHEDULER_NAME).is_file() else f"{SCHEDULER_NAME} is missing"


def checkpoint_problem(checkpoint: str | Path, model_only: bool = False, extra_files: tuple = ()) -> Optional[str]:
    """Why `checkpoint` cannot be resumed exactly as the Trainer wrote it, or None when it is complete:
    trainer_state.json parses and records the folder's step, the weights, optimizer, scheduler and each
    process's RNG state are there (the files Trainer._save_checkpoint writes), and no file in it is cut short.

    Args:
        checkpoint: a checkpoint-<step> folder.
        model_only: the run saves with `save_only_model` (no optimizer, scheduler or RNG state to require).
        extra_files: files the trainer writes after trainer_state.json (TRL's GRPO entropy controller state).

    Returns:
        What is missing or broken, naming the file, or None.
    """
    from transformers.trainer import TRAINER_STATE_NAME

    checkpoint = Path(checkpoint)
    step = int(checkpoint.name.rsplit("-", 1)[1])
    state = checkpoint / TRAINER_STATE_NAME
    if problem := file_problem(state):
        return problem + " (the Trainer writes it last: the save did not finish)"
    fields = json.loads(state.read_text())
    if not isinstance(fields, dict):
        return f"{TRAINER_STATE_NAME} holds {fields!r}, not the Trainer's state object"
    if (recorded := fields.get("global_step")) != step:
        return f"{TRAINER_STATE_NAME} records global_step {recorded}, not {step}"
    if not isinstance(fields.get("max_steps", 0), int):  # finished_checkpoint compares it with global_step
        return f"{TRAINER_STATE_NAME} records max_steps {fields['max_steps']!r}, not a number of steps"
    rng = ["rng_state.pth"] if world_size() <= 1 else [f"rng_state_{rank}.pth" for rank in range(world_size())]
    missing = [n for n in ([] if model_only else rng) + list(extra_files) if not (checkpoint / n).is_file()]
    problem = _weight_problem(checkpoint) or (None if model_only else _optimizer_problem(checkpoint))
    problem = problem or (f"{', '.join(missing)} missing" if missing else None)
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    return problem or next((p for p in map(file_problem, files) if p), None) or checksum_problem(checkpoint)


CHECKSUMS = "checksums.json"


def write_checkpoint_checksums(checkpoint: str | Path) -> None:
    """checkpoint/checksums.json: the sha256 of every file the Trainer wrote there, written last (after the whole
    save), so that a checkpoint counts as complete only with it and a file changed on disk since (a flipped
    byte, a partial copy) is caught on resume (checksum_problem)."""
    checkpoint = Path(checkpoint)
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    sums = {p.relative_to(checkpoint).as_posix(): file_sha256(p) for p in files}
    with atomic_write(checkpoint / CHECKSUMS) as out:
        json.dump(sums, out, indent=1)


def checksum_problem(checkpoint: Path) -> Optional[str]:
    """Why checkpoint/checksums.json does not vouch for the folder (missing: the save did not finish; a listed
    file missing or with another sha256: changed since it was saved), or None."""
    record = checkpoint / CHECKSUMS
    if not record.is_file():
        return f"{CHECKSUMS} is missing (written after every other file: the save did not finish)"
    try:
        sums = json.loads(record.read_text())
    except ValueError:
        return f"{CHECKSUMS} is cut short or not JSON"
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        return f"{CHECKSUMS} is not an object of file names and sha256 digests"
    for name, digest in sums.items():
        path = checkpoint / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{CHECKSUMS} lists {name!r}, outside the checkpoint"
        if not path.is_file():
            return f"{name} is missing (listed in {CHECKSUMS})"
        if file_sha256(path) != digest:
            return f"{name} does not match its sha256 in {CHECKSUMS} (changed or corrupted since it was saved)"
    return None


def _last_complete_checkpoint(output_dir: Path, model_only: bool, extra_files: tuple) -> Optional[Path]:
    """The newest complete checkpoint-<step> folder in output_dir, or None. Each newer, incomplete one is
    skipped with a warning naming it and what it lacks, and removed (by rank 0) so that the Trainer saving that
    step again writes into a clean folder and its checkpoint rotation never counts it."""
    import re
    import shutil

    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    name = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")  # the folders transformers' get_last_checkpoint counts
    found = [(name.fullmatch(d.name), d) for d in output_dir.iterdir() if d.is_dir()]
    steps = {int(m.group(1)): d for m, d in found if m}
    for step in sorted(steps, reverse=True):
        problem = checkpoint_problem(steps[step], model_only, extra_files)
        if problem is None:
            return steps[step]
        logging.getLogger("agentrl").warning(
            "%s is incomplete (%s): skipped and removed; resuming from an earlier checkpoint", steps[step], problem
        )
        if is_main_process():
            shutil.rmtree(steps[step])
    return None


def resumable_checkpoint(
    output_dir: str | Path, key: str, model_only: bool = False, extra_files: tuple = ()
) -> Optional[str]:
    """The last complete checkpoint in output_dir (checkpoint_problem; incomplete newer ones are removed with a
    warning) if it was written by a run with the same fingerprint `key`; otherwise the directory is cleared (a
    changed config must not resume a stale run) and the stage trains from the start. A finished checkpoint
    (finished_checkpoint: a kill came after the last step's save) is returned too: training.train loads it
    instead of training again.

    With several processes call it inside `args.main_process_first(local=False)`: rank 0 clears a stale
    directory and writes the new fingerprint before the other ranks look, so all ranks agree.

    Args:
        output_dir: the stage's checkpoint directory (args.output_dir).
        key: the fingerprint of what the run trains on (stage.resume_checkpoint).
        model_only: the run saves with `save_only_model`: checkpoints hold no optimizer, scheduler or RNG state.
        extra_files: files a complete checkpoint also holds (checkpoint_problem).

    Returns:
        The checkpoint folder to pass to trainer.train(resume_from_checkpoint=...), or None.
    """
    import shutil

    output_dir = Path(output_dir)
    stamp = output_dir / "fingerprint.txt"
    stale = output_dir.exists() and (not stamp.exists() or stamp.read_text().strip() != key)
    last = _last_complete_checkpoint(output_dir, model_only, extra_files) if output_dir.is_dir() and not stale else None
    if stale and is_main_process():
        shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    if is_main_process():
        with atomic_write(stamp) as out:  # a kill while writing it must not leave a stamp that matches nothing
            out.write(key + "\n")
    return str(last) if last else None


def finished_checkpoint(checkpoint: str | Path) -> bool:
    """Whether a complete checkpoint was saved at its run's last step (global_step >= max_steps): resuming it
    with the Trainer would take one step past max_steps, so training.train loads it instead."""
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    return 0 < state.get("max_steps", 0) <= state["global_step"]


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
    threads = fixed_threads() or max(1, usable_cpus() // world_size())
    torch.set_num_threads(threads)
    return threads
