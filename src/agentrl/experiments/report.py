"""`make report`: reports/report.html, what `dvc plots show` cannot draw.

The curves (SFT loss, GRPO reward, tool use, accuracy per stage: the `plots:` of dvc.yaml) are `dvc plots show`
(`dvc plots diff <exp>` across experiments). This report adds the accuracy per stage with its 95% interval,
the comparison table (accuracy, interval, tool use per stage; GRPO - SFT with its paired CI and McNemar p) and
example completions that SFT got wrong and GRPO right (and the reverse) with their tool calls. Its inputs are
headline metrics (metrics/eval_<stage>.json, metrics/compare.json) and eval/<stage>/predictions.jsonl; a
missing one is an error naming the file and the `dvc repro` stage that writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jinja2
import matplotlib
import yaml

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STAGES = ("base", "sft", "grpo")
# the per-stage columns of the comparison table: headline keys of metrics/eval_<stage>.json (also the W&B bars)
STAGE_COLUMNS = {  # key: (label, format)
    "accuracy": ("accuracy", "{:.1%}"),
    "tool_use_rate": ("tool use rate", "{:.1%}"),
    "tool_calls_per_problem": ("tool calls per problem", "{:.2f}"),
}
TOOL_KEYS = ("tool_use_rate", "tool_calls_per_problem")  # absent when the pipeline runs without tools
COMPARE_KEYS = ("grpo_minus_sft", "ci95", "p_value")
PRED_KEYS = ("id", "question", "completion", "extracted", "ground_truth", "correct")
EXAMPLES = {"fixed by GRPO": 3, "broken by GRPO": 2}  # how many of each kind


class MissingInputs(FileNotFoundError):
    """Report inputs not there yet; the message names each file and the stage that writes it."""


def inputs() -> dict[str, str]:
    """Each input file -> the dvc.yaml stage that writes it."""
    files = {"metrics/compare.json": "compare"}
    for s in STAGES:
        files[f"metrics/eval_{s}.json"] = f"eval_{s}"
        files[f"eval/{s}/predictions.jsonl"] = f"eval_{s}"
    return files


def dvc_plots(root: Path = Path(".")) -> list[tuple[str, dict]]:
    """The top-level `plots:` of dvc.yaml as (title, definition): the one list of curves (`dvc plots show`)."""
    path = root / "dvc.yaml"
    if not path.exists():
        raise MissingInputs(f"{path}: missing (run from the repository root)")
    out = []
    for entry in yaml.safe_load(path.read_text()).get("plots") or []:
        if not (isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry.values())), dict)):
            raise ValueError(f"{path}: plots entry {entry!r}: expected '- <title>: {{x: ..., y: {{<file>: <col>}}}}'")
        out.append(next(iter(entry.items())))
    return out


def _need(data: dict, key: str, where: str, stage: str, expected: str = "a number"):
    if key not in data:
        raise ValueError(f"{where}: no '{key}' (expected {expected}; rerun `dvc repro {stage}`)")
    return data[key]


def _interval(data: dict, key: str, where: str, stage: str) -> tuple[float, float]:
    v = _need(data, key, where, stage, "[low, high]")
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v) and v[0] <= v[1]):
        raise ValueError(f"{where}: '{key}' is {v!r}; expected [low, high] with low <= high")
    return v[0], v[1]


def _json(path: Path, stage: str, text: str | None = None):
    try:
        return json.loads(path.read_text(encoding="utf-8") if text is None else text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); rerun `dvc repro {stage}`") from None


def _predictions(path: Path, stage: str) -> dict[str, dict]:
    rows = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = _json(Path(f"{path}:{n}"), f"eval_{stage}", line)
            for k in PRED_KEYS:
                _need(row, k, f"{path}:{n}", f"eval_{stage}", "a prediction field")
            rows[row["id"]] = row
    return rows


def load(root: Path) -> dict:
    """The report's data from the pipeline's files (all of them, or MissingInputs listing each one missing)."""
    missing = [f"{f} (dvc repro {stage})" for f, stage in inputs().items() if not (root / f).exists()]
    if missing:
        raise MissingInputs("report inputs missing:\n  " + "\n  ".join(missing))
    stages = []
    for s in STAGES:
        where = f"metrics/eval_{s}.json"
        m = _json(root / where, f"eval_{s}")
        row = {"stage": s, "accuracy": _need(m, "accuracy", where, f"eval_{s}")}
        row["ci95"] = _interval(m, "accuracy_ci95", where, f"eval_{s}")
        row.update({k: m.get(k) for k in TOOL_KEYS})  # None: evaluated without tools
        stages.append(row)
    compare = _json(root / "metrics/compare.json", "compare")
    diff = {k: _need(compare, k, "metrics/compare.json", "compare") for k in COMPARE_KEYS}
    diff["ci95"] = _interval(compare, "ci95", "metrics/compare.json", "compare")
    preds = {s: _predictions(root / f"eval/{s}/predictions.jsonl", s) for s in ("sft", "grpo")}
    pairs = [(a, preds["grpo"][i]) for i, a in preds["sft"].items() if i in preds["grpo"]]
    examples = []
    for kind, n in EXAMPLES.items():
        want_grpo = kind == "fixed by GRPO"
        chosen = [(a, b) for a, b in pairs if b["correct"] == want_grpo and a["correct"] != want_grpo][:n]
        examples += [{"kind": kind, "sft": a, "grpo": b} for a, b in chosen]
    from ..stages.card import SEEDS, read_seeds

    seeds = read_seeds(root / SEEDS)  # None until `make seeds` has run
    return {
        "stages": stages,
        "diff": diff,
        "examples": examples,
        "plots": [t for t, _ in dvc_plots(root)],
        "seeds": seeds,
        "seed_rows": seed_rows(seeds),
    }


def seed_rows(seeds: dict | None) -> list[dict]:
    """The table rows of the seed spread: stage, accuracy and tool use as 'mean ± sd (min – max)'."""
    if not seeds:
        return []

    def cell(s: dict | None) -> str:
        if not s:
            return "–"
        sd = "" if s.get("sd") is None else f" ± {100 * s['sd']:.1f}"
        return f"{100 * s['mean']:.1f}%{sd} ({100 * s['min']:.1f} – {100 * s['max']:.1f})"

    return [
        {"stage": stage, "accuracy": cell(f.get("accuracy")), "tool_use": cell(f.get("tool_use_rate"))}
        for stage, f in seeds["stages"].items()
    ]


def accuracy_figure(stages: list[dict]):
    """Accuracy per stage, error bars = the 95% interval of metrics/eval_<stage>.json."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    acc = [r["accuracy"] for r in stages]
    err = [[a - r["ci95"][0] for a, r in zip(acc, stages)], [r["ci95"][1] - a for a, r in zip(acc, stages)]]
    ax.bar([r["stage"] for r in stages], acc, yerr=err, capsize=6, color=["#999", "#4c72b0", "#dd8452"])
    for i, r in enumerate(stages):
        ax.text(i, r["ci95"][1] + 0.01, f"{r['accuracy']:.1%}", ha="center", va="bottom")
    ax.set(ylabel="accuracy (held-out)", title="Accuracy per stage (95% CI)", ylim=(0, 1.15))
    fig.tight_layout()
    return fig


