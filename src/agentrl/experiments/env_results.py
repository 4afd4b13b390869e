"""Copy a finished experiment's metrics into the repo, so the README's environment rows trace to files.

    python scripts/env_results.py env-countdown docs/envs/countdown

Reads the experiment's git ref (`dvc exp run --name env-countdown` writes refs/exps/.../env-countdown) and writes
the metrics files that dvc.yaml declares (the pipeline's own, not the benchmarks' metrics/bench*.json that
ride along in git) to the target folder, plus `experiment.md` naming the experiment, its commit, the params it ran
with (the keys that differ from the baseline) and the command that made it. The folder's README.md, the hand-written
account of the results, is left alone.

It never overwrites another run's results silently: when a file it would write is already in the folder with other
content (a preset folder's committed run, another experiment's copy), it stops, names those files and writes nothing;
`--force` replaces them and lists what it replaced. Copy a trial next to a preset's results with a fresh folder:

    python scripts/env_results.py env-countdown docs/envs/countdown/trials/my-trial
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from agentrl.experiments.overrides import leaves, load, same
from agentrl.experiments.queue import dvc_stages


def git(*args: str) -> str:
    """Run git here.

    Returns:
        Its output; CalledProcessError when it fails.
    """
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def exp_ref(name: str) -> str:
    """The git ref of the experiment `name` (refs/exps/<baseline>/<name>): the only one of that name, or of several
    the only one run on the checked-out commit (`make real` re-run after a commit: the run that just finished).

    Returns:
        The ref; SystemExit when there is none, or several and not exactly one of them on HEAD.
    """
    refs = [r for r in git("for-each-ref", "refs/exps", "--format=%(refname)").split() if r.rsplit("/", 1)[-1] == name]
    if not refs:
        raise SystemExit(f"no experiment named {name!r} (dvc exp list --all-commits shows the ones there are)")
    if len(refs) == 1:
        return refs[0]
    head = git("rev-parse", "HEAD").strip()
    on_head = [r for r in refs if r.startswith(f"refs/exps/{head[:2]}/{head[2:]}/")]
    if len(on_head) == 1:
        return on_head[0]
    raise SystemExit(
        f"{len(refs)} experiments named {name!r} ({', '.join(refs)}), {len(on_head)} of them on HEAD {head[:7]}: "
        "remove the old ones (git update-ref -d <ref>)"
    )


def declared_metrics() -> list[str]:
    """The metrics/*.json files that dvc.yaml declares as stage metrics, in stage order (the workspace's dvc.yaml,
    the pipeline an experiment of this repository runs).

    Returns:
        The files, as dvc.yaml names them.
    """
    if not Path("dvc.yaml").exists():
        raise SystemExit("no dvc.yaml here: run from the repository root (the experiment's pipeline names its metrics)")
    return [m for s in dvc_stages(Path(".")) for m in s["metrics"] if m.startswith("metrics/") and m.endswith(".json")]


MISSING = object()  # a key one side of changed_params does not have


def changed_params(base: str, commit: str) -> list[tuple[str, object, object]]:
    """Every params.yaml leaf that differs between the two commits, by value as the stages read them
    (overrides.load, overrides.same: `1e-6` a float, `true` not `1`; MISSING where a side lacks the key): `dvc exp
    run -S` rewrites the file's layout (flow lists, nulls, quotes), which a text diff would show.

    Returns:
        (key, baseline value, experiment value), sorted by key.
    """
    before, after = (dict(leaves(load(git("show", f"{c}:params.yaml")) or {})) for c in (base, commit))
    return [
        (k, before.get(k, MISSING), after.get(k, MISSING))
        for k in sorted(set(before) | set(after))
        if k not in before or k not in after or not same(before[k], after[k])
    ]


def _cell(value: object) -> str:
    """A params value as a table cell: JSON in backquotes, `(absent)` for MISSING."""
    return "(absent)" if value is MISSING else f"`{json.dumps(value, default=str)}`"


def declared_diagnostics(metrics: list[str]) -> list[str]:
    """The diagnostics/<name>.json beside each declared metrics file (stage times, peak RSS, details)."""
    return [str(Path("diagnostics") / Path(m).name) for m in metrics]


def experiment_files(experiment: str, out_dir: Path, commit: str, base: str, metrics: list[str]) -> dict[str, str]:
    """The text of every file the copy writes, by name: the declared metrics as the experiment committed them, and
    experiment.md.

    Args:
        experiment: the experiment's name (`env-countdown`).
        out_dir: the folder the files go to (named in experiment.md's command).
        base: the commit it ran on (its parent), the baseline of the params table.
        metrics: the metrics files dvc.yaml declares (declared_metrics).

    Returns:
        file name -> text, in the order they are written.
    """
    texts = {}
    for path in metrics:
        try:
            data = json.loads(git("show", f"{commit}:{path}"))
        except subprocess.CalledProcessError:
            raise SystemExit(
                f"{path}: declared in dvc.yaml but not in experiment commit {commit[:10]} (did its stage run?)"
            ) from None
        texts[path.removeprefix("metrics/")] = json.dumps(data, indent=2) + "\n"
    rows = "".join(f"| `{k}` | {_cell(old)} | {_cell(new)} |\n" for k, old, new in changed_params(base, commit))
    made_by = (
        f"make real REAL={experiment.removeprefix('real-')}"
        if experiment.startswith("real-")
        else f"make env ENV={experiment.removeprefix('env-')}"
    )
    flags = "--diagnostics " if any(p.startswith("diagnostics/") for p in metrics) else ""
    texts["experiment.md"] = (
        f"# {experiment}\n\nMetrics of the experiment `{experiment}` (commit {commit[:10]} on {base[:10]}), "
        f"copied by `python scripts/env_results.py {flags}{experiment} {out_dir}` after "
        f"`{made_by}`.\n\nThe params it changed (params.yaml, by value):\n\n"
        f"| key | baseline | this experiment |\n|---|---|---|\n{rows}"
    )
    return texts


def files_it_would_replace(out_dir: Path, texts: dict[str, str]) -> list[str]:
    """The files in `out_dir` that the copy would change: present with other content (an identical file, e.g. the
    same experiment copied twice, is not a replacement).
    """
    return [name for name, text in texts.items() if (out_dir / name).exists() and (out_dir / name).read_text() != text]


def main(argv: list[str] | None = None) -> None:
    """`python scripts/env_results.py EXPERIMENT OUT_DIR [--force]`: copy the experiment's metrics out.

    Args:
        argv: the arguments (default: sys.argv[1:]).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--force", action="store_true", help="replace files of another run in out_dir (listed)")
    ap.add_argument(
        "--diagnostics", action="store_true", help="also the stages' diagnostics (times, peak RSS): OUT_DIR/diagnostics"
    )
    args = ap.parse_args(argv)
    ref = exp_ref(args.experiment)
    commit = git("rev-parse", ref).strip()
    base = git("rev-parse", f"{commit}^").strip()
    files = declared_metrics()
    files += declared_diagnostics(files) if args.diagnostics else []
    texts = experiment_files(args.experiment, args.out_dir, commit, base, files)
    replaced = files_it_would_replace(args.out_dir, texts)
    if replaced and not args.force:
        raise SystemExit(
            f"{args.out_dir} already holds another run's results, which this copy would overwrite: "
            f"{', '.join(replaced)}. Nothing written. Copy to a fresh folder "
            f"(python scripts/env_results.py {args.experiment} {args.out_dir}/trials/<name>) or pass --force "
            f"to replace them; the experiment stays available as {ref}."
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (args.out_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (args.out_dir / name).write_text(text)
    if replaced:
        print(f"replaced (--force): {', '.join(replaced)}", file=sys.stderr)
    count = len(texts) - 1
    print(f"{count} metrics files of {args.experiment} ({commit[:10]}) -> {args.out_dir}", file=sys.stderr)
