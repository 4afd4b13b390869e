"""Docs that match the files (issue 43): every figure in README.md and docs/results.md is read from a committed file.

A *unit* is a paragraph, a list item, a table row or a heading. Its *sources* are the committed files and folders it
names (a link, or a path in backticks) plus those of a `<!-- source: path, path -->` comment earlier in its section
(until the next heading). A folder stands for the JSON/CSV/YAML files directly in it; a link to a folder's README.md
for that folder. The check loads every source and, for each figure of the unit, wants a value there that rounds to it:

- percentages (`46.8%`, and the CI bounds right after one, `(42.5–51.2)`): a fraction x with 100·x, or x itself;
- point differences (`+47.0`, `−16.6 points`): the same, sign ignored (files store |GRPO − SFT| either way round);
- p-values (`p = 2.04e-65`, `p = 0.0039`): a number or numeric string, to the digits shown;
- counts of problems (`500 held-out problems`, `gains 239`, `4 lost`): an integer, exactly.

Any time in minutes (`28 min 47 s`, `4.4 min`) must name its CPU (Xeon, EPYC, ...) in the same unit (for a table
row: the row or the table's header), because the machines here differ about 2x in speed.

Exemptions, explicit and few: the level of an interval (`95% CI`), fenced code blocks (commands and sample traces,
not results), a unit carrying `<!-- unchecked: why -->`, and a section after such a comment on its own line (until
the next heading); at most MAX_UNCHECKED such comments per document.
"""

from __future__ import annotations

import ast
import csv
import fnmatch
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIGURE_DOCS = ("README.md", "docs/results.md", "docs/experiments.md")
LINK_DOCS = (
    "README.md",
    "docs/results.md",
    "docs/architecture.md",
    "docs/experiments.md",
    "docs/envs/countdown/README.md",
    "docs/envs/countdown-nofeedback/README.md",
)
MAX_UNCHECKED = 2
README_MAX_LINES = 150

CPU = re.compile(r"Xeon|EPYC|Ryzen|Threadripper|Core i[3579]|Apple M\d|Graviton", re.I)
MINUTES = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?min\b")
SOURCE_COMMENT = re.compile(r"<!--\s*source:\s*(.*?)\s*-->")
UNCHECKED = re.compile(r"<!--\s*unchecked:\s*\S.*?-->")
PERCENT = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s?%(?:\s*\((\d+(?:\.\d+)?)\s?[–-]\s?(\d+(?:\.\d+)?)\))?")
POINTS = re.compile(r"(?<![\w.])(?:[+−](\d+(?:\.\d+)?)|-(\d+(?:\.\d+)?)(?=\s*points))(?![\w.%×])")
P_VALUE = re.compile(r"\bp\s?=\s?(\d+(?:\.\d+)?(?:e[-−]?\d+)?)")
COUNT = re.compile(
    r"(?<![\w.])(\d[\d,]*)\s+(?:held-out\s+)?(?:problems|instances|episodes)\b"
    r"|\b(?:gains|gained|loses|lost)\s+(\d+)(?![\w.,%])|(?<![\w.])(\d+)\s+(?:gained|lost)\b"
)
DATA_SUFFIXES = (".json", ".csv", ".yaml", ".yml")


@dataclass
class Unit:
    """A paragraph, list item, table row or heading of a markdown file."""

    line: int
    text: str
    sources: list[str] = field(default_factory=list)
    header: str = ""  # a table row's header row
    unchecked: bool = False  # in a section exempted by an `<!-- unchecked: why -->` line, or carrying one


