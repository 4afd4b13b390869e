"""Stage `card`: the model card of the exported model -> models/card/README.md; and `make publish`.

The card (Hugging Face model-card format, written with huggingface_hub's ModelCard/ModelCardData) records
how models/merged was made: base model and revision, data source and size, the params that trained it,
the git commit, held-out accuracy per stage with 95% intervals and the paired GRPO-vs-SFT test, tool use,
the int8 accuracy, and how to serve it.

Why a stage of its own after `eval_quantized`, writing outside models/merged: the int8 accuracy is measured
by `eval_quantized`, which reads models/merged, so `export` cannot know it; and a file inside models/merged
written by a later stage would overlap export's output (DVC refuses overlapping outputs) and change a
dependency of eval_quantized. So `card` depends on models/merged and on the metrics files it reports, writes
models/card/README.md (a DVC-cached output, pushed and pulled with the models), and `make publish`
uploads models/merged plus that card as the repository's README.md, in one hub commit.

`python -m agentrl.stages.card --publish REPO_ID` (make publish REPO_ID=...): needs HF_TOKEN in the environment
(never read from or written to a file, never logged), refuses when the pipeline is not up to date
(`dvc status card --with-deps`) or the card was written for other weights than models/merged holds.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from ..common import atomic_write, get_logger, model_files_digest, read_metrics
from ..config import Params, load_params_or_exit

log = get_logger("card")
MERGED = Path("models/merged")
CARD = Path("models/card/README.md")
TOKEN_ENV = "HF_TOKEN"
# the params sections the card reports ("the params that trained it"); dvc.yaml's card stage lists the same
CARD_PARAMS = ("seed", "data", "model", "sft", "grpo", "agent", "eval", "export")
TOOL_KEYS = ("tool_use_rate", "tool_calls_per_problem", "tool_error_rate")
# what each row of the accuracy table reads (the eval stages' metrics files)
EVAL_ROWS = (
    ("base", "base model", "metrics/eval_base.json"),
    ("sft", "SFT", "metrics/eval_sft.json"),
    ("grpo", "GRPO (LoRA adapter)", "metrics/eval_grpo.json"),
    ("merged", "merged (this model)", "metrics/eval_merged.json"),
    ("merged_int8", "merged, int8", "metrics/eval_merged_int8.json"),
)
METRICS_FILES = (
    "metrics/prepare.json",
    "metrics/base.json",
    "metrics/sft_train.json",
    "metrics/grpo_train.json",
    "metrics/compare.json",
    "metrics/export.json",
    "metrics/quantize.json",
    *(f for _, _, f in EVAL_ROWS),
)


# the spread over seeds (`make seeds`, scripts/seeds.py): a dependency of the card stage, committed; its "seeds"
# list is empty until `make seeds` has run
SEEDS = Path("docs/seeds.json")
SEED_STAGES = (("base", "base model"), ("sft", "SFT"), ("grpo", "GRPO"), ("merged", "merged"), ("merged_int8", "int8"))


class PublishError(RuntimeError):
    """The model card cannot be pushed to the hub; said in one line."""

    pass


def read_seeds(path: Path = SEEDS) -> Optional[dict]:
    """The seed aggregate of `make seeds` (docs/seeds.json), or None when there is none yet (no file, or no
    seeds in it). A file that is not such an aggregate is a ValueError naming it and what was expected.

    Returns:
        The aggregate, or None.
    """
    import json

    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error}); rerun `make seeds N=3`") from None
    if not isinstance(data, dict) or not isinstance(data.get("seeds"), list):
        raise ValueError(f"{path}: expected an object with a 'seeds' list (scripts/seeds.py writes it)")
    if not data["seeds"]:
        return None
    for key in ("stages", "grpo_minus_sft", "pooled", "paired_per_seed"):
        if not isinstance(data.get(key), (dict, list)):
            raise ValueError(f"{path}: no '{key}' (expected the aggregate of scripts/seeds.py; rerun `make seeds N=3`)")
    return data


def _spread(stats: Optional[dict], points: bool = False) -> str:
    """mean ± sd (min–max) of a fraction, as percent (or signed points)."""
    if not stats:
        return "–"
    show = (lambda x: f"{100 * x:+.1f}") if points else (lambda x: f"{100 * x:.1f}%")
    sd = "" if stats.get("sd") is None else f" ± {100 * stats['sd']:.1f}"
    return f"{show(stats['mean'])}{sd} ({show(stats['min'])} … {show(stats['max'])})"


def seed_summary(seeds: Optional[dict], committed_seed: int) -> str:
    """Markdown: accuracy and tool use per stage over the seeds next to the committed run's seed, and GRPO - SFT
    per seed and pooled; or a sentence saying no seed spread was recorded.

    Args:
        seeds: read_seeds()'s aggregate, or None.
        committed_seed: the seed of the run the card reports.
    """
    if not seeds:
        return (
            f"Not measured: this card reports one run (seed {committed_seed}). `make seeds N=3` runs the pipeline "
            f"over several seeds (DVC experiments) and records the spread in `{SEEDS}`."
        )
    count, listed = len(seeds["seeds"]), ", ".join(map(str, seeds["seeds"]))
    inside = "includes" if committed_seed in seeds["seeds"] else "does not include"
    rows = [
        f"| {label} | {_spread(seeds['stages'].get(key, {}).get('accuracy'))} | "
        f"{_spread(seeds['stages'].get(key, {}).get('tool_use_rate'))} |"
        for key, label in SEED_STAGES
        if key in seeds["stages"]
    ]
    pooled = seeds["pooled"]
    return "\n".join(
        [
            f"Over {count} seeds ({listed}; the set {inside} this run's seed {committed_seed}), each a whole pipeline "
            f"run with its own problems (`{SEEDS}`, `make seeds`): mean ± sample sd (min … max).",
            "",
            "| model | accuracy | tool use |",
            "|---|---|---|",
            *rows,
            "",
            f"GRPO − SFT: {_spread(seeds['grpo_minus_sft'], points=True)} points; pooled over the seeds "
            f"{pooled['gained']} problems gained and {pooled['lost']} lost of {pooled['problems']}, exact McNemar p = "
            f"{pooled['p_value']:.2g}.",
        ]
    )


def _read(path: str) -> dict:
    """A stage's headline metrics and its diagnostics, merged (read_metrics names a missing diagnostics file)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path}: not found; the card reports it (run the stage that writes it: dvc repro)")
    return read_metrics(path)