PAGE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(
    """<!doctype html>
<html><head><meta charset="utf-8"><title>agentrl report</title>
<style>body{font-family:sans-serif;max-width:60em} td,th{padding:2px 10px;text-align:right}
pre{background:#f4f4f4;padding:6px} .call{font-family:monospace}</style></head><body>
<h1>agentrl report</h1>
<p>The plots ({{ plots | join(", ") }}) are the <code>plots:</code> of dvc.yaml:
<code>dvc plots show</code> renders them (dvc_plots/index.html), <code>dvc plots diff &lt;exp&gt;</code> compares
experiments.</p>
<h2>Accuracy per stage</h2>
<img src="{{ figure }}" alt="accuracy per stage with 95% confidence intervals">
<table id="comparison"><tr><th>stage</th><th>accuracy</th><th>95% CI</th>
{%- for k in tool_keys %}<th>{{ columns[k][0] }}</th>{% endfor %}<th>exact McNemar p</th></tr>
{%- for r in stages %}
<tr><td>{{ r.stage }}</td><td>{{ pct(r.accuracy) }}</td><td>{{ pct(r.ci95[0]) }} – {{ pct(r.ci95[1]) }}</td>
{%- for k in tool_keys %}<td>{{ "no tools" if r[k] is none else columns[k][1].format(r[k]) }}</td>{% endfor %}
<td></td></tr>
{%- endfor %}
<tr><td>GRPO − SFT</td><td>{{ signed(diff.grpo_minus_sft) }}</td>
<td>{{ signed(diff.ci95[0]) }} – {{ signed(diff.ci95[1]) }}</td>{% for k in tool_keys %}<td></td>{% endfor %}
<td>{{ "%.2g" | format(diff.p_value | float) }}</td></tr>
</table>
<p>Accuracy intervals: metrics/eval_&lt;stage&gt;.json; GRPO − SFT: paired bootstrap CI and exact McNemar test on
the same problems (metrics/compare.json).</p>
<h2 id="seeds">Over seeds</h2>
{%- if seeds %}
<p>The table above is one run. Over {{ seeds.seeds | length }} seeds ({{ seeds.seeds | join(", ") }}; docs/seeds.json,
<code>make seeds</code>), each a whole pipeline run with its own problems: mean ± sample sd (min – max).</p>
<table id="seed-spread"><tr><th>stage</th><th>accuracy</th><th>tool use</th></tr>
{%- for r in seed_rows %}
<tr><td>{{ r.stage }}</td><td>{{ r.accuracy }}</td><td>{{ r.tool_use }}</td></tr>
{%- endfor %}
</table>
<p>GRPO − SFT over the seeds: mean {{ signed(seeds.grpo_minus_sft.mean) }}, min {{ signed(seeds.grpo_minus_sft.min) }},
max {{ signed(seeds.grpo_minus_sft.max) }}; pooled: {{ seeds.pooled.gained }} problems gained, {{ seeds.pooled.lost }}
lost of {{ seeds.pooled.problems }}, exact McNemar p = {{ "%.2g" | format(seeds.pooled.p_value) }}.</p>
{%- else %}
<p>No seed spread recorded: the figures above are one run. <code>make seeds N=3</code> runs the pipeline over
three seeds and writes docs/seeds.json, which this report then shows here.</p>
{%- endif %}
<h2>Example completions</h2>
{%- for e in examples %}
<h3>{{ e.kind }}: {{ e.sft.question }} (answer {{ e.sft.ground_truth }})</h3>
{%- for stage in ("sft", "grpo") %}{% set p = e[stage] %}
<p><b>{{ stage | upper }}</b>: answer {{ p.extracted if p.extracted is not none else "none" }}
({{ "correct" if p.correct else "wrong" }});
{%- if p.tool_calls is not defined %} evaluated without tools.
{%- elif not p.tool_calls %} no tool call.
{%- else %} tool calls:{% for c in p.tool_calls %}
<span class="call">{{ c.expression }} → {{ c.result }}{% if not c.ok %} (error){% endif %}</span>
{%- if not loop.last %};{% endif %}{% endfor %}{% endif %}</p>
<pre>{{ p.completion }}</pre>
{%- endfor %}
{%- else %}
<p>No problem that SFT and GRPO answer differently.</p>
{%- endfor %}
</body></html>
"""
)