def units(text: str) -> list[Unit]:
    """Split markdown into units, each with the section's `<!-- source: -->` paths; fenced code is left out.

    Args:
        text: the markdown.

    Returns:
        The units in order.
    """
    found: list[Unit] = []
    section: list[str] = []
    exempt = False
    current: Unit | None = None
    header = ""
    in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            in_code, current = not in_code, None
            continue
        if in_code:
            continue
        if stripped.startswith("#"):
            section, current, header, exempt = [], None, "", False
            found.append(Unit(number, stripped))
            continue
        if UNCHECKED.fullmatch(stripped):
            exempt, current = True, None
            found.append(Unit(number, stripped, unchecked=True))
            continue
        comment = SOURCE_COMMENT.search(stripped)
        if comment and stripped.startswith("<!--"):
            section = section + [p.strip() for p in comment.group(1).split(",") if p.strip()]
            current = None
            continue
        if not stripped:
            current, header = None, ""
            continue
        if stripped.startswith("|"):
            current = None
            if re.fullmatch(r"\|[\s|:-]+\|", stripped):
                continue
            if not header:
                header = stripped
            found.append(Unit(number, stripped, list(section), header, exempt))
            continue
        if current is None or re.match(r"([-*]|\d+\.)\s", stripped):
            current = Unit(number, stripped, list(section), unchecked=exempt)
            found.append(current)
        else:
            current.text += " " + stripped
    return found


def named_paths(text: str) -> list[str]:
    """Paths a unit names: link targets and backticked tokens that look like paths."""
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    ticks = [t for t in re.findall(r"`([^`\s]+)`", text) if "/" in t or t.endswith(DATA_SUFFIXES)]
    return [p.split("#")[0] for p in links + ticks if not re.match(r"[a-z]+://", p) and p.split("#")[0]]


def resolve(path: str, doc_dir: Path, root: Path) -> list[Path]:
    """The data files a named path stands for (none when it names nothing committed)."""
    for base in (doc_dir, root):
        if "*" in path:
            matches = sorted(base.glob(path))
            if matches:
                return [m for m in matches if m.suffix in DATA_SUFFIXES]
            continue
        target = base / path
        if target.name == "README.md":
            target = target.parent
        if target.is_dir():
            return sorted(p for p in target.iterdir() if p.suffix in DATA_SUFFIXES)
        if target.is_file():
            return [target] if target.suffix in DATA_SUFFIXES else []
    return []


def numbers_in(value: object) -> list[float]:
    """Every number in a loaded JSON/YAML value, numeric strings (`"2.04e-65"`) included."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        try:
            return [float(value)]
        except ValueError:
            return []
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers_in(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers_in(v)]
    return []


def load_numbers(path: Path) -> list[float]:
    """The numbers in one committed data file; an unreadable file is named in the error."""
    try:
        if path.suffix == ".json":
            return numbers_in(json.loads(path.read_text()))
        if path.suffix == ".csv":
            return [n for row in csv.reader(path.read_text().splitlines()) for cell in row for n in numbers_in(cell)]
        return numbers_in(yaml.safe_load(path.read_text()))
    except (ValueError, yaml.YAMLError) as err:
        raise AssertionError(f"{path}: not readable as {path.suffix[1:]}: {err}") from err


def rounds_to(shown: str, values: list[float], scales: tuple[float, ...] = (100.0, 1.0)) -> bool:
    """Whether some value, times one of the scales, rounds to the figure as shown (to its decimals)."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    target = float(shown)
    half = 0.5 * 10**-decimals + 1e-9
    return any(abs(abs(v) * s - target) <= half for v in values for s in scales)


def p_matches(shown: str, values: list[float]) -> bool:
    """Whether some value equals the p-value to the significant digits shown (`2e-65` matches 2.04e-65)."""
    shown = shown.replace("−", "-")
    target = float(shown)
    if target == 0:
        return 0.0 in values
    mantissa = shown.split("e")[0].replace(".", "").lstrip("0")
    exponent = math.floor(math.log10(target))
    half = 0.5 * 10 ** (exponent - max(len(mantissa), 1) + 1) * (1 + 1e-9)
    return any(abs(v - target) <= half for v in values)


