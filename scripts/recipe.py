"""Apply a params recipe (configs/recipes/*.yaml) as one DVC experiment, or to params.yaml itself.

    python scripts/recipe.py run configs/recipes/qwen3-0.6b-gsm8k.yaml [more.yaml ...] [-- <dvc exp run args>]
    python scripts/recipe.py show configs/recipes/qwen3-0.6b-gsm8k.yaml      # the -S arguments only
    python scripts/recipe.py apply configs/recipes/qwen3-0.6b-gsm8k.yaml [more.yaml ...] [--force]

A recipe is a params override: every leaf (a non-mapping value) replaces that key of params.yaml. `run`
first applies the overrides to a scratch copy of params.yaml with DVC's own mechanism and validates the
result (a typo in the recipe stops here, naming the key), then runs `dvc exp run -S ++key=value ...`
(`++`: set the key, adding it when params.yaml does not have it), so the experiment records the params.
`apply` writes the recipes (in order, a later one winning) into params.yaml, validated the same way, and prints
each changed key, so that a cluster job can run the stages directly (docs/scaling.md#cluster-sequence). It is a no-op
when params.yaml already has every value, and refuses to overwrite uncommitted edits of params.yaml unless --force.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from agentrl.experiments.queue import run_in_workspace
from agentrl.experiments.recipe import RecipeError, apply_in_place, check, overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "show", "apply"])
    ap.add_argument("recipe")
    ap.add_argument(
        "dvc_args",
        nargs=argparse.REMAINDER,
        help="run: more recipes (a later one wins), then after -- extra `dvc exp run` arguments; "
        "apply: more recipes, then --force to apply over uncommitted edits of params.yaml",
    )
    a = ap.parse_args()
    try:
        if a.command == "apply":
            more = [x for x in a.dvc_args if x != "--force"]
            changes = apply_in_place([a.recipe, *more], force="--force" in a.dvc_args)
            print("\n".join(changes) if changes else "params.yaml already has every value of the recipe")
            return
        cut = a.dvc_args.index("--") if "--" in a.dvc_args else len(a.dvc_args)
        head, extra = a.dvc_args[:cut], a.dvc_args[cut + 1 :]  # before --: more recipes (and, unseparated, dvc's)
        more = [x for x in head if x.endswith((".yaml", ".yml"))]
        extra = [x for x in head if x not in more] + extra
        args = [x for recipe in (a.recipe, *more) for o in overrides(recipe) for x in ("-S", o)]
        if a.command == "show":
            print("\n".join(args[1::2]))
            return
        check(a.recipe, more=more)
    except RecipeError as e:
        raise SystemExit(str(e)) from None
    cmd = ["dvc", "exp", "run", *args, *extra]
    print(" ".join(cmd), flush=True)
    # a temporary workspace or the queue leaves this one untouched; a workspace run holds it (refused when busy)
    sys.exit(subprocess.call(cmd) if {"--temp", "--queue"} & set(extra) else run_in_workspace(cmd))


if __name__ == "__main__":
    main()
