"""Helpers the tests (tests/) and the scripts (scripts/) share: a free local port, the service started and
polled until healthy, a stage under `accelerate launch`, a params.yaml value set by its dotted key, a copy of
the repository, and the tool loop against plain `generate` (tokens/s). No pipeline stage imports this module
(dvc.yaml's deps do not list it)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Iterable, Optional

# ------------------------------------------------------------------------------------------- environment
# dvc exp and the repository copies commit: a git identity for machines without one
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "agentrl-test",
    "GIT_AUTHOR_EMAIL": "test@example.invalid",
    "GIT_COMMITTER_NAME": "agentrl-test",
    "GIT_COMMITTER_EMAIL": "test@example.invalid",
}


def tool_env(wandb_mode: Optional[str] = "offline", **extra: str) -> dict:
    """The environment to run the project's tools in a subprocess: os.environ with this interpreter's bin/ first
    on PATH (dvc, accelerate), the git identity, WANDB_MODE (unchanged when None) and `extra`."""
    env = {**os.environ, **GIT_IDENTITY, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if wandb_mode is not None:
        env["WANDB_MODE"] = wandb_mode
    return {**env, **extra}


# ------------------------------------------------------------------------------------------- training
def accelerate_launch(
    config_file: str | Path, module: str, cwd: str | Path, num_processes: int = 2, timeout_s: int = 900
) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file F --num_processes N -m module` in `cwd`, with this interpreter's
    accelerate, W&B offline and one OpenMP thread per process; AssertionError with the output's tail on failure."""
    env = tool_env("offline", OMP_NUM_THREADS="1")
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config_file)]
    cmd += ["--num_processes", str(num_processes), "-m", module]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r


# ------------------------------------------------------------------------------------------- serving
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, log: Optional[Path] = None) -> dict:
    """Poll `base`/health until it answers 200 and return its JSON; RuntimeError (naming `log`) when the
    process exits first or `timeout_s` passes (the process is then terminated)."""
    import httpx

    where = f"; see {log}" if log else ""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {base}/health answered{where}")
        try:
            r = httpx.get(base + "/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"{base}/health did not answer 200 within {timeout_s:g} s{where}")


def start_server(
    model: str | Path,
    port: int,
    *,
    params: Optional[str | Path] = None,
    output: Optional[IO] = None,
    timeout_s: float = 120,
) -> tuple[subprocess.Popen, str]:
    """`uvicorn agentrl.serve:app` on 127.0.0.1:`port` serving `model` (AGENTRL_MODEL_PATH; AGENTRL_PARAMS
    when `params` is given), stdout/stderr to `output` (else inherited); (process, base URL) once healthy."""
    env = {**os.environ, "AGENTRL_MODEL_PATH": str(model)}
    if params is not None:
        env["AGENTRL_PARAMS"] = str(params)
    cmd = [sys.executable, "-m", "uvicorn", "agentrl.serve:app", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        cmd + ["--log-level", "warning"],
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT if output else None,
    )
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, timeout_s, Path(output.name) if output and hasattr(output, "name") else None)
    return proc, base


# -------------------------------------------------------------------------------------------- params
def set_param(params_file: str | Path, dotted: str, value) -> None:
    """Set one value of a params.yaml by its dotted key (`grpo.trainer.learning_rate`); every key above the
    last must exist (a KeyError names the missing one and the file)."""
    import yaml

    from .overrides import OverrideError, set_value

    path = Path(params_file)
    tree = yaml.safe_load(path.read_text())
    try:
        set_value(tree, dotted, value, create=False)
    except OverrideError as e:
        raise KeyError(f"{path}: {e}") from None
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


