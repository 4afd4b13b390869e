"""`make bench-repro` (`scripts/bench.py --reproducibility`): the cost of reproducibility.mode portable, side by
side with native, on params.yaml's model and trainer configs -> metrics/bench_reproducibility.json
(docs/reproducibility.md). Each side runs in its own process (`--reproducibility-child MODE`), since torch and MKL
fix their kernels per process."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from agentrl.common import write_json
from agentrl.config import load_params

from .measure import machine, stats
from .training import grpo_step_stats, sft_step_times

REPRO_SFT_STEPS = 15  # steps 6..15 timed (sft_step_times leaves 5 out)
REPRO_GRPO_STEPS = 5  # steps 3..5 timed (grpo_step_stats leaves 2 out)
# the figures compared, each read from one child's result
FIGURES = {
    "sft_trainer_step_s": lambda x: x["sft"]["trainer"],
    "sft_plain_step_s": lambda x: x["sft"]["plain_loop"],
    "grpo_step_s": lambda x: x["grpo_seconds_per_step"],
}


def reproducibility_child(mode: str) -> None:
    """One side of `--reproducibility` in its own process, in the scratch directory the parent prepared: SFT and
    GRPO step times under reproducibility.mode `mode`, printed as one `RESULT {json}` line.

    Args:
        mode: "native" or "portable"; the scratch params.yaml must say the same.
    """
    from agentrl.reproducibility import state

    params = load_params()  # the scratch params.yaml, whose mode `import agentrl` applied before torch computed
    assert params.reproducibility.mode == mode, (params.reproducibility, mode)
    sft = sft_step_times(params, False, steps=REPRO_SFT_STEPS)
    grpo = grpo_step_stats(params, steps=REPRO_GRPO_STEPS)
    out = {"mode": mode, "state": state(), "sft": sft, "grpo_seconds_per_step": grpo["seconds_per_step"]}
    print("RESULT " + json.dumps(out), flush=True)


def _scratch_params() -> dict:
    """params.yaml for the scratch directory: the default's shapes and work per step, a small data set, the base
    model not pre-trained, a 2-step SFT adapter, no tracking."""
    from agentrl.config import load_yaml

    p = load_yaml("params.yaml")
    p["data"]["synthetic"].update(num_train=2000, num_test=50)
    p["model"]["pretrain"]["enabled"] = False
    p["sft"]["trainer"].update(max_steps=2, save_strategy="no")
    p["tracking"]["report_to"] = []
    return p


def _alternating_runs(scratch: str, params: dict, repeats: int) -> dict[str, list[dict]]:
    """In `scratch`: prepare, base and sft once, then one child process per mode, alternating native, portable,
    native, ... so a drifting machine load hits both.

    Args:
        params: _scratch_params' tree (its reproducibility.mode is set per child).
        repeats: runs per mode.

    Returns:
        {"native": [child result, ...], "portable": [...]}.
    """
    import yaml

    from agentrl.reproducibility import unpinned_environ

    runs: dict[str, list[dict]] = {"native": [], "portable": []}
    env = {**unpinned_environ(), "WANDB_MODE": "disabled"}
    env.pop("AGENTRL_PARAMS", None)

    def run(cmd: list[str], what: str) -> str:
        r = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"bench: {what} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return r.stdout

    Path(scratch, "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for stage in ("prepare", "base", "sft"):
        run([sys.executable, "-m", f"agentrl.stages.{stage}"], stage)
    for i in range(repeats):
        for mode in ("native", "portable"):
            params.setdefault("reproducibility", {})["mode"] = mode
            Path(scratch, "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            out = run([sys.executable, "-m", "agentrl.benchmarks.bench", "--reproducibility-child", mode], mode)
            line = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if not line:
                raise SystemExit(f"bench: {mode} run {i + 1} printed no result:\n{out[-2000:]}")
            runs[mode].append(json.loads(line[-1][len("RESULT ") :]))
            print(f"{mode} run {i + 1}: {runs[mode][-1]}", flush=True)
    return runs


def _table(res: dict, repeats: int) -> list[str]:
    """The printed comparison: one row per figure, native and portable medians and their ratio.

    Args:
        repeats: runs per mode.
    """
    lines = [
        f"reproducibility.mode portable vs native on {res['machine']}, medians of {repeats} runs per mode "
        "(alternating processes):",
        "",
        "| figure | native s | portable s | portable / native |",
        "|---|---|---|---|",
    ]
    for name in FIGURES:
        r = res[name]
        lines.append(
            f"| {name} | {r['native']['median']:.3f} | {r['portable']['median']:.3f} | "
            f"{r['ratio_portable_over_native']:.2f} |"
        )
    return lines


def reproducibility_cost(repeats: int) -> dict:
    """`make bench-repro`: in a scratch directory (prepare, the base model not pre-trained, a 2-step SFT adapter),
    SFT steps (sft_step_times) and GRPO steps (grpo_step_stats, steps 3..5) in one process per mode, alternating.
    Ratio = portable / native of the medians -> metrics/bench_reproducibility.json; the table is printed.

    Args:
        repeats: runs per mode.

    Returns:
        What metrics/bench_reproducibility.json holds.
    """
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        runs = _alternating_runs(tmp, _scratch_params(), repeats)
    res: dict = {
        "machine": machine(),
        "repeats": repeats,
        "kernels": {m: runs[m][0]["state"] for m in runs},
    }
    for name, get in FIGURES.items():
        med = {m: stats([get(x) for x in runs[m]]) for m in runs}
        res[name] = {**med, "ratio_portable_over_native": med["portable"]["median"] / med["native"]["median"]}
    write_json(here / "metrics/bench_reproducibility.json", res)
    print("\n".join(_table(res, repeats)))
    return res
