"""Code a person reads in one sitting (issue 43): no function in src/agentrl over MAX_FUNCTION_LINES lines unless
its docstring says why ("Long because ..."), and no module-level def or class that shadows a Python builtin (a
reward called `format` hid the builtin inside its module), and a docstring on every public module-level function
(issue 54: what it is for, not Args/Returns sections that repeat the signature; none is demanded). Each checker is
also run on a planted file, so a checker that finds nothing cannot pass unnoticed."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agentrl"
MAX_FUNCTION_LINES = 80
LONG_REASON = "Long because"
BUILTIN_NAMES = {name for name in dir(builtins) if not name.startswith("__")}


def _python_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def long_functions(paths: list[Path], max_lines: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (and methods) longer than `max_lines` lines, decorators excluded, whose docstring gives no reason.

    Args:
        paths: the Python files to check.
        max_lines: the most lines a function may have without "Long because" in its docstring.

    Returns:
        One "path:line name (N lines)" per offending function.
    """
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > max_lines and LONG_REASON not in (ast.get_docstring(node) or ""):
                found.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    return found


def shadowed_builtins(paths: list[Path]) -> list[str]:
    """Module-level functions and classes named like a Python builtin (format, input, filter, ...).

    Args:
        paths: the Python files to check.

    Returns:
        One "path:line name" per module-level def or class that shadows a builtin.
    """
    found = []
    for path in paths:
        for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in BUILTIN_NAMES:
                found.append(f"{path}:{node.lineno} {node.name}")
    return found


def undocumented_functions(paths: list[Path]) -> list[str]:
    """Public module-level functions (no leading underscore) without a docstring, as "path:line name"."""
    found = []
    for path in paths:
        for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                if not ast.get_docstring(node):
                    found.append(f"{path}:{node.lineno} {node.name}")
    return found


def test_the_package_is_checked():
    paths = _python_files(SRC)
    assert len(paths) > 30 and SRC / "agent" / "rewards.py" in paths, paths


def test_no_long_function_without_a_reason():
    found = long_functions(_python_files(SRC))
    assert not found, (
        f"functions over {MAX_FUNCTION_LINES} lines: split them, or say in the docstring why not "
        f"('{LONG_REASON} ...'):\n" + "\n".join(found)
    )


def test_no_module_level_def_shadows_a_builtin():
    found = shadowed_builtins(_python_files(SRC))
    assert not found, "module-level names that shadow a builtin (rename them):\n" + "\n".join(found)


def test_long_function_checker_finds_a_planted_one(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    planted = tmp_path / "planted.py"
    planted.write_text(
        f"def too_long():\n{body}\n\n"
        f'def long_with_reason():\n    """{LONG_REASON} it is a table."""\n{body}\n\n'
        f"def short():\n    return 1\n",
        encoding="utf-8",
    )
    assert long_functions([planted]) == [f"{planted}:1 too_long ({MAX_FUNCTION_LINES + 1} lines)"]


def test_builtin_shadowing_checker_finds_a_planted_one(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def format(completions):\n    return completions\n\n\n"
        "class filter:\n    pass\n\n\n"
        "def format_reward(completions):\n"
        "    def input():  # nested: not a module-level name\n        return 1\n\n    return input()\n",
        encoding="utf-8",
    )
    assert shadowed_builtins([planted]) == [f"{planted}:1 format", f"{planted}:5 filter"]


def test_every_public_function_says_what_it_is_for():
    found = undocumented_functions(_python_files(SRC))
    assert not found, "public functions without a docstring:\n" + "\n".join(found)


def test_docstring_checker_finds_a_planted_one(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        'def bare(x):\n    return x\n\n\ndef _private(x):\n    return x\n\n\ndef said(x):\n    """Why."""\n',
        encoding="utf-8",
    )
    assert undocumented_functions([planted]) == [f"{planted}:1 bare"]
