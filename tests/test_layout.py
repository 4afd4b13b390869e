"""The package layout (issue 43, docs/architecture.md): the sub-packages, and no trace of the old flat module paths
(issue 54: no compatibility layer). The import layering is checked in test_dvc_pipeline.py (layering_violations)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

import agentrl

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src/agentrl"
PACKAGES = ("agent", "api", "benchmarks", "envs", "experiments", "serving", "stages")


def test_old_module_paths_are_simply_gone():
    """Issue 54 item 5: no compatibility layer. The flat modules of before issue 43 and the tool loop's names once
    in agentrl.agent raise Python's own errors: no meta-path finder redirects them, no package __getattr__."""
    assert not [f for f in sys.meta_path if type(f).__module__.startswith("agentrl")]
    for old in ("agentrl.sft", "agentrl.agent_api", "agentrl.tools", "agentrl.stage"):
        with pytest.raises(ModuleNotFoundError, match=f"No module named '{old}'"):
            importlib.import_module(old)
    with pytest.raises(ImportError, match="cannot import name 'generate_with_tools'"):
        from agentrl.agent import generate_with_tools  # noqa: F401
    assert not hasattr(importlib.import_module("agentrl.agent"), "__getattr__")
    from agentrl.agent import loop, tools  # the package's modules import as usual

    assert callable(loop.generate_with_tools) and callable(tools.get_tool)


def test_every_module_path_the_commands_run_exists():
    """dvc.yaml's stage commands, the Makefile's `python -m` / uvicorn targets and the shell scripts name modules
    that exist (after a move, a stale path there fails only when someone runs it)."""
    texts = [yaml.safe_dump(yaml.safe_load((ROOT / "dvc.yaml").read_text())), (ROOT / "Makefile").read_text()]
    texts += [p.read_text() for p in sorted((ROOT / "scripts").glob("*.sh"))]
    named = {m for text in texts for m in re.findall(r"(?:-m |uvicorn )(agentrl(?:\.\w+)+)", text)}
    assert {"agentrl.stages.sft", "agentrl.stages.evaluate", "agentrl.api.mcp_server"} <= named, named
    for module in sorted(named):
        assert importlib.util.find_spec(module) is not None, f"{module} is run but does not exist"
    served = re.findall(r"uvicorn (agentrl[\w.]*):(\w+)", (ROOT / "Makefile").read_text())
    assert served == [("agentrl.serving.app", "app")], served


def test_the_tree_has_the_sub_packages_and_none_is_crowded():
    """Where a new stage, environment, reward, route or API action goes can be read from the tree: the seven
    sub-packages exist and none holds more than 12 modules (nor does the top level, the core)."""
    assert agentrl.__file__ == str(SRC / "__init__.py")
    for package in PACKAGES:
        assert (SRC / package / "__init__.py").exists(), package
    for folder in [SRC, *(SRC / p for p in PACKAGES)]:
        modules = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 12, f"{folder.relative_to(ROOT)} holds {len(modules)} modules: {sorted(modules)}"


SCRIPTS_LINE_BUDGET = 800  # issue 43: scripts/ holds command lines; the library code lives in the package


def scripts_path_inserts(tests: Path) -> list[str]:
    """The test files (and lines) that put scripts/ on sys.path to import library code from it.

    Args:
        tests: the folder of test files to read.

    Returns:
        "file:line" for each sys.path insert or append whose line names scripts.
    """
    found = []
    for path in sorted(tests.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"sys\.path\.(insert|append)\(.*scripts", line):
                found.append(f"{path.name}:{number}")
    return found


def test_scripts_are_thin_command_lines_and_no_test_imports_from_them(tmp_path):
    """scripts/ stays a room of command lines (<= 800 lines of Python in all) and tests import the package, not
    scripts/ (a planted insert is found, so the check can fail)."""
    lines = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "scripts").glob("*.py")}
    assert sum(lines.values()) <= SCRIPTS_LINE_BUDGET, sorted(lines.items(), key=lambda item: -item[1])
    assert scripts_path_inserts(ROOT / "tests") == []
    planted = "sys.path." + 'insert(0, str(ROOT / "scripts"))'  # split so that this file does not match itself
    (tmp_path / "test_planted.py").write_text(f"import sys\n{planted}\n")
    assert scripts_path_inserts(tmp_path) == ["test_planted.py:2"]
