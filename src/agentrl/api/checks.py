"""An agent's request checked before anything runs (agentrl.api.actions): the error every action returns,
argument types, request limits, and params overrides validated against the schema, the agent rules
(docs/security.md) and what `dvc exp run -S` writes.

validate_overrides renders the overrides once (agentrl.experiments.overrides.render), applies them to the workspace's
params.yaml with DVC's own code (overrides.apply), reads the result back as the stages read it and validates
that tree: what is validated is the file the experiment runs with. Every refusal is an APIError naming the key.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Optional

from .. import config
from ..experiments import overrides as overrides_mod
from ..experiments.queue import experiment_name_problem


class APIError(Exception):
    """A failed action; `to_json()` is what the caller gets back."""

    def __init__(self, type_: str, message: str, key: Optional[str] = None, **extra: Any):
        super().__init__(message)
        self.type, self.key, self.message, self.extra = type_, key, message, extra

    def to_json(self) -> dict:
        return {"error": {"type": self.type, "key": self.key, "message": self.message, **self.extra}}


# ---------------------------------------------------------------------------------- arguments, limits
# Limits of one request (every action): its JSON size, nesting, and the number of override keys. Checked first,
# in time linear in the request (and bounded by the limit), so a huge request costs nothing.
MAX_REQUEST_CHARS = 64 * 1024
MAX_DEPTH = 8
MAX_OVERRIDES = 256


def require(args: dict, key: str, typ: type | tuple, default: Any = ..., what: str = "") -> Any:
    """`args[key]` of type `typ` (`default` when absent; ... = required), else APIError naming the key and `what` was
    expected."""
    if key not in args or args[key] is None:
        if default is ...:
            raise APIError("missing_argument", f"'{key}' is required{': ' + what if what else ''}", key=key)
        return default
    value = args[key]
    if not isinstance(value, typ) or (isinstance(value, bool) and typ in (int, (int, float))):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise APIError("wrong_type", f"'{key}' must be {names}, got {type(value).__name__}", key=key)
    return value


def check_known(args: dict, allowed: set[str]) -> None:
    """APIError naming the first argument not in `allowed`."""
    for k in args:
        if k not in allowed:
            raise APIError("unknown_argument", f"unknown argument '{k}'; expected one of {sorted(allowed)}", key=k)


def too_large(args: dict) -> Optional[tuple[str, str]]:
    """(why, argument) when the request exceeds MAX_REQUEST_CHARS / MAX_DEPTH, naming the argument where the
    limit was passed; None when it does not. Iterative, stops as soon as a limit is passed."""
    size = 0
    for key, value in args.items():
        size += len(str(key)) + 4
        stack = [(value, 1)]
        while stack:
            node, depth = stack.pop()
            if depth > MAX_DEPTH + 2:
                return f"nested deeper than {MAX_DEPTH + 2} levels", str(key)[:100]
            if isinstance(node, dict):
                size += 2 + sum(len(str(k)) + 4 for k in node)
                stack.extend((x, depth + 1) for x in node.values())
            elif isinstance(node, (list, tuple)):
                size += 2 + len(node)
                stack.extend((x, depth + 1) for x in node)
            else:
                size += len(node) + 2 if isinstance(node, str) else 8
            if size > MAX_REQUEST_CHARS:
                return f"larger than {MAX_REQUEST_CHARS} characters of JSON", str(key)[:100]
    return None


# ------------------------------------------------------------------------------------ experiment names
def check_experiment_name(name: str) -> None:
    """Refuse a name that is not a plain experiment name (experiments.queue.experiment_name_problem: git's ref
    rules, no revision syntax, not a name git itself resolves). Names of existing branches and tags are checked
    against the repository (api/actions.py).
    """
    why = experiment_name_problem(name)
    if why:
        raise APIError("invalid_value", f"'name' {why}; got {name[:200]!r}", key="name")


# ----------------------------------------------------------------------------------- overrides
# Keys whose values are import paths (`module:attr`): an agent's override may name registry entries (checked by
# config.validate_params without importing anything) or import paths the user's own params.yaml names at the
# same key; never a new one (agent.tools=["os:system"] would run it). agent.environment: a registry name or
# module:Class, when the schema has it.
IMPORT_KEYS = ("agent.tools", "grpo.rewards", "agent.environment")
# Keys whose values are paths or hub ids the stages open: relative, no '..', inside the repository.
PATH_KEYS = ("data.train_file", "data.test_file", "data.hub_dataset", "model.base_model", "serve.model_path")
ACCELERATE_DIR = "configs/accelerate"
# Keys only the user's params.yaml sets: where a model is served (its network exposure).
RESERVED_KEYS = ("serve.host", "agent.environment_url")  # the latter reaches the network with dataset rows
# Pass-through (TRL/PEFT) arguments that reach the network, the filesystem or code: only the user's params.yaml
# sets them (push_to_hub, hub_model_id, *_dir, *_path, accelerator_config, vllm_server_host, ...).
PASSTHROUGH_SECTIONS = ("sft.trainer", "grpo.trainer", "sft.lora", "grpo.lora")
RESERVED_PASSTHROUGH = re.compile(r"(hub|_dir$|_path$|_file$|_config$|_url$|_host$|_port$|token|vllm_server|callback)")


_WRONG_TYPE = re.compile(r"(_type|_parsing)$")


def _kind(err: dict) -> str:
    error_type = err["type"]
    if error_type == "extra_forbidden":
        return "unknown_key"
    if error_type == "missing":
        return "missing_key"
    if _WRONG_TYPE.search(error_type) or error_type in ("literal_error", "enum"):
        return "wrong_type" if error_type not in ("literal_error", "enum") else "invalid_value"
    if error_type in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long"):
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


def read_params(root: Path) -> dict:
    """params.yaml read as the stages read it (config.load_yaml: strict, 1e-6 a number)."""
    return _params_text(root)[1]


def _override_error(error: overrides_mod.OverrideError) -> APIError:
    return APIError(
        error.type, str(error), key=error.key, errors=[{"key": error.key, "type": error.type, "message": error.message}]
    )


def _schema_check(tree: dict, keys: list[str], source: str) -> None:
    try:
        config.validate_params(tree, source)
    except config.ParamsError as e:
        errors = _errors(e, tree, keys)
        first = errors[0] if errors else {"key": None, "type": "invalid_params"}
        raise APIError(first["type"], str(e), key=first["key"], errors=errors) from None


def validate_overrides(root: Path, overrides: Any) -> tuple[dict, list[str], str]:
    """(params, -S arguments, params.yaml text) for the overrides: the arguments rendered once
    (agentrl.experiments.overrides.render), applied to the workspace's params.yaml as `dvc exp run -S` applies them
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
    value = overrides_mod.get(tree, key)
    if isinstance(value, dict):
        return [str(k) for k in value]
    if isinstance(value, list):
        return [x for x in value if isinstance(x, str)]
    return [value] if isinstance(value, str) else []


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
    # a Gymnasium env_id (anywhere under environments, a mixture's members included) that names `module:Env` makes
    # gymnasium import the module: the same rule as the import paths above
    allowed_ids = {
        v for k, v in overrides_mod.leaves(base.get("environments") or {}, "environments") if k.endswith(".env_id")
    }
    for key, value in overrides_mod.leaves(tree.get("environments") or {}, "environments", lists=True):
        if key.endswith(".env_id") and isinstance(value, str) and ":" in value and value not in allowed_ids:
            raise APIError(
                "not_allowed",
                f"{key}: '{value[:100]}' makes gymnasium import a module that params.yaml does not name; an override "
                "may use registered env ids (FrozenLake-v1) or the ones params.yaml already lists",
                key=key,
            )
    for key in RESERVED_KEYS:
        if not overrides_mod.same(overrides_mod.get(tree, key), overrides_mod.get(base, key)):
            raise APIError("not_allowed", f"{key}: only params.yaml sets it, not an override", key=key)
    for key in PATH_KEYS:
        value = overrides_mod.get(tree, key)
        if isinstance(value, str) and not overrides_mod.same(value, overrides_mod.get(base, key)):
            _check_repo_path(root, key, value)
    accel = overrides_mod.get(tree, "distributed.accelerate_config")
    if isinstance(accel, str) and accel != overrides_mod.get(base, "distributed.accelerate_config"):
        _check_repo_path(root, "distributed.accelerate_config", accel, under=ACCELERATE_DIR, must_exist=True)
    for section in PASSTHROUGH_SECTIONS:
        new, old = overrides_mod.get(tree, section), overrides_mod.get(base, section)
        if not isinstance(new, dict):
            continue
        old = old if isinstance(old, dict) else {}
        for arg, value in new.items():
            if arg in old and overrides_mod.same(value, old[arg]):
                continue
            where = f"{section}.{arg}"
            if RESERVED_PASSTHROUGH.search(str(arg)):
                raise APIError(
                    "not_allowed",
                    f"{where}: reaches the network, files or code (hub, paths, servers); only params.yaml sets it",
                    key=where,
                )
            for leaf, item in overrides_mod.leaves(value, where, lists=True):
                if isinstance(item, str) and ("/" in item or "\\" in item or item.startswith(("~", "."))):
                    raise APIError(
                        "not_allowed",
                        f"{leaf}: {item[:100]!r} looks like a path; an override sets values, not paths",
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


def _errors(error: Exception, raw: dict, overrides: list[str]) -> list[dict]:
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
    for line in str(error).splitlines()[1:]:
        match = _LINE.match(line)
        if not match:
            continue
        key, msg = match.groups()
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
