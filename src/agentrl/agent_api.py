"""The pipeline as a tool for agents: JSON in, JSON out, every run a DVC experiment.

    python -m agentrl.agent_api describe
    python -m agentrl.agent_api run_experiment '{"overrides": {"seed": 7}, "name": "seed7"}'
    python -m agentrl.agent_api compare '{"a": "seed7", "b": "workspace"}'

Actions (`call(action, args)`; the MCP server in `agentrl.mcp_server` exposes the same functions):

  describe          params schema (from config.Params), the stages of dvc.yaml, the workspace's metrics
  run_experiment    params overrides -> `dvc exp run` with a name. mode "temp" (default) runs now in a DVC
                    temporary workspace and returns the metrics; "queue" queues it (`dvc exp run --queue`)
                    and starts a queue worker; "workspace" runs it like "temp", then applies the result to
                    the workspace (`dvc exp apply`), so a failed run never touches the workspace
  list_experiments  `dvc.api.exp_show` rows
  compare           two experiments' metrics, and the paired McNemar test (agentrl.compare) when both
                    evaluated the same held-out problems
  evaluate          a model of an experiment (or the workspace) on its first N held-out problems, in a
                    scratch directory (agentrl.evaluate); the workspace's outputs are not written
  status            runs started through this API (stage, progress) and DVC's queue

Every failure is a JSON object {"error": {"type", "key", "message", ...}}, never a traceback. Overrides are
validated against the params schema (config.validate_params) before anything runs. Runs started here are
serialised by a file lock (.dvc/tmp/agentrl_agent/run.lock), so concurrent calls cannot interleave DVC
operations on the repository.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from . import config
from . import overrides as overrides_mod

Progress = Optional[Callable[[float, Optional[float], str], None]]

MODES = ("temp", "queue", "workspace")
EVAL_STAGES = ("base", "sft", "grpo", "merged")
MODEL_CHAINS = {"base": ["base"], "sft": ["base", "sft"], "grpo": ["base", "sft", "grpo"], "merged": ["merged"]}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
STATE_DIR = Path(".dvc") / "tmp" / "agentrl_agent"
LOCK_TIMEOUT_S = 24 * 3600  # a run waits for the one before it rather than failing
TAIL_CHARS = 3000


class APIError(Exception):
    """A failed action; `to_json()` is what the caller gets back."""

    def __init__(self, type_: str, message: str, key: Optional[str] = None, **extra: Any):
        super().__init__(message)
        self.type, self.key, self.message, self.extra = type_, key, message, extra

    def to_json(self) -> dict:
        return {"error": {"type": self.type, "key": self.key, "message": self.message, **self.extra}}


# ------------------------------------------------------------------------------------------ helpers
def _root(root: Optional[str | Path]) -> Path:
    r = Path(root or os.environ.get("AGENTRL_REPO") or ".").resolve()
    if not (r / "dvc.yaml").exists() or not (r / "params.yaml").exists():
        raise APIError("not_a_pipeline_repo", f"{r} has no dvc.yaml and params.yaml", key="root")
    return r


def _env() -> dict:
    env = {
        **os.environ,
        "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
        "DVC_NO_ANALYTICS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    return env


def _state_dir(root: Path) -> Path:
    d = root / STATE_DIR
    d.mkdir(parents=True, exist_ok=True)
    return d


def _dvc(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["dvc", *args], cwd=root, env=_env(), capture_output=True, text=True)
    if check and r.returncode:
        raise APIError(
            "dvc_failed",
            f"dvc {' '.join(args)} exited {r.returncode}: {(r.stderr or r.stdout)[-TAIL_CHARS:].strip()}",
            key=None,
        )
    return r


def _require(args: dict, key: str, typ: type | tuple, default: Any = ..., what: str = "") -> Any:
    if key not in args or args[key] is None:
        if default is ...:
            raise APIError("missing_argument", f"'{key}' is required{': ' + what if what else ''}", key=key)
        return default
    v = args[key]
    if not isinstance(v, typ) or (isinstance(v, bool) and typ in (int, (int, float))):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise APIError("wrong_type", f"'{key}' must be {names}, got {type(v).__name__}", key=key)
    return v


def _check_known(args: dict, allowed: set[str]) -> None:
    for k in args:
        if k not in allowed:
            raise APIError("unknown_argument", f"unknown argument '{k}'; expected one of {sorted(allowed)}", key=k)


def stages(root: Path) -> list[dict]:
    spec = yaml.safe_load((root / "dvc.yaml").read_text()) or {}
    out = []
    for name, s in (spec.get("stages") or {}).items():
        out.append(
            {
                "name": name,
                "cmd": s.get("cmd"),
                "params": s.get("params") or [],
                "outs": [o if isinstance(o, str) else next(iter(o)) for o in s.get("outs") or []],
                "metrics": [m if isinstance(m, str) else next(iter(m)) for m in s.get("metrics") or []],
            }
        )
    return out


def _metrics_files(root: Path) -> list[str]:
    return [m for s in stages(root) for m in s["metrics"]]


def _read_metrics(root: Path, rev: Optional[str], diagnostics: bool = False) -> dict:
    """{metrics file: its JSON} of the workspace (rev None) or of a git revision / experiment; with
    `diagnostics`, the stages' diagnostics/<name>.json outputs instead (timings, memory, histograms)."""
    if diagnostics:
        files = [o for s in stages(root) for o in s["outs"] if o.startswith("diagnostics/")]
    else:
        files = _metrics_files(root)
    out: dict = {}
    if rev is None:
        for f in files:
            p = root / f
            if p.exists():
                out[f] = json.loads(p.read_text())
        return out
    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(root), rev=rev)
    for f in files:
        try:
            out[f] = json.loads(fs.read_text(f))
        except FileNotFoundError:
            continue
    return out


