"""Stage `compare` end to end (compare.main): the files the eval stages write in, metrics/compare.json and the
accuracy-per-stage plot's CSV out."""

import csv
import json

import pytest

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
    from agentrl import compare

    write_evals(workdir, tools)
    compare.main()
    out = json.loads((workdir / "metrics/compare.json").read_text())
    assert (out["base_accuracy"], out["sft_accuracy"], out["grpo_accuracy"]) == (0.2, 0.4, 0.8)
    assert out["sft_minus_base"] == pytest.approx(0.2) and out["grpo_minus_sft"] == pytest.approx(0.4)
    g = out["grpo_vs_sft"]
    assert (g["n"], g["only_before_correct"], g["only_after_correct"]) == (10, 1, 5)
    assert g["difference"] == pytest.approx(0.4)
    assert out["p_value"] == g["p_value"] == pytest.approx(2 * (1 + 6) / 2**6)  # exact McNemar, b=1, c=5
    lo, hi = out["ci95"]
    assert out["ci95"] == g["ci95"] and -1 <= lo < 0.4 < hi <= 1  # the bootstrap CI holds the difference
    b = out["sft_vs_base"]
    assert (b["only_before_correct"], b["only_after_correct"], b["p_value"]) == (0, 2, 0.5)
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
    assert json.loads((workdir / "metrics/compare.json").read_text())["ci95"] == out["ci95"]
