"""The DVC pipeline itself, run for real in a temporary copy of the repository on a miniature config."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from agentrl.scratch import git_commit_all, set_param
from conftest import mini_params, tool_env


def run(cmd, cwd, check=True):
    r = subprocess.run(cmd, cwd=cwd, env=tool_env("offline"), capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]


SRC = Path(__file__).resolve().parents[1] / "src/agentrl"


def package_imports(module: str, src: Path = SRC) -> set[str]:
    """The package modules `module` imports itself, at module level or inside functions: `from .x import y`,
    `from . import x`, `from agentrl.x import y`, `import agentrl.x`, and in a subpackage `from ..x import y`."""
    import ast

    found = set()
    path = src / f"{module}.py"
    if not path.exists():  # a subpackage (envs/): what its modules import
        files = sorted((src / module).glob("*.py"))
        return {m for f in files for m in package_imports(f"{module}/{f.stem}", src) if m != module}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and "/" in module:
            continue  # inside a subpackage: `from . import x` is the subpackage itself, its directory is the dep
        if isinstance(node, ast.ImportFrom) and node.level == ("/" in module) + 1:  # `from ..x` in a subpackage
            found |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("agentrl."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("agentrl.")}
    return found


def local_imports(module: str, src: Path = SRC) -> set[str]:
    """`module` and the package modules it imports, directly or through each other."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += package_imports(m, src)
    return seen


def import_cycle(src: Path = SRC) -> list[str]:
    """One import cycle among the package's modules (['a', 'b', 'a']), or [] when there is none."""
    modules = [p.stem for p in src.glob("*.py")] + [p.name for p in src.iterdir() if (p / "__init__.py").exists()]
    graph = {m: package_imports(m, src) for m in modules}
    done, path = set(), []

    def visit(m):
        if m in path:
            return path[path.index(m) :] + [m]
        if m in done or m not in graph:
            return []
        path.append(m)
        for d in sorted(graph[m]):
            if cycle := visit(d):
                return cycle
        path.pop()
        done.add(m)
        return []

    for m in sorted(graph):
        if cycle := visit(m):
            return cycle
    return []


def test_no_import_cycle_among_package_modules():
    assert len(list(SRC.glob("*.py"))) > 10
    assert import_cycle() == [], " -> ".join(import_cycle())


