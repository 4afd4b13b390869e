"""Experiment tracking in one place: which backends a stage reports to, and how.

`tracking.report_to` selects TensorBoard (runs/<stage>), DVCLive (dvclive/<stage>, metrics and
plots that dvc.yaml declares) and Weights & Biases (wandb/, offline unless WANDB_API_KEY is set or
tracking.wandb_mode is 'online'). The runs of one pipeline run share a W&B group; the W&B config is
the full validated params plus the git commit. No secret is ever copied into a config.
"""
from __future__ import annotations

import os
import subprocess
from typing import Any

from transformers import TrainerCallback

from .config import Params

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_group() -> str:
    """One W&B group per pipeline run: the DVC experiment name, else AGENTRL_RUN_GROUP, else the commit."""
    return os.environ.get("DVC_EXP_NAME") or os.environ.get("AGENTRL_RUN_GROUP") or f"repro-{git_commit()[:8]}"


def wandb_mode(params: Params) -> str:
    if "wandb" not in params.tracking.report_to or params.tracking.wandb_mode == "disabled":
        return "disabled"
    if params.tracking.wandb_mode == "online" or os.environ.get("WANDB_API_KEY"):
        return "online"
    return "offline"


def redact(obj: Any) -> Any:
    """Drop values whose key looks like a secret (api keys, tokens, passwords)."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if any(m in str(k).upper() for m in SECRET_MARKERS) and v else redact(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def wandb_config(params: Params) -> dict:
    return redact({**params.model_dump(mode="json"), "git_commit": git_commit()})


class ParamsToWandb(TrainerCallback):
    """Adds the validated params + git commit to the W&B run config (after WandbCallback set it up)."""

    def __init__(self, params: Params):
        self.config = wandb_config(params)

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        import wandb

        if wandb.run is not None:
            wandb.config.update({"params": self.config, "git_commit": self.config["git_commit"]}, allow_val_change=True)


def dvclive_callback(live):
    """transformers' DVCLiveCallback with the optimizer step as DVCLive's step (the stock callback counts
    its log calls, so every `logging_steps` would be one unit on the plots' x axis)."""
    from transformers.integrations import DVCLiveCallback

    class OptimizerStepDVCLive(DVCLiveCallback):
        def on_log(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.live.step = state.global_step
            super().on_log(args, state, control, **kwargs)

    return OptimizerStepDVCLive(live=live)


def setup(params: Params, stage: str) -> dict:
    """TrainingArguments kwargs (report_to, run_name) + callbacks for a training stage."""
    mode = wandb_mode(params)
    os.environ["WANDB_MODE"] = mode
    os.environ["WANDB_PROJECT"] = params.tracking.wandb_project
    os.environ["WANDB_RUN_GROUP"] = run_group()
    os.environ.setdefault("WANDB_DIR", os.getcwd())
    os.environ["WANDB_JOB_TYPE"] = stage
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["TENSORBOARD_LOGGING_DIR"] = f"runs/{stage}"
    report_to = [b for b in params.tracking.report_to if b != "dvclive" and not (b == "wandb" and mode == "disabled")]
    callbacks: list = []
    if "wandb" in report_to:
        callbacks.append(ParamsToWandb(params))
    if "dvclive" in params.tracking.report_to:
        from dvclive import Live

        from .common import is_main_process

        if is_main_process():
            live = Live(dir=f"dvclive/{stage}", save_dvc_exp=False, dvcyaml=None, report=None)
            callbacks.append(dvclive_callback(live))
    name = os.environ.get("DVC_EXP_NAME")
    return {
        "report_to": report_to or "none",
        "run_name": f"{name}-{stage}" if name else stage,
        "callbacks": callbacks,
    }


def log_eval_to_wandb(params: Params, name: str, metrics: dict, predictions: list[dict]) -> None:
    """One W&B run per evaluation: summary metrics + a wandb.Table of per-sample predictions."""
    mode = wandb_mode(params)
    if mode == "disabled":
        return
    import wandb

    dvc_exp = os.environ.get("DVC_EXP_NAME")
    run = wandb.init(project=params.tracking.wandb_project, group=run_group(), job_type="eval",
                     name=f"{dvc_exp}-eval_{name}" if dvc_exp else f"eval_{name}", mode=mode,
                     dir=os.environ.get("WANDB_DIR", os.getcwd()), config={"params": wandb_config(params)},
                     reinit="finish_previous")
    cols = ["id", "question", "completion", "extracted", "ground_truth", "correct", "reward"]
    table = wandb.Table(columns=cols, data=[[p.get(c) for c in cols] for p in predictions])
    run.log({f"eval/{name}/predictions": table})
    run.summary.update({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
    run.finish()