def git_state() -> dict:
    """The commit of the code that ran, and the tracked files that differed from it then (the run's own
    results, dvc.lock, metrics/ and diagnostics/, are left out: `dvc repro` rewrites them as it goes)."""

    def git(*args: str) -> Optional[str]:
        result = subprocess.run(["git", *args], capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "changed": []}
    changed = git("diff", "--name-only", "HEAD", "--", ".", ":!dvc.lock", ":!metrics", ":!diagnostics") or ""
    return {"commit": commit, "changed": sorted(line for line in changed.splitlines() if line.strip())}


def _pct(fraction: Optional[float]) -> str:
    return "–" if fraction is None else f"{100 * fraction:.1f}%"


def _ci(ci: Optional[list]) -> str:
    return "–" if not ci else f"{100 * ci[0]:.1f}–{100 * ci[1]:.1f}%"


def _signed(fraction: float) -> str:
    return f"{100 * fraction:+.1f}"


def collect(params: Params) -> dict:
    """Everything the card reports, from params and the run's metrics files (no model is loaded).

    Returns:
        params, metrics (by stage), git state, merged_digest and seeds.
    """
    return {
        "params": params,
        "metrics": {Path(f).stem: _read(f) for f in METRICS_FILES},
        "git": git_state(),
        "merged_digest": model_files_digest(MERGED),
        "seeds": read_seeds(),
    }


def _base_model_line(params: Params, base: dict) -> str:
    if params.model.base_model == "tiny":
        tiny = params.model.tiny
        return (
            f"`tiny`: a {base.get('parameters', '?'):,}-parameter Qwen3-architecture model (hidden "
            f"{tiny.hidden_size}, {tiny.num_hidden_layers} layer{'s' if tiny.num_hidden_layers != 1 else ''}, vocab "
            f"{base.get('vocab_size', '?')}) with its own "
            f"tokenizer, built and pre-trained locally by the `base` stage (no hub download)"
        )
    if params.model.base_model.endswith(".gguf"):
        return (
            f"the GGUF file `{params.model.base_model}` ({base.get('gguf_file_type', '?')}, `{params.model.revision}`), "
            f"dequantized to a {base.get('parameters', '?'):,}-parameter fp32 model by transformers"
        )
    hub_id, resolved = params.model.base_model, base.get("resolved_commit")
    return f"[`{hub_id}`](https://huggingface.co/{hub_id}) at revision `{params.model.revision}`" + (
        f" (resolved commit `{resolved}`)" if resolved else ""
    )