def _summary(metrics: dict) -> dict:
    """The headline numbers: accuracy of every evaluated model, the paired test, training loss/reward."""
    s = {}
    for f, m in metrics.items():
        stem = Path(f).stem
        if stem.startswith("eval_") and "accuracy" in m:
            s[f"{stem[5:]}_accuracy"] = m["accuracy"]
        if stem == "compare":
            for k in ("grpo_minus_sft", "p_value", "ci95"):
                if k in m:
                    s[f"compare.{k}"] = m[k]
    return s


def _resolve(root: Path, name: str, key: str) -> Optional[str]:
    """Experiment name, git revision or "workspace" -> full commit sha (None for the workspace)."""
    if name == "workspace":
        return None
    if len(name) > 200 or name.startswith("-") or overrides_mod.CONTROL_RE.search(name):
        raise APIError(
            "invalid_value", f"'{key}' must be an experiment name or git revision, got {name[:200]!r}", key=key
        )
    from dvc.repo import Repo
    from dvc.scm import RevError, resolve_rev

    with Repo(str(root)) as repo:
        try:
            return resolve_rev(repo.scm, name)
        except RevError:
            known = sorted(e for e in experiment_names(root) if e)
            raise APIError(
                "unknown_experiment",
                f"no experiment or git revision named '{name}'; experiments of "
                f"this baseline: {known or 'none'} (or 'workspace')",
                key=key,
            ) from None


def _exp_rows(root: Path) -> list[dict]:
    import dvc.api

    return dvc.api.exp_show(repo=str(root))


def experiment_names(root: Path) -> list[str]:
    return [r["Experiment"] for r in _exp_rows(root) if r.get("Experiment")]


# ----------------------------------------------------------------------------------- overrides
# Limits of one request (every action): its JSON size, nesting, and the number of override keys. Checked first,
# in time linear in the request (and bounded by the limit), so a huge request costs nothing.
MAX_REQUEST_CHARS = 64 * 1024
MAX_DEPTH = 8
MAX_OVERRIDES = 256

# Keys whose values are import paths (`module:attr`): an agent's override may name registry entries (checked by
# config.validate_params without importing anything) or import paths the user's own params.yaml names at the
# same key; never a new one (agent.tools=["os:system"] would run it). agent.environment: a registry name or
# module:Class, when the schema has it.
IMPORT_KEYS = ("agent.tools", "grpo.rewards", "agent.environment")
# Keys whose values are paths or hub ids the stages open: relative, no '..', inside the repository.
PATH_KEYS = ("data.train_file", "data.test_file", "data.hub_dataset", "model.base_model", "serve.model_path")
ACCELERATE_DIR = "configs/accelerate"
# Keys only the user's params.yaml sets: where a model is served (its network exposure).
RESERVED_KEYS = ("serve.host",)
# Pass-through (TRL/PEFT) arguments that reach the network, the filesystem or code: only the user's params.yaml
# sets them (push_to_hub, hub_model_id, *_dir, *_path, accelerator_config, vllm_server_host, ...).
PASSTHROUGH_SECTIONS = ("sft.trainer", "grpo.trainer", "sft.lora", "grpo.lora")
RESERVED_PASSTHROUGH = re.compile(r"(hub|_dir$|_path$|_file$|_config$|_url$|_host$|_port$|token|vllm_server|callback)")


