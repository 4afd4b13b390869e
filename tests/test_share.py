"""Sharing results: the DVC remote (make push / make pull), the model card (stage `card`) and make publish."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from agentrl.serving.local import free_port, wait_healthy
from conftest import ROOT, mini_params, tool_env

BIN = Path(sys.executable).parent
VENV = BIN.parent  # the venv running the tests: make targets use it (VENV=...) and skip set-up (-o setup)
SECRET = "hf_testtoken_DO_NOT_LEAK_0123456789"


def run(cmd, cwd, check=True, env=None, timeout=900):
    full = {**{k: v for k, v in tool_env("offline").items() if k != "HF_TOKEN"}, **(env or {})}
    r = subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        )
    return r


def make(target, cwd, *args, check=True, env=None):
    return run(["make", "--no-print-directory", "-o", "setup", target, f"VENV={VENV}", *args], cwd, check, env)


# ------------------------------------------------------------------------------------------ remote / set-up
def test_default_remote_is_a_directory_outside_the_checkout():
    from configobj import ConfigObj

    conf = ConfigObj(str(ROOT / ".dvc/config"))
    name = conf["core"]["remote"]
    url = conf[f'remote "{name}"']["url"]
    assert url == "~/.cache/agentrl/dvc-remote"
    resolved = Path(url).expanduser()
    assert resolved.is_absolute() and ROOT not in resolved.parents and "credential" not in str(conf).lower()


def test_remote_override_is_absolute_for_a_directory_and_kept_for_a_url(tmp_path, monkeypatch):
    from agentrl.experiments.share import OVERRIDE, remote_override

    monkeypatch.chdir(tmp_path)
    assert remote_override(None) is None and remote_override("") is None
    local = remote_override("rel/remote")
    assert local == {"remote": {OVERRIDE: {"url": str(tmp_path / "rel/remote")}}, "core": {"remote": OVERRIDE}}
    assert remote_override("~/r")["remote"][OVERRIDE]["url"] == str(Path.home() / "r")
    assert remote_override("s3://bucket/agentrl")["remote"][OVERRIDE]["url"] == "s3://bucket/agentrl"


def test_remote_plugins_are_pinned_apart_and_installed_only_when_asked():
    pins = [
        line
        for line in (ROOT / "requirements-remotes.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert sorted(p.split("==")[0] for p in pins) == ["dvc-gs", "dvc-s3", "dvc-ssh"] and all("==" in p for p in pins)
    default = (ROOT / "requirements.txt").read_text()
    assert "dvc==3.67.1" in default and not any(p.split("==")[0] in default for p in pins)
    stamp = (
        f"{VENV}/.setup-"
        + __import__("hashlib")
        .sha256((ROOT / "requirements.txt").read_bytes() + (ROOT / "pyproject.toml").read_bytes())
        .hexdigest()[:16]
    )
    r = run(
        ["make", "--no-print-directory", "-o", stamp, "setup", f"VENV={VENV}", "EXTRAS=s3 azure"], ROOT, check=False
    )
    assert r.returncode != 0 and "unknown extra 'azure'" in r.stderr, r.stderr
    dry = run(
        ["make", "-n", "--no-print-directory", "-o", stamp, "setup", f"VENV={VENV}", "EXTRAS=s3 ssh"], ROOT
    ).stdout
    assert "-c requirements-remotes.txt dvc-s3 dvc-ssh" in dry, dry
    assert (
        "requirements-remotes"
        not in run(["make", "-n", "--no-print-directory", "-o", stamp, "setup", f"VENV={VENV}"], ROOT).stdout
    )


def test_push_then_pull_in_a_clone_through_a_one_off_remote(tmp_path):
    """make's share module on a one-file DVC repository: DVC_REMOTE is used for that command only (never written
    to a config file), a fresh clone gets the file back, and experiments are skipped without a git remote."""
    a, remote = tmp_path / "a", tmp_path / "remote"
    a.mkdir()
    run(["git", "init", "-q"], a)
    run(["dvc", "init", "-q"], a)
    (a / "data.txt").write_text("shared result\n")
    run(["dvc", "add", "-q", "data.txt"], a)
    run(["git", "add", "-A"], a)
    run(["git", "commit", "-qm", "data"], a)
    out = run([sys.executable, "-m", "agentrl.experiments.share", "push", "--remote", str(remote)], a).stdout
    assert "dvc push: 1 files" in out and str(remote) in out, out
    assert "dvc exp push: skipped, no git remote 'origin'" in out, out
    assert str(remote) not in (a / ".dvc/config").read_text() and not (a / ".dvc/config.local").exists()
    assert list(remote.rglob("*")), "nothing was pushed to the remote directory"

    b = tmp_path / "b"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    assert not (b / "data.txt").exists()
    out = run(
        [sys.executable, "-m", "agentrl.experiments.share", "pull"], b, check=False, env={"DVC_REMOTE": str(remote)}
    )
    assert out.returncode == 0, out.stderr
    assert (b / "data.txt").read_text() == "shared result\n"
    assert "dvc exp pull origin:" in out.stdout, out.stdout  # the clone has a git remote: experiments pulled too
    assert run(["dvc", "status"], b).stdout.strip() == "Data and pipelines are up to date."
    # an output missing from the local cache and from the remote: an error, not a push of the rest
    shutil.rmtree(a / ".dvc/cache")
    r = run(
        [sys.executable, "-m", "agentrl.experiments.share", "push", "--remote", str(tmp_path / "empty")], a, check=False
    )
    assert r.returncode == 1 and "in neither the local cache nor remote 'cli'" in r.stderr, (r.stdout, r.stderr)
    # no remote at all: an error naming the variable, not a silent no-op
    r = run([sys.executable, "-m", "agentrl.experiments.share", "push"], a, check=False)
    assert r.returncode == 1 and "DVC_REMOTE" in r.stderr, r.stderr


def test_pull_refuses_a_corrupted_remote_naming_the_file(tmp_path):
    """Issue 26 item 4: one flipped byte of a model file on the remote. `make pull` used to install it (exit 0,
    md5 different from dvc.lock, `dvc status` clean); now DVC's `verify` hashes what it downloads and the pull
    fails naming the file, which is not installed. A remote that does not exist is named as such."""
    import hashlib

    a, remote = tmp_path / "a", tmp_path / "remote"
    (a / "models/merged").mkdir(parents=True)
    run(["git", "init", "-q"], a)
    run(["dvc", "init", "-q"], a)
    weights = b"\x00weights of the run\x01" * 64
    (a / "models/merged/model.safetensors").write_bytes(weights)
    (a / "models/merged/config.json").write_text("{}")
    run(["dvc", "add", "-q", "models/merged"], a)
    run(["git", "add", "-A"], a)
    run(["git", "commit", "-qm", "model"], a)
    run([sys.executable, "-m", "agentrl.experiments.share", "push", "--remote", str(remote)], a)
    md5 = hashlib.md5(weights).hexdigest()
    obj = remote / "files/md5" / md5[:2] / md5[2:]
    obj.chmod(0o644)
    data = bytearray(obj.read_bytes())
    data[10] ^= 0xFF
    obj.write_bytes(bytes(data))

    b = tmp_path / "b"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    r = run([sys.executable, "-m", "agentrl.experiments.share", "pull", "--remote", str(remote)], b, check=False)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "models/merged/model.safetensors" in r.stderr and "corrupt" in r.stderr and md5 in r.stderr, r.stderr
    assert not (b / "models/merged/model.safetensors").exists()  # nothing unverified was installed

    r = run(
        [sys.executable, "-m", "agentrl.experiments.share", "pull", "--remote", str(tmp_path / "no-such-remote")],
        b,
        check=False,
    )
    assert r.returncode == 1 and "does not exist" in r.stderr and str(tmp_path / "no-such-remote") in r.stderr
    assert "Is your cache up to date" not in r.stderr, r.stderr

    data[10] ^= 0xFF  # the remote repaired: the same pull installs the exact bytes
    obj.write_bytes(bytes(data))
    run([sys.executable, "-m", "agentrl.experiments.share", "pull", "--remote", str(remote)], b)
    assert (b / "models/merged/model.safetensors").read_bytes() == weights


# ------------------------------------------------------------------------------------------------ the card
def fake_run(tmp: Path, *, tools: bool = True, int8: bool = True) -> dict:
    """The metrics files and models/merged a pipeline run leaves, with values the card must carry."""

    def ev(acc, ci, **extra):
        return {"accuracy": acc, "accuracy_ci95": ci, "num_samples": 24, "format_rate": 0.875, **extra}

    tool = (
        (lambda r, c, e: {"tool_use_rate": r, "tool_calls_per_problem": c, "tool_error_rate": e})
        if tools
        else (lambda *a: {})
    )
    m = {
        "prepare": {
            "source": "synthetic",
            "written": {"sft_train": 200, "rl_train": 200, "test": 24},
            "dropped": {"total": 0},
        },
        "base": {"base_model": "tiny", "parameters": 12345, "vocab_size": 453},
        "sft_train": {"steps": 6, "first_loss": 5.5, "final_loss": 3.25, "learning_rate": 0.005},
        "grpo_train": {
            "steps": 2,
            "completions_per_step": 8,
            "learning_rate": 0.001,
            "beta": 0.0,
            "reward_first": 0.125,
            "reward_last": 0.25,
        },
        "eval_base": ev(0.0, [0.0, 0.1379]),
        "eval_sft": ev(0.2917, [0.1494, 0.4892], **tool(0.5, 0.75, 0.0)),
        "eval_grpo": ev(0.4583, [0.2788, 0.6494], **tool(0.9583, 1.25, 0.0417)),
        "eval_merged": ev(0.4583, [0.2788, 0.6494], **tool(0.9583, 1.25, 0.0417)),
        "eval_merged_int8": ev(0.4167, [0.2447, 0.6118]) if int8 else {"skipped": "export.quantize is none"},
        "compare": {
            "grpo_vs_sft": {
                "n": 24,
                "difference": 0.1667,
                "only_before_correct": 1,
                "only_after_correct": 5,
                "p_value": 0.2188,
                "ci95": [-0.0417, 0.375],
            },
            "sft_vs_base": {
                "n": 24,
                "difference": 0.2917,
                "only_before_correct": 0,
                "only_after_correct": 7,
                "p_value": 0.0156,
                "ci95": [0.125, 0.4583],
            },
        },
        "export": {
            "max_abs_logit_diff": 1.2e-6,
            "tolerance": 1e-4,
            "greedy_identical_count": 2,
            "num_prompts": 2,
            "parameters": 12345,
            "passed": True,
        },
        "quantize": (
            {
                "quantize": "int8",
                "merged_accuracy": 0.4583,
                "int8_accuracy": 0.4167,
                "int8_backend": "torch_dynamic",
                "accuracy_delta": -0.0416,
                "int8_speed_ratio": 1.31,
            }
            if int8
            else {"quantize": "none", "merged_accuracy": 0.4583}
        ),
    }
    from agentrl.common import write_metrics

    for name, data in m.items():  # headline keys to metrics/, the rest to diagnostics/, as the stages write them
        write_metrics(tmp / "metrics" / f"{name}.json", data)
    merged = tmp / "models/merged"
    merged.mkdir(parents=True, exist_ok=True)
    (merged / "model.safetensors").write_bytes(b"weights of this run")
    (merged / "config.json").write_text("{}")
    return m


def test_card_stage_reports_what_it_depends_on():
    from agentrl.stages.card import CARD, CARD_PARAMS, MERGED, METRICS_FILES

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    card = stages["card"]
    assert card["cmd"] == "sh scripts/stage-python.sh -m agentrl.stages.card"
    assert set(card["params"]) == set(CARD_PARAMS)
    assert set(METRICS_FILES) | {str(MERGED)} <= set(card["deps"])
    # its output is outside every other stage's output (DVC refuses overlaps) and holds the card
    assert card["outs"] == [str(CARD.parent)]
    others = [
        str(o if isinstance(o, str) else next(iter(o)))
        for n, s in stages.items()
        if n != "card"
        for o in s.get("outs", []) + s.get("metrics", []) + s.get("plots", [])
    ]
    assert not [o for o in others if o == str(CARD.parent) or str(CARD).startswith(o + "/")], others
    # it runs after the stage that measures the int8 accuracy
    assert "metrics/eval_merged_int8.json" in card["deps"]


def test_card_carries_the_runs_metrics_and_parses(workdir):
    from huggingface_hub import ModelCard

    from agentrl.common import model_files_digest
    from agentrl.config import load_params
    from agentrl.stages.card import CARD, write_card

    m = fake_run(workdir)
    run(["git", "init", "-q"], workdir)
    run(["git", "add", "params.yaml"], workdir)
    run(["git", "commit", "-qm", "params"], workdir)
    commit = run(["git", "rev-parse", "HEAD"], workdir).stdout.strip()
    write_card(load_params())

    card = ModelCard.load(CARD)
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert "base_model" not in meta  # `tiny` is built locally: no hub id to point at
    agentrl = meta["agentrl"]
    assert agentrl["git_commit"] == commit and agentrl["uncommitted_changes"] == []
    assert agentrl["merged_model_digest"] == model_files_digest("models/merged")
    assert agentrl["int8_accuracy"] == 0.4167 and agentrl["test_problems"] == 24
    assert agentrl["tools"] == mini_params()["agent"]["tools"]
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert results == {"held-out accuracy (fp32, greedy)": 0.4583, "held-out accuracy (int8, greedy)": 0.4167}
    text = card.text
    for row in (
        "| base model | **0.0%** | 0.0–13.8% | 24 |",
        "| SFT | **29.2%** | 14.9–48.9% | 24 |",
        "| GRPO (LoRA adapter) | **45.8%** | 27.9–64.9% | 24 |",
        "| merged, int8 | **41.7%** | 24.5–61.2% | 24 |",
    ):
        assert row in text, text
    assert "| 95.8% | 1.25 | 4.2% |" in text  # GRPO's tool use: rate, calls per problem, error rate
    assert "**GRPO − SFT = +16.7 points**, paired-bootstrap 95% CI -4.2 … +37.5" in text
    assert "held-out accuracy 41.7% against 45.8% in fp32 (-4.2 points)" in text and "1.31×" in text
    assert "200 SFT / 200 GRPO training problems, 24 held-out test problems" in text
    assert f"git commit `{commit}`" in text and "make serve MODEL=models/merged" in text
    params = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    assert params["sft"]["trainer"]["learning_rate"] == mini_params()["sft"]["trainer"]["learning_rate"]
    assert params["seed"] == mini_params()["seed"] and "tracking" not in params and "serve" not in params
    assert m["sft_train"]["final_loss"] == 3.25 and "loss 5.500 → 3.250" in text

    # a changed params file (as in a `dvc exp run -S ...`) is named on the card
    (workdir / "params.yaml").write_text((workdir / "params.yaml").read_text() + "\n")
    write_card(load_params())
    assert ModelCard.load(CARD).data.to_dict()["agentrl"]["uncommitted_changes"] == ["params.yaml"]


def test_card_without_tools_or_int8_says_so(workdir):
    from huggingface_hub import ModelCard

    from agentrl.config import load_params
    from agentrl.stages.card import CARD, write_card

    p = mini_params()
    p["agent"]["tools"] = []
    p["export"]["quantize"] = "none"
    (workdir / "params.yaml").write_text(yaml.safe_dump(p))
    fake_run(workdir, tools=False, int8=False)
    write_card(load_params())
    card = ModelCard.load(CARD)
    assert "trained and evaluated without tools (`agent.tools: []`)" in card.text
    assert "| merged, int8 | not evaluated (export.quantize is none)" in card.text
    assert "Not evaluated (`export.quantize: none`)" in card.text and "tool use |" not in card.text
    assert card.data.to_dict()["agentrl"]["git_commit"] is None and "not run in a git checkout" in card.text
    assert [r.metric_name for r in card.data.eval_results] == ["held-out accuracy (fp32, greedy)"]


def test_card_names_a_missing_metrics_file(workdir):
    from agentrl.config import load_params
    from agentrl.stages.card import write_card

    fake_run(workdir)
    (workdir / "metrics/quantize.json").unlink()
    with pytest.raises(FileNotFoundError, match="metrics/quantize.json"):
        write_card(load_params())


# ------------------------------------------------------------------------------------------------ publish
def test_make_publish_without_token_or_repo_id_refuses_naming_the_variable():
    r = make("publish", ROOT, "REPO_ID=someone/agentrl", check=False)
    assert r.returncode != 0 and "HF_TOKEN is not set" in r.stderr, (r.stdout, r.stderr)
    r = make("publish", ROOT, check=False, env={"HF_TOKEN": SECRET})
    assert r.returncode != 0 and "REPO_ID is not set" in r.stderr and SECRET not in r.stdout + r.stderr


@pytest.fixture
def published(workdir, monkeypatch, capsys):
    """A run with its card, a token in the environment, and the hub replaced by a recorder."""
    from huggingface_hub import HfApi

    import agentrl.stages.card as card
    from agentrl.config import load_params

    fake_run(workdir)
    card.write_card(load_params())
    calls = []
    monkeypatch.setattr(
        HfApi,
        "create_repo",
        lambda self, repo_id, **kw: (
            calls.append(("create_repo", self.token, repo_id, kw)) or f"https://huggingface.co/{repo_id}"
        ),
    )
    monkeypatch.setattr(
        HfApi,
        "create_commit",
        lambda self, repo_id, operations, **kw: (
            calls.append(("create_commit", self.token, repo_id, list(operations), kw)) or "commit-info"
        ),
    )
    monkeypatch.setattr(card, "pipeline_changes", lambda: {})
    monkeypatch.setenv("HF_TOKEN", SECRET)
    return calls


def test_publish_uploads_merged_and_card_in_one_commit(published, workdir, capsys, caplog):
    import agentrl.stages.card as card

    assert card.publish("someone/agentrl-merged", private=True) == "commit-info"
    (_, tok1, repo1, kw1), (_, tok2, repo2, ops, kw2) = published
    assert tok1 == tok2 == SECRET and repo1 == repo2 == "someone/agentrl-merged"
    assert kw1["private"] is True and kw1["exist_ok"] is True
    files = {o.path_in_repo: Path(o.path_or_fileobj) for o in ops}
    assert set(files) == {"model.safetensors", "config.json", "README.md"}
    assert files["README.md"].read_text() == (workdir / "models/card/README.md").read_text()
    assert files["model.safetensors"].read_bytes() == b"weights of this run"
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err + caplog.text + kw2["commit_message"] + kw2["commit_description"]
    assert not [p for p in workdir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_publish_refuses_a_stale_card_or_pipeline(published, workdir, monkeypatch):
    import agentrl.stages.card as card

    monkeypatch.setattr(card, "pipeline_changes", lambda: {"grpo": [{"changed deps": {}}]})
    with pytest.raises(card.PublishError, match=r"not up to date.*grpo"):
        card.publish("someone/agentrl-merged")
    monkeypatch.setattr(card, "pipeline_changes", lambda: {})
    (workdir / "models/merged/model.safetensors").write_bytes(b"other weights")
    with pytest.raises(card.PublishError, match="was written for models/merged with digest"):
        card.publish("someone/agentrl-merged")
    monkeypatch.setenv("HF_TOKEN", "")
    with pytest.raises(card.PublishError, match="HF_TOKEN is not set"):
        card.publish("someone/agentrl-merged")
    assert published == []  # nothing reached the hub


def test_make_register_tags_a_clean_commit_and_refuses_a_dirty_one(tmp_path):
    repo = tmp_path / "r"
    repo.mkdir()
    run(["git", "init", "-q"], repo)
    run(["dvc", "init", "-q"], repo)
    (repo / "params.yaml").write_text("seed: 1\n")
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", "results"], repo)
    reg = ["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "-o", "setup", "register", f"VENV={VENV}"]
    (repo / "params.yaml").write_text("seed: 2\n")
    r = run(reg, repo, check=False)
    assert r.returncode != 0 and "commit them first" in r.stderr and not run(["git", "tag"], repo).stdout.strip()
    run(["git", "checkout", "-q", "params.yaml"], repo)
    run(reg + ["VERSION=v1.2.0"], repo)
    assert run(["git", "tag"], repo).stdout.split() == ["merged@v1.2.0"]


# ------------------------------------------------------------------------------- the acceptance, end to end
def tree(directory: Path) -> dict:
    import hashlib

    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
def test_clone_and_pull_reproduces_the_pushed_run_without_retraining(copy_repo, tmp_path, monkeypatch):
    """Pipeline in copy A -> make push -> fresh git clone B -> make pull: dvc status clean, dvc repro runs no stage,
    same metrics, same model, make serve serves it, and the card is publishable from B."""
    import httpx

    a, remote, b = copy_repo, tmp_path / "remote", tmp_path / "clone"
    (a / "params.yaml").write_text(yaml.safe_dump(mini_params(), sort_keys=False))
    run(["git", "init", "-q"], a)
    run(["git", "add", "-A"], a)
    run(["git", "commit", "-qm", "code"], a)
    t = time.perf_counter()
    run(["dvc", "repro"], a)
    repro_s = time.perf_counter() - t
    run(["git", "add", "-A"], a)  # dvc.lock, metrics/ (cache: false) and the .gitignore files DVC wrote
    run(["git", "commit", "-qm", "results"], a)

    from huggingface_hub import ModelCard

    card = ModelCard.load(a / "models/card/README.md")
    grpo = json.loads((a / "metrics/eval_grpo.json").read_text())
    assert f"| GRPO (LoRA adapter) | **{100 * grpo['accuracy']:.1f}%** |" in card.text
    assert (
        card.data.to_dict()["agentrl"]["int8_accuracy"]
        == json.loads((a / "metrics/quantize.json").read_text())["int8_accuracy"]
    )

    push = make("push", a, f"DVC_REMOTE={remote}")
    assert "dvc push:" in push.stdout and "dvc exp push: skipped" in push.stdout, push.stdout

    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    assert not (b / "models/merged").exists()
    t = time.perf_counter()
    pull = make("pull", b, f"DVC_REMOTE={remote}")
    pull_s = time.perf_counter() - t
    assert "dvc exp pull origin:" in pull.stdout, pull.stdout

    assert run(["dvc", "status"], b).stdout.strip() == "Data and pipelines are up to date."
    repro = run(["dvc", "repro"], b).stdout
    stages = list(yaml.safe_load((b / "dvc.yaml").read_text())["stages"])
    assert "Running stage" not in repro, repro
    for s in stages:
        assert f"Stage '{s}' didn't change, skipping" in repro, (s, repro)
    assert run(["dvc", "metrics", "show", "--json"], b).stdout == run(["dvc", "metrics", "show", "--json"], a).stdout

    for d in (
        "models/merged",
        "models/card",
        "models/sft",
        "models/grpo",
        "data/prepared",
        "eval/grpo",
        "dvclive/grpo",
    ):
        assert tree(b / d) == tree(a / d) and tree(a / d), d

    # make serve serves the pulled model
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env["PATH"] = str(BIN) + os.pathsep + env["PATH"]
    server = subprocess.Popen(
        ["make", "--no-print-directory", "-o", "setup", "serve", f"VENV={VENV}", f"PORT={port}"],
        cwd=b,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        try:
            health = wait_healthy(server, f"http://127.0.0.1:{port}", 180)
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{(tmp_path / 'serve.log').read_text()[-3000:]}")
        assert Path(str(health.get("model_path", health.get("path", "")))).name == "merged", health
        r = httpx.post(
            f"http://127.0.0.1:{port}/generate",
            json={"text": "Tom has 3 apples and buys 4 more. How many apples does he have?", "max_tokens": 8},
            timeout=60,
        )
        assert r.status_code == 200 and "text" in r.json(), r.text
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
        log.close()

    # the card is publishable from the clone: the real `dvc status card --with-deps` check passes
    from huggingface_hub import HfApi

    import agentrl.stages.card as card_mod

    sent = []
    monkeypatch.chdir(b)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, ops, **kw: sent.extend(ops) or "ok")
    card_mod.publish("someone/agentrl-merged")
    assert "README.md" in {o.path_in_repo for o in sent} and "config.json" in {o.path_in_repo for o in sent}

    print(f"\nshare timings: dvc repro (copy A) {repro_s:.1f} s, make pull (clone B) {pull_s:.1f} s")
