"""Experiment tracking in one place: which backends a stage reports to, and how.

`tracking.report_to` selects TensorBoard (runs/<stage>), DVCLive (dvclive/<stage>, metrics and
plots that dvc.yaml declares) and Weights & Biases (wandb/). The runs of one pipeline run share a W&B
group; the W&B config is the full validated params plus the git commit. No secret is ever copied into a
config.

W&B mode, first match wins (`wandb_mode`):
  1. `wandb` not in tracking.report_to, tracking.wandb_mode: disabled, or WANDB_MODE=disabled -> disabled
  2. the WANDB_MODE environment variable (offline | online; `dryrun` = offline, `run` = online)
  3. tracking.wandb_mode in params.yaml (offline by default)
WANDB_API_KEY never selects a mode: it only authenticates an online run.

Tracking can never fail or hang a stage: before an online run the W&B server is probed with the key
(a few seconds at most); a network or authentication failure, or a W&B error while starting or logging
a run, degrades that run to offline with one warning (`wandb sync wandb/offline-run-*` uploads it later).
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any, Optional

from transformers import TrainerCallback

from .config import Params

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
ENV_MODES = {"offline": "offline", "dryrun": "offline", "online": "online", "run": "online", "disabled": "disabled"}
PROBE_TIMEOUT_S = 5.0
log = logging.getLogger("agentrl.tracking")
if not log.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("%(asctime)s [tracking] %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(_h)
    log.propagate = False
log.setLevel(logging.INFO)

_degraded: Optional[str] = None  # why this process runs W&B offline although online was asked for


def git_commit() -> str:
    """The checked-out commit, or 'unknown' outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_group() -> str:
    """One W&B group per pipeline run: the DVC experiment name, else AGENTRL_RUN_GROUP, else the commit."""
    return os.environ.get("DVC_EXP_NAME") or os.environ.get("AGENTRL_RUN_GROUP") or f"repro-{git_commit()[:8]}"


def wandb_mode(params: Params) -> str:
    """The W&B mode asked for (module docstring: disabled wins, then WANDB_MODE, then tracking.wandb_mode).
    An unrecognised WANDB_MODE value is an error naming it, not a guess."""
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env and env not in ENV_MODES:
        raise ValueError(f"WANDB_MODE={env!r}: expected one of {', '.join(sorted(ENV_MODES))}")
    if "wandb" not in params.tracking.report_to or "disabled" in (params.tracking.wandb_mode, ENV_MODES.get(env)):
        return "disabled"
    return ENV_MODES[env] if env else params.tracking.wandb_mode


def _warn_offline(reason: str) -> None:
    """Switch this process to offline W&B, warning once."""
    global _degraded
    if _degraded is None:
        log.warning(
            "W&B online logging unavailable (%s); logging offline to wandb/ instead (upload later with `wandb sync`)",
            reason,
        )
    _degraded = _degraded or reason
    os.environ["WANDB_MODE"] = "offline"


def _api_key() -> Optional[str]:
    key = os.environ.get("WANDB_API_KEY")
    if key:
        return key
    try:  # `wandb login` stores the key in ~/.netrc for the API host
        import netrc
        from urllib.parse import urlparse

        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
        auth = netrc.netrc().authenticators(host) if host else None
        return auth[2] if auth else None
    except (OSError, netrc.NetrcParseError):
        return None


