"""How gridworld episodes ended, from evaluation predictions (which failures a better policy could have avoided).

    python scripts/gridworld_failures.py PREDICTIONS.jsonl[.gz] [...]

Each file is an evaluation's predictions of a gridworld run (`eval/<stage>/predictions.jsonl`: one row per grid
with `correct` and the episode's `tool_calls`, each `{"expression": direction, "result": observation}`). An
unsolved episode is counted by its last move that was not refused ("error: episode over" after the end is
ignored):

- `slipped into a hole`: the move slipped sideways into a hole (the risk of the route: only a safer route avoids it);
- `walked into a hole, first move`: the first move, without a slip, into a hole next to S (read off the grid);
- `walked into a visible hole`: without a slip, into the cell the previous local view showed as `O`;
- `walked into a hole`: without a slip, into a hole the last observation did not show (position view);
- `out of moves or stopped`: anything else (the move budget ran out, the policy stopped early, errors).

With the look action (`environments.gridworld.look`) a look counts as the observation before the move that
follows it, and the episodes that looked at least once are counted apart: how many, and how many of them solved.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from agentrl.envs.gridworld import VIEW_ORDER  # the order of the cells a local view lists
from agentrl.stages.compare import read_predictions

KINDS = (
    "solved",
    "slipped into a hole",
    "walked into a hole, first move",
    "walked into a visible hole",
    "walked into a hole",
    "out of moves or stopped",
)


def classify(row: dict) -> str:
    """One of KINDS for a predictions row."""
    if row["correct"]:
        return "solved"
    calls = [c for c in row.get("tool_calls") or [] if not str(c.get("result", "")).startswith("error: episode over")]
    last = str(calls[-1]["result"]) if calls else ""
    words = last.split(":")[0].split()
    if "hole" not in words:
        return "out of moves or stopped"
    if "slip" in words:
        return "slipped into a hole"
    if len(calls) == 1:
        return "walked into a hole, first move"
    before = str(calls[-2]["result"])
    view = before.split(":", 1)[1].split() if ":" in before and not before.startswith("error") else []
    direction = str(calls[-1].get("expression", "")).strip().lower()
    if len(view) == len(VIEW_ORDER) and direction in VIEW_ORDER and view[VIEW_ORDER.index(direction)] == "O":
        return "walked into a visible hole"
    return "walked into a hole"


def looks(row: dict) -> int:
    """The look actions of an episode that the environment answered."""
    return sum(
        str(c.get("expression", "")).strip().lower() == "look" and not str(c.get("result", "")).startswith("error")
        for c in row.get("tool_calls") or []
    )


def read(path: Path) -> list[dict]:
    try:
        return read_predictions(path, ("correct",))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("predictions", nargs="+", type=Path)
    args = ap.parse_args(argv)
    out = {}
    for path in args.predictions:
        rows = read(path)
        counts = Counter(classify(r) for r in rows)
        looked = [r for r in rows if looks(r)]
        out[str(path)] = {k: counts[k] for k in KINDS}
        out[str(path)].update(looked=len(looked), looked_solved=sum(bool(r["correct"]) for r in looked))
        print(f"{path} ({sum(counts.values())} episodes)")
        for k in KINDS:
            print(f"  {k:32s} {counts[k]:5d}")
        if looked:
            n, solved = len(rows) - len(looked), counts["solved"] - out[str(path)]["looked_solved"]
            print(
                f"  looked at least once: {len(looked)} episodes, {out[str(path)]['looked_solved']} solved; "
                f"never looked: {n}, {solved} solved"
            )
    return out


if __name__ == "__main__":
    main()
