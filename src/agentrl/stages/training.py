"""What the training stages (sft.py, grpo.py) share, in the order they run it: the TRL and PEFT configs from
`<stage>.trainer` and `<stage>.lora`, seed and tracking, resuming checkpoints/<stage>/ under a fingerprint of
the stage's own params, inputs, code and launch, training with the measurements every run reports, saving, and
main()'s exit status 2 on a params error."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..common import (
    configure_cpu_threads,
    file_digest,
    finished_checkpoint,
    get_logger,
    peak_rss_mb,
    precision_kwargs,
    resolve_precision,
    resumable_checkpoint,
    world_size,
    write_checkpoint_checksums,
)
from ..config import Params, ParamsError, load_params_or_exit
from ..envs.registry import ImportPathError, check_imports
from ..modeling import STAGE_DIRS, lora_config, save_stage_result
from ..passthrough import PassthroughError, build_passthrough, passthrough_value

REPO = Path(__file__).resolve().parents[3]  # the checkout whose dvc.yaml declares this package's stages


def effective_batch(per_device: int, grad_accum: int) -> int:
    """Examples per optimizer step over all processes.

    Returns:
        per_device x grad_accum x processes.
    """
    return per_device * grad_accum * world_size()


def learning_rate(params: Params, stage: str) -> float:
    """`<stage>.trainer.learning_rate` (the reference learning rate; TRL's default when unset) after
    distributed.scale_lr: scaled with the stage's effective batch (per-device batch x processes x accumulation,
    TRL defaults for what the section leaves out) against distributed.reference_batch.

    Args:
        stage: sft or grpo.
    """
    path, trainer, distributed = f"{stage}.trainer", getattr(params, stage).trainer, params.distributed
    lr = passthrough_value(path, trainer, "learning_rate")
    if distributed.scale_lr == "none":
        return lr
    ratio = (
        effective_batch(
            passthrough_value(path, trainer, "per_device_train_batch_size"),
            passthrough_value(path, trainer, "gradient_accumulation_steps"),
        )
        / distributed.reference_batch
    )
    return lr * (ratio**0.5 if distributed.scale_lr == "sqrt" else ratio)


def trainer_config(params: Params, stage: str, output_dir: str, **derived):
    """trl.SFTConfig / trl.GRPOConfig(**<stage>.trainer) plus what the stage derives (config.DERIVED): output_dir,
    the scaled learning rate, seed/data_seed, the precision flags and `derived` (tracking arguments, ...).

    Args:
        stage: sft or grpo.
        **derived: further derived arguments (tracking, GRPO's reward_weights).

    Returns:
        The TRL config. PassthroughError naming the section when TRL rejects a value.
    """
    return build_passthrough(
        f"{stage}.trainer",
        {**getattr(params, stage).trainer, "learning_rate": learning_rate(params, stage)},  # the reference, scaled
        output_dir=output_dir,
        seed=params.seed,
        data_seed=params.seed,
        **precision_kwargs(params.model.precision),
        **derived,
    )


def peft_config(params: Params, stage: str):
    """peft.LoraConfig(**<stage>.lora), or None when <stage>.use_lora is false (all weights train).

    Args:
        stage: sft or grpo.

    Returns:
        The LoraConfig, or None.
    """
    section = getattr(params, stage)
    return lora_config(section.lora, f"{stage}.lora") if section.use_lora else None


def fused_lm_head_positions(choice: str) -> None:
    """model.lm_head_positions, applied to TRL (process-wide). TRL 1.16's SFT and GRPO losses run the LM head fused
    with the log-softmax (trl.kernels.ChunkedLogProbFunction, no full logits). On a Triton device it scores only the
    positions with a label ("compact"); elsewhere every position, so that compiled tile shapes stay fixed on Neuron.
    On the CPU, eager, that choice only costs: GRPO's loss labels the completion alone, a third of the positions in
    the calculator recipe. "labelled" makes TRL take its compact branch on CPU too (trl.trainer.utils._use_triton
    decides only that there; the kernels keep their torch code). Each scored position computes what it did: the same
    bits on a tiny model (tests/test_training.py) and on a SmolLM2 micro-batch in native mode, but a matmul over fewer
    rows may round differently (the golden run in portable mode does), hence params.yaml's default "all", TRL's own
    choice.

    Args:
        choice: "labelled" or "all".
    """
    import trl.trainer.utils as trl_utils
    from trl.kernels.chunked_logprob import _use_triton

    if choice not in ("labelled", "all"):
        raise ValueError(f"model.lm_head_positions: expected 'labelled' or 'all', got {choice!r}")
    trl_utils._use_triton = _use_triton if choice == "all" else _labelled_on_cpu


def _labelled_on_cpu(device) -> bool:
    """trl.trainer.utils' compact switch under model.lm_head_positions labelled: always on CPU, TRL's own elsewhere."""
    from trl.kernels.chunked_logprob import _use_triton

    return device.type == "cpu" or _use_triton(device)


def start(params: Params, stage: str, config: Callable) -> tuple[Any, list]:
    """The imports params name (registry.check_imports), seed, CPU threads, the LM head's scored positions
    (fused_lm_head_positions) and tracking, then the stage's TRL config
    `config(params, report_to=, run_name=)`; returns it with the tracking callbacks. The config comes before any
    work: it stops on a bad value, and it registers the DeepSpeed config, so the model created next is
    ZeRO-3-partitioned (zero3_init_flag) in its target dtype.

    Args:
        stage: sft or grpo.
        config: sft_config or grpo_config.

    Returns:
        (the TRL config, the tracking callbacks).
    """
    from transformers import set_seed

    from .. import tracking

    check_imports(params)  # a typo in a module:attr stops the stage here, before any model or data is read
    set_seed(params.seed)
    configure_cpu_threads()
    fused_lm_head_positions(params.model.lm_head_positions)
    track = tracking.setup(params, stage)
    callbacks = track.pop("callbacks")
    return config(params, **track), [*callbacks, checksum_callback()]


def checksum_callback():
    """A TrainerCallback writing checksums.json into each checkpoint once the Trainer has saved all of it (its
    on_save comes after Trainer._save_checkpoint): resume counts a checkpoint complete only with it and checks
    every file against it (common.checksum_problem)."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class ChecksumEachCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank's files (its RNG state, DeepSpeed shards) are written
            if state.is_world_process_zero:
                write_checkpoint_checksums(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    return ChecksumEachCheckpoint()


def code_digest(stage: str, root: Path) -> dict[str, str]:
    """Digest of each file of the code stage `stage` runs: its deps under src/ in `root`/dvc.yaml (modules, and every
    file of a package directory but its __pycache__). Editing any other module (serve.py, ...) keeps the
    stage's checkpoint resumable, as it keeps DVC's stage up to date.

    Returns:
        path -> digest of each such file.
    """
    import yaml

    spec = root / "dvc.yaml"
    if not spec.is_file():
        raise FileNotFoundError(f"{spec}: not found; the resume fingerprint reads stage '{stage}''s code deps there")
    stages = yaml.safe_load(spec.read_text())["stages"]
    if stage not in stages:
        raise KeyError(f"{spec}: no stage '{stage}'")
    files = []
    for dep in (d for d in stages[stage]["deps"] if d.startswith("src/")):
        path = root / dep
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{spec}: stage '{stage}' depends on {dep}, which does not exist")
    return {p.relative_to(root).as_posix(): file_digest(p) for p in files}


# accelerate passes the launch configuration to each process in ACCELERATE_* variables; these describe the
# run's parallel layout (DeepSpeed stage, offload, mixed precision, FSDP ...). Debug/affinity ones do not.
_IGNORED_ACCELERATE_ENV = {
    "ACCELERATE_DEBUG_MODE",
    "ACCELERATE_DEBUG_RDV_FILE",
    "ACCELERATE_CPU_AFFINITY",
    "ACCELERATE_LOG_LEVEL",
}


def run_environment_digest(params: Params) -> dict:
    """What makes a checkpoint of the same params incompatible or different across launches: the
    accelerate config file (path and contents), the number of processes actually running, the launch
    settings accelerate hands to the processes, the resolved precision and the device type. With it in
    the fingerprint, `make repro` followed by `make train-zero2 NPROC=2` trains from scratch instead of
    "resuming" a single-process checkpoint that DeepSpeed cannot load.

    Returns:
        The launch's description, as JSON-able values.
    """
    distributed = params.distributed
    cfg = Path(distributed.accelerate_config)
    return {
        "accelerate_config": distributed.accelerate_config,
        "accelerate_config_sha": file_digest(cfg) if cfg.is_file() else "missing",
        "distributed": distributed.model_dump(mode="json"),
        "world_size": world_size(),
        "launch_env": {
            k: v
            for k, v in sorted(os.environ.items())
            if k.startswith("ACCELERATE_") and k not in _IGNORED_ACCELERATE_ENV
        },
        "precision": resolve_precision(params.model.precision),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }


def fingerprint(*parts: Any) -> str:
    """One short digest of JSON-able parts (the resume fingerprint)."""
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def files_written_after_trainer_state(args) -> tuple[str, ...]:
    """Checkpoint files a TRL trainer writes after transformers' trainer_state.json, which a complete checkpoint
    must also hold: GRPOTrainer's entropy controller state when GRPOConfig.use_adaptive_entropy is on (without
    it the resumed run silently restarts the controller). SFTConfig has no such field.

    Args:
        args: the stage's trl.SFTConfig or trl.GRPOConfig.

    Returns:
        The file names (none for most runs).
    """
    return ("entropy_ctrl_state.json",) if getattr(args, "use_adaptive_entropy", False) else ()


def resume_checkpoint(args, params: Params, stage: str, *inputs: Any) -> Optional[str]:
    """The checkpoint in args.output_dir to resume: its last one when it was written under the same
    fingerprint of `inputs` (the stage's params and the digests of its data and input models), the stage's
    code (code_digest) and its launch (run_environment_digest); otherwise None, the directory cleared
    (common.resumable_checkpoint). Only a complete checkpoint counts: one a kill cut short inside its save is
    removed with a warning naming it, and the run resumes from the one before (common.checkpoint_problem). Rank 0
    settles this before the other ranks look.

    Args:
        args: the stage's TRL config (output_dir, save_only_model).
        stage: sft or grpo.
        *inputs: what the run trains on: params sections and digests of its data and models.

    Returns:
        The checkpoint folder to resume from, or None.
    """
    key = fingerprint(*inputs, code_digest(stage, REPO), run_environment_digest(params))
    with args.main_process_first(local=False, desc="checkpoint fingerprint"):
        resume = resumable_checkpoint(
            args.output_dir, key, args.save_only_model, files_written_after_trainer_state(args)
        )
    if resume:
        get_logger(stage).info("resuming from %s", resume)
    return resume


def checkpoint_step(checkpoint: Optional[str | Path]) -> int:
    """The optimizer step a checkpoint was saved at (0 for None): where a resumed run's segment starts.

    Args:
        checkpoint: a checkpoint folder (checkpoint-<step>), or None.
    """
    if not checkpoint:
        return 0
    state = Path(checkpoint) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    return int(str(checkpoint).rstrip("/").rsplit("-", 1)[-1])


def train(trainer, resume: Optional[str]) -> tuple[Any, dict]:
    """trainer.train(resume_from_checkpoint=resume): its TrainOutput and what every training run reports
    (steps, time, the steps and time of this run's own segment when it resumed, learning rate, launch).

    Args:
        resume: the checkpoint to resume from, or None.

    Returns:
        (TrainOutput, the run's report).
    """
    t0 = time.time()
    if resume and finished_checkpoint(resume):
        out, resume = load_finished_run(trainer, resume)
    else:
        out = trainer.train(resume_from_checkpoint=resume)
    runtime = time.time() - t0
    ran = out.global_step - checkpoint_step(resume)  # a resumed run starts at its checkpoint
    return out, {
        "steps": out.global_step,
        "runtime_s": round(runtime, 2),
        "steps_this_run": ran,
        "seconds_per_step": round(runtime / max(1, ran), 4),
        "learning_rate": trainer.args.learning_rate,
        "resumed_from": resume,
        "num_processes": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
    }


def load_finished_run(trainer, checkpoint: str) -> tuple[Any, Optional[str]]:
    """A run that a kill stopped after its last step's save, finished from that checkpoint without training again
    (trainer.train would take one step past max_steps): its weights and TrainerState loaded as trainer.train
    would have left them. Its TrainOutput's training_loss is the logged losses' mean weighted by the steps each
    covers (the Trainer's running sum is not in the checkpoint). DeepSpeed and FSDP load weights only inside
    trainer.train, so there the run trains again from the start, which a fixed seed makes give the same weights.
    Returns the TrainOutput and the checkpoint the run resumed from (None when it trained again).
    """
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput

    log = get_logger("train")
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        log.warning(
            "%s ends a finished run; DeepSpeed/FSDP cannot load it outside training: training again", checkpoint
        )
        return trainer.train(resume_from_checkpoint=None), None
    log.info("%s ends a finished run (saved at max_steps): loading it, no step trained again", checkpoint)
    trainer._load_from_checkpoint(checkpoint)
    trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
    logged = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h and "step" in h]
    covered = [step - before for (step, _), before in zip(logged, [0] + [s for s, _ in logged])]
    loss = sum(value * steps for (_, value), steps in zip(logged, covered)) / max(1, sum(covered))
    return TrainOutput(trainer.state.global_step, loss, {}), checkpoint


def save(trainer, tokenizer, stage: str, metrics_path: str, metrics: dict) -> dict:
    """models/<stage>/ (model or adapter, tokenizer) and the metrics with the process's peak memory.

    Args:
        stage: sft or grpo.
        metrics_path: where the metrics go (metrics/<stage>_train.json).
    """
    metrics["peak_rss_mb"] = peak_rss_mb()
    save_stage_result(trainer, tokenizer, STAGE_DIRS[stage], metrics_path, metrics)
    return metrics


def main(stage: str, train_stage: Callable[[Params], dict], *errors: type[Exception]) -> None:
    """`train_stage(params.yaml)`; a value the TRL config rejects (PassthroughError, named by its section), a
    `module:attr` of params that does not import (ImportPathError) or one of the stage's own `errors` ends the
    process with exit status 2 and the message.

    Args:
        stage: sft or grpo (the logger's name).
        train_stage: the stage's train(params).
    """
    params = load_params_or_exit()
    try:
        train_stage(params)
    except (ParamsError, PassthroughError, ImportPathError, *errors) as error:
        get_logger(stage).error("%s", error)
        raise SystemExit(2) from None
