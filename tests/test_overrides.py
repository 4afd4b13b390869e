"""agentrl.experiments.overrides is the one place dotted params keys are read, written, flattened and rendered for
`dvc exp run -S`: no other module of src/ or scripts/ does it by hand, and what each caller's arguments make
DVC write into params.yaml is the value asked for."""

import ast

import pytest

from agentrl.experiments import overrides
from conftest import ROOT

MODULE = "src/agentrl/experiments/overrides.py"
# Dotted-key walks outside overrides on purpose, each with its reason (not override logic: no params key is
# rendered or set from a request there). The test fails when one is gone (drop it here) as when a new one appears.
ELSEWHERE = {
    "src/agentrl/common.py:split_metrics": "a metrics file's headline keys, not params: every stage imports common, "
    "and overrides is no stage's dependency (dvc.yaml)",
    "src/agentrl/passthrough.py:_non_finite": "the pass-through check's own walk for non-finite numbers: overrides "
    "imports config (to read params as the stages do), which imports passthrough, so it cannot import it back",
}


def _is_dot_split(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "split"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and node.args[0].value == "."
    )


def _is_dotted_fstring(node: ast.AST) -> bool:
    """f"{a}.{b}": a dotted key joined from two parts."""
    v = node.values if isinstance(node, ast.JoinedStr) else []
    return (
        len(v) == 3
        and isinstance(v[0], ast.FormattedValue)
        and isinstance(v[1], ast.Constant)
        and v[1].value == "."
        and isinstance(v[2], ast.FormattedValue)
    )


def _is_set_argument(node: ast.AST) -> bool:
    """f"++{key}=...", f"+{key}=...", f"~{key}": a Hydra override written by hand."""
    v = node.values if isinstance(node, ast.JoinedStr) else []
    return (
        len(v) >= 2
        and isinstance(v[0], ast.Constant)
        and v[0].value in ("+", "++", "~")
        and isinstance(v[1], ast.FormattedValue)
    )