def build(root: Path = Path("."), out: Path = Path("reports")) -> dict:
    """The experiments report (reports/): the figures and the tables, from the repository's metrics."""
    data = load(root)
    out.mkdir(parents=True, exist_ok=True)
    fig = accuracy_figure(data["stages"])
    fig.savefig(out / "accuracy_by_stage.png", dpi=110)
    plt.close(fig)
    tool_keys = [k for k in TOOL_KEYS if any(r[k] is not None for r in data["stages"])]
    page = PAGE.render(
        **data,
        figure="accuracy_by_stage.png",
        tool_keys=tool_keys,
        columns=STAGE_COLUMNS,
        pct=lambda x: f"{x:.1%}",
        signed=lambda x: f"{x:+.1%}",
    )
    (out / "report.html").write_text(page, encoding="utf-8")
    return {"html": out / "report.html", "figure": out / "accuracy_by_stage.png", "examples": len(data["examples"])}


def main(argv: list[str] | None = None) -> int:
    """`python -m agentrl.experiments.report [--out DIR]` (`make report`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="reports")
    a = ap.parse_args(argv)
    try:
        r = build(Path("."), Path(a.out))
    except (MissingInputs, ValueError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    print(f"wrote {r['html']} ({r['examples']} example completions); curves: dvc plots show")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