def _data_line(params: Params, prep: dict) -> str:
    data = params.data
    if data.source == "synthetic":
        src = f"the seeded synthetic GSM8K-format generator (`data.synthetic`, seed {params.seed})"
    elif data.source == "gsm8k":
        src = (
            f"[`{data.hub_dataset}`](https://huggingface.co/datasets/{data.hub_dataset}) config `{data.hub_config}`, "
            f"revision `{data.hub_revision or 'main'}`"
        )
    else:
        src = f"local JSONL files `{data.train_file}` (train) and `{data.test_file}` (test)"
    written = prep.get("written", {})
    dropped = prep.get("dropped", {}).get("total", 0)
    return (
        f"{src}: {written.get('sft_train', '?'):,} SFT / {written.get('rl_train', '?'):,} GRPO training problems, "
        f"{written.get('test', '?'):,} held-out test problems ({dropped} rows dropped by the quality checks)"
    )


def _eval_results(params: Params, evals: dict) -> list:
    """The card metadata's eval results (huggingface_hub EvalResult): the merged model's fp32 and int8 accuracy.

    Args:
        params: the run's params (the data source names the dataset).
        evals: EVAL_ROWS key -> that evaluation's metrics.

    Returns:
        One EvalResult per evaluation that has an accuracy.
    """
    from huggingface_hub import EvalResult

    dataset_name = (
        params.data.hub_dataset if params.data.source == "gsm8k" else f"agentrl {params.data.source} held-out test set"
    )
    return [
        EvalResult(
            task_type="text-generation",
            dataset_type=dataset_name,
            dataset_name=dataset_name,
            dataset_split="test",
            metric_type="accuracy",
            metric_name=name,
            metric_value=round(evals[key]["accuracy"], 4),
        )
        for key, name in (
            ("merged", "held-out accuracy (fp32, greedy)"),
            ("merged_int8", "held-out accuracy (int8, greedy)"),
        )
        if "accuracy" in evals[key]
    ]


def _card_data(info: dict, evals: dict) -> Any:
    """The card's YAML metadata (ModelCardData), with the run's provenance under `agentrl`.

    Args:
        info: collect()'s dict.
        evals: EVAL_ROWS key -> that evaluation's metrics.
    """
    from huggingface_hub import ModelCardData

    params: Params = info["params"]
    metrics, git = info["metrics"], info["git"]
    return ModelCardData(
        model_name="agentrl merged policy (SFT + GRPO)",
        base_model=params.model.base_model if "/" in params.model.base_model else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["agentrl", "trl", "sft", "grpo", "dvc", "math-word-problems"],
        datasets=[params.data.hub_dataset] if params.data.source == "gsm8k" else None,
        metrics=["accuracy"],
        eval_results=_eval_results(params, evals),
        agentrl={
            "git_commit": git["commit"],
            "uncommitted_changes": git["changed"],
            "merged_model_digest": info["merged_digest"],
            "base_model": params.model.base_model,
            "base_model_revision": params.model.revision,
            "base_model_resolved_commit": metrics["base"].get("resolved_commit"),
            "data_source": params.data.source,
            "test_problems": metrics["prepare"].get("written", {}).get("test"),
            "int8_accuracy": metrics["quantize"].get("int8_accuracy"),
            "tools": list(params.agent.tools),
            "seeds_in_spread": (info.get("seeds") or {}).get("seeds", []),
        },
    )


def _tool_cells(evaluation: dict) -> str:
    """The tool-use cells of one accuracy-table row: use rate, calls per problem, error rate ("–" when absent)."""
    cells = []
    for key in TOOL_KEYS:
        if key not in evaluation:
            cells.append("–")
        elif key == "tool_calls_per_problem":
            cells.append(f"{evaluation[key]:.2f}")
        else:
            cells.append(_pct(evaluation[key]))
    return " " + " | ".join(cells) + " |"


