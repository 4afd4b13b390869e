"""The DVC pipeline itself, run for real in a temporary copy of the repository on a miniature config."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from agentrl.experiments.scratch import git_commit_all, set_param
from conftest import mini_params, tool_env


def run(cmd, cwd, check=True):
    r = subprocess.run(cmd, cwd=cwd, env=tool_env("offline"), capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def ran_stages(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]


SRC = Path(__file__).resolve().parents[1] / "src/agentrl"

# The layering of docs/architecture.md: a module imports only from its own package and from packages of a lower tier.
# Core is the top-level modules (config, common, data, ...); the three top packages are peers.
TIERS = {"core": 0, "envs": 1, "agent": 2, "stages": 3, "api": 4, "serving": 4, "experiments": 4, "benchmarks": 5}
# The crossings allowed besides: the params schema checks names against the environment registry (and nothing else
# below it imports agent code), and the agent API's actions validate and queue experiments (overrides, queue).
ALLOWED_CROSSINGS = {("config", "envs.registry"), ("api", "experiments")}


def module_file(module: str, src: Path = SRC) -> Path:
    """The file of a dotted package module: `stages.sft` -> stages/sft.py, `envs` -> envs/__init__.py."""
    path = src / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def is_module(module: str, src: Path = SRC) -> bool:
    """Whether a dotted name (`envs.registry`, `agent`) is a module or sub-package of the package."""
    path = src / module.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def package_imports(module: str, src: Path = SRC) -> set[str]:
    """The package modules `module` (a dotted name such as `stages.sft`) imports itself, at module level or inside
    functions, as dotted names: `from .x import y`, `from ..envs.registry import y`, `from . import x` (x a module
    of the package, else the package's __init__), `from agentrl.x import y`, `import agentrl.x`."""
    import ast

    package = module.split(".")[:-1] if module_file(module, src).name != "__init__.py" else module.split(".")
    found = set()
    for node in ast.walk(ast.parse(module_file(module, src).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "agentrl":
            base = node.module.split(".")[1:]
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith("agentrl.")}
            continue
        else:
            continue
        for alias in node.names:  # `from base import name`: the module base.name, else an attribute of base
            target = ".".join(base + [alias.name])
            if is_module(target, src):
                found.add(target)
            elif base:
                found.add(".".join(base))
    return found - {module}


def local_imports(module: str, src: Path = SRC) -> set[str]:
    """`module` and the package modules it imports, directly or through each other, with the sub-packages' __init__
    that importing them runs (`stages.sft` runs stages/__init__.py). The package's own __init__ (agentrl/) runs
    for every module and is not listed: it pins the kernels through reproducibility.py, which config imports."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += package_imports(m, src) | {".".join(parts[:i]) for i in range(1, len(parts))}
    return seen


def all_modules(src: Path = SRC) -> list[str]:
    """Every module of the package as a dotted name (a sub-package's __init__ as the sub-package's name)."""
    names = []
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts == ("__init__",):
            continue  # the package itself (every module runs it)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def import_cycle(src: Path = SRC) -> list[str]:
    """One import cycle among the package's modules (['a', 'b', 'a'], ['envs.x', 'envs.y', 'envs.x']), lazy imports
    inside functions included, or [] when there is none. Inside a sub-package too: two modules of `envs/` that
    import each other are one idea split in two files."""
    graph = {m: package_imports(m, src) - {m} for m in all_modules(src)}
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


def layer_of(module: str, tiers: dict = TIERS) -> str:
    """The layer a dotted module belongs to: its sub-package (`stages`), or `core` for a top-level module."""
    head = module.split(".")[0]
    return head if head in tiers else "core"


def layering_violations(src: Path = SRC, tiers: dict = TIERS, allowed: set = ALLOWED_CROSSINGS) -> list[str]:
    """Every import that goes up or sideways across the layers (`envs.x -> agent.tools`), as readable lines.

    Args:
        src: the package directory.
        tiers: layer -> tier; a module may import its own layer and lower tiers.
        allowed: (importer, imported) pairs let through, each a module or a layer name.

    Returns:
        "importer -> imported (layer tier N may not import layer tier M)" per violation, sorted.
    """
    found = []
    for module in all_modules(src):
        for imported in package_imports(module, src):
            mine, theirs = layer_of(module, tiers), layer_of(imported, tiers)
            if mine == theirs or tiers[theirs] < tiers[mine]:
                continue
            if {(module, imported), (mine, theirs), (module, theirs), (mine, imported)} & allowed:
                continue
            found.append(
                f"{module} -> {imported} ({mine} tier {tiers[mine]} may not import {theirs} tier {tiers[theirs]})"
            )
    return sorted(found)


def test_no_import_cycle_among_package_modules():
    assert len(all_modules()) > 40
    assert import_cycle() == [], " -> ".join(import_cycle())


def test_import_cycle_finder_finds_one(tmp_path):
    """The cycle check above can fail: a package where a imports b (inside a function) and b imports a."""
    (tmp_path / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "b.py").write_text("from . import a\n")
    (tmp_path / "c.py").write_text("from .a import f\n")
    assert import_cycle(tmp_path) == ["a", "b", "a"]
    (tmp_path / "b.py").write_text("import json\n")
    assert import_cycle(tmp_path) == []
    (tmp_path / "pkg").mkdir()  # a sub-package module that imports back the module importing it
    (tmp_path / "pkg/__init__.py").write_text("")
    (tmp_path / "pkg/m.py").write_text("from ..c import f\n")
    (tmp_path / "c.py").write_text("from .a import f\nfrom .pkg.m import g\n")
    assert import_cycle(tmp_path) == ["c", "pkg.m", "c"]
    (tmp_path / "c.py").write_text("from .a import f\n")  # two modules of one sub-package, one importing lazily
    (tmp_path / "pkg/m.py").write_text("from .n import h\n")
    (tmp_path / "pkg/n.py").write_text("def h():\n    from .m import g\n")
    assert import_cycle(tmp_path) == ["pkg.m", "pkg.n", "pkg.m"]


def test_package_imports_resolve_relative_imports_in_sub_packages(tmp_path):
    """`from . import x` in a sub-package is the module x when there is one, else the sub-package's __init__;
    `from ..x import y` climbs one package; importing a sub-package module runs the sub-package's __init__."""
    for d in ("envs", "stages"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "__init__.py").write_text("def helper():\n    pass\n")
    (tmp_path / "config.py").write_text("def f():\n    from .envs.registry import TASKS\n")
    (tmp_path / "envs/registry.py").write_text("from . import countdown, helper\n")
    (tmp_path / "envs/countdown.py").write_text("")
    (tmp_path / "stages/sft.py").write_text("from .. import config\nfrom ..envs import countdown\n")
    assert package_imports("envs.registry", tmp_path) == {"envs.countdown", "envs"}
    assert package_imports("stages.sft", tmp_path) == {"config", "envs.countdown"}
    assert local_imports("stages.sft", tmp_path) == {
        "stages.sft",
        "stages",
        "config",
        "envs",
        "envs.registry",
        "envs.countdown",
    }


def test_packages_import_only_downward():
    """core -> envs -> agent -> stages -> {api, serving, experiments} (docs/architecture.md): no module imports a
    layer above its own or a peer, save the crossings ALLOWED_CROSSINGS names."""
    assert {layer_of(m) for m in all_modules()} == set(TIERS), "a sub-package without a layer in TIERS"
    assert layering_violations() == [], "\n".join(layering_violations())
    # config reads the environment registry and nothing else above core: the schema never imports agent code
    assert {m for m in package_imports("config") if layer_of(m) != "core"} == {"envs.registry"}
    assert not {m for m in local_imports("config") if layer_of(m) not in ("core", "envs")}


def test_layering_check_finds_an_upward_import(tmp_path):
    """The layering check above can fail: an environment that imports the tool loop, a stage that imports the API."""
    for d in ("envs", "agent", "stages", "api"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "config.py").write_text("def f():\n    from .envs.registry import TASKS\n")
    (tmp_path / "envs/registry.py").write_text("TASKS = {}\n")
    (tmp_path / "agent/tools.py").write_text("from ..envs.registry import TASKS\n")
    (tmp_path / "stages/sft.py").write_text("from ..agent import tools\n")
    (tmp_path / "api/actions.py").write_text("from ..stages import sft\n")
    assert layering_violations(tmp_path) == []
    (tmp_path / "envs/server.py").write_text("def f():\n    from ..agent.tools import TASKS\n")
    (tmp_path / "stages/sft.py").write_text("from ..agent import tools\nfrom ..api.actions import call\n")
    assert layering_violations(tmp_path) == [
        "envs.server -> agent.tools (envs tier 1 may not import agent tier 2)",
        "stages.sft -> api.actions (stages tier 3 may not import api tier 4)",
    ]
    (tmp_path / "common.py").write_text("from .envs import registry\n")  # core: only config may read the registry
    assert layering_violations(tmp_path)[0] == "common -> envs.registry (core tier 0 may not import envs tier 1)"


def test_number_parsing_is_not_in_the_rewards_dependency_chain_of_data_stages():
    """prepare and base read answers (answers.py) but not the rewards: a reward change does not re-run them."""
    for module in ("stages.prepare", "stages.base", "data", "serving.app", "stages.compare"):
        assert "agent.rewards" not in local_imports(module), module
    assert "answers" in local_imports("stages.prepare") and "answers" in local_imports("agent.rewards")
    for module in ("stages.evaluate", "stages.quantize"):
        assert "stages.export" not in local_imports(module), module


def stage_code_deps(module: str, src: Path = SRC) -> set[str]:
    """The code deps a stage running `module` declares: the file of every module in its import closure, a whole
    sub-package directory when the closure holds every file of it."""
    files = {module_file(m, src) for m in local_imports(module, src)}
    for package in {f.parent for f in files if f.parent != src}:
        if set(package.glob("*.py")) <= files:
            files = {f for f in files if f.parent != package} | {package}
    return {str(f.relative_to(src.parents[1])) for f in files}


def test_every_stage_depends_on_all_the_code_it_runs():
    """A stage's deps list every package module its entry module imports, so `dvc repro` re-runs it when
    any of that code changes, and no other package module, so it re-runs only then."""
    root = Path(__file__).resolve().parents[1]
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert stages
    for name, stage in stages.items():
        module = stage["cmd"].split("-m agentrl.")[1].split()[0]
        needed = stage_code_deps(module)
        declared = {d for d in stage["deps"] if d.startswith("src/")}
        missing = needed - declared
        assert not missing, f"dvc.yaml stage {name!r} runs agentrl.{module} but does not depend on {sorted(missing)}"
        extra = declared - needed
        assert not extra, f"dvc.yaml stage {name!r} runs agentrl.{module}, which never imports {sorted(extra)}"


def test_stage_code_deps_name_a_directory_only_when_the_stage_imports_all_of_it(tmp_path):
    """A sub-package is one dep when the stage imports every file of it, else each file it imports is."""
    pkg = tmp_path / "src/agentrl"
    (pkg / "envs").mkdir(parents=True)
    (pkg / "stages").mkdir()
    for f in ("envs/__init__.py", "stages/__init__.py", "stages/other.py", "envs/b.py", "config.py"):
        (pkg / f).write_text("")
    (pkg / "envs/a.py").write_text("from . import b\n")
    (pkg / "stages/run.py").write_text("from .. import config\nfrom ..envs import a\n")
    assert stage_code_deps("stages.run", pkg) == {
        "src/agentrl/stages/run.py",
        "src/agentrl/stages/__init__.py",
        "src/agentrl/config.py",
        "src/agentrl/envs",
    }
    (pkg / "envs/c.py").write_text("")  # a file of envs the stage never imports
    assert stage_code_deps("stages.run", pkg) == {
        "src/agentrl/stages/run.py",
        "src/agentrl/stages/__init__.py",
        "src/agentrl/config.py",
        "src/agentrl/envs/__init__.py",
        "src/agentrl/envs/a.py",
        "src/agentrl/envs/b.py",
    }


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


ECHO_ENVIRONMENT = '''"""A throwaway built-in: say the row's word back."""

GEN_DEFAULTS = {"length": 3}
ENV_DEFAULTS = {"loud": False}


class Echo:
    def __init__(self, loud: bool = False):
        self.loud, self.word = loud, None

    def reset(self, **row):
        self.word = row.get("word")

    def say(self, word: str) -> str:
        """Say a word.

        Args:
            word: the word.
        """
        return "yes" if word == self.word else "no"


def make_rows(n, rng, split, env_knobs=None, exclude=(), **gen_knobs):
    rows, taken = [], set(exclude)
    while len(rows) < n:
        word = "".join(rng.choice("abcdefgh") for _ in range(gen_knobs.get("length", 3)))
        if word not in taken:
            taken.add(word)
            rows.append({"question": f"Say {word}.", "answer": f"#### {word}", "ground_truth": word, "word": word})
    return rows


def instance_key(row):
    return row["word"]


def correct(row, text, env):
    return text.strip().endswith(row["word"])
'''

ECHO_RUN = """
import json, sys
from pathlib import Path
from agentrl.agent.tools import toolset_from_params
from agentrl.config import validate_params
from agentrl.envs import contract
from agentrl.envs.registry import environment_spec
from agentrl.stages.prepare import prepare

import yaml

params = validate_params(yaml.safe_load(Path(sys.argv[1]).read_text()))
spec = environment_spec(params.agent.environment, params.environments)
contract.check_task_module(spec.task)
episode = toolset_from_params(params.agent, env_params=params.environments).episode({"word": "abc"})
metrics = prepare(params, Path("prepared"), Path("prepare.json"))
import agentrl

print(json.dumps({"gen": spec.gen, "env": spec.env, "tools": list(episode.tools), "written": metrics["written"],
                  "package": agentrl.__file__}))
"""


def test_a_new_builtin_environment_needs_no_dvc_yaml_edit(tmp_path):
    """Issue 54 item 2: a new built-in environment, added as docs/environments.md says (its module in envs/, its
    import and one line in each dict of envs/tasks.py, its params section), is resolved, played and prepared, and
    every stage's declared code deps still match its import closure: dvc.yaml needs no edit."""
    import shutil
    import sys

    src = tmp_path / "src" / "agentrl"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / "envs" / "echo.py").write_text(ECHO_ENVIRONMENT)
    tasks = (src / "envs" / "tasks.py").read_text()
    tasks = tasks.replace("from . import countdown,", "from . import countdown, echo,")
    tasks = tasks.replace(
        "ENVIRONMENTS: dict[str, type] = {\n", 'ENVIRONMENTS: dict[str, type] = {\n    "echo": echo.Echo,\n'
    )
    tasks = tasks.replace("TASKS = {\n", 'TASKS = {\n    "echo": echo,\n')
    assert tasks.count("echo") == 5, "envs/tasks.py no longer has the shape docs/environments.md describes"
    (src / "envs" / "tasks.py").write_text(tasks)

    stages = yaml.safe_load((Path(__file__).resolve().parents[1] / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        module = stage["cmd"].split("-m agentrl.")[1].split()[0]
        declared = {d for d in stage["deps"] if d.startswith("src/")}
        assert stage_code_deps(module, src) == declared, f"stage {name} would need a dvc.yaml edit"
        assert module_file("envs.echo", src) in {module_file(m, src) for m in local_imports(module, src)}

    raw = mini_params()
    raw["agent"].update(environment="echo", tools=[], format="inline")
    raw["environments"]["echo"] = {"num_train": 4, "num_test": 2, "length": 4, "loud": True}
    (tmp_path / "echo.yaml").write_text(yaml.safe_dump(raw))
    (tmp_path / "run.py").write_text(ECHO_RUN)
    env = {**tool_env(), "PYTHONPATH": str(tmp_path / "src")}
    out = subprocess.run(
        [sys.executable, "run.py", "echo.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got.pop("package") == str(src / "__init__.py"), "the run imported another agentrl than the copy"
    assert got == {"gen": {"length": 4}, "env": {"loud": True}, "tools": ["say"],
                   "written": {"sft_train": 4, "rl_train": 4, "test": 2}}  # fmt: skip


def test_bytecode_in_a_directory_dep_is_not_a_change():
    """A stage that depends on a whole sub-package (src/agentrl/envs) must not re-run because Python wrote
    __pycache__ there: DVC ignores bytecode (.dvcignore), checked with DVC's own ignore rules."""
    from dvc.repo import Repo

    root = Path(__file__).resolve().parents[1]
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    folders = {d for s in stages.values() for d in s["deps"] if d.startswith("src/") and not d.endswith(".py")}
    assert "src/agentrl/envs" in folders
    ignore = Repo(str(root)).dvcignore
    for folder in folders:
        assert ignore.is_ignored_file(str(root / folder / "__pycache__" / "registry.cpython-311.pyc")), folder
        assert not ignore.is_ignored_file(str(root / folder / "__init__.py")), folder