def _too_large(args: dict) -> Optional[tuple[str, str]]:
    """(why, argument) when the request exceeds MAX_REQUEST_CHARS / MAX_DEPTH, naming the argument where the
    limit was passed; None when it does not. Iterative, stops as soon as a limit is passed."""
    size = 0
    for key, value in args.items():
        size += len(str(key)) + 4
        stack = [(value, 1)]
        while stack:
            v, depth = stack.pop()
            if depth > MAX_DEPTH + 2:
                return f"nested deeper than {MAX_DEPTH + 2} levels", str(key)[:100]
            if isinstance(v, dict):
                size += 2 + sum(len(str(k)) + 4 for k in v)
                stack.extend((x, depth + 1) for x in v.values())
            elif isinstance(v, (list, tuple)):
                size += 2 + len(v)
                stack.extend((x, depth + 1) for x in v)
            else:
                size += len(v) + 2 if isinstance(v, str) else 8
            if size > MAX_REQUEST_CHARS:
                return f"larger than {MAX_REQUEST_CHARS} characters of JSON", str(key)[:100]
    return None


_WRONG_TYPE = re.compile(r"(_type|_parsing)$")


def _kind(err: dict) -> str:
    t = err["type"]
    if t == "extra_forbidden":
        return "unknown_key"
    if t == "missing":
        return "missing_key"
    if _WRONG_TYPE.search(t) or t in ("literal_error", "enum"):
        return "wrong_type" if t not in ("literal_error", "enum") else "invalid_value"
    if t in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long"):
        return "out_of_range"
    return "invalid_value"


_PARAMS_CACHE: dict[Path, tuple[str, Any]] = {}


def _params_text(root: Path) -> tuple[str, dict]:
    """(text, tree) of the workspace's params.yaml, the tree read as the stages read it (config.load_yaml:
    strict, 1e-6 a number); parsed again only when the text changed. The tree is a copy, free to edit."""
    path = root / "params.yaml"
    text = path.read_text()
    cached = _PARAMS_CACHE.get(path)
    if cached is None or cached[0] != text:
        try:
            raw = config.load_yaml(path)
        except config.ParamsError as e:
            raise APIError(
                "invalid_workspace_params", f"the workspace's params.yaml cannot be read: {e}", key=None
            ) from None
        cached = _PARAMS_CACHE[path] = (text, raw if isinstance(raw, dict) else {})
    return text, copy.deepcopy(cached[1])


def _read_params(root: Path) -> dict:
    """params.yaml read as the stages read it (config.load_yaml: strict, 1e-6 a number)."""
    return _params_text(root)[1]


def _override_error(e: overrides_mod.OverrideError) -> APIError:
    return APIError(e.type, str(e), key=e.key, errors=[{"key": e.key, "type": e.type, "message": e.message}])


def _schema_check(tree: dict, keys: list[str], source: str) -> None:
    try:
        config.validate_params(tree, source)
    except config.ParamsError as e:
        errors = _errors(e, tree, keys)
        first = errors[0] if errors else {"key": None, "type": "invalid_params"}
        raise APIError(first["type"], str(e), key=first["key"], errors=errors) from None


