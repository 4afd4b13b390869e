"""Apply a params recipe (configs/recipes/*.yaml) as one DVC experiment.

    python scripts/recipe.py run configs/recipes/qwen3-0.6b-gsm8k.yaml [-- <dvc exp run args>]
    python scripts/recipe.py show configs/recipes/qwen3-0.6b-gsm8k.yaml      # the -S arguments only

A recipe is a params override: every leaf (a non-mapping value) replaces that key of params.yaml. `run`
first applies the overrides to a scratch copy of params.yaml with DVC's own mechanism and validates the
result (a typo in the recipe stops here, naming the key), then runs `dvc exp run -S ++key=value ...`
(`++`: set the key, adding it when params.yaml does not have it), so the experiment records the params.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from agentrl.config import ParamsError, load_params, load_yaml
from agentrl.experiments.overrides import OverrideError, leaves, render


def overrides(recipe: str | Path) -> list[str]:
    """`++key=value` per leaf of the recipe (agentrl.experiments.overrides: leaves, rendered as `dvc exp run -S`
    reads them)."""
    tree = load_yaml(recipe)
    if not isinstance(tree, dict) or not tree:
        raise SystemExit(f"{recipe}: expected a mapping of params sections")
    try:
        return render(dict(leaves(tree)))
    except OverrideError as e:
        raise SystemExit(f"{recipe}: {e}") from None


def apply(params_file: str | Path, recipe: str | Path) -> None:
    """Apply the recipe to `params_file` in place, exactly as `dvc exp run -S` would."""
    from dvc.utils.hydra import apply_overrides

    apply_overrides(str(params_file), overrides(recipe))


def check(recipe: str | Path, params_file: str | Path = "params.yaml") -> None:
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d) / "params.yaml"
        shutil.copy(params_file, scratch)
        apply(scratch, recipe)
        try:
            load_params(scratch)
        except ParamsError as e:
            raise SystemExit(f"{recipe}: the overridden params are invalid:\n{e}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "show"])
    ap.add_argument("recipe")
    ap.add_argument("dvc_args", nargs=argparse.REMAINDER, help="after --: extra `dvc exp run` arguments")
    a = ap.parse_args()
    args = [x for o in overrides(a.recipe) for x in ("-S", o)]
    if a.command == "show":
        print("\n".join(args[1::2]))
        return
    check(a.recipe)
    extra = a.dvc_args[1:] if a.dvc_args[:1] == ["--"] else a.dvc_args
    cmd = ["dvc", "exp", "run", *args, *extra]
    print(" ".join(cmd), flush=True)
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