def _accuracy_table(evals: dict, tools_seen: bool) -> str:
    """The markdown table of held-out accuracy per evaluation (with tool-use columns when any evaluation has them).

    Args:
        evals: EVAL_ROWS key -> that evaluation's metrics.

    Returns:
        The table: header, separator and one row per EVAL_ROWS entry.
    """
    rows = []
    for key, label, metrics_file in EVAL_ROWS:
        evaluation = evals[key]
        if "accuracy" not in evaluation:
            skipped = evaluation.get("skipped", "see " + metrics_file)
            rows.append(f"| {label} | not evaluated ({skipped}) | | | |" + (" | | |" if tools_seen else ""))
            continue
        row = (
            f"| {label} | **{_pct(evaluation['accuracy'])}** | {_ci(evaluation.get('accuracy_ci95'))} | "
            f"{evaluation.get('num_samples', '–')} | {evaluation.get('format_rate', 0):.2f} |"
        )
        rows.append(row + _tool_cells(evaluation) if tools_seen else row)
    head = "| model | accuracy | 95% CI (Wilson) | problems | format rate |"
    separator = "|---|---|---|---|---|"
    if tools_seen:
        head += " tool use | tool calls / problem | tool error rate |"
        separator += "---|---|---|"
    return "\n".join([head, separator, "\n".join(rows)])


def _paired_tests(comparison: dict) -> str:
    """The paired GRPO − SFT and SFT − base tests of the compare stage as markdown bullets, or a sentence."""
    paired = []
    for name, test in (
        ("GRPO − SFT", comparison.get("grpo_vs_sft", {})),
        ("SFT − base", comparison.get("sft_vs_base", {})),
    ):
        if test:
            paired.append(
                f"- **{name} = {_signed(test['difference'])} points**, paired-bootstrap 95% CI "
                f"{_signed(test['ci95'][0])} … {_signed(test['ci95'][1])}, exact McNemar p = {test['p_value']:.2g} "
                f"({test['only_after_correct']} problems gained, {test['only_before_correct']} lost, n = {test['n']})"
            )
    return "\n".join(paired) if paired else "No paired comparison recorded."


def _tools_section(params: Params, tools_seen: bool) -> str:
    """The card's "Tool use" paragraph: the tools and call format the policy was trained with, or that it had none."""
    agent = params.agent
    if not agent.tools:
        return "None: this model was trained and evaluated without tools (`agent.tools: []`)."
    tools = (
        f"The policy calls tools while it solves a problem: `agent.tools: {list(agent.tools)}`, format "
        f"`{agent.format}`, at most {agent.max_tool_calls} calls per completion (calculator input at most "
        f"{agent.max_expression_chars} characters). The same tool loop ran in SFT data, GRPO rollouts, "
        "evaluation, and runs in `make serve`. Tool use per stage is in the table above "
        "(share of problems with a call, calls per problem, share of calls that returned an error)."
    )
    if not tools_seen:
        tools += " The evaluation metrics of this run carry no tool-use counts."
    return tools


def _int8_section(quantized: dict) -> str:
    """The card's "int8" paragraph from the quantize stage's metrics: int8 against fp32 accuracy and speed."""
    if "int8_accuracy" not in quantized:
        return f"Not evaluated (`export.quantize: {quantized.get('quantize', 'none')}`)."
    return (
        f"`export.quantize: int8` ({quantized.get('int8_backend')}): held-out accuracy "
        f"{_pct(quantized['int8_accuracy'])} against {_pct(quantized['merged_accuracy'])} in fp32 "
        f"({_signed(quantized['accuracy_delta'])} points), measured speed ratio int8/fp32 "
        f"{quantized['int8_speed_ratio']:.2f}× in this run on this machine (> 1: int8 is faster)."
    )


def _code_line(git: dict) -> str:
    """The git commit the card was made from, and up to 10 tracked files that differed from it."""
    if not git["commit"]:
        return "unknown (not run in a git checkout)"
    if not git["changed"]:
        return f"git commit `{git['commit']}` (no uncommitted changes to tracked files)"
    changed = ", ".join(f"`{path}`" for path in git["changed"][:10])
    more = " …" if len(git["changed"]) > 10 else ""
    return f"git commit `{git['commit']}`; files that differed from it when the card was written: {changed}{more}"