def validate_overrides(root: Path, overrides: Any) -> tuple[dict, list[str], str]:
    """(params, -S arguments, params.yaml text) for the overrides: the arguments rendered once
    (agentrl.overrides.render), applied to the workspace's params.yaml as `dvc exp run -S` applies them
    (overrides.apply, DVC's own code), read back as the stages read it, and validated (config.validate_params
    and the agent rules: no interpolation, no new import path, paths inside the repository). What is validated
    is the file the experiment runs with. Raises APIError naming the first offending key; nothing is written."""
    if not isinstance(overrides, dict):
        raise APIError(
            "wrong_type",
            f"'overrides' must be an object {{\"dotted.key\": value}}, got {type(overrides).__name__}",
            key="overrides",
        )
    if len(overrides) > MAX_OVERRIDES:
        raise APIError(
            "request_too_large", f"{len(overrides)} overrides; at most {MAX_OVERRIDES} per run", key="overrides"
        )
    text, raw = _params_text(root)
    try:
        config.validate_params(raw)
    except config.ParamsError as e:
        errors = _errors(e, raw, [])
        raise APIError(
            "invalid_workspace_params",
            f"the workspace's params.yaml is itself invalid, fix it first: {e}",
            key=errors[0]["key"] if errors else None,
            errors=errors,
        ) from None
    keys = list(overrides)
    if not keys:  # `dvc exp run` without -S: params.yaml as it is
        return raw, [], text
    intended = copy.deepcopy(raw)
    try:
        for k, v in overrides.items():
            overrides_mod.check_key(k)
            overrides_mod.check_value(k, v, MAX_DEPTH)
        clash = overrides_mod.overlapping(keys)
        if clash:
            raise overrides_mod.OverrideError(
                clash[1], f"overlaps '{clash[0]}' in the same request: set one or the other", "invalid_value"
            )
        for k, v in overrides.items():
            overrides_mod.set_value(intended, k, overrides_mod.hydra_keys(v))
    except overrides_mod.OverrideError as e:
        raise _override_error(e) from None
    # the quick checks on the values as given (most refusals end here), then the authoritative ones on the
    # params.yaml that `dvc exp run -S` writes
    _schema_check(intended, keys, "params.yaml + overrides")
    _check_policy(root, raw, intended, overrides)
    set_args = overrides_mod.render(overrides, raw)
    try:
        new_text = overrides_mod.apply(text, set_args)
    except overrides_mod.OverrideError as e:
        raise _override_error(e) from None
    applied = overrides_mod.load(new_text)
    for k, v in overrides.items():
        got = overrides_mod.get(applied, k)
        if not overrides_mod.same(got, v):
            shown = "nothing" if got is overrides_mod.MISSING else f"{got!r} ({type(got).__name__})"
            raise APIError(
                "not_representable",
                f"{k}: `dvc exp run -S` would write {shown} to params.yaml, not the value given "
                f"({v!r}); write it differently (e.g. a number, not a string) or set it in params.yaml",
                key=k,
            )
    _schema_check(applied, keys, "params.yaml + overrides, as dvc exp run -S writes it")
    _check_policy(root, raw, applied, overrides)
    return applied, set_args, new_text


def _import_names(tree: dict, key: str) -> list[str]:
    v = overrides_mod.get(tree, key)
    if isinstance(v, dict):
        return [str(k) for k in v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, str)]
    return [v] if isinstance(v, str) else []


def _check_policy(root: Path, base: dict, tree: dict, overrides: dict) -> None:
    """The agent rules on the params an override produces, against the user's params.yaml (`base`)."""
    for key in IMPORT_KEYS:
        allowed = set(_import_names(base, key))
        for name in _import_names(tree, key):
            if ":" in name and name not in allowed:
                raise APIError(
                    "not_allowed",
                    f"{key}: '{name}' is an import path that params.yaml does not name; an override may use the "
                    f"registry's names or the import paths params.yaml already lists there ({sorted(allowed)})",
                    key=key,
                )
    for key in RESERVED_KEYS:
        if not overrides_mod.same(overrides_mod.get(tree, key), overrides_mod.get(base, key)):
            raise APIError("not_allowed", f"{key}: only params.yaml sets it, not an override", key=key)
    for key in PATH_KEYS:
        v = overrides_mod.get(tree, key)
        if isinstance(v, str) and not overrides_mod.same(v, overrides_mod.get(base, key)):
            _check_repo_path(root, key, v)
    accel = overrides_mod.get(tree, "distributed.accelerate_config")
    if isinstance(accel, str) and accel != overrides_mod.get(base, "distributed.accelerate_config"):
        _check_repo_path(root, "distributed.accelerate_config", accel, under=ACCELERATE_DIR, must_exist=True)
    for section in PASSTHROUGH_SECTIONS:
        new, old = overrides_mod.get(tree, section), overrides_mod.get(base, section)
        if not isinstance(new, dict):
            continue
        old = old if isinstance(old, dict) else {}
        for arg, v in new.items():
            if arg in old and overrides_mod.same(v, old[arg]):
                continue
            where = f"{section}.{arg}"
            if RESERVED_PASSTHROUGH.search(str(arg)):
                raise APIError(
                    "not_allowed",
                    f"{where}: reaches the network, files or code (hub, paths, servers); only params.yaml sets it",
                    key=where,
                )
            for leaf, x in overrides_mod.leaves(v, where, lists=True):
                if isinstance(x, str) and ("/" in x or "\\" in x or x.startswith(("~", "."))):
                    raise APIError(
                        "not_allowed",
                        f"{leaf}: {x[:100]!r} looks like a path; an override sets values, not paths",
                        key=where,
                    )


