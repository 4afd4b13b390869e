"""Params recipes (configs/recipes/*.yaml, configs/envs/*.yaml): a recipe is a params override, every leaf (a
non-mapping value) replacing that key of params.yaml.

    overrides(recipe)            # the `dvc exp run -S ++key=value` arguments, one per leaf
    check(recipe)                # applied to a scratch copy of params.yaml and validated (a typo names the key)
    apply_in_place([r1, r2])     # params.yaml rewritten with the recipes applied in order (a cluster job's step 1)

Every application goes through DVC's own override code (dvc.utils.hydra / agentrl.experiments.overrides.apply),
so params.yaml reads exactly as `dvc exp run -S` would have written it. scripts/recipe.py is the command line.
The GSM8K recipe's inputs (its held-out slice of GSM8K's train split) are made here too (GSM8K_HOLDOUT_DOC,
scripts/gsm8k_holdout.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable

from ..config import ParamsError, load_params, load_yaml
from . import overrides as ov


class RecipeError(ValueError):
    """A recipe that cannot be applied as given, or a params.yaml it must not overwrite; the message names the
    file and what was expected."""


def overrides(recipe: str | Path) -> list[str]:
    """The `++key=value` argument per leaf of the recipe, as `dvc exp run -S` reads them.

    Args:
        recipe: a YAML file holding a mapping of params sections.

    Returns:
        The rendered overrides, in the recipe's order.
    """
    tree = load_yaml(recipe)
    if not isinstance(tree, dict) or not tree:
        raise RecipeError(f"{recipe}: expected a mapping of params sections")
    try:
        return ov.render(dict(ov.leaves(tree)))
    except ov.OverrideError as e:
        raise RecipeError(f"{recipe}: {e}") from None


def apply(params_file: str | Path, recipe: str | Path) -> None:
    """Apply the recipe to `params_file` in place, with DVC's own function, exactly as `dvc exp run -S` would.

    Args:
        params_file: the params.yaml to rewrite (no validation: see `check` and `apply_in_place`).
    """
    from dvc.utils.hydra import apply_overrides

    apply_overrides(str(params_file), overrides(recipe))


def check(recipe: str | Path, params_file: str | Path = "params.yaml", more: Iterable[str | Path] = ()) -> None:
    """Apply the recipe (then each of `more`, a later one winning) to a scratch copy of `params_file` and validate
    the result; RecipeError naming the recipes and every invalid key otherwise.

    Args:
        params_file: the params.yaml the recipe would be applied to (left untouched).
    """
    recipes = [recipe, *more]
    with tempfile.TemporaryDirectory() as d:
        scratch = Path(d) / "params.yaml"
        shutil.copy(params_file, scratch)
        for one in recipes:
            apply(scratch, one)
        try:
            load_params(scratch)
        except ParamsError as e:
            names = " + ".join(str(r) for r in recipes)
            raise RecipeError(f"{names}: the overridden params are invalid:\n{e}") from None


def applied_text(params_text: str, recipes: Iterable[str | Path]) -> str:
    """params.yaml's text with each recipe applied in turn (a later recipe wins on a key both set).

    Args:
        recipes: recipe files, applied in order.

    Returns:
        The text `dvc exp run -S` would write.
    """
    text = params_text
    for recipe in recipes:
        try:
            text = ov.apply(text, overrides(recipe))
        except ov.OverrideError as e:
            raise RecipeError(f"{recipe}: {e}") from None
    return text


def changed_keys(old: Any, new: Any) -> list[str]:
    """`key: old -> new` for every leaf that differs between two params trees (added and removed leaves too).

    Returns:
        One line per changed leaf, in the new tree's order, then the removed ones.
    """
    before, after = dict(ov.leaves(old)), dict(ov.leaves(new))

    def shown(tree: dict, key: str) -> str:
        return repr(tree[key]) if key in tree else "(absent)"

    lines = [
        f"{k}: {shown(before, k)} -> {v!r}" for k, v in after.items() if k not in before or not ov.same(before[k], v)
    ]
    # an empty mapping that became a filled one shows as its new leaves, not also as a removed key
    gone = [k for k in before if k not in after and not any(a.startswith(k + ".") for a in after)]
    return lines + [f"{k}: {before[k]!r} -> (absent)" for k in gone]


def uncommitted_edits(params_file: Path) -> str:
    """git's one-line status of `params_file` ('' when it matches the last commit).

    Returns:
        The porcelain status line(s), empty when the file has no uncommitted edits.
    """
    cmd = ["git", "status", "--porcelain", "--untracked-files=all", "--", params_file.name]
    try:
        r = subprocess.run(cmd, cwd=params_file.parent, capture_output=True, text=True)
    except FileNotFoundError:
        raise RecipeError(
            f"{params_file}: git is not installed, so its uncommitted edits cannot be checked; "
            "--force applies the recipe anyway"
        ) from None
    if r.returncode:
        raise RecipeError(
            f"{params_file}: not in a git checkout ({r.stderr.strip()}), so its uncommitted edits cannot be "
            "checked; --force applies the recipe anyway"
        )
    return r.stdout.strip()


def apply_in_place(
    recipes: list[str | Path], params_file: str | Path = "params.yaml", force: bool = False
) -> list[str]:
    """Rewrite `params_file` with the recipes applied in order, after validating the result.

    Applying recipes params.yaml already has is a no-op (so every node of a job, and every stage, may run it).
    Otherwise a params.yaml with uncommitted edits is refused unless `force`: the recipe could overwrite them.
    The new file replaces the old one in one rename, so a node reading it on a shared filesystem never sees
    half of it.

    Args:
        recipes: recipe files, applied in order (a later one wins on a key both set).

    Returns:
        `key: old -> new` per changed leaf; empty when params.yaml already had every value.
    """
    params_file = Path(params_file)
    if not recipes:
        raise RecipeError("expected at least one recipe file")
    if not params_file.is_file():
        raise RecipeError(f"{params_file}: file not found (run from the repository root)")
    old_text = params_file.read_text()
    new_text = applied_text(old_text, recipes)
    changes = changed_keys(ov.load(old_text), ov.load(new_text))
    if not changes:
        return []
    status = "" if force else uncommitted_edits(params_file)
    if status:
        raise RecipeError(
            f"{params_file} has uncommitted edits ({status}) that the recipe would overwrite:\n  "
            + "\n  ".join(changes)
            + "\ncommit them first, or pass --force"
        )
    fd, scratch = tempfile.mkstemp(prefix=".params-", suffix=".yaml", dir=params_file.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_text)
        os.chmod(scratch, params_file.stat().st_mode)  # mkstemp's 0600 would otherwise replace params.yaml's mode
        try:
            load_params(scratch)
        except ParamsError as e:
            names = ", ".join(map(str, recipes))
            invalid = str(e).replace(scratch, str(params_file))
            raise RecipeError(f"{names}: the overridden params are invalid:\n{invalid}") from None
        os.replace(scratch, params_file)
    finally:
        Path(scratch).unlink(missing_ok=True)
    return changes


# ------------------------------------------------------------------ the GSM8K recipe's held-out slice
GSM8K_HOLDOUT_DOC = """The real-GSM8K recipe's inputs (configs/recipes/smollm2-135m-gsm8k.yaml): GSM8K's train split,
MIT-licensed, from ../shared/data/gsm8k/train.jsonl (7,473 rows; no hub here), split into a fixed held-out slice that
training never sees and the rows training may use, both written to inputs/gsm8k/ (inputs/ is a dependency of
`prepare`, so a changed source re-runs the pipeline):

    python scripts/gsm8k_holdout.py [--source FILE] [--holdout 500] [--seed 0]     # `make real REAL=smollm2-135m-gsm8k`