def _how_it_was_made(info: dict) -> str:
    """The card's "How it was made" bullets: base model, data, SFT, GRPO, the merge check, code and weights."""
    params: Params = info["params"]
    metrics = info["metrics"]
    sft, grpo, export = metrics["sft_train"], metrics["grpo_train"], metrics["export"]
    nan = float("nan")
    return f"""- **Base model:** {_base_model_line(params, metrics["base"])}.
- **Data:** {_data_line(params, metrics["prepare"])}.
- **SFT:** {sft.get("steps", "?")} steps, {"LoRA" if params.sft.use_lora else "all weights"}, learning rate {sft.get("learning_rate", "?")},
  loss {sft.get("first_loss", nan):.3f} → {sft.get("final_loss", nan):.3f}.
- **GRPO:** {grpo.get("steps", "?")} steps of {grpo.get("completions_per_step", "?")} completions, LoRA r={params.grpo.lora.get("r", "?")},
  learning rate {grpo.get("learning_rate", "?")}, KL β {grpo.get("beta", "?")}, rewards {dict(params.grpo.rewards)};
  mean reward {grpo.get("reward_first", nan):.3f} (first step) → {grpo.get("reward_last", nan):.3f} (last).
- **Merge check:** max |logit difference| merged vs adapter model {export.get("max_abs_logit_diff", nan):.2g}
  (tolerance {export.get("tolerance", "?")}), greedy completions identical on {export.get("greedy_identical_count", "?")}/{export.get("num_prompts", "?")}
  prompts; {export.get("parameters", "?"):,} parameters.
- **Code:** {_code_line(info["git"])}.
- **Weights:** digest `{info["merged_digest"]}` of the files of `models/merged` (`agentrl.common.model_files_digest`)."""


def _gguf_section(gguf: dict) -> str:
    """How to run the GGUF files export wrote (export.gguf), with their round-trip check, ending in a blank line;
    empty without any (the card then reads as before GGUF existed)."""
    if not gguf:
        return ""
    rows = "\n".join(
        f"- `{g['file']}` ({kind}, {g['bytes'] / 1e6:.0f} MB): read back through transformers, greedy completions "
        f"identical to the merged model's on {g['greedy_identical_count']}/{g['num_prompts']} held-out prompts"
        for kind, g in gguf.items()
    )
    first = next(iter(gguf.values()))["file"]
    return f"""As GGUF, for llama.cpp, Ollama and LM Studio (`export.gguf`):

{rows}

```bash
llama-cli -m {first} -cnv          # llama.cpp, its chat template from the file
printf 'FROM ./{first}\\n' > Modelfile && ollama create agentrl -f Modelfile && ollama run agentrl
make serve MODEL={first}           # this project's OpenAI-compatible server reads the GGUF too
```

The calculator is the project's tool loop (`agent.*` params), not part of the file: another runtime gets the model's
text, `<<48/2=` included, and has to supply the result itself.

"""


def render(info: dict) -> str:
    """The card's text: YAML metadata (ModelCardData) + a markdown body.

    Args:
        info: collect()'s dict: params, metrics (by stage), git state, merged_digest, seeds.

    Returns:
        The model card (huggingface_hub ModelCard content), front matter included.
    """
    from huggingface_hub import ModelCard

    params: Params = info["params"]
    metrics = info["metrics"]
    evals = {key: metrics[Path(metrics_file).stem] for key, _, metrics_file in EVAL_ROWS}
    tools_seen = any(key in evaluation for evaluation in evals.values() for key in TOOL_KEYS)
    system = f"system prompt: `{params.data.system_prompt}`" if params.data.system_prompt else "no system prompt"
    trained = {key: params.model_dump(mode="json")[key] for key in CARD_PARAMS}
    body = f"""
# agentrl merged policy (SFT + GRPO)

A causal language model for GSM8K-style math word problems, made by the [agentrl](#reproduce) DVC pipeline:
`prepare → base → sft → eval → grpo → eval → export → eval_quantized → card`. The SFT result and the GRPO LoRA
adapter are merged into the base weights (`merge_and_unload`), so plain `transformers` loads it, no PEFT.

## How it was made

{_how_it_was_made(info)}

## Held-out accuracy

Greedy decoding on the held-out test split (`eval.*` params), answers extracted after `####`.

{_accuracy_table(evals, tools_seen)}

{_paired_tests(metrics["compare"])}

### Over seeds

{seed_summary(info.get("seeds"), params.seed)}

## Tool use

{_tools_section(params, tools_seen)}

## int8

{_int8_section(metrics["quantize"])}

## How to use it

```bash
make serve MODEL=models/merged        # FastAPI: POST /generate, POST /v1/chat/completions, GET /health
curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
  -d '{{"messages": [{{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}}]}}'
```

{_gguf_section(metrics["export"].get("gguf") or {})}From the hub (after `make publish REPO_ID=<user>/<name>`): `huggingface-cli download <user>/<name> --local-dir merged`,
then `make serve MODEL=merged`, or `AutoModelForCausalLM.from_pretrained("<user>/<name>")` with the tokenizer's
chat template ({system}). Serve it with the `agent:` params it was trained with.

## Reproduce

```bash
git checkout {info["git"]["commit"] or "<commit>"}
make pull      # the cached models and outputs from the DVC remote; or `make repro` to retrain
```

## Params that trained it

```yaml
{yaml.safe_dump(trained, sort_keys=False, allow_unicode=True).rstrip()}
```
"""
    return ModelCard(f"---\n{_card_data(info, evals).to_yaml()}\n---\n{body}").content