def test_import_cycle_finder_finds_one(tmp_path):
    """The cycle check above can fail: a package where a imports b (inside a function) and b imports a."""
    (tmp_path / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    (tmp_path / "c.py").write_text("from .a import f\n")
    assert import_cycle(tmp_path) == ["a", "b", "a"]
    (tmp_path / "b.py").write_text("import json\n")
    assert import_cycle(tmp_path) == []
    (tmp_path / "pkg").mkdir()  # a subpackage that imports back the module importing it
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/m.py").write_text("from ..c import f\n")
    (tmp_path / "c.py").write_text("from .a import f\nfrom .pkg.m import g\n")
    assert import_cycle(tmp_path) == ["c", "pkg", "c"]


def test_number_parsing_is_not_in_the_rewards_dependency_chain_of_data_stages():
    """prepare and base read answers (answers.py) but not the rewards: a reward change does not re-run them."""
    for module in ("prepare", "base", "data", "serve", "compare"):
        assert "rewards" not in local_imports(module), module
    assert "answers" in local_imports("prepare") and "answers" in local_imports("rewards")
    for module in ("evaluate", "quantize"):
        assert "export" not in local_imports(module), module


def test_every_stage_depends_on_all_the_code_it_runs():
    """A stage's deps list every package module its entry module imports, so `dvc repro` re-runs it when
    any of that code changes, and no other package module, so it re-runs only then."""
    root = Path(__file__).resolve().parents[1]
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert stages
    for name, stage in stages.items():
        module = stage["cmd"].split("-m agentrl.")[1].split()[0]
        needed = {f"src/agentrl/{m}" + ("" if (SRC / m).is_dir() else ".py") for m in local_imports(module)}
        declared = {d for d in stage["deps"] if d.startswith("src/")}
        missing = needed - declared
        assert not missing, f"dvc.yaml stage {name!r} runs agentrl.{module} but does not depend on {sorted(missing)}"
        extra = declared - needed
        assert not extra, f"dvc.yaml stage {name!r} runs agentrl.{module}, which never imports {sorted(extra)}"


@pytest.fixture
def repo(copy_repo):
    (copy_repo / "params.yaml").write_text(yaml.safe_dump(mini_params(), sort_keys=False))
    git_commit_all(copy_repo, "init")
    return copy_repo


def test_prepare_stage_caching(repo):
    out = run(["dvc", "repro", "prepare"], repo).stdout
    assert ran_stages(out) == ["prepare"]
    assert (repo / "data/prepared/test.jsonl").exists() and (repo / "metrics/prepare.json").exists()
    assert json.loads(run(["dvc", "status", "--json", "prepare"], repo).stdout) == {}  # nothing changed
    assert ran_stages(run(["dvc", "repro", "prepare"], repo).stdout) == []
    set_param(repo / "params.yaml", "grpo.trainer.learning_rate", 1e-5)
    assert ran_stages(run(["dvc", "repro", "prepare"], repo).stdout) == []
    set_param(repo / "params.yaml", "data.max_samples", 50)
    assert list(json.loads(run(["dvc", "status", "--json", "prepare"], repo).stdout)) == ["prepare"]  # changed
    assert ran_stages(run(["dvc", "repro", "prepare"], repo).stdout) == ["prepare"]
    assert json.loads((repo / "metrics/prepare.json").read_text())["written"]["sft_train"] == 50


def test_full_pipeline_then_grpo_only_change(repo):
    out = run(["dvc", "repro"], repo).stdout
    stages = ran_stages(out)
    for s in (
        "prepare",
        "base",
        "sft",
        "grpo",
        "eval_base",
        "eval_sft",
        "eval_grpo",
        "compare",
        "export",
        "eval_quantized",
        "card",
    ):
        assert s in stages, out[-2000:]
    assert run(["dvc", "status"], repo).stdout.strip() == "Data and pipelines are up to date."
    assert ran_stages(run(["dvc", "repro"], repo).stdout) == []
    metrics = run(["dvc", "metrics", "show", "--json"], repo).stdout
    assert "eval_grpo.json" in metrics and "accuracy" in metrics
    # `dvc plots show` renders the training curves and the accuracy per stage from the run's outputs
    plots = json.loads(run(["dvc", "plots", "show", "--json"], repo).stdout)
    for name, field in (
        ("SFT loss", "loss"),
        ("SFT learning rate", "learning_rate"),
        ("GRPO reward", "reward"),
        ("GRPO completion length", "mean_length"),
        ("Accuracy per stage", "accuracy"),
    ):
        values = plots["data"][name][0]["content"]["data"]["values"]
        assert values and all(field in v or "reward_std" in v for v in values), name
    stages = {v["stage"] for v in plots["data"]["Accuracy per stage"][0]["content"]["data"]["values"]}
    assert stages == {"base", "sft", "grpo"}, stages
    # no plot declared in dvc.yaml errors on the default params, and each one has data
    assert not plots.get("errors"), plots.get("errors")
    declared = [next(iter(p)) for p in yaml.safe_load((repo / "dvc.yaml").read_text())["plots"]]
    assert all(plots["data"][name][0]["content"]["data"]["values"] for name in declared), declared
    compare_inputs = ("metrics/eval_grpo.json", "eval/grpo/predictions.jsonl")  # what compare reads of eval_grpo
    before = [(repo / f).read_bytes() for f in compare_inputs]
    set_param(repo / "params.yaml", "grpo.trainer.learning_rate", 2e-4)
    rerun = ran_stages(run(["dvc", "repro"], repo).stdout)
    # compare re-runs only when the new GRPO model's evaluation changed (timings are diagnostics, not its inputs)
    changed = before != [(repo / f).read_bytes() for f in compare_inputs]
    expected = {"grpo", "eval_grpo", "export", "eval_quantized", "card"} | ({"compare"} if changed else set())
    assert set(rerun) == expected, (rerun, changed)
    assert json.loads((repo / "metrics/export.json").read_text())["passed"]
