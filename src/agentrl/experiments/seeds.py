"""`make seeds N=3`: the pipeline over N seeds as DVC experiments, and the spread of its headline figures.

    python scripts/seeds.py -n 3 [--first 42] [--jobs 1]

Queues `dvc exp run --queue -S seed=K --name seed-K` for K = first .. first+N-1 (default first: params.yaml's
seed, so the committed run is one of them and comes from DVC's run cache), runs the queue with JOBS DVC queue
workers (`agentrl.experiments.queue`; stages whose inputs a seed does not change are reused from the cache), then
reads each experiment's metrics with `dvc.api` and writes the aggregate:

- docs/seeds.json: per stage (base, sft, grpo, merged, merged_int8) mean, sample sd, min and max of accuracy and
  tool use over the seeds; the paired GRPO - SFT test of each seed (metrics/compare.json: difference, exact
  McNemar p, problems gained and lost) and pooled over the seeds (exact McNemar on all the discordant pairs);
- docs/seeds.md: the same as tables; and docs/results.md's block between the `seeds:start` / `seeds:end` markers.

`seed` reaches every stage (the synthetic problems, the tiny model's initialisation, SFT, GRPO sampling), so each
seed also draws its own held-out problems: the spread is over the whole pipeline. Experiments named seed-K that
already succeeded on this commit are reused, not re-run. The model card (`card` stage, which reads
docs/seeds.json) and `make report` show the spread next to the committed run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from agentrl.experiments import overrides
from agentrl.experiments.queue import dvc, run_queue

OUT_JSON = Path("docs/seeds.json")
OUT_MD = Path("docs/seeds.md")
README = Path("docs/results.md")  # its seeds block (the README links it)
MARKERS = ("<!-- seeds:start -->", "<!-- seeds:end -->")
# stage -> its evaluation metrics file; the figures aggregated per stage
STAGES = {
    "base": "metrics/eval_base.json",
    "sft": "metrics/eval_sft.json",
    "grpo": "metrics/eval_grpo.json",
    "merged": "metrics/eval_merged.json",
    "merged_int8": "metrics/eval_merged_int8.json",
}
FIGURES = ("accuracy", "tool_use_rate")
COMPARE = "metrics/compare.json"
COMPARE_DETAILS = "diagnostics/compare.json"  # grpo_vs_sft: only_before_correct / only_after_correct / n


def experiment_states() -> dict[str, str]:
    """The experiments on this commit.

    Returns:
        Experiment name -> state (Success, Queued, Failed, ...).
    """
    import dvc.api

    return {r["Experiment"]: r["State"] for r in dvc.api.exp_show() if r.get("Experiment")}


def queue_and_run(seeds: list[int], jobs: int) -> None:
    """Queue `seed-K` for each seed not already run on this commit (a failed or queued one afresh), run the queue."""
    states, queued = experiment_states(), []
    for k in seeds:
        name = f"seed-{k}"
        if states.get(name) == "Success":
            print(f"{name}: already run on this commit, reused")
            continue
        if name in states:  # failed or left queued by an interrupted run: queue it afresh
            dvc("exp", "remove", name)
        dvc("exp", "run", "--queue", "-S", *overrides.render({"seed": k}, add=False), "--name", name)
        queued.append(name)
    if queued:
        run_queue(queued, jobs)


def exp_commit(name: str) -> str:
    """The commit of experiment `name` on this baseline (refs/exps/<baseline>/<name>, as `dvc exp` stores it).

    Returns:
        Its commit; ValueError when it has no ref on this commit.
    """
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    ref = f"refs/exps/{head[:2]}/{head[2:]}/{name}"
    r = subprocess.run(["git", "rev-parse", "--verify", "-q", ref], capture_output=True, text=True)
    if r.returncode:
        raise ValueError(f"experiment {name}: no {ref} (run on another commit? see `dvc exp show`)")
    return r.stdout.strip()


def _metrics(path: str, name: str) -> dict:
    """`path` as the experiment committed it (metrics and diagnostics are git-tracked `cache: false` outputs).

    Args:
        path: a metrics or diagnostics file.

    Returns:
        Its JSON; ValueError naming the experiment and the file when it is missing or not JSON.
    """
    r = subprocess.run(["git", "show", f"{exp_commit(name)}:{path}"], capture_output=True, text=True)
    if r.returncode:
        raise ValueError(f"experiment {name}: {path} missing (see `dvc queue logs {name}`)")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as e:
        raise ValueError(f"experiment {name}: {path} is not valid JSON ({e})") from None


def collect(seeds: list[int]) -> list[dict]:
    """Each seed's figures from its experiment: accuracy and tool use per stage, the paired GRPO - SFT test.

    Args:
        seeds: the seeds (their experiments seed-K must have succeeded).

    Returns:
        One run per seed.
    """
    states = experiment_states()
    failed = [f"seed-{k} ({states.get(f'seed-{k}', 'missing')})" for k in seeds if states.get(f"seed-{k}") != "Success"]
    if failed:
        sys.exit(f"seeds: experiments did not succeed: {', '.join(failed)}; see `dvc queue logs <name>`")
    runs = []
    for k in seeds:
        name = f"seed-{k}"
        stages = {}
        for stage, path in STAGES.items():
            m = _metrics(path, name)
            stages[stage] = {f: m.get(f) for f in FIGURES}
        cmp = _metrics(COMPARE, name)
        paired = _metrics(COMPARE_DETAILS, name).get("grpo_vs_sft")
        if not paired:
            raise ValueError(f"experiment {name}: {COMPARE_DETAILS} has no grpo_vs_sft (rerun the compare stage)")
        runs.append(
            {
                "seed": k,
                "experiment": name,
                "stages": stages,
                "grpo_minus_sft": cmp["grpo_minus_sft"],
                "ci95": cmp["ci95"],
                "p_value": float(cmp["p_value"]),  # text in scientific notation since metrics/compare.json shows it
                "gained": paired["only_after_correct"],
                "lost": paired["only_before_correct"],
                "n": paired["n"],
            }
        )
    return runs


def spread(values: list) -> dict | None:
    """mean, sample sd (None for one value), min, max of the numbers among `values` (None when there are none).

    Args:
        values: one figure per seed (None where a seed lacks it).

    Returns:
        {mean, sd, min, max, n}, or None.
    """
    xs = [v for v in values if isinstance(v, (int, float))]
    if not xs:
        return None
    return {
        "mean": statistics.fmean(xs),
        "sd": statistics.stdev(xs) if len(xs) > 1 else None,
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def aggregate(runs: list[dict]) -> dict:
    """The spread over the seeds: per stage and figure, of GRPO - SFT, and the paired test per seed and pooled.

    Returns:
        What docs/seeds.json holds (without commit and seconds).
    """
    from agentrl.stages.compare import mcnemar_exact

    gained, lost = sum(r["gained"] for r in runs), sum(r["lost"] for r in runs)
    return {
        "seeds": [r["seed"] for r in runs],
        "stages": {stage: {f: spread([r["stages"][stage][f] for r in runs]) for f in FIGURES} for stage in STAGES},
        "grpo_minus_sft": spread([r["grpo_minus_sft"] for r in runs]),
        "paired_per_seed": [
            {k: r[k] for k in ("seed", "grpo_minus_sft", "ci95", "p_value", "gained", "lost", "n")} for r in runs
        ],
        "pooled": {
            "test": "exact McNemar on the discordant pairs of all seeds together",
            "problems": sum(r["n"] for r in runs),
            "gained": gained,
            "lost": lost,
            "difference": (gained - lost) / max(1, sum(r["n"] for r in runs)),
            "p_value": mcnemar_exact(lost, gained),
        },
        "runs": runs,
    }


def _pct(s: dict | None) -> str:
    """A spread as `mean% ± sd (min–max)`, `–` for none."""
    if s is None:
        return "–"
    sd = "" if s["sd"] is None else f" ± {100 * s['sd']:.1f}"
    return f"{100 * s['mean']:.1f}%{sd} ({100 * s['min']:.1f}–{100 * s['max']:.1f})"


def markdown(agg: dict) -> str:
    """The spread as markdown: per stage mean ± sd (min–max), then the paired test per seed and pooled."""
    seeds = ", ".join(map(str, agg["seeds"]))
    lines = [
        f"Over {len(agg['seeds'])} seeds ({seeds}; `make seeds`, docs/seeds.json): mean ± sample sd (min–max).",
        "",
        "| model | accuracy | tool use |",
        "|---|---|---|",
    ]
    for stage, figs in agg["stages"].items():
        lines.append(f"| {stage} | {_pct(figs['accuracy'])} | {_pct(figs['tool_use_rate'])} |")
    d, pooled = agg["grpo_minus_sft"], agg["pooled"]
    sd = "" if d["sd"] is None else f" ± {100 * d['sd']:.1f}"
    lines += [
        "",
        f"GRPO − SFT: {100 * d['mean']:+.1f}{sd} points (min {100 * d['min']:+.1f}, max {100 * d['max']:+.1f}); "
        f"pooled over the seeds: {pooled['gained']} problems gained, {pooled['lost']} lost of {pooled['problems']}, "
        f"exact McNemar p = {pooled['p_value']:.2g}.",
        "",
        "| seed | GRPO − SFT (points) | paired 95% CI | exact McNemar p | gained / lost |",
        "|---|---|---|---|---|",
    ]
    for r in agg["paired_per_seed"]:
        lines.append(
            f"| {r['seed']} | {100 * r['grpo_minus_sft']:+.1f} | {100 * r['ci95'][0]:+.1f} … {100 * r['ci95'][1]:+.1f} "
            f"| {r['p_value']:.2g} | {r['gained']} / {r['lost']} |"
        )
    return "\n".join(lines) + "\n"


def update_readme(text: str, path: Path = README) -> bool:
    """Replace the block between the README's seeds markers with `text`.

    Args:
        path: the file holding the markers (docs/results.md).

    Returns:
        False when the file or the markers are absent (nothing written).
    """
    if not path.is_file():
        return False
    readme = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(MARKERS[0]) + r".*?" + re.escape(MARKERS[1]), re.S)
    if not pattern.search(readme):
        return False
    path.write_text(pattern.sub(lambda _: f"{MARKERS[0]}\n{text}{MARKERS[1]}", readme), encoding="utf-8")
    return True


def write(agg: dict, seconds: float) -> None:
    """docs/seeds.json, docs/seeds.md and docs/results.md's seeds block; the markdown printed."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    OUT_JSON.parent.mkdir(parents=True, exist_ok=True)
    OUT_JSON.write_text(json.dumps({**agg, "commit": commit, "seconds": round(seconds, 1)}, indent=2) + "\n")
    md = markdown(agg)
    OUT_MD.write_text("# Seed spread of the default pipeline\n\n" + md)
    readme = update_readme(md)
    print(md)
    print(f"wrote {OUT_JSON}, {OUT_MD}" + (f" and {README}'s seeds block" if readme else ""))


