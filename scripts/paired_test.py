"""Paired test between two prediction files on the same held-out problems (e.g. an ablation against the full run).

    python scripts/paired_test.py BEFORE.jsonl[.gz] AFTER.jsonl[.gz] [--seed 42] [--out result.json]

Each file is an evaluation's predictions (`eval/<stage>/predictions.jsonl`, one row per problem with `id` and
`correct`). The test is the compare stage's own (`agentrl.stages.compare.paired_test`: exact McNemar on the
problems only one of the two solved, paired bootstrap 95% CI of the difference AFTER - BEFORE), over the ids both files
have.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agentrl.stages.compare import paired_test, read_predictions


def correctness(path: Path) -> dict[str, bool]:
    try:
        out = {str(r["id"]): bool(r["correct"]) for r in read_predictions(path, ("id", "correct"))}
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not out:
        raise SystemExit(f"{path}: no predictions")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--seed", type=int, default=42, help="bootstrap seed")
    ap.add_argument("--out", type=Path, help="also write the result here (JSON)")
    a = ap.parse_args()
    before, after = correctness(a.before), correctness(a.after)
    try:
        result = paired_test(before, after, a.seed)
    except ValueError as e:
        raise SystemExit(f"{a.before} vs {a.after}: {e}") from None
    result = {
        "before": str(a.before),
        "after": str(a.after),
        "accuracy_before": sum(before.values()) / len(before),
        "accuracy_after": sum(after.values()) / len(after),
        **result,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