def figures(text: str) -> list[tuple[str, str]]:
    """(kind, figure as written) for every checked figure in a unit's text (code spans and link targets removed)."""
    prose = re.sub(r"`[^`]*`|\]\([^)]*\)|<!--.*?-->|\b95%(?= CI| confidence| interval| paired)", " ", text)
    found = []
    for m in PERCENT.finditer(prose):
        found += [("percent", g) for g in m.groups() if g is not None]
    found += [("points", a or b) for a, b in POINTS.findall(prose)]
    found += [("p", p) for p in P_VALUE.findall(prose)]
    found += [("count", next(g for g in m.groups() if g)) for m in COUNT.finditer(prose)]
    return found


def figure_matches(kind: str, figure: str, values: list[float]) -> bool:
    """Whether a figure as written matches one of its sources' values.

    Args:
        kind: percent, points, p or count (figures()).
        figure: the figure as the doc writes it.
        values: every number in the unit's sources.

    Returns:
        True when some value rounds to it (an exact integer for a count).
    """
    if kind == "p":
        return p_matches(figure, values)
    if kind == "count":
        return float(figure.replace(",", "")) in values
    return rounds_to(figure, values)


def check_figures(doc: Path, root: Path = ROOT) -> list[str]:
    """Every problem with the figures and times of one markdown file, each naming the file and line.

    Args:
        doc: the markdown file.
        root: the repository root paths are resolved against (after the doc's own folder).

    Returns:
        One message per figure without a matching value in its sources, per figure without sources, per time in
        minutes without a CPU, and one if the document has more than MAX_UNCHECKED exemptions.
    """
    problems = []
    cache: dict[Path, list[float]] = {}
    all_units = units(doc.read_text())
    exemptions = sum(len(UNCHECKED.findall(u.text)) for u in all_units)
    if exemptions > MAX_UNCHECKED:
        problems.append(f"{doc.name}: {exemptions} `unchecked` exemptions, at most {MAX_UNCHECKED}")
    for unit in all_units:
        where = f"{doc.name}:{unit.line}"
        if MINUTES.search(unit.text) and not CPU.search(unit.text + " " + unit.header):
            problems.append(f"{where}: a time in minutes without its CPU (name it: Intel Xeon, AMD EPYC, ...)")
        if unit.unchecked or UNCHECKED.search(unit.text):
            continue
        shown = figures(unit.text)
        if not shown:
            continue
        files = [f for p in unit.sources + named_paths(unit.text) for f in resolve(p, doc.parent, root)]
        if not files:
            problems.append(f"{where}: figures {[f for _, f in shown]} but no committed source named")
            continue
        values = [n for f in files for n in cache.setdefault(f, load_numbers(f))]
        for kind, figure in shown:
            if not figure_matches(kind, figure, values):
                names = ", ".join(sorted({str(f.relative_to(root)) for f in files}))
                problems.append(f"{where}: {kind} {figure} is not in its sources ({names})")
    return problems


@pytest.mark.parametrize("name", FIGURE_DOCS)
def test_every_figure_is_read_from_a_committed_file(name):
    problems = check_figures(ROOT / name)
    assert not problems, "\n".join(problems)


def test_the_check_fails_on_a_planted_wrong_figure_and_a_time_without_cpu(tmp_path):
    readme = (ROOT / "README.md").read_text()
    assert "46.8%" in readme, "the plant needs the README's SFT accuracy"
    planted = tmp_path / "README.md"
    planted.write_text(readme.replace("46.8%", "64.8%", 1) + "\nThe whole pipeline took 12 min 3 s.\n")
    problems = check_figures(planted)
    assert any("percent 64.8 is not in its sources" in p for p in problems), problems
    assert any("a time in minutes without its CPU" in p for p in problems), problems
    assert len(problems) == 2, problems  # nothing else in the copy fails


