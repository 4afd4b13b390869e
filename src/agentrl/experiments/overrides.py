"""Params overrides by dotted key: get/set/flatten on a params tree, and their one rendering for `dvc exp run -S`.

    args = render({"seed": 7, "model.chat_template_kwargs": {"enable_thinking": False}}, base_tree)
    text = apply(params_yaml_text, args)   # params.yaml exactly as `dvc exp run -S <args>` writes it
    tree = load(text)                      # ... read back as the stages read it (config's strict loader)

Every dotted key the project reads, writes or renders goes through here: the agent API, recipes
(scripts/recipe.py), sweeps (scripts/sweep.py, sweep_worker.py), the GPU check and the tests' set_param
(tests/test_overrides.py finds any hand-written copy in src/ and scripts/).

`render` checks each override (`check_key`, `check_value`) and writes it in Hydra's grammar (what `-S` parses):
strings always quoted, a dict value replacing the mapping it names in `base` (`~key` then `++key={...}`: Hydra
and DVC would merge it into the old one), other values `++key=value` (add or override) or, with `add=False`,
`key=value` (override a key params.yaml has; DVC refuses a typo). `render_grid` writes a sweep (`key=v1,v2`,
DVC expands the product). `apply` runs DVC's own override code (dvc.utils.hydra.apply_overrides: ruamel
round-trip load, Hydra's parser, OmegaConf update, DVC's merge and dump) on the text in memory, so what the agent
API validates is the file the experiment runs with, byte for byte (tests/test_security.py checks it against
DVC's function on a file). Interpolations (`${...}`) are refused before rendering: OmegaConf would resolve them
(`${oc.env:SECRET}` reads the environment). Dict keys are limited to what Hydra's grammar writes unquoted
(letters, digits, `_`, `-`): Hydra has no quoted dict keys, so `{"x:1,seed:7,y": 1}` would become three keys.
"""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

KEY_RE = re.compile(r"^[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*$")  # a dotted params key: eval.batch_size, steps.1
DICT_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")  # a dict key Hydra's grammar writes unquoted
CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls except tab and newline, and DEL
MISSING = object()


class OverrideError(ValueError):
    """An override that cannot be written or applied as given; `key` names it."""

    def __init__(self, key: str, message: str, type_: str = "invalid_value"):
        super().__init__(message if message.startswith(key) else f"{key}: {message}")
        self.key, self.message, self.type = key, message, type_


# --------------------------------------------------------------------------------------- dotted keys
def get(tree: Any, dotted: str) -> Any:
    """tree[a][b][c] for "a.b.c"; MISSING when a part is absent. A part that is an integer also matches an
    integer key (data.synthetic.steps.1) or a list index."""
    node = tree
    for p in dotted.split("."):
        if isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
            continue
        if not isinstance(node, dict):
            return MISSING
        if p in node:
            node = node[p]
        elif p.isdigit() and int(p) in node:
            node = node[int(p)]
        else:
            return MISSING
    return node


def set_value(tree: dict, dotted: str, value: Any, create: bool = True) -> None:
    """tree[a][b][c] = value for "a.b.c", the sections created as needed (with `create`; without, a missing
    one is an error); OverrideError naming the section that is a value or missing."""
    node, parts = tree, dotted.split(".")
    for i, p in enumerate(parts[:-1]):
        if p not in node and create:
            node[p] = {}
        elif not isinstance(node.get(p), dict):
            what = "no section" if p not in node else "a value, not a section"
            raise OverrideError(dotted, f"'{'.'.join(parts[: i + 1])}' is {what}", "unknown_key")
        node = node[p]
    node[parts[-1]] = value


def sections(dotted: str) -> list[str]:
    """The sections above a dotted key, outermost first: "a.b.c" -> ["a", "a.b"]."""
    parts = dotted.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def leaves(tree: Any, prefix: str = "", lists: bool = False) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of `tree`, in order: a non-empty dict is walked (and, with `lists`, a
    non-empty list, by index); anything else is a leaf, an empty dict included. Iterative (no recursion limit)."""
    out, stack = [], [(prefix, tree)]
    while stack:
        key, v = stack.pop()
        if isinstance(v, dict) and v:
            items = v.items()
        elif lists and isinstance(v, list) and v:
            items = enumerate(v)
        else:
            out.append((key, v))
            continue
        stack.extend(reversed([(f"{key}.{k}" if key else str(k), x) for k, x in items]))
    return out


def hydra_keys(v: Any) -> Any:
    """A JSON value with its dict keys as Hydra's grammar reads them unquoted: digits are integers
    (`{"1": 0.3}` is written `{1:0.3}`, data.synthetic.steps' own form). For a quick check before `apply`."""
    if isinstance(v, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): hydra_keys(x) for k, x in v.items()}
    if isinstance(v, list):
        return [hydra_keys(x) for x in v]
    return v


# ------------------------------------------------------------------------------------------ checking
def check_key(key: Any) -> str:
    """A dotted params key as `dvc exp run -S` takes it, else OverrideError naming it."""
    if not isinstance(key, str) or not KEY_RE.match(key) or len(key) > 200:
        shown = key if isinstance(key, str) else type(key).__name__
        raise OverrideError(
            str(shown)[:200], "not a dotted params key such as 'eval.batch_size' (letters, digits, '_')", "unknown_key"
        )
    return key


