"""Do two pipeline runs hold the same bytes? Compares the outputs' md5 of two `dvc.lock` files, stage by stage.

    python scripts/compare_locks.py dvc.lock docs/repro-runs/portable-amd-epyc/dvc.lock
    python scripts/compare_locks.py exp:repro-check docs/repro-runs/portable-amd-epyc/dvc.lock   # make repro-check

`exp:NAME` reads the dvc.lock of the DVC experiment NAME (its git ref refs/exps/.../NAME).

Prints one line per output (same / DIFFERENT / only in one file) and exits 1 when any model output (under
`models/`, except the model card) differs or is missing from one side (the issue-23 check: a fresh clone's run
reproduces every model), 0 otherwise; other outputs (data, predictions, metrics, the card) are reported but do
not decide the exit code unless `--all` is given. Metrics files hold timings and memory, and the card names the
git commit it was made from, so those differ between any two runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import yaml

from env_results import exp_ref  # scripts/ is on sys.path when a script runs


def read_lock(source: str) -> str:
    """The text of a dvc.lock: a file, or `exp:NAME` (the lock committed in DVC experiment NAME's git ref)."""
    if not source.startswith("exp:"):
        try:
            return Path(source).read_text()
        except OSError as e:
            raise SystemExit(f"compare_locks: cannot read {source}: {e}") from None
    shown = subprocess.run(
        ["git", "show", f"{exp_ref(source[len('exp:') :])}:dvc.lock"], capture_output=True, text=True
    )
    if shown.returncode:
        raise SystemExit(f"compare_locks: {source}: {shown.stderr.strip()}")
    return shown.stdout


def outputs(source: str) -> dict[str, str]:
    """{output path: md5} of every stage's outs in a dvc.lock (see read_lock), or SystemExit naming it and what
    is wrong."""
    try:
        lock = yaml.safe_load(read_lock(source))
    except yaml.YAMLError as e:
        raise SystemExit(f"compare_locks: cannot read {source}: {e}") from None
    if not isinstance(lock, dict) or not isinstance(lock.get("stages"), dict):
        raise SystemExit(f"compare_locks: {source} is not a dvc.lock (no 'stages' mapping)")
    out = {}
    for stage, body in lock["stages"].items():
        for o in (body or {}).get("outs") or []:
            if not isinstance(o, dict) or "path" not in o or "md5" not in o:
                raise SystemExit(f"compare_locks: {source}: stage {stage!r} has an out without path and md5: {o!r}")
            out[o["path"]] = o["md5"]
    return out


NOT_MODELS = ("models/card",)  # under models/ but a document: it names the commit, so it differs between commits


def is_model(path: str) -> bool:
    return path.startswith("models/") and path.rstrip("/") not in NOT_MODELS


def compare(a: dict[str, str], b: dict[str, str]) -> list[tuple[str, str]]:
    """[(output path, same | DIFFERENT | only in A | only in B)], sorted by path."""
    rows = []
    for p in sorted(set(a) | set(b)):
        if p not in b:
            rows.append((p, "only in A"))
        elif p not in a:
            rows.append((p, "only in B"))
        else:
            rows.append((p, "same" if a[p] == b[p] else "DIFFERENT"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="a dvc.lock (A), or exp:NAME")
    ap.add_argument("b", help="another dvc.lock (B), or exp:NAME")
    ap.add_argument("--all", action="store_true", help="every output decides the exit code, not only models/")
    args = ap.parse_args(argv)
    rows = compare(outputs(args.a), outputs(args.b))
    for p, verdict in rows:
        print(f"{verdict:>10}  {p}")
    deciding = [(p, v) for p, v in rows if args.all or is_model(p)]
    bad = [p for p, v in deciding if v != "same"]
    print(f"{len(deciding) - len(bad)} of {len(deciding)} {'outputs' if args.all else 'model outputs'} identical")
    return 1 if bad or not deciding else 0


if __name__ == "__main__":
    sys.exit(main())