def test_a_figure_without_a_source_and_too_many_exemptions_fail(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# x\n\nGRPO gains 12.5% (p = 0.01).\n\n```\n99.9% in code is not checked\n```\n")
    assert check_figures(doc) == ["doc.md:3: figures ['12.5', '0.01'] but no committed source named"]
    doc.write_text("".join(f"\n{k}% <!-- unchecked: a test -->\n" for k in range(MAX_UNCHECKED + 1)))
    assert check_figures(doc) == [f"doc.md: {MAX_UNCHECKED + 1} `unchecked` exemptions, at most {MAX_UNCHECKED}"]
    doc.write_text("## a\n<!-- unchecked: a test -->\n\n| 12.5% |\n\nand 1.5%\n\n## b\n\n7.5%\n")
    assert check_figures(doc) == ["doc.md:10: figures ['7.5'] but no committed source named"]  # until the heading


def test_section_sources_rounding_and_p_values(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"acc": 0.468, "ci": [0.4247, 0.5118], "p": "2.04e-65", "n": 239}))
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- source: m.json -->\n| a | b |\n|---|---|\n| SFT | 46.8% (42.5–51.2), +46.8, p = 2e-65, gains 239 |\n"
    )
    assert check_figures(doc, tmp_path) == []
    doc.write_text("<!-- source: m.json -->\nSFT 46.9%, p = 3e-65, 238 problems.\n")
    assert [p.split(": ", 1)[1].split(" is")[0] for p in check_figures(doc, tmp_path)] == [
        "percent 46.9",
        "p 3e-65",
        "count 238",
    ]


@pytest.mark.parametrize("name", LINK_DOCS)
def test_relative_links_point_at_committed_paths(name):
    doc = ROOT / name
    broken = [
        target
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
        if not re.match(r"[a-z]+://|#|mailto:", target) and not (doc.parent / target.split("#")[0]).exists()
    ]
    assert not broken, f"{name}: links to missing paths {broken}"


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}"


# ------------------------------------------------------------------------------------------ code references
# Issue 54 item 6: the code a doc names in backticks exists. Checked: the current docs (README.md, docs/*.md but the
# history, the real-model results' READMEs); records of past runs (docs/envs/*, docs/repro-runs/*, docs/history.md)
# name the code of the commit they were made at. A reference is one of:
#   `make target`                      a target of the Makefile (globs such as `make sweep-*` match one)
#   `path/file.py`                     a file: from the repository root, src/agentrl/, the doc's folder, or the tail
#                                      of a path in the repository (`stages/export.py`, `export.py`)
#   `module.name`, `module.Class.attr`  (with `agentrl.` or without, a module as short as its last part, a call's
#   `python -m agentrl.module`          arguments allowed) a module of src/agentrl and, after it, a name defined or
#                                      imported at its top level (then a method or attribute of that class)
# A dotted name that is a params.yaml key (`data.calculator_share`, `grpo.trainer.beta`) is a knob, not code.
SRC = ROOT / "src/agentrl"
CODE_REF_DOCS = sorted(
    {"README.md"}
    | {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "history.md"}
    | {str(p.relative_to(ROOT)) for p in (ROOT / "docs/real").glob("*/README.md")}
)
PASSTHROUGH_PARENTS = ("trainer", "lora", "environments", "reward_kwargs", "rewards", "env_kwargs", "config", "knobs")
DOTTED = re.compile(r"(?:python -m )?((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)(?:\(.*\))?")