def override_logic(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) for each piece of dotted-key or `-S` logic in a module's source:
    a dotted key split and walked (a loop over its parts, `*head, last = ...`, a prefix slice), a tree flattened
    into dotted keys (f"{a}.{b}" built while walking a dict's items recursively or from a stack), or a `-S`
    argument rendered by hand (f"++{k}=..." / f"~{k}", or an f-string right after "-S")."""
    tree = ast.parse(source)
    found = []
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def where(line: int) -> str:
        inner = [f for f in funcs if f.lineno <= line <= f.end_lineno]
        return max(inner, key=lambda f: f.lineno).name if inner else "<module>"

    for node in ast.walk(tree):
        if isinstance(node, ast.For) and _is_dot_split(node.iter):
            found.append((node.lineno, "walks a dotted key part by part"))
        if isinstance(node, ast.Assign) and _is_dot_split(node.value):
            if any(
                isinstance(t, (ast.Tuple, ast.List)) and any(isinstance(e, ast.Starred) for e in t.elts)
                for t in node.targets
            ):
                found.append((node.lineno, "splits a dotted key into its sections and last part"))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and _is_dot_split(node.value):
            found.append((node.lineno, "takes the sections of a dotted key"))
        if _is_set_argument(node):
            found.append((node.lineno, "renders a `-S` argument by hand"))
        if isinstance(node, (ast.Tuple, ast.List, ast.Call)):
            items = node.args if isinstance(node, ast.Call) else node.elts
            for a, b in zip(items, items[1:]):
                if isinstance(a, ast.Constant) and a.value == "-S" and isinstance(b, ast.JoinedStr):
                    found.append((b.lineno, "renders a `-S` argument by hand"))
    for f in funcs:
        body = list(ast.walk(f))
        dotted = [n for n in body if _is_dotted_fstring(n)]
        walks_items = any(isinstance(n, ast.Attribute) and n.attr == "items" for n in body)
        recurses = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == f.name for n in body)
        stack = any(isinstance(n, ast.While) for n in body)
        if dotted and walks_items and (recurses or stack):
            found.append((dotted[0].lineno, "flattens a tree into dotted keys"))
    return sorted((line, where(line), what) for line, what in found)


def test_the_scanner_finds_each_kind_of_override_logic():
    """Each rule on a small example of what it stands for (the forms the old code had), and nothing on the
    look-alikes that are not params keys."""
    caught = """
def get(tree, dotted):
    for k in dotted.split("."):
        tree = tree[k]
    return tree
def set_(tree, dotted, v):
    *head, last = dotted.split(".")
def parents(k):
    return [".".join(k.split(".")[:i]) for i in range(1, 3)]
def leaves(tree, prefix=""):
    out = []
    for k, v in tree.items():
        out += leaves(v, f"{prefix}.{k}") if isinstance(v, dict) else [(f"{prefix}.{k}", v)]
    return out
def args(point):
    return [a for k, v in point.items() for a in ("-S", f"{k}={v}")] + [f"++{k}=1" for k in point]
"""
    assert [(line, fn) for line, fn, _ in override_logic(caught)] == [
        (3, "get"),
        (7, "set_"),
        (9, "parents"),
        (13, "leaves"),
        (16, "args"),
        (16, "args"),
    ]
    fine = """
def kind(x):
    return str(x).split(".")[-1]
def loc(param):
    return [p for p in param.split(".")]
def message(section, arg):
    return f"{section}.{arg}: not allowed"
def run(args):
    return ["dvc", "exp", "run", *[x for a in args for x in ("-S", a)]]
"""
    assert override_logic(fine) == []


def test_no_override_logic_outside_its_module():
    """src/ and scripts/ leave dotted keys and `-S` rendering to agentrl.experiments.overrides (file:line named)."""
    sites = {}
    for path in sorted([*ROOT.glob("src/**/*.py"), *ROOT.glob("scripts/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel == MODULE:
            continue
        for line, fn, what in override_logic(path.read_text()):
            sites.setdefault(f"{rel}:{fn}", []).append(f"{rel}:{line} ({fn}): {what}")
    new = [s for site, found in sites.items() if site not in ELSEWHERE for s in found]
    assert not new, "override logic outside agentrl.experiments.overrides (use it instead):\n" + "\n".join(new)
    gone = sorted(set(ELSEWHERE) - set(sites))
    assert not gone, f"no longer found, remove from ELSEWHERE: {gone}"


# ------------------------------------------------------------------------------ what DVC writes is what was asked
PARAMS = "a:\n  s: x\n  n: 1\n  m: {k: 1, j: 2}\nb: 2\n"
TRICKY = [
    1e-6,
    8,
    -0.5,
    True,
    None,
    "a b",
    "é ü",  # the old JSON renderer wrote \u00e9
    "back\\slash",  # ... and doubled this backslash
    "tab\there",
    'it\'s "quoted"',
    "end\\",
    "x=1,y",
    "1e-4",
    "null",
    "true",
    [1, "a", [2.5]],
    {"k": 3, "new-key": "v"},  # the old JSON renderer's quoted keys: DVC refused them
]


def written(args: list[str], key: str):
    """The value at `key` of PARAMS after `dvc exp run -S <args>` (DVC's own code, in memory)."""
    return overrides.get(overrides.load(overrides.apply(PARAMS, args)), key)


@pytest.mark.parametrize("value", TRICKY, ids=repr)
def test_every_rendering_writes_the_value_asked(value):
    """The same value through each caller's rendering: a sweep's point (`key=v`), an agent's override on the
    params tree (`++key=v`, a dict replacing the mapping), a recipe's leaf (`++key=v`, merged)."""
    base = overrides.load(PARAMS)
    mapping = "a.m" if isinstance(value, dict) else "a.n"  # a dict replaces the mapping a.m
    for args, key in [
        (overrides.render({"a.s": value}, add=False), "a.s"),
        (overrides.render({mapping: value}, base), mapping),
        (overrides.render({"c.new": value}), "c.new"),
    ]:
        assert overrides.same(written(args, key), value), (args, written(args, key))


def test_a_grid_writes_each_value_asked():
    """`key=v1,v2,...` as DVC expands it (dvc.utils.hydra.get_hydra_sweeps), one params.yaml per point."""
    from dvc.utils.hydra import get_hydra_sweeps

    values = [v for v in TRICKY if not isinstance(v, dict)]  # a sweep point sets a value; dicts would merge
    points = get_hydra_sweeps({"params.yaml": overrides.render_grid({"a.s": values, "b": [1, 2]})})
    assert len(points) == 2 * len(values)
    got = [(written(p["params.yaml"], "a.s"), written(p["params.yaml"], "b")) for p in points]
    want = [(v, b) for v in values for b in (1, 2)]
    assert all(overrides.same(g, w) for g, w in zip(got, want)), [(g, w) for g, w in zip(got, want) if g != w]


def test_a_sweep_key_params_yaml_lacks_is_refused_by_dvc():
    """`key=v` (add=False, sweeps) overrides a key params.yaml has: DVC refuses a typo instead of adding it."""
    with pytest.raises(overrides.OverrideError, match="dvc exp run -S would refuse"):
        overrides.apply(PARAMS, overrides.render({"a.sss": 1}, add=False))
    assert written(overrides.render({"a.sss": 1}), "a.sss") == 1  # `++`: added


@pytest.mark.parametrize(
    "ov, message",
    [
        ({"a.s": "${oc.env:HOME}"}, "a.s: .*interpolation"),
        ({"a.s": float("nan")}, "a.s: .*finite"),
        ({"a s": 1}, "not a dotted params key"),
        ({"a.m": {"x:1,b:2": 1}}, "a.m: .*dict key"),
    ],
)
def test_render_refuses_what_hydra_would_not_carry_unchanged(ov, message):
    for render in (lambda: overrides.render(ov), lambda: overrides.render_grid({k: [v] for k, v in ov.items()})):
        with pytest.raises(overrides.OverrideError, match=message):
            render()


def test_leaves_sections_and_set_value():
    tree = {"a": {"b": {"c": 1}, "l": [1, {"x": 2}], "e": {}}, "d": None}
    assert overrides.leaves(tree) == [("a.b.c", 1), ("a.l", [1, {"x": 2}]), ("a.e", {}), ("d", None)]
    assert overrides.leaves(tree, "p", lists=True)[1:3] == [("p.a.l.0", 1), ("p.a.l.1.x", 2)]
    assert overrides.sections("a.b.c") == ["a", "a.b"] and overrides.sections("a") == []
    overrides.set_value(tree, "n.m", 3)
    assert tree["n"] == {"m": 3}
    with pytest.raises(overrides.OverrideError, match="'d' is a value, not a section"):
        overrides.set_value(tree, "d.x", 1)
    with pytest.raises(overrides.OverrideError, match="'z' is no section"):
        overrides.set_value(tree, "z.x", 1, create=False)
