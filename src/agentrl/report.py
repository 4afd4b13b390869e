"""`make report`: reports/report.html and reports/report.md with PNG plots, readable offline.

Plots: SFT loss, GRPO reward and KL, accuracy base -> SFT -> GRPO with 95% intervals, accuracy by
problem difficulty (reasoning steps), plus example completions before/after GRPO. Works from the
files the pipeline writes (metrics/, dvclive/, eval/); missing inputs are listed, not hidden.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STAGES = ("base", "sft", "grpo")


def read_tsv(path: Path, column: str) -> tuple[list[float], list[float]]:
    if not path.exists():
        return [], []
    with path.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return [float(r["step"]) for r in rows], [float(r[column]) for r in rows]


def _line(ax, xs, ys, label):
    if xs:
        ax.plot(xs, ys, label=label)


def build(root: Path = Path("."), out: Path = Path("reports")) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    live = root / "dvclive"
    figures: list[tuple[str, str]] = []
    missing: list[str] = []

    def save(fig, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        figures.append((name, title))

    # 1. SFT loss
    xs, ys = read_tsv(live / "sft/plots/metrics/loss.tsv", "loss")
    if xs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        _line(ax, xs, ys, "train loss")
        ax.set(xlabel="optimizer step", ylabel="loss", title="SFT training loss")
        save(fig, "sft_loss.png", "SFT training loss")
    else:
        missing.append("dvclive/sft/plots/metrics/loss.tsv")

    # 2. GRPO reward (+/- std) and 3. KL / completion length
    xs, ys = read_tsv(live / "grpo/plots/metrics/reward.tsv", "reward")
    if xs:
        _, sd = read_tsv(live / "grpo/plots/metrics/reward_std.tsv", "reward_std")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(xs, ys, label="reward mean")
        if len(sd) == len(ys):
            ax.fill_between(
                xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], alpha=0.2, label="± std"
            )
        ax.set(xlabel="optimizer step", ylabel="reward", title="GRPO reward")
        ax.legend()
        save(fig, "grpo_reward.png", "GRPO reward per step")
    else:
        missing.append("dvclive/grpo/plots/metrics/reward.tsv")
    kx, ky = read_tsv(live / "grpo/plots/metrics/kl.tsv", "kl")
    lx, ly = read_tsv(live / "grpo/plots/metrics/completions/mean_length.tsv", "mean_length")
    if kx or lx:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if kx:
            ax.plot(kx, ky, label="KL", color="tab:red")
            ax.set_ylabel("KL")
        ax2 = ax.twinx()
        if lx:
            ax2.plot(lx, ly, label="completion length", color="tab:green")
            ax2.set_ylabel("mean completion tokens")
        ax.set(xlabel="optimizer step", title="GRPO KL and completion length")
        save(fig, "grpo_kl_length.png", "GRPO KL and completion length")

    # 4. accuracy per stage with 95% CI, 5. accuracy by difficulty
    evals = {
        s: json.loads((root / f"metrics/eval_{s}.json").read_text())
        for s in STAGES
        if (root / f"metrics/eval_{s}.json").exists()
    }
    missing += [f"metrics/eval_{s}.json" for s in STAGES if s not in evals]
    if evals:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        names = list(evals)
        acc = [evals[s]["accuracy"] for s in names]
        lo = [a - evals[s]["accuracy_ci95"][0] for a, s in zip(acc, names)]
        hi = [evals[s]["accuracy_ci95"][1] - a for a, s in zip(acc, names)]
        ax.bar(names, acc, yerr=[lo, hi], capsize=6, color=["#999", "#4c72b0", "#dd8452"][: len(names)])
        for i, (a, h) in enumerate(zip(acc, hi)):
            ax.text(i, a + h + 0.01, f"{a:.1%}", ha="center", va="bottom")  # above the CI's upper cap
        ax.set(ylabel="accuracy (held-out)", title="Accuracy per stage (95% CI)", ylim=(0, max(acc) * 1.3 + 0.05))
        save(fig, "accuracy_by_stage.png", "Accuracy per stage")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        steps = sorted({k for e in evals.values() for k in e.get("accuracy_by_steps", {})})
        width = 0.8 / len(names)
        for i, s in enumerate(names):
            vals = [evals[s].get("accuracy_by_steps", {}).get(k, 0.0) for k in steps]
            ax.bar([j + i * width for j in range(len(steps))], vals, width, label=s)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(steps))], [f"{k} steps" for k in steps])
        ax.set(ylabel="accuracy", title="Accuracy by problem difficulty")
        ax.legend()
        save(fig, "accuracy_by_difficulty.png", "Accuracy by difficulty")

    # examples before/after GRPO
    examples = []
    pf = {s: root / f"eval/{s}/predictions.jsonl" for s in ("sft", "grpo")}
    if all(p.exists() for p in pf.values()):
        sft = {r["id"]: r for r in map(json.loads, pf["sft"].read_text().splitlines())}
        grpo = [json.loads(line) for line in pf["grpo"].read_text().splitlines()]
        fixed = [(sft[g["id"]], g) for g in grpo if g["id"] in sft and g["correct"] and not sft[g["id"]]["correct"]]
        broke = [(sft[g["id"]], g) for g in grpo if g["id"] in sft and not g["correct"] and sft[g["id"]]["correct"]]
        examples = [("fixed by GRPO", a, b) for a, b in fixed[:3]] + [("broken by GRPO", a, b) for a, b in broke[:2]]

    compare = (
        json.loads((root / "metrics/compare.json").read_text()) if (root / "metrics/compare.json").exists() else {}
    )
    md = ["# agentrl report", ""]
    if compare:
        md += [
            f"Accuracy: base {compare['base_accuracy']:.1%} → SFT {compare['sft_accuracy']:.1%} → "
            f"GRPO {compare['grpo_accuracy']:.1%}; GRPO − SFT = {compare['grpo_minus_sft']:+.1%} "
            f"(95% CI {compare['ci95'][0]:+.1%} … {compare['ci95'][1]:+.1%}, "
            f"exact McNemar p = {compare['p_value']:.2g}).",
            "",
        ]
    for name, title in figures:
        md += [f"## {title}", "", f"![{title}]({name})", ""]
    if examples:
        md += ["## Example completions before/after GRPO", ""]
        for kind, a, b in examples:
            md += [
                f"**{kind}** — {a['question']} (answer {a['ground_truth']})",
                "",
                "SFT:",
                "```",
                a["completion"],
                "```",
                "GRPO:",
                "```",
                b["completion"],
                "```",
                "",
            ]
    if missing:
        md += ["## Missing inputs", ""] + [f"- `{m}`" for m in missing] + [""]
    (out / "report.md").write_text("\n".join(md))

    body, in_pre = [], False
    for line in md:
        if line == "```":
            body.append("</pre>" if in_pre else "<pre>")
            in_pre = not in_pre
        elif in_pre:
            body.append(html.escape(line))
        elif line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("!["):
            name = line[line.index("(") + 1 : -1]
            body.append(f'<img src="{html.escape(name)}" alt="{html.escape(name)}" style="max-width:720px">')
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>agentrl report</title></head><body>"
        + "\n".join(body)
        + "</body></html>"
    )
    (out / "report.html").write_text(page)
    return {"figures": [f for f, _ in figures], "missing": missing, "examples": len(examples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="reports")
    a = ap.parse_args()
    r = build(Path("."), Path(a.out))
    print(
        f"wrote {a.out}/report.html and report.md with {len(r['figures'])} plots"
        + (f"; missing inputs: {', '.join(r['missing'])}" if r["missing"] else "")
    )


if __name__ == "__main__":
    main()