@functools.cache
def package_modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package by dotted name (`stages.export`, `agent` for agent/__init__.py)."""
    out = {}
    for f in src.rglob("*.py"):
        parts = list(f.relative_to(src).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


@functools.cache
def top_level_names(path: Path) -> dict[str, set[str]]:
    """A module's top-level names (defined, assigned or imported), each class with its own members' names."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {
                getattr(n, "name", None) or getattr(getattr(n, "target", None), "id", "")
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.AnnAssign))
            } | {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names[t.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
    return names


def is_params_key(parts: list[str], params: dict) -> bool:
    """Whether `parts` walks params.yaml, or ends in a pass-through section it reaches (TRL/PEFT/environment knobs)."""
    node: object = params
    for i, part in enumerate(parts):
        if isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return i > 0 and parts[i - 1] in PASSTHROUGH_PARENTS
    return True


@functools.cache
def repository_index(root: Path) -> tuple[frozenset, tuple, dict]:
    """What the references are checked against, read once per repository: the Makefile's targets, the repository's
    .py files (outside .venv) and params.yaml."""
    targets = frozenset(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", (root / "Makefile").read_text(), re.M))
    py_files = tuple(str(p.relative_to(root)) for p in root.rglob("*.py") if ".venv" not in p.relative_to(root).parts)
    return targets, py_files, yaml.safe_load((root / "params.yaml").read_text())


def code_reference_problem(ref: str, doc_dir: Path, root: Path = ROOT, src: Path = SRC) -> str | None:
    """Why a backticked reference names code that does not exist, or None (also for text that is no reference)."""
    targets, py_files, params = repository_index(root)
    if m := re.match(r"make\s+([\w*-]+)", ref):
        return None if m.group(1).startswith("-") or fnmatch.filter(targets, m.group(1)) else "no such make target"
    if re.fullmatch(r"[\w./-]+\.py", ref):
        if any((base / ref).exists() for base in (root, src, doc_dir)):
            return None
        return None if any(p == ref or p.endswith("/" + ref) for p in py_files) else "no such file"
    if re.search(r"\.(json|jsonl|ya?ml|csv|md|txt|gguf|safetensors|bin|pt|pth|lock|toml|log|png|svg)$", ref):
        return None  # a data file's name (`prepare.json`), not code
    if not (m := DOTTED.fullmatch(ref)):
        return None
    parts = m.group(1).split(".")
    qualified = parts[0] == "agentrl"
    parts = parts[1:] if qualified else parts
    if not qualified and is_params_key(parts, params):
        return None
    modules = package_modules(src)
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        files = [f for d, f in modules.items() if d == name or (not qualified and d.endswith("." + name))]
        if not files:
            continue
        rest = parts[k:]
        for f in files:
            names = top_level_names(f)
            if not rest or (rest[0] in names and (len(rest) == 1 or not names[rest[0]] or rest[1] in names[rest[0]])):
                return None
        return f"{'.'.join(rest)} is not defined in {', '.join(str(f.relative_to(root)) for f in files)}"
    return "no such module in src/agentrl" if qualified else None


def code_reference_problems(doc: Path, root: Path = ROOT, src: Path = SRC) -> list[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # commands and sample output, not references
    found = []
    for ref in re.findall(r"`([^`\n]+)`", text):
        if why := code_reference_problem(ref.strip(), doc.parent, root, src):
            found.append(f"{doc.relative_to(root) if doc.is_relative_to(root) else doc.name}: `{ref}`: {why}")
    return found


@pytest.mark.parametrize("name", CODE_REF_DOCS)
def test_the_code_a_doc_names_exists(name):
    problems = code_reference_problems(ROOT / name)
    assert not problems, "\n".join(problems)


def test_the_code_reference_check_fails_on_planted_references(tmp_path):
    """It fails on a function, module, file and make target that do not exist, and passes on real ones and knobs."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "Call `agent.loop.generate_with_tool` (sic), `agentrl.stages.nonexistent`, `stages/nothing.py`, `make no-such`;"
        " `agent.generate_with_tools` (the old path). Real: `agent.loop.generate_with_tools`,"
        " `common.checkpoint_problem`, `stages/export.py`, `make test`, `data.calculator_share`, `grpo.trainer.beta`,"
        " `tools.Episode.run`, `metrics/prepare.json`.\n"
    )
    problems = [p.split(": `")[1].split("`")[0] for p in code_reference_problems(doc, ROOT, SRC)]
    assert problems == [
        "agent.loop.generate_with_tool",
        "agentrl.stages.nonexistent",
        "stages/nothing.py",
        "make no-such",
        "agent.generate_with_tools",
    ]