def probe_wandb(timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when the W&B server answers and accepts the key within `timeout` seconds, else the reason.
    Runs in a daemon thread with a hard deadline: a hanging DNS lookup cannot hold the stage either."""
    import queue
    import threading

    answer: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: answer.put(_probe(timeout)), daemon=True, name="wandb-probe").start()
    try:
        return answer.get(timeout=timeout + 1)
    except queue.Empty:
        return f"no answer from the W&B server within {timeout:.0f} s"


def _probe(timeout: float) -> Optional[str]:
    import httpx

    key = _api_key()
    if not key:
        return "no W&B API key (set WANDB_API_KEY or run `wandb login`)"
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").rstrip("/") + "/graphql"
    try:
        response = httpx.post(url, json={"query": "query { viewer { id } }"}, auth=("api", key), timeout=timeout)
    except Exception as error:  # network errors, bad URLs: all mean "not reachable"
        return f"cannot reach {url}: {type(error).__name__}: {error}"
    if response.status_code in (401, 403):
        return f"the W&B server at {url} rejected the API key (HTTP {response.status_code})"
    if response.status_code != 200:
        return f"the W&B server at {url} answered HTTP {response.status_code}"
    try:
        viewer = (response.json().get("data") or {}).get("viewer")
    except ValueError:
        return f"the W&B server at {url} did not answer JSON"
    return None if viewer else f"the W&B server at {url} did not accept the API key"


def effective_wandb_mode(params: Params) -> str:
    """wandb_mode(), with online degraded to offline (one warning) when the server or the key fails."""
    mode = wandb_mode(params)
    if mode != "online":
        return mode
    if _degraded is not None:
        return "offline"
    reason = probe_wandb()
    if reason:
        _warn_offline(reason)
        return "offline"
    return "online"


def redact(obj: Any) -> Any:
    """Drop values whose key looks like a secret (api keys, tokens, passwords)."""
    if isinstance(obj, dict):
        return {
            k: ("<redacted>" if any(m in str(k).upper() for m in SECRET_MARKERS) and v else redact(v))
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def wandb_config(params: Params) -> dict:
    """The run's params and commit for W&B, secrets redacted."""
    return redact({**params.model_dump(mode="json"), "git_commit": git_commit()})


def _init_wandb(mode: str, **kwargs):
    """wandb.init in `mode`; an online start that fails (network, auth, timeout) is retried offline."""
    import wandb

    settings = wandb.Settings(init_timeout=30, silent=True)
    if mode == "online":
        try:
            return wandb.init(mode="online", settings=settings, **kwargs)
        except Exception as e:  # any W&B failure must not stop the stage
            _warn_offline(f"wandb.init failed: {type(e).__name__}: {e}")
            try:
                wandb.finish(exit_code=1)
            except Exception:  # nothing was started
                pass
    return wandb.init(mode="offline", settings=settings, **kwargs)


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
    its log calls, so every `logging_steps` would be one unit on the plots' x axis).

    On a resumed run the curves start again from the checkpoint's own history: `dvc repro` deletes the
    stage's dvclive/ output before it runs, and a killed run may have logged steps past its checkpoint, so
    the logged history saved in the checkpoint (trainer_state.json) is replayed first; the plots then
    hold every step of the run, each once."""
    from transformers.integrations import DVCLiveCallback

    class OptimizerStepDVCLive(DVCLiveCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            super().on_train_begin(args, state, control, **kwargs)
            if state.is_world_process_zero and state.global_step > 0:
                for entry in state.log_history:
                    if "step" in entry and entry["step"] <= state.global_step:
                        self.live.step = entry["step"]
                        logs = {k: v for k, v in entry.items() if k != "step"}
                        DVCLiveCallback.on_log(self, args, state, control, logs=logs)

        def on_log(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.live.step = state.global_step
            super().on_log(args, state, control, **kwargs)

    return OptimizerStepDVCLive(live=live)


def setup(params: Params, stage: str) -> dict:
    """TrainingArguments kwargs (report_to, run_name) + callbacks for a training stage."""
    from .common import is_main_process

    mode = effective_wandb_mode(params)
    os.environ["WANDB_MODE"] = mode
    os.environ["WANDB_PROJECT"] = params.tracking.wandb_project
    os.environ["WANDB_RUN_GROUP"] = run_group()
    os.environ.setdefault("WANDB_DIR", os.getcwd())
    os.environ["WANDB_JOB_TYPE"] = stage
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ["TENSORBOARD_LOGGING_DIR"] = f"runs/{stage}"
    report_to = [b for b in params.tracking.report_to if b != "dvclive" and not (b == "wandb" and mode == "disabled")]
    name = os.environ.get("DVC_EXP_NAME")
    run_name = f"{name}-{stage}" if name else stage
    callbacks: list = []
    if "wandb" in report_to:
        callbacks.append(ParamsToWandb(params))
        if mode == "online" and is_main_process():
            # started here so that a failing online start falls back to offline instead of failing the stage;
            # transformers' WandbCallback then logs into this run
            _init_wandb(
                mode,
                project=params.tracking.wandb_project,
                group=run_group(),
                job_type=stage,
                name=run_name,
                dir=os.environ["WANDB_DIR"],
            )
    if "dvclive" in params.tracking.report_to:
        from dvclive import Live

        if is_main_process():
            live = Live(dir=f"dvclive/{stage}", save_dvc_exp=False, dvcyaml=None, report=None)
            callbacks.append(dvclive_callback(live))
    return {"report_to": report_to or "none", "run_name": run_name, "callbacks": callbacks}


def log_eval_to_wandb(params: Params, name: str, metrics: dict, predictions: list[dict]) -> None:
    """One W&B run per evaluation: summary metrics + a wandb.Table of per-sample predictions. Never raises:
    a W&B failure while logging online is retried offline, and an offline failure is a warning."""
    mode = effective_wandb_mode(params)
    if mode == "disabled":
        return
    try:
        _log_eval(params, name, metrics, predictions, mode)
    except Exception as error:  # the evaluation's own results are already written
        if mode == "online":
            _warn_offline(f"logging eval_{name} failed: {type(error).__name__}: {error}")
            try:
                _log_eval(params, name, metrics, predictions, "offline")
                return
            except Exception as offline_error:
                error = offline_error
        log.warning(
            "W&B logging of eval_%s failed (%s: %s); metrics/eval_%s.json is written regardless",
            name,
            type(error).__name__,
            error,
            name,
        )


def _calls_text(calls: list[dict]) -> str:
    """A prediction's tool calls as one table cell: `48+25 → 73; 9/0 → error: … (failed)`."""
    return "; ".join(f"{c['expression']} → {c['result']}" + ("" if c.get("ok", True) else " (failed)") for c in calls)


def _log_eval(params: Params, name: str, metrics: dict, predictions: list[dict], mode: str) -> None:
    import wandb

    dvc_exp = os.environ.get("DVC_EXP_NAME")
    run = _init_wandb(
        mode,
        project=params.tracking.wandb_project,
        group=run_group(),
        job_type="eval",
        name=f"{dvc_exp}-eval_{name}" if dvc_exp else f"eval_{name}",
        dir=os.environ.get("WANDB_DIR", os.getcwd()),
        config={"params": wandb_config(params)},
        reinit="finish_previous",
    )
    cols = ["id", "question", "completion", "extracted", "ground_truth", "correct", "reward"]
    rows = [[p.get(c) for c in cols] + [_calls_text(p.get("tool_calls") or [])] for p in predictions]
    table = wandb.Table(columns=[*cols, "tool_calls"], data=rows)
    run.log({f"eval/{name}/predictions": table})
    run.summary.update({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
    run.finish()
