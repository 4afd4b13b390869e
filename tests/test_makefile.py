"""The Makefile's own surface: `make help` lists every target; `make exps` fits 100 columns."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def makefile_targets() -> set[str]:
    """Every explicit target of a rule in the Makefile (not .PHONY, pattern or variable-named ones, nor
    target-specific variable lines like `train-ddp: ACCEL = ddp`)."""
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([a-zA-Z0-9_.-]+(?: [a-zA-Z0-9_.-]+)*):(?!=)(.*)$", line)
        if not m or m.group(1).startswith(".") or re.match(r"\s*[A-Z_]+\s*[:?+]?=", m.group(2)):
            continue
        targets |= set(m.group(1).split())
    return targets


def test_make_help_lists_every_target_with_one_line():
    out = subprocess.run(
        ["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    listed = {}
    for line in out.splitlines()[1:]:
        name, _, text = line.strip().partition(" ")
        listed[name] = text.strip()
    targets = makefile_targets()
    assert len(targets) >= 35, sorted(targets)  # the parser found the rules
    assert targets == set(listed), f"not in make help: {sorted(targets - set(listed))}; extra: {set(listed) - targets}"
    assert all(listed.values()), [k for k, v in listed.items() if not v]
    assert max(map(len, out.splitlines())) <= 100


def _exps():
    spec = importlib.util.spec_from_file_location("exps", ROOT / "scripts/exps.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rev(name, seed, p, acc=0.5, executor=None):
    metrics = {
        "metrics/compare.json": {
            "data": {
                "sft_accuracy": acc,
                "grpo_accuracy": 0.93,
                "grpo_minus_sft": 0.93 - acc,
                "p_value": p,
                "grpo_tool_use_rate": 1.0,
            }
        },  # fmt: skip
        "metrics/quantize.json": {"data": {"int8_accuracy": 0.92}},
    }
    params = {"params.yaml": {"data": {"seed": seed, "grpo": {"trainer": {"learning_rate": 5e-4, "beta": 0.0}}}}}
    return {"rev": "f" * 40, "name": name, "data": {"timestamp": "2026-12-01T18:15:38", "metrics": metrics,
                                                   "params": params}, "error": None}  # fmt: skip


def test_make_exps_prints_the_headline_in_100_columns_with_p_in_scientific_notation():
    exps = _exps()
    base = _rev("main", 42, "2.04e-65", acc=0.468)
    long = _rev("a-very-long-experiment-name-from-a-sweep-worker-t17", 43, 3.1e-70)
    long["data"]["params"]["params.yaml"]["data"]["grpo"] = {"trainer": {"learning_rate": 1e-3, "beta": 0.04}}
    base["experiments"] = [{"executor": {"state": "running"}, "revs": [long]}, {"revs": [_rev("seed-44", 44, None)]}]
    text = exps.table(exps.rows([base]))
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    main_row = next(x for x in lines if x.startswith("main"))
    assert main_row.split()[-6:] == ["46.8", "93.0", "+46.2", "2.0e-65", "100.0", "92.0"]
    exp_row = next(x for x in lines if "a-very-long" in x)
    assert "3.1e-70" in exp_row and "running" in exp_row and "…" in exp_row  # shortened, not wrapped
    assert "seed-44" in text and "success" in next(x for x in lines if "seed-44" in x)
    changed = text.split("params changed from the baseline:")[1]
    assert "grpo.trainer.beta=0.04" in changed and "grpo.trainer.learning_rate=0.001" in changed
    assert "seed=43" in changed and "seed=44" in changed


def test_make_exp_runs_dvc_through_the_workspace_guard():
    """`make exp` is a workspace `dvc exp run` through scripts/workspace_run.py: refused while another run holds the
    workspace (tests/test_exp_queue.py) and DVC run by experiments.queue.dvc_command (no shutdown noise)."""
    out = subprocess.run(
        ["make", "-n", "--no-print-directory", "exp", 'DVC_EXP_ARGS=-n lr3 -S seed=7'],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "python scripts/workspace_run.py dvc exp run -n lr3 -S seed=7" in out.stdout, out.stdout
