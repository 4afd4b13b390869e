"""`make seeds` (scripts/seeds.py, agentrl.experiments.seeds): the aggregate over seeds, the README block, the model
card's and the report's seed spread; and (slow) the script end to end over `dvc exp` in a scratch copy of the
repository."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import yaml

from agentrl.experiments import seeds
from agentrl.experiments.scratch import git_commit_all
from agentrl.stages.card import read_seeds, seed_summary
from agentrl.stages.compare import mcnemar_exact
from conftest import ROOT, mini_params, tool_env


def fake_run(seed, sft, grpo, gained, lost, n=100):
    stages = {s: {"accuracy": 0.0, "tool_use_rate": 0.0} for s in seeds.STAGES}
    stages["sft"] = {"accuracy": sft, "tool_use_rate": 0.5}
    stages["grpo"] = stages["merged"] = {"accuracy": grpo, "tool_use_rate": 1.0}
    stages["merged_int8"] = {"accuracy": grpo - 0.01, "tool_use_rate": None}  # a run without the figure
    return {
        "seed": seed,
        "experiment": f"seed-{seed}",
        "stages": stages,
        "grpo_minus_sft": grpo - sft,
        "ci95": [grpo - sft - 0.05, grpo - sft + 0.05],
        "p_value": mcnemar_exact(lost, gained),
        "gained": gained,
        "lost": lost,
        "n": n,
    }


RUNS = [fake_run(42, 0.50, 0.90, 42, 2), fake_run(43, 0.60, 0.95, 36, 1), fake_run(44, 0.55, 0.97, 44, 2)]


def test_aggregate_spread_and_pooled_test():
    agg = seeds.aggregate(RUNS)
    sft = agg["stages"]["sft"]["accuracy"]
    assert agg["seeds"] == [42, 43, 44]
    assert sft["mean"] == pytest.approx(0.55) and sft["sd"] == pytest.approx(statistics.stdev([0.5, 0.6, 0.55]))
    assert (sft["min"], sft["max"], sft["n"]) == (0.5, 0.6, 3)
    assert agg["stages"]["merged_int8"]["tool_use_rate"] is None  # no run had it: no number made up
    assert agg["grpo_minus_sft"]["mean"] == pytest.approx((0.4 + 0.35 + 0.42) / 3)
    pooled = agg["pooled"]
    assert (pooled["gained"], pooled["lost"], pooled["problems"]) == (122, 5, 300)
    assert pooled["p_value"] == mcnemar_exact(5, 122) and pooled["difference"] == pytest.approx(117 / 300)
    assert [r["p_value"] for r in agg["paired_per_seed"]] == [r["p_value"] for r in RUNS]
    one = seeds.aggregate(RUNS[:1])["stages"]["sft"]["accuracy"]
    assert one["sd"] is None and one["mean"] == 0.5  # one seed: no spread claimed


def test_markdown_and_readme_block(tmp_path):
    md = seeds.markdown(seeds.aggregate(RUNS))
    assert "| sft | 55.0% ± 5.0 (50.0–60.0) | 50.0% ± 0.0 (50.0–50.0) |" in md
    assert "| 43 | +35.0 | +30.0 … +40.0 |" in md and "122 problems gained, 5 lost of 300" in md
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{seeds.MARKERS[0]}\nold table\n{seeds.MARKERS[1]}\nafter\n")
    assert seeds.update_readme(md, readme)
    text = readme.read_text()
    assert "old table" not in text and md in text and text.startswith("# x\nbefore\n") and text.endswith("after\n")
    readme.write_text("no markers\n")
    assert not seeds.update_readme(md, readme) and readme.read_text() == "no markers\n"


def test_the_results_doc_has_the_seeds_block():
    text = (ROOT / seeds.README).read_text()
    assert text.count(seeds.MARKERS[0]) == 1 and text.index(seeds.MARKERS[0]) < text.index(seeds.MARKERS[1])


def test_card_seed_summary(tmp_path):
    assert read_seeds(tmp_path / "none.json") is None
    path = tmp_path / "seeds.json"
    path.write_text(json.dumps({"seeds": [], "status": "not measured yet"}))
    assert read_seeds(path) is None
    assert "Not measured: this card reports one run (seed 42). `make seeds N=3`" in seed_summary(None, 42)
    path.write_text(json.dumps(seeds.aggregate(RUNS)))
    text = seed_summary(read_seeds(path), 42)
    assert "Over 3 seeds (42, 43, 44; the set includes this run's seed 42)" in text
    assert "| SFT | 55.0% ± 5.0 (50.0% … 60.0%) |" in text and "exact McNemar p = " in text
    assert "does not include this run's seed 7" in seed_summary(read_seeds(path), 7)
    path.write_text(json.dumps({"seeds": [1], "stages": {}}))
    with pytest.raises(ValueError, match=r"seeds.json: no 'grpo_minus_sft'"):
        read_seeds(path)
    path.write_text("{")
    with pytest.raises(ValueError, match=r"seeds.json: not valid JSON"):
        read_seeds(path)


def test_report_shows_the_seed_spread_or_says_there_is_none(tmp_path):
    from agentrl.experiments import report
    from test_report import write_fixture

    write_fixture(tmp_path)
    report.build(tmp_path, tmp_path / "reports")
    page = (tmp_path / "reports/report.html").read_text()
    assert "No seed spread recorded" in page and 'id="seed-spread"' not in page
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/seeds.json").write_text(json.dumps(seeds.aggregate(RUNS)))
    report.build(tmp_path, tmp_path / "reports")
    page = (tmp_path / "reports/report.html").read_text()
    assert 'id="seed-spread"' in page and "<td>sft</td><td>55.0% ± 5.0 (50.0 – 60.0)</td>" in page
    assert "122 problems gained, 5\nlost of 300" in page


def _git(repo, *args):
    r = subprocess.run(["git", *args], cwd=repo, env=tool_env(None), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_collect_reads_each_experiments_committed_metrics(tmp_path, monkeypatch):
    """seeds.collect reads metrics/ and diagnostics/ as each experiment committed them (git-tracked `cache: false`
    outputs, at refs/exps/<baseline>/<name>), so a baseline without them works too; a missing file is named."""
    (tmp_path / "README.md").write_text("x\n")
    git_commit_all(tmp_path, "baseline")
    base = _git(tmp_path, "rev-parse", "HEAD")
    for run_ in RUNS[:2]:
        for stage, path in seeds.STAGES.items():
            (tmp_path / path).parent.mkdir(exist_ok=True)
            (tmp_path / path).write_text(json.dumps(run_["stages"][stage]))
        keys = ("grpo_minus_sft", "ci95", "p_value")
        (tmp_path / seeds.COMPARE).write_text(json.dumps({k: run_[k] for k in keys}))
        (tmp_path / "diagnostics").mkdir(exist_ok=True)
        detail = {"only_after_correct": run_["gained"], "only_before_correct": run_["lost"], "n": run_["n"]}
        (tmp_path / seeds.COMPARE_DETAILS).write_text(json.dumps({"grpo_vs_sft": detail}))
        _git(tmp_path, "add", "-A")
        _git(tmp_path, "commit", "-qm", f"exp {run_['seed']}")
        exp = _git(tmp_path, "rev-parse", "HEAD")
        _git(tmp_path, "update-ref", f"refs/exps/{base[:2]}/{base[2:]}/seed-{run_['seed']}", exp)
        _git(tmp_path, "reset", "-q", "--hard", base)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(seeds, "experiment_states", lambda: {"seed-42": "Success", "seed-43": "Success"})
    got = seeds.collect([42, 43])
    assert got == [{k: v for k, v in r.items()} for r in RUNS[:2]]
    monkeypatch.setattr(seeds, "experiment_states", lambda: {"seed-42": "Success", "seed-43": "Failed"})
    with pytest.raises(SystemExit, match=r"experiments did not succeed: seed-43 \(Failed\)"):
        seeds.collect([42, 43])
    with pytest.raises(ValueError, match="experiment seed-44: no refs/exps/"):
        seeds.exp_commit("seed-44")


def run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, env=tool_env("disabled"), capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.mark.slow
@pytest.mark.heavy  # two whole miniature pipelines through dvc exp: 37 min on the loaded 2-core machine
def test_seeds_script_end_to_end(copy_repo):
    """Two seeds of the miniature pipeline as `dvc exp` runs; the aggregate matches each experiment's metrics,
    the README block and the card show it, and a second call reuses the experiments."""
    import dvc.api

    p = mini_params()
    p["tracking"]["report_to"] = ["dvclive"]
    (copy_repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    git_commit_all(copy_repo, "code")
    out = run([sys.executable, "scripts/seeds.py", "-n", "2"], copy_repo)
    first = p["seed"]
    agg = json.loads((copy_repo / "docs/seeds.json").read_text())
    assert agg["seeds"] == [first, first + 1]
    rows = {r["Experiment"]: r for r in dvc.api.exp_show(repo=str(copy_repo)) if r["Experiment"]}
    assert {rows[f"seed-{k}"]["State"] for k in agg["seeds"]} == {"Success"}
    head = _git(copy_repo, "rev-parse", "HEAD")
    for k, r in zip(agg["seeds"], agg["runs"]):
        ref = f"refs/exps/{head[:2]}/{head[2:]}/seed-{k}"  # each experiment's own committed files
        for stage, path in seeds.STAGES.items():
            m = json.loads(_git(copy_repo, "show", f"{ref}:{path}"))
            assert r["stages"][stage]["accuracy"] == m["accuracy"], (k, stage)
        c = json.loads(_git(copy_repo, "show", f"{ref}:metrics/compare.json"))
        assert (r["grpo_minus_sft"], r["p_value"]) == (c["grpo_minus_sft"], float(c["p_value"]))
    accs = [r["stages"]["sft"]["accuracy"] for r in agg["runs"]]
    assert agg["stages"]["sft"]["accuracy"]["mean"] == pytest.approx(statistics.fmean(accs))
    assert (
        seeds.markdown({k: v for k, v in agg.items() if k not in ("commit", "seconds")})
        in (copy_repo / seeds.README).read_text()
    )
    # the experiments ran in temporary copies: no pipeline run here for the card to describe yet
    assert "the model card shows the spread once the pipeline has run here: dvc repro" in out
    again = run([sys.executable, "scripts/seeds.py", "-n", "2"], copy_repo)
    assert f"seed-{first}: already run on this commit, reused" in again
    assert "Running stage 'sft'" not in again