def _check_repo_path(root: Path, key: str, value: str, under: str = "", must_exist: bool = False) -> None:
    """A relative path without '..' that stays inside the repository (under `under`), after symlinks."""
    parts = value.replace("\\", "/").split("/")
    bad = value.startswith(("/", "~")) or ".." in parts or "\\" in value or not value
    target = (root / value).resolve()
    base = (root / under).resolve() if under else root.resolve()
    if bad or not target.is_relative_to(base) or (must_exist and not target.is_file()):
        where = f"a file under {under}/" if under else "a path inside the repository"
        raise APIError(
            "not_allowed",
            f"{key}: must be {where} (relative, no '..'{', existing' if must_exist else ''}), got {value[:200]!r}",
            key=key,
        )


_LINE = re.compile(r"^\s+(\S+?): (.+)$")


def _errors(e: Exception, raw: dict, overrides: list[str]) -> list[dict]:
    """One {key, type, message} per offending key of a ParamsError (its documented `  key.path: message`
    lines; the type from pydantic's error where the schema raised it), the overridden keys first. Linear in
    the number of errors and keys (prefix sets, no pairwise comparison)."""
    from pydantic import ValidationError

    kinds = {}
    try:
        config.Params.model_validate(raw)
    except ValidationError as ve:
        kinds = {".".join(str(p) for p in err["loc"]): _kind(err) for err in ve.errors()}
    out = []
    for line in str(e).splitlines()[1:]:
        m = _LINE.match(line)
        if not m:
            continue
        key, msg = m.groups()
        kind = kinds.get(key) or (
            "unknown_key"
            if "unknown" in msg
            else "wrong_type"
            if re.search(r"\b(type|expected)\b", msg)
            else "invalid_value"
        )
        out.append({"key": key, "type": kind, "message": msg})
    given = set(overrides)
    above = {s for k in overrides for s in overrides_mod.sections(k)}

    def related(err: dict) -> bool:
        key = err["key"]
        return key in above or key in given or any(s in given for s in overrides_mod.sections(key))

    return sorted(out, key=lambda err: not related(err))


# ------------------------------------------------------------------------------------------ runs
class _Run:
    """Progress of one run, mirrored to .dvc/tmp/agentrl_agent/runs/<name>.json for `status`."""

    def __init__(self, root: Path, name: str, mode: str, overrides: dict, progress: Progress):
        self.dir = _state_dir(root) / "runs"
        self.dir.mkdir(exist_ok=True)
        self.file = self.dir / f"{name}.json"
        self.total = len(stages(root))
        self.progress = progress
        self.info = {
            "name": name,
            "mode": mode,
            "overrides": overrides,
            "state": "waiting",
            "stage": None,
            "stages_done": 0,
            "stages_total": self.total,
            "started": time.time(),
            "pid": os.getpid(),
        }
        self._save()

    def _save(self) -> None:
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.info))
        tmp.replace(self.file)

    def update(self, message: str, **kw: Any) -> None:
        self.info.update(kw, message=message)
        self._save()
        if self.progress:
            self.progress(float(self.info["stages_done"]), float(self.total), message)

    def line(self, line: str) -> None:
        m = re.match(r"Running stage '([^']+)'", line) or re.match(r"Stage '([^']+)' didn't change", line)
        if m:
            if self.info["stage"] is not None:
                self.info["stages_done"] += 1
            verb = "running" if line.startswith("Running") else "unchanged"
            self.update(
                f"stage {m.group(1)} ({verb}, {self.info['stages_done'] + 1}/{self.total})",
                stage=m.group(1),
                state="running",
            )

    def close(self) -> None:
        self.file.unlink(missing_ok=True)