def check_value(key: str, value: Any, max_depth: int = 8) -> None:
    """A JSON value Hydra's grammar can carry unchanged: no interpolation, no control characters, finite
    numbers, dict keys Hydra writes unquoted, at most `max_depth` levels of lists and dicts. Iterative (no
    recursion limit) and linear in the size of the value."""
    import math

    stack = [(value, key, 0)]
    while stack:
        v, where, depth = stack.pop()
        if depth > max_depth:
            raise OverrideError(key, f"nested deeper than {max_depth} levels at {where}", "out_of_range")
        if v is None or isinstance(v, (bool, int)):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                raise OverrideError(key, f"{where}: must be a finite number (got {v!r})", "invalid_value")
        elif isinstance(v, str):
            check_string(key, where, v)
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str) or not DICT_KEY_RE.match(k) or len(k) > 100:
                    raise OverrideError(
                        key,
                        f"{where}: dict key {str(k)[:100]!r} cannot be written in DVC's -S override grammar (Hydra has"
                        " no quoted keys): letters, digits, '_' and '-' only; set other keys in params.yaml",
                        "invalid_value",
                    )
                stack.append((x, f"{where}.{k}", depth + 1))
        else:
            raise OverrideError(key, f"{where}: unsupported value type {type(v).__name__}", "wrong_type")


def check_string(key: str, where: str, s: str) -> None:
    """OverrideError when a string value would be changed by DVC's -S parsing (an interpolation)."""
    if "${" in s:
        raise OverrideError(
            key,
            f"{where}: '${{' is an interpolation (OmegaConf would resolve it, e.g. from the environment); "
            "overrides are plain values",
            "invalid_value",
        )
    m = CONTROL_RE.search(s)
    if m:
        raise OverrideError(key, f"{where}: control character {m.group()!r} in a string", "invalid_value")


def overlapping(keys: list[str]) -> tuple[str, str] | None:
    """(parent, child) when one key is a prefix section of another ('grpo' and 'grpo.rewards'): their order
    would decide the result. Linear in the total length of the keys."""
    given = set(keys)
    for k in keys:
        for parent in sections(k):
            if parent in given:
                return parent, k
    return None


# ------------------------------------------------------------------------------------------ rendering
def hydra_value(v: Any) -> str:
    """A JSON value in the override grammar of `dvc exp run -S` (Hydra's). Check it with `check_value` first:
    this renders, it does not refuse."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        # Hydra's quoted string: a quote is escaped, and so is every backslash before a quote or the end
        v = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", v)
        v = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, v)
        return "'" + v + "'"
    if isinstance(v, list):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"unsupported value type {type(v).__name__}")


def render(overrides: dict, base: dict | None = None, add: bool = True) -> list[str]:
    """The `dvc exp run -S` arguments for `overrides` ({dotted key: JSON value}), each checked first
    (OverrideError naming the key): `++key=value`, or `key=value` without `add`. A dict value that replaces a
    mapping of the params tree `base` deletes it first (`~key`), so the result is the dict given; without `base`
    a dict value is merged into the mapping, as a recipe's leaves are."""
    args = []
    for k, v in overrides.items():
        check_key(k)
        check_value(k, v)
        if isinstance(v, dict) and base is not None and isinstance(get(base, k), dict):
            args.append(f"~{k}")
        args.append(f"{'++' if add else ''}{k}={hydra_value(v)}")
    return args


def render_grid(grid: dict) -> list[str]:
    """The `dvc exp run -S` arguments of a grid sweep ({dotted key: [values]}): `key=v1,v2` each, for keys
    params.yaml has; DVC runs the product. OverrideError naming the key of a value `render` refuses."""
    args = []
    for k, values in grid.items():
        check_key(k)
        for v in values:
            check_value(k, v)
        args.append(f"{k}={','.join(hydra_value(v) for v in values)}")
    return args


# ------------------------------------------------------------------------------------------- applying
@functools.lru_cache(maxsize=4)
def _parsed(text: str):
    from dvc.utils.serialize._yaml import parse_yaml_for_update

    return parse_yaml_for_update(text, "params.yaml")


def apply(text: str, args: list[str]) -> str:
    """params.yaml `text` with the `-S` arguments `args` applied as `dvc exp run` applies them: the body of
    dvc.utils.hydra.apply_overrides (pinned DVC 3.67) on the text in memory. OverrideError when DVC would refuse
    them."""
    from dvc.utils.collections import merge_dicts, remove_missing_keys, to_omegaconf
    from dvc.utils.hydra import to_hydra_overrides
    from dvc.utils.serialize._yaml import dumps_yaml
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.errors import ConfigCompositionException, OverrideParseException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    original = copy.deepcopy(_parsed(text))
    try:
        parsed = to_hydra_overrides(args)
        new = OmegaConf.create(to_omegaconf(original), flags={"allow_objects": True})
        OmegaConf.set_struct(new, True)
        ConfigLoaderImpl._apply_overrides_to_config(parsed, new)
        new = OmegaConf.to_object(new)
    except (ConfigCompositionException, OverrideParseException, OmegaConfBaseException) as e:
        raise OverrideError("overrides", f"dvc exp run -S would refuse them: {str(e).splitlines()[0][:300]}") from None
    merge_dicts(original, new)
    remove_missing_keys(original, new)
    return dumps_yaml(original)


def load(text: str) -> Any:
    """A params.yaml text read as the stages read it (config's strict loader: YAML 1.1 plus `1e-6` floats)."""
    import yaml

    from .. import config

    return yaml.load(text, Loader=config._Loader)


def same(a: Any, b: Any) -> bool:
    """a and b are the same JSON value: bool is no number, int and float are compared as numbers, dict keys as
    strings (JSON has no integer keys: {"1": 0.3} is data.synthetic.steps' {1: 0.3})."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        sa, sb = {str(k): v for k, v in a.items()}, {str(k): v for k, v in b.items()}
        return len(sa) == len(a) and sa.keys() == sb.keys() and all(same(sa[k], sb[k]) for k in sa)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
