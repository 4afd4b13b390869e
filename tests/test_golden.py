"""Golden hashes: a miniature base + SFT + GRPO run whose weights' sha256 are committed (tests/golden_hashes.json).

Any change of the training numerics (a stage's code, the tiny model, TRL/PEFT/torch versions, the defaults of
params.yaml that conftest.mini_params derives from) changes them and fails this test. The run isolates the
training numerics: its problems are written here (data.source jsonl, no synthetic generator), with no tools
(agent.tools: [], no tool loop) and under reproducibility.mode portable (the same bytes on any x86-64 CPU
with AVX2). When a change is intended, regenerate and commit the hashes with the reason:

    .venv/bin/python tests/test_golden.py --update      # rewrites tests/golden_hashes.json

`run_pipeline` is shared with tests/test_reproducibility.py (two kernel dispatches, same bytes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import mini_params  # noqa: E402

GOLDEN = Path(__file__).with_name("golden_hashes.json")
STAGES = ("base", "sft", "grpo")
UPDATE = ".venv/bin/python tests/test_golden.py --update"

# One subprocess per run, so that `import agentrl` pins the kernels before torch starts (as in a stage process).
# argv: working directory, stages to run (comma-separated), CPU count the stages see ("" = the machine's).
RUNNER = """
import hashlib, json, os, sys
from pathlib import Path
os.chdir(sys.argv[1])
if sys.argv[3]:
    os.cpu_count = lambda: int(sys.argv[3])  # the stages' native thread choice (common.configure_cpu_threads)
    os.sched_getaffinity = lambda pid: set(range(int(sys.argv[3])))
import agentrl  # applies params.yaml `reproducibility` before torch starts
from agentrl.stages import base, grpo, prepare, sft
from agentrl.config import load_params
from agentrl.reproducibility import state
params = load_params()
prepare.prepare(params)
run = {"base": base.build_tiny, "sft": sft.train, "grpo": grpo.train}
stages = sys.argv[2].split(",")
for s in stages:
    run[s](params)
out = {s: {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(Path("models", s).glob("*.safetensors"))}
       for s in stages}
print("RESULT " + json.dumps({"weights": out, "state": state()}))
"""


def golden_params(mode: str = "portable") -> dict:
    """The miniature config (conftest.mini_params) on the problems below, without tools, no checkpoints."""
    p = mini_params()
    p["data"].update(source="jsonl", train_file="train.jsonl", test_file="test.jsonl", eval_max_samples=None)
    p["agent"]["tools"] = []
    p["tracking"]["report_to"] = []
    for stage in ("sft", "grpo"):
        p[stage]["trainer"]["save_strategy"] = "no"
    p["reproducibility"] = {"mode": mode, "threads": 2}
    return p


def problems(n: int, offset: int = 0) -> list[dict]:
    """GSM8K-format rows written here, so the generator's changes do not reach the golden run."""
    rows = []
    for i in range(offset, offset + n):
        a, b = 3 + i, 2 + (13 * i) % 9  # every question differs
        rows.append(
            {
                "question": f"Ann has {a} pens and buys {b} more. How many pens?",
                "answer": f"{a}+{b}={a + b}\n#### {a + b}",
            }
        )
    return rows


def run_pipeline(workdir: Path, params: dict, stages=STAGES, env: dict | None = None, cpus: str = "") -> dict:
    """prepare + `stages` in a fresh process in `workdir` -> {"weights": {stage: {file: sha256}}, "state": ...}.
    `env` adds to the environment (e.g. ATEN_CPU_CAPABILITY, MKL_CBWR: another CPU's kernel dispatch)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", problems(200)), ("test.jsonl", problems(16, offset=1000))):
        (workdir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    from agentrl.reproducibility import unpinned_environ

    # this process's environment without the kernel pins `import agentrl` put there (params.yaml of the cwd)
    full_env = {**unpinned_environ(), "WANDB_MODE": "disabled", **(env or {})}
    full_env.pop("AGENTRL_PARAMS", None)
    cmd = [sys.executable, "-c", RUNNER, str(workdir), ",".join(stages), cpus]
    r = subprocess.run(cmd, cwd=workdir, env=full_env, capture_output=True, text=True, timeout=900)
    lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    if r.returncode or not lines:
        raise AssertionError(f"miniature run failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "trl", "peft", "accelerate")}


def compare(got: dict, want: dict) -> list[str]:
    """One line per weight file whose sha256 differs from the golden one (or is missing on either side)."""
    lines = []
    for stage in STAGES:
        g, w = got.get(stage, {}), want.get(stage, {})
        for name in sorted(set(g) | set(w)):
            if g.get(name) != w.get(name):
                lines.append(f"models/{stage}/{name}: sha256 {g.get(name)} (golden {w.get(name)})")
    return lines


def _needs_portable_cpu():
    from agentrl.reproducibility import cpu_problem

    why = cpu_problem()
    if why:
        pytest.skip(f"golden hashes are for reproducibility.mode portable on x86-64 with AVX2: {why}")


def test_golden_hashes(tmp_path):
    _needs_portable_cpu()
    golden = json.loads(GOLDEN.read_text())
    out = run_pipeline(tmp_path, golden_params())
    assert out["state"]["aten_cpu_capability"] == "AVX2" and out["state"]["threads"] == 2, out["state"]
    diff = compare(out["weights"], golden["weights"])
    now = versions()
    assert not diff, (
        "the miniature base + SFT + GRPO run no longer gives the committed weights (tests/golden_hashes.json):\n  "
        + "\n  ".join(diff)
        + f"\nlibrary versions now {now}, when the hashes were written {golden.get('versions')}."
        + "\nA numeric change reached the training code (stage code, tiny model, params.yaml defaults, pinned "
        f"versions). If it is intended, regenerate the hashes with `{UPDATE}` and commit tests/golden_hashes.json "
        "saying why; if not, find what changed."
    )


def test_compare_names_each_changed_file():
    want = {"base": {"model.safetensors": "a"}, "sft": {"x.safetensors": "b"}, "grpo": {"y.safetensors": "c"}}
    got = {"base": {"model.safetensors": "a"}, "sft": {"x.safetensors": "B"}, "grpo": {}}
    assert compare(got, want) == [
        "models/sft/x.safetensors: sha256 B (golden b)",
        "models/grpo/y.safetensors: sha256 None (golden c)",
    ]
    assert compare(want, want) == []


def update() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = run_pipeline(Path(d), golden_params())
    GOLDEN.write_text(
        json.dumps({"weights": out["weights"], "state": out["state"], "versions": versions()}, indent=2) + "\n"
    )
    print(f"wrote {GOLDEN}: {json.dumps(out['weights'], indent=2)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(f"usage: {UPDATE}")
    update()