The slice is drawn by `--seed` from the source's rows, so the same file gives the same slice; inputs/gsm8k/source.json
records the source's sha256, its row count and the split. GSM8K's own test split would be the usual held-out set; it
is not on this machine, so the slice of train stands in for it (the model card's 1.4% is on the test split).
"""
GSM8K_SOURCE = Path("../shared/data/gsm8k/train.jsonl")
GSM8K_OUT_DIR = Path("inputs/gsm8k")


def read_gsm8k_rows(source: Path) -> list[str]:
    """The source's lines, each checked to be a JSON object with string `question` and `answer` (GSM8K's form)."""
    if not source.is_file():
        raise SystemExit(
            f"{source}: GSM8K's train split is not there (the recipe reads it from ../shared/data/gsm8k/train.jsonl; "
            f"pass --source with a GSM8K-format jsonl file)"
        )
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise SystemExit(f"{source}:{number}: not JSON ({error})") from None
        if not (isinstance(row, dict) and isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)):
            raise SystemExit(f"{source}:{number}: expected an object with string 'question' and 'answer'")
    return lines


def split_gsm8k_holdout(source: Path, out_dir: Path, holdout: int, seed: int) -> dict:
    """Write out_dir/heldout.jsonl (`holdout` rows drawn by `seed`) and out_dir/train.jsonl (every other row, in the
    source's order) and out_dir/source.json; returns what source.json records."""
    lines = read_gsm8k_rows(source)
    if not 0 < holdout < len(lines):
        raise SystemExit(f"--holdout: expected 1..{len(lines) - 1} rows of {source}'s {len(lines)}, got {holdout}")
    held = set(random.Random(seed).sample(range(len(lines)), holdout))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "heldout.jsonl").write_text("".join(lines[i] + "\n" for i in sorted(held)))
    (out_dir / "train.jsonl").write_text("".join(line + "\n" for i, line in enumerate(lines) if i not in held))
    record = {
        "source": str(source),
        "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "rows": len(lines),
        "heldout_rows": holdout,
        "train_rows": len(lines) - holdout,
        "seed": seed,
    }
    (out_dir / "source.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def gsm8k_holdout_main(argv: list[str] | None = None) -> None:
    """`python scripts/gsm8k_holdout.py`: the GSM8K recipe's inputs (GSM8K_HOLDOUT_DOC says how)."""
    ap = argparse.ArgumentParser(description=GSM8K_HOLDOUT_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", type=Path, default=GSM8K_SOURCE)
    ap.add_argument("--out-dir", type=Path, default=GSM8K_OUT_DIR)
    ap.add_argument("--holdout", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    record = split_gsm8k_holdout(args.source, args.out_dir, args.holdout, args.seed)
    print(f"{record['train_rows']} train and {record['heldout_rows']} held-out rows of {args.source} -> {args.out_dir}")