def main(argv: list[str] | None = None) -> None:
    """`python scripts/seeds.py`: run the seeds, write the spread, re-render the model card when it can.

    Args:
        argv: the arguments (default: sys.argv[1:]).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3, help="number of seeds")
    ap.add_argument("--first", type=int, default=None, help="first seed (default: params.yaml's seed)")
    ap.add_argument("--jobs", type=int, default=1, help="experiments run at a time by the DVC queue")
    ap.add_argument("--no-run", action="store_true", help="only aggregate the seed-K experiments already run")
    a = ap.parse_args(argv)
    if a.n < 1 or a.jobs < 1:
        sys.exit(f"seeds: -n and --jobs must be at least 1 (got -n {a.n}, --jobs {a.jobs})")
    if a.first is None:
        from agentrl.config import load_params

        a.first = load_params().seed
    seeds = list(range(a.first, a.first + a.n))
    started = time.time()
    if not a.no_run:
        queue_and_run(seeds, a.jobs)
    agg = aggregate(collect(seeds))
    write(agg, time.time() - started)
    # the model card shows the spread (docs/seeds.json is a dependency of the card stage): re-render it when the
    # workspace holds a pipeline run (the experiments ran in temporary copies, not here)
    stages = yaml.safe_load(Path("dvc.yaml").read_text()).get("stages") or {} if Path("dvc.yaml").is_file() else {}
    if "card" in stages and Path("models/merged").is_dir():
        dvc("repro", "card", capture=False)
    else:
        print("the model card shows the spread once the pipeline has run here: dvc repro")