# ------------------------------------------------------------------------------------- repository copy
# top-level entries a copy of the repository leaves out: pipeline outputs, caches, local tool state
NOT_COPIED = frozenset(
    {
        ".venv",
        ".git",
        ".pytest_cache",
        ".ruff_cache",
        ".hypothesis",
        ".whl",
        ".gl",
        "data",
        "models",
        "checkpoints",
        "eval",
        "metrics",
        "diagnostics",
        "dvclive",
        "runs",
        "wandb",
        "reports",
        "sweeps",
        "gpu_check",
    }
)


def copy_repo(
    src: str | Path, dst: str | Path, *, only: Optional[Iterable[str]] = None, outputs: Iterable[str] = ()
) -> Path:
    """Copy the repository at `src` (code, configs, dvc.yaml, params) to `dst`: every top-level entry but
    NOT_COPIED (or only the ones named in `only`), without __pycache__ / *.egg-info and without .dvc's cache
    and tmp; then each path of `outputs` (e.g. "models", ".dvc/cache") as it is, when it exists."""
    src, dst = Path(src), Path(dst)
    anywhere = shutil.ignore_patterns("__pycache__", "*.egg-info")
    keep = set(only) if only is not None else None

    def ignore(directory, names):
        skip = set(anywhere(directory, names))
        if Path(directory) == src:
            skip |= {n for n in names if n in NOT_COPIED or (keep is not None and n not in keep)}
        if Path(directory) == src / ".dvc":
            skip |= {"cache", "tmp"} & set(names)  # the copy starts with an empty cache
        return skip

    shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
    for p in outputs:
        if (src / p).is_dir():
            shutil.copytree(src / p, dst / p, symlinks=True, dirs_exist_ok=True)
        elif (src / p).is_file():
            (dst / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / p, dst / p)
    return dst


def git_commit_all(repo: str | Path, message: str) -> None:
    """`git init` (when `repo` is not one yet), `git add -A`, `git commit` under a fixed local identity."""
    env = {**os.environ, **GIT_IDENTITY}
    cmds = [["git", "add", "-A"], ["git", "commit", "-qm", message]]
    if not (Path(repo) / ".git").exists():
        cmds.insert(0, ["git", "init", "-q"])
    for cmd in cmds:
        r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} in {repo} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")


# ------------------------------------------------------------------------------------------ benchmarks
def tool_loop_vs_plain(model, tok, prompts: list, toolset, max_new: int, batch_size: int, template_kwargs=None) -> dict:
    """Generated tokens/s of the tool loop (agent.generate_with_tools) against one plain `model.generate` per
    batch on the same prompts and batch size (no tool runs there: the model writes every result itself), greedy,
    after a short warm-up. Tokens are counted up to and including eos; the loop's count includes the tool
    results it inserts, which it does not sample (`loop_sampled_tokens_per_second` leaves them out)."""
    import torch

    from agentrl.agent import generate_with_tools

    def sync():
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    kw = template_kwargs or {}
    generate_with_tools(model, tok, prompts[:2], toolset, 4, batch_size=batch_size, chat_template_kwargs=kw)
    sync()
    t = time.perf_counter()
    rolls = [
        r[0] for r in generate_with_tools(model, tok, prompts, toolset, max_new, batch_size, chat_template_kwargs=kw)
    ]
    sync()
    loop_s = time.perf_counter() - t
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False, **kw) for p in prompts]
    plain_tokens, t = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            seqs = model.generate(
                **enc.to(model.device),
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            for row in seqs[:, enc["input_ids"].shape[1] :].tolist():
                plain_tokens += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    sync()
    plain_s = time.perf_counter() - t
    loop_tokens = sum(r.num_tokens for r in rolls)
    return {
        "loop_tokens_per_second": loop_tokens / loop_s,
        "loop_sampled_tokens_per_second": sum(sum(r.env_mask) for r in rolls) / loop_s,
        "plain_tokens_per_second": plain_tokens / plain_s,
        "ratio": (loop_tokens / loop_s) / (plain_tokens / plain_s),
        "tool_calls": sum(len(r.calls) for r in rolls),
        "problems": len(prompts),
        "device": str(model.device),
    }
