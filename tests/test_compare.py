"""Stage `compare` end to end (compare.main): the files the eval stages write in, metrics/compare.json and the
accuracy-per-stage plot's CSV out."""

import csv
import json

import pytest
import yaml

from agentrl.common import HEADLINE, diagnostics_path, read_metrics, split_metrics, write_metrics
from conftest import ROOT

# correctness per problem id (10 problems): base 2 right, sft 4, grpo 8; sft -> grpo: 5 gained, 1 lost
CORRECT = {
    "base": [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
    "sft": [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
    "grpo": [1, 0, 1, 1, 1, 1, 1, 1, 1, 0],
}


def write_evals(root, tools: bool):
    for stage, flags in CORRECT.items():
        d = root / "eval" / stage
        d.mkdir(parents=True)
        # written in another order than the ids sort: the pairing is by id, not by line
        rows = [{"id": f"test-{i:02d}", "correct": bool(c)} for i, c in reversed(list(enumerate(flags)))]
        (d / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        m = {"accuracy": sum(flags) / len(flags), "num_samples": len(flags)}
        if tools:
            m.update(tool_use_rate=0.1 * len(stage), tool_calls_per_problem=0.5, tool_error_rate=0.0)
        (root / "metrics").mkdir(exist_ok=True)
        (root / f"metrics/eval_{stage}.json").write_text(json.dumps(m))


@pytest.mark.parametrize("tools", [True, False])
def test_compare_main_writes_paired_test_and_plot_csv(workdir, tools):
    from agentrl.stages import compare

    write_evals(workdir, tools)
    compare.main()
    headline = json.loads((workdir / "metrics/compare.json").read_text())
    assert set(headline) <= set(HEADLINE["compare"]) and "grpo_vs_sft" not in headline  # details: diagnostics/
    out = read_metrics(workdir / "metrics/compare.json")
    assert (out["base_accuracy"], out["sft_accuracy"], out["grpo_accuracy"]) == (0.2, 0.4, 0.8)
    assert out["sft_minus_base"] == pytest.approx(0.2) and out["grpo_minus_sft"] == pytest.approx(0.4)
    g = out["grpo_vs_sft"]
    assert (g["n"], g["only_before_correct"], g["only_after_correct"]) == (10, 1, 5)
    assert g["difference"] == pytest.approx(0.4)
    assert g["p_value"] == pytest.approx(2 * (1 + 6) / 2**6)  # exact McNemar, b=1, c=5
    # the headline p as text in scientific notation (DVC prints numbers rounded: 4e-69 as 0.0)
    assert headline["p_value"] == out["p_value"] == f"{g['p_value']:.2e}" == "2.19e-01"
    lo, hi = out["ci95"]
    assert out["ci95"] == g["ci95"] and -1 <= lo < 0.4 < hi <= 1  # the bootstrap CI holds the difference
    b = out["sft_vs_base"]
    assert (b["only_before_correct"], b["only_after_correct"], b["p_value"]) == (0, 2, 0.5)
    gb = out["grpo_vs_base"]  # GRPO against the untrained model, on the same problems: 7 gained, 1 lost
    assert (gb["only_before_correct"], gb["only_after_correct"]) == (1, 7)
    assert gb["difference"] == pytest.approx(0.6) and gb["p_value"] == pytest.approx(2 * (1 + 8) / 2**8)
    tool_keys = {k for k in out if k.endswith(compare.TOOL_KEYS)}
    if tools:
        assert out["sft_tool_use_rate"] == pytest.approx(0.3) and out["grpo_tool_use_rate"] == pytest.approx(0.4)
        assert len(tool_keys) == 6 and "base_tool_use_rate" not in out
    else:
        assert not tool_keys
    with open(workdir / "metrics/accuracy_by_stage.csv", newline="") as f:
        assert list(csv.reader(f)) == [["stage", "accuracy"], ["base", "0.2"], ["sft", "0.4"], ["grpo", "0.8"]]
    # the seed of params.yaml seeds the bootstrap: the same inputs give the same interval
    compare.main()
    assert read_metrics(workdir / "metrics/compare.json")["ci95"] == out["ci95"]


def test_metrics_split_keeps_every_value_once_and_dvc_yaml_declares_both_files(tmp_path):
    data = {
        "accuracy": 0.5,
        "accuracy_ci95": [0.4, 0.6],
        "eval_seconds": 3.2,
        "accuracy_by_steps": {"1": 1.0},
        "tool_use_rate": 0.3,
    }
    head, rest = split_metrics("eval_sft", data)
    assert head == {"accuracy": 0.5, "accuracy_ci95": [0.4, 0.6], "tool_use_rate": 0.3}
    assert rest == {"eval_seconds": 3.2, "accuracy_by_steps": {"1": 1.0}}
    nested = {"parameters": 10, "pretrain": {"final_loss": 1.5, "steps": 3}, "runtime_s": 2.0}
    assert split_metrics("base", nested) == (
        {"parameters": 10, "pretrain": {"final_loss": 1.5}},
        {"pretrain": {"steps": 3}, "runtime_s": 2.0},
    )
    with pytest.raises(KeyError, match="no headline metrics defined for 'bench'"):
        split_metrics("bench", {})
    write_metrics(tmp_path / "metrics/eval_sft.json", data)
    assert json.loads((tmp_path / "diagnostics/eval_sft.json").read_text()) == rest
    assert read_metrics(tmp_path / "metrics/eval_sft.json") == data
    # every stage that writes metrics/<name>.json declares it as a DVC metric and diagnostics/<name>.json as an output
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    declared = {}
    for st in stages.values():
        for m in st.get("metrics") or []:
            f = next(iter(m)) if isinstance(m, dict) else m
            outs = [next(iter(o)) if isinstance(o, dict) else o for o in st.get("outs") or []]
            declared[f] = str(diagnostics_path(f)) in outs
    stems = {f.split("/")[-1][: -len(".json")] for f in declared}
    assert stems == set(HEADLINE) | {f"eval_{s}" for s in ("base", "sft", "grpo", "merged", "merged_int8")}
    assert all(declared.values()), declared


def test_paired_test_script_compares_two_prediction_files(tmp_path):
    """scripts/paired_test.py (an ablation against the full run): the compare stage's test over the common ids, and
    a bad row named by file and line."""
    import gzip
    import json
    import subprocess
    import sys
    from pathlib import Path

    from agentrl.stages.compare import paired_test

    script = Path(__file__).resolve().parents[1] / "scripts/paired_test.py"
    a = {f"p{i}": i % 3 == 0 for i in range(60)}
    b = {f"p{i}": i % 2 == 0 for i in range(60)}
    pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    pa.write_text("".join(json.dumps({"id": k, "correct": v}) + "\n" for k, v in a.items()))
    with gzip.open(pb, "wt") as f:
        f.writelines(json.dumps({"id": k, "correct": v, "extracted": None}) + "\n" for k, v in b.items())
    r = subprocess.run(
        [sys.executable, str(script), str(pa), str(pb), "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "r.json").read_text())
    assert {k: got[k] for k in paired_test(a, b, 42)} == paired_test(a, b, 42)
    assert (got["accuracy_before"], got["accuracy_after"]) == (20 / 60, 30 / 60)
    pa.write_text('{"id": "p1", "correct": true}\n{"id": "p2"}\n')
    r = subprocess.run([sys.executable, str(script), str(pa), str(pb)], capture_output=True, text=True)
    assert r.returncode != 0 and "a.jsonl:2" in r.stderr and "'correct'" in r.stderr
