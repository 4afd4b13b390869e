"""`make exps`: the experiments with the headline columns only, readable in 100 columns.

    python scripts/exps.py [--all] [--width 100]

`dvc exp show` makes every params key and metric a column (a grid of "…" in a terminal) and `dvc metrics show`
rounds p-values to 0.0. This reads `dvc exp show --json` and prints, per baseline commit and its experiments:
accuracy after SFT and GRPO, their difference with the exact McNemar p-value in scientific notation, GRPO's tool
use and the int8 export's accuracy; then, per experiment, the params it changed from its baseline.
`--all` also lists baselines of other branches and tags (`dvc exp show -A`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from agentrl.experiments.overrides import leaves

# column title, metrics file, key, format (None: not run)
COLUMNS = (
    ("sft", "metrics/compare.json", "sft_accuracy", "pct"),
    ("grpo", "metrics/compare.json", "grpo_accuracy", "pct"),
    ("grpo-sft", "metrics/compare.json", "grpo_minus_sft", "signed"),
    ("p", "metrics/compare.json", "p_value", "sci"),
    ("tools", "metrics/compare.json", "grpo_tool_use_rate", "pct"),
    ("int8", "metrics/quantize.json", "int8_accuracy", "pct"),
)


def fmt(value, kind: str) -> str:
    """One cell: a percentage, signed points or scientific notation; `-` for a figure not there.

    Args:
        value: the metric (a number, or text such as "2.04e-65"), None when absent.
        kind: pct, signed or sci.

    Returns:
        The cell's text (a value that is not a number as it is).
    """
    if value is None:
        return "-"
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    return {"pct": f"{100 * x:.1f}", "signed": f"{100 * x:+.1f}", "sci": f"{x:.1e}"}[kind]


def figures(rev: dict) -> tuple[dict, dict]:
    """The metrics and params of one `dvc exp show --json` entry.

    Args:
        rev: the entry (a baseline or an experiment's rev).

    Returns:
        (metrics file -> metrics, params leaves).
    """
    data = rev.get("data") or {}
    metrics = {path: (m or {}).get("data") or {} for path, m in (data.get("metrics") or {}).items()}
    params = ((data.get("params") or {}).get("params.yaml") or {}).get("data") or {}
    return metrics, dict(leaves(params))  # params as DVC names them for `-S`


def rows(show: list[dict]) -> list[dict]:
    """One row per baseline and experiment: name, state, created, headline cells, params changed from its baseline.

    Args:
        show: `dvc exp show --json`'s output.

    Returns:
        The rows, each baseline followed by its experiments.
    """
    out = []
    for base in show:
        base_metrics, base_params = figures(base)
        name = base.get("name") or (base["rev"] if base["rev"] == "workspace" else base["rev"][:7])
        out.append({"name": name, "baseline": True, "metrics": base_metrics})
        for exp in base.get("experiments") or []:
            state = (exp.get("executor") or {}).get("state")  # queued / running / success / failed; None: done
            for rev in exp.get("revs") or []:
                metrics, params = figures(rev)
                data = rev.get("data") or {}
                changed = {k: v for k, v in params.items() if base_params.get(k, object()) != v}
                out.append(
                    {
                        "name": rev.get("name") or exp.get("name") or rev["rev"][:7],
                        "baseline": False,
                        "state": "failed" if rev.get("error") else (state or "success"),
                        "created": (data.get("timestamp") or "")[:16].replace("T", " "),
                        "metrics": metrics,
                        "changed": changed,
                    }
                )
    return out


def table(items: list[dict], width: int = 100) -> str:
    """The rows as fixed-width text no wider than `width` (names shortened, changed params wrapped below).

    Returns:
        The table, then the changed params and a legend.
    """
    cells = [[fmt(r["metrics"].get(f, {}).get(k), kind) for _, f, k, kind in COLUMNS] for r in items]
    widths = [max([len(t)] + [len(c[i]) for c in cells]) for i, (t, *_) in enumerate(COLUMNS)]
    fixed = sum(w + 2 for w in widths) + 16 + 2 + 8 + 2  # numbers, created, state
    name_w = max(12, min(max(len(r["name"]) + 4 for r in items), width - fixed))
    head = f"{'experiment':<{name_w}}{'created':<18}{'state':<10}" + "".join(
        f"{t:>{w + 2}}" for (t, *_), w in zip(COLUMNS, widths)
    )
    lines = [head, "-" * len(head)]
    for r, c in zip(items, cells):
        name = ("" if r["baseline"] else "  ") + r["name"]
        if len(name) > name_w - 1:
            name = name[: name_w - 2] + "…"
        created = "" if r["baseline"] else r["created"]
        state = "baseline" if r["baseline"] else r["state"]
        lines.append(f"{name:<{name_w}}{created:<18}{state:<10}" + "".join(f"{x:>{w + 2}}" for x, w in zip(c, widths)))
    changed = [r for r in items if not r["baseline"] and r["changed"]]
    if changed:
        lines += ["", "params changed from the baseline:"]
        for r in changed:
            text = f"  {r['name']}: " + ", ".join(f"{k}={v}" for k, v in sorted(r["changed"].items()))
            while len(text) > width:
                cut = text.rfind(", ", 0, width)
                cut = cut if cut > 0 else width
                lines.append(text[: cut + 1])
                text = "    " + text[cut + 1 :].lstrip()
            lines.append(text)
    lines.append(f"\naccuracy and tool use in %; grpo-sft in points; p: exact McNemar, grpo vs sft ({len(items)} rows)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python scripts/exps.py`: print the table of `dvc exp show --json`.

    Args:
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        The exit status (dvc's when it failed).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="baselines of all branches and tags too (dvc exp show -A)")
    ap.add_argument("--width", type=int, default=100, help="the widest line (default 100)")
    a = ap.parse_args(argv)
    exe = Path(sys.executable).parent / "dvc"
    cmd = [str(exe) if exe.is_file() else "dvc", "exp", "show", "--json"] + (["-A"] if a.all else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        print(f"make exps: `{' '.join(cmd[1:])}` failed ({r.returncode}):\n{r.stderr}", file=sys.stderr)
        return r.returncode
    print(table(rows(json.loads(r.stdout)), a.width))
    return 0
