"""Copy a finished experiment's metrics into the repo, so the README's environment rows trace to files.

    python scripts/env_results.py env-countdown docs/envs/countdown

Reads the experiment's git ref (`dvc exp run --name env-countdown` writes refs/exps/.../env-countdown) and writes
every metrics/*.json of that commit to the target folder, plus a README naming the experiment, its commit, the
params it ran with (`dvc exp show`-style, the keys that differ from the baseline) and the command that made it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def exp_ref(name: str) -> str:
    refs = [r for r in git("for-each-ref", "refs/exps", "--format=%(refname)").split() if r.rsplit("/", 1)[-1] == name]
    if not refs:
        raise SystemExit(f"no experiment named {name!r} (dvc exp list --all-commits shows the ones there are)")
    if len(refs) > 1:
        raise SystemExit(f"{len(refs)} experiments named {name!r}: remove the old ones (dvc exp remove {name})")
    return refs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment")
    ap.add_argument("out_dir", type=Path)
    a = ap.parse_args()
    ref = exp_ref(a.experiment)
    commit = git("rev-parse", ref).strip()
    base = git("rev-parse", f"{commit}^").strip()
    files = [f for f in git("ls-tree", "--name-only", f"{commit}:metrics").split() if f.endswith(".json")]
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for f in files:
        data = json.loads(git("show", f"{commit}:metrics/{f}"))
        (a.out_dir / f).write_text(json.dumps(data, indent=2) + "\n")
    params = git("diff", "--unified=0", base, commit, "--", "params.yaml")
    (a.out_dir / "README.md").write_text(
        f"# {a.experiment}\n\nMetrics of the experiment `{a.experiment}` (commit {commit[:10]} on {base[:10]}), "
        f"copied by `python scripts/env_results.py {a.experiment} {a.out_dir}` after "
        f"`make env ENV={a.experiment.removeprefix('env-')}`.\n\nThe params it changed:\n\n```diff\n{params}```\n"
    )
    print(f"{len(files)} metrics files of {a.experiment} ({commit[:10]}) -> {a.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