@contextlib.contextmanager
def _lock(root: Path, run: _Run):
    from filelock import FileLock, Timeout

    lock = FileLock(str(_state_dir(root) / "run.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        run.update("waiting for another run of this repository to finish", state="waiting")
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        except Timeout:
            raise APIError("busy", "another run held the repository lock for too long", key=None) from None
    try:
        yield
    finally:
        lock.release()


def _stream(root: Path, cmd: list[str], run: _Run) -> tuple[int, str]:
    """Run a dvc command, feeding its output lines to the progress; returns (exit code, output tail)."""
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        errors="replace",
    )
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        run.line(line.strip())
        tail.append(line)
        if len(tail) > 400:
            del tail[:200]
    return proc.wait(), "".join(tail)[-TAIL_CHARS:]


def _failed_stage(output: str) -> Optional[str]:
    m = re.findall(r"failed to reproduce '([^']+)'", output) or re.findall(r"Running stage '([^']+)'", output)
    return m[-1] if m else None


def run_experiment(args: dict, root: Optional[str | Path] = None, progress: Progress = None) -> dict:
    _check_known(args, {"overrides", "name", "mode", "start_queue"})
    r = _root(root)
    overrides = _require(args, "overrides", dict, {}, 'an object {"dotted.key": value}')
    mode = _require(args, "mode", str, "temp")
    if mode not in MODES:
        raise APIError("invalid_value", f"'mode' must be one of {list(MODES)}, got '{mode}'", key="mode")
    start_queue = _require(args, "start_queue", bool, True)
    name = _require(args, "name", str, None)
    if name is None:
        name = f"agent-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    elif not NAME_RE.match(name) or ".." in name or name.endswith(".lock"):
        raise APIError(
            "invalid_value",
            f"'name' must be letters, digits, '.', '_' or '-' (a git ref name), got '{name}'",
            key="name",
        )
    params, set_args, _ = validate_overrides(r, overrides)
    set_args = [x for arg in set_args for x in ("-S", arg)]  # each one `dvc exp run -S <arg>`
    if name in experiment_names(r) or _run_in_progress(r, name):
        raise APIError(
            "name_conflict",
            f"an experiment named '{name}' already exists for this baseline; choose another name",
            key="name",
        )
    run = _Run(r, name, mode, overrides, progress)
    try:
        with _lock(r, run):
            if name in experiment_names(r):  # named by a run that held the lock before us
                raise APIError("name_conflict", f"an experiment named '{name}' already exists", key="name")
            if mode == "queue":
                _dvc(r, "exp", "run", "--queue", "-n", name, *set_args)
                if start_queue:
                    _dvc(r, "queue", "start", "-j", "1")
                run.update("queued", state="queued")
                return {
                    "name": name,
                    "mode": mode,
                    "state": "queued",
                    "overrides": overrides,
                    "next": "call status to follow it, list_experiments/compare once it has run",
                }
            run.update("starting dvc exp run --temp", state="running")
            t0 = time.time()
            code, out = _stream(r, ["dvc", "exp", "run", "--temp", "-n", name, *set_args], run)
            if code:
                raise APIError(
                    "run_failed",
                    f"dvc exp run failed (exit {code}); the workspace is unchanged. Output tail:\n{out}",
                    key=None,
                    stage=_failed_stage(out),
                    name=name,
                )
            rev = _resolve(r, name, "name")
            _check_params_reached(r, rev, params, name)
            applied = False
            if mode == "workspace":
                run.update("applying the experiment to the workspace (dvc exp apply)")
                _dvc(r, "exp", "apply", name)
                applied = True
            metrics = _read_metrics(r, rev)
            run.update("done", state="done", stages_done=run.total)
            return {
                "name": name,
                "mode": mode,
                "rev": rev,
                "applied_to_workspace": applied,
                "overrides": overrides,
                "seconds": round(time.time() - t0, 1),
                "summary": _summary(metrics),
                "metrics": metrics,
                "diagnostics": _read_metrics(r, rev, diagnostics=True),
            }
    finally:
        run.close()


def _run_in_progress(root: Path, name: str) -> bool:
    """A live run of this API holds the name (the progress file of a killed process does not)."""
    f = _state_dir(root) / "runs" / f"{name}.json"
    try:
        return _pid_alive(json.loads(f.read_text()).get("pid"))
    except (OSError, ValueError):
        return False


def _check_params_reached(root: Path, rev: Optional[str], params: dict, name: str) -> None:
    """The experiment ran with exactly the params that were validated (no silent fallback); otherwise the
    experiment is removed and the call fails naming the first differing key."""
    from dvc.api import DVCFileSystem

    got = overrides_mod.load(DVCFileSystem(str(root), rev=rev).read_text("params.yaml"))
    if overrides_mod.same(got, params):
        return
    diff = next(
        (
            k
            for k, v in overrides_mod.leaves(params, lists=True)
            if not overrides_mod.same(overrides_mod.get(got, k), v)
        ),
        "params.yaml",
    )
    _dvc(root, "exp", "remove", name, check=False)
    raise APIError(
        "override_not_applied",
        f"{diff}: the experiment ran with {overrides_mod.get(got, diff)!r}, validated was "
        f"{overrides_mod.get(params, diff)!r}; the experiment '{name}' was removed",
        key=diff,
    )


# --------------------------------------------------------------------------------------- reading
def describe(args: dict, root: Optional[str | Path] = None) -> dict:
    _check_known(args, set())
    r = _root(root)
    params = _read_params(r)
    return {
        "params_schema": config.Params.model_json_schema(),
        "params": params,
        "stages": stages(r),
        "metrics": _read_metrics(r, None),
        "actions": sorted(ACTIONS),
        "override_syntax": {"overrides": {"seed": 7, "eval.batch_size": 16}},
    }


def list_experiments(args: dict, root: Optional[str | Path] = None) -> dict:
    _check_known(args, {"all_commits"})
    r = _root(root)
    import dvc.api

    num = -1 if _require(args, "all_commits", bool, False) else 1
    rows = dvc.api.exp_show(repo=str(r), num=num)
    return {"experiments": [_clean(row) for row in rows]}


def _clean(row: dict) -> dict:
    """exp_show rows: DVC writes '!' for a missing value and NaN for an absent one; JSON wants null."""
    out = {}
    for k, v in row.items():
        if v == "!" or (isinstance(v, float) and v != v):
            v = None
        out[k] = v
    return out


def _correctness(root: Path, rev: Optional[str], stage: str) -> Optional[dict[str, bool]]:
    path = f"eval/{stage}/predictions.jsonl"
    try:
        if rev is None:
            text = (root / path).read_text()
        else:
            from dvc.api import DVCFileSystem

            text = DVCFileSystem(str(root), rev=rev).read_text(path)
    except FileNotFoundError:
        return None
    return {row["id"]: bool(row["correct"]) for row in (json.loads(x) for x in text.splitlines() if x.strip())}


def compare(args: dict, root: Optional[str | Path] = None) -> dict:
    """Metrics of a and b side by side; exact McNemar + paired bootstrap (agentrl.compare) on `stage`'s
    predictions when both evaluated the same problems."""
    from .compare import paired_test

    _check_known(args, {"a", "b", "stage"})
    r = _root(root)
    a = _require(args, "a", str, what="an experiment name, a git revision or 'workspace'")
    b = _require(args, "b", str, what="an experiment name, a git revision or 'workspace'")
    stage = _require(args, "stage", str, "grpo")
    if stage not in EVAL_STAGES:
        raise APIError("invalid_value", f"'stage' must be one of {list(EVAL_STAGES)}, got '{stage}'", key="stage")
    ra, rb = _resolve(r, a, "a"), _resolve(r, b, "b")
    ma, mb = _read_metrics(r, ra), _read_metrics(r, rb)
    sa, sb = _summary(ma), _summary(mb)
    out: dict = {
        "a": {"name": a, "rev": ra, "summary": sa},
        "b": {"name": b, "rev": rb, "summary": sb},
        "difference": {k: sb[k] - sa[k] for k in sa if k.endswith("_accuracy") and k in sb},
        "stage": stage,
    }
    ca, cb = _correctness(r, ra, stage), _correctness(r, rb, stage)
    if ca is None or cb is None:
        missing = [n for n, c in ((a, ca), (b, cb)) if c is None]
        out["paired_test"] = None
        out["paired_test_reason"] = f"no eval/{stage}/predictions.jsonl in {missing}"
    elif set(ca) != set(cb):
        out["paired_test"] = None
        out["paired_test_reason"] = (
            f"the two evaluated different problems ({len(ca)} and {len(cb)}, "
            f"{len(set(ca) & set(cb))} in common): no paired test"
        )
    else:
        seed = _read_params(r).get("seed", 0)
        out["paired_test"] = {**paired_test(ca, cb, seed), "before": a, "after": b}
    return out


def evaluate(args: dict, root: Optional[str | Path] = None, progress: Progress = None) -> dict:
    """Evaluate `stage`'s model of `experiment` on the first `n` held-out problems of that experiment, in a
    scratch copy (its params.yaml, test set and models) so that nothing of the workspace is written."""
    _check_known(args, {"experiment", "stage", "n"})
    r = _root(root)
    exp = _require(args, "experiment", str, "workspace")
    stage = _require(args, "stage", str, "grpo")
    if stage not in EVAL_STAGES:
        raise APIError("invalid_value", f"'stage' must be one of {list(EVAL_STAGES)}, got '{stage}'", key="stage")
    n = _require(args, "n", int, 50)
    if n < 1:
        raise APIError("out_of_range", f"'n' must be >= 1, got {n}", key="n")
    rev = _resolve(r, exp, "experiment")
    needed = ["params.yaml", "data/prepared/test.jsonl"] + [f"models/{m}" for m in MODEL_CHAINS[stage]]
    scratch = Path(tempfile.mkdtemp(prefix="eval-", dir=_state_dir(r)))
    try:
        if progress:
            progress(0.0, 2.0, f"fetching {stage} model of {exp}")
        _fetch(r, rev, needed, scratch, exp)
        if progress:
            progress(1.0, 2.0, f"evaluating {stage} of {exp} on {n} problems")
        proc = subprocess.run(
            [sys.executable, "-m", "agentrl.agent_api", "_eval_worker", json.dumps({"stage": stage, "n": n})],
            cwd=scratch,
            env=_env(),
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise APIError(
                "evaluation_failed",
                f"evaluation exited {proc.returncode}: {(proc.stderr or proc.stdout)[-TAIL_CHARS:]}",
                key=None,
            )
        metrics = json.loads(proc.stdout.strip().splitlines()[-1])
        return {"experiment": exp, "rev": rev, "stage": stage, "n": metrics.get("num_samples"), "metrics": metrics}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fetch(root: Path, rev: Optional[str], paths: list[str], dst: Path, exp: str) -> None:
    """Copy paths of the workspace (rev None) or of an experiment (from git and the DVC cache) into dst."""
    missing = []
    if rev is None:
        for p in paths:
            src = root / p
            if src.is_dir() and any(src.iterdir()):
                shutil.copytree(src, dst / p)
            elif src.is_file():
                (dst / p).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst / p)
            else:
                missing.append(p)
    else:
        from dvc.api import DVCFileSystem

        fs = DVCFileSystem(str(root), rev=rev)
        for p in paths:
            (dst / p).parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get(p, str(dst / p), recursive=True)
            except Exception:  # not in the experiment, or not in the local DVC cache
                missing.append(p)
    if missing:
        raise APIError(
            "missing_outputs",
            f"'{exp}' has no {missing} (or they are not in the local DVC cache): "
            "run the pipeline for it first (run_experiment)",
            key="experiment",
        )


def _eval_worker(args: dict) -> dict:
    from .evaluate import evaluate as run_eval

    params = config.load_params()
    return run_eval(params, args["stage"], name=f"agent_{args['stage']}", limit=args["n"], log_to_trackers=False)


def status(args: dict, root: Optional[str | Path] = None) -> dict:
    _check_known(args, set())
    r = _root(root)
    runs = []
    for f in sorted((_state_dir(r) / "runs").glob("*.json")):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        alive = _pid_alive(info.get("pid"))
        info["elapsed_s"] = round(time.time() - info.get("started", time.time()), 1)
        if not alive:
            info["state"] = "interrupted"
        runs.append(info)
    q = _dvc(r, "queue", "status", check=False)
    queue_rows = [
        row for row in (_clean(x) for x in _exp_rows(r)) if row.get("State") in ("Queued", "Running", "Failed")
    ]
    return {
        "runs": runs,
        "queue": [{"name": x.get("Experiment"), "rev": x.get("rev"), "state": x.get("State")} for x in queue_rows],
        "dvc_queue_status": (q.stdout or q.stderr).strip(),
    }


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


ACTIONS: dict[str, Callable[..., dict]] = {
    "describe": describe,
    "run_experiment": run_experiment,
    "list_experiments": list_experiments,
    "compare": compare,
    "evaluate": evaluate,
    "status": status,
}
PROGRESS_ACTIONS = {"run_experiment", "evaluate"}


def call(
    action: str, args: Optional[dict] = None, root: Optional[str | Path] = None, progress: Progress = None
) -> dict:
    """Run one action; always returns a JSON-serialisable dict (an {"error": ...} object on failure)."""
    try:
        if action not in ACTIONS:
            raise APIError(
                "unknown_action",
                f"unknown action {str(action)[:100]!r}; expected one of {sorted(ACTIONS)}",
                key="action",
            )
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise APIError("wrong_type", f"arguments must be a JSON object, got {type(args).__name__}", key=None)
        too_large = _too_large(args)
        if too_large:
            why, key = too_large
            raise APIError("request_too_large", f"'{key}' is {why}: the request is refused unread", key=key)
        kw = {"progress": progress} if action in PROGRESS_ACTIONS else {}
        result = ACTIONS[action](args, root=root, **kw)
        return json.loads(json.dumps(result, default=str))
    except APIError as e:
        return e.to_json()
    except Exception as e:  # the contract is JSON out, never a traceback
        return APIError("internal_error", f"{type(e).__name__}: {e}", key=None).to_json()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "_eval_worker":
        print(json.dumps(_eval_worker(json.loads(argv[1]))))
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        args = json.loads(argv[1]) if len(argv) > 1 else {}
    except json.JSONDecodeError as e:
        out = APIError("invalid_json", f"arguments are not valid JSON: {e}", key=None).to_json()
    else:
        out = call(argv[0], args, progress=lambda p, t, m: print(f"[{p:g}/{t:g}] {m}", file=sys.stderr))
    print(json.dumps(out, indent=2))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    raise SystemExit(main())