def write_card(params: Params, path: Path = CARD) -> Path:
    """Render the card and write it (parsed back first: a card that does not render is an error here)."""
    text = render(collect(params))
    from huggingface_hub import ModelCard

    ModelCard(text)  # parses the metadata back: a card that does not render is an error here, not on the hub
    with atomic_write(path) as out:
        out.write(text)
    log.info("model card written to %s", path)
    return path


# ----------------------------------------------------------------------------------------------- publish
def pipeline_changes() -> dict:
    """`dvc status card --with-deps`: what is out of date in the card and every stage upstream of it."""
    from dvc.repo import Repo

    with Repo(".") as repo:
        return repo.status(targets=["card"], with_deps=True)


def publish(repo_id: str, private: bool = False) -> Any:
    """Upload models/merged and its card to the hub in one commit (`make publish`), after checking the token,
    the repository id, that the pipeline is up to date and that the card was written for these weights.

    Args:
        repo_id: <user or org>/<name>.

    Returns:
        The hub's commit info. PublishError saying what is missing.
    """
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise PublishError(
            f"{TOKEN_ENV} is not set: export {TOKEN_ENV}=<a write token from "
            "https://huggingface.co/settings/tokens> and run make publish again (the token is read "
            "from the environment only; it is never written to a file or printed)"
        )
    if not repo_id or repo_id.count("/") != 1:
        raise PublishError(f"REPO_ID must be <user or org>/<name>, got {repo_id!r}")
    for need in (MERGED, CARD):
        if not need.exists():
            raise PublishError(f"{need}: not found; run `dvc repro` (or `make pull`) first")
    stale = pipeline_changes()
    if stale:
        raise PublishError(
            f"the pipeline is not up to date, so {CARD} may not describe models/merged: "
            f"{', '.join(sorted(stale))} changed (`dvc status card --with-deps`); run `dvc repro` first"
        )
    from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

    card = ModelCard.load(CARD)
    written_for = (card.data.to_dict().get("agentrl") or {}).get("merged_model_digest")
    now = model_files_digest(MERGED)
    if written_for != now:
        raise PublishError(
            f"{CARD} was written for models/merged with digest {written_for}, but models/merged now has "
            f"{now}; run `dvc repro card` (or `make pull`)"
        )
    files = sorted(path for path in MERGED.rglob("*") if path.is_file() and path.name != "README.md")
    ops = [
        CommitOperationAdd(path_in_repo=path.relative_to(MERGED).as_posix(), path_or_fileobj=str(path))
        for path in files
    ]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(CARD)))
    commit = (card.data.to_dict().get("agentrl") or {}).get("git_commit")
    api = HfApi(token=token)
    url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.create_commit(
        repo_id,
        ops,
        repo_type="model",
        commit_message=f"agentrl export{f' (git {commit[:12]})' if commit else ''}",
        commit_description=f"models/merged + model card; weights digest {now}",
    )
    log.info("published %d files of %s and the model card to %s", len(files), MERGED, url)
    return info


def main() -> None:
    """`python -m agentrl.stages.card [--publish REPO_ID]`."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--publish", metavar="REPO_ID", help=f"upload models/merged + the card (needs {TOKEN_ENV})")
    ap.add_argument("--private", action="store_true", help="create the hub repository private")
    args = ap.parse_args()
    if args.publish is not None:
        try:
            publish(args.publish, private=args.private)
        except PublishError as error:
            print(f"make publish: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    write_card(load_params_or_exit())


if __name__ == "__main__":
    main()
