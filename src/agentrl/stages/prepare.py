"""Stage `prepare`: raw problems -> data/prepared/{sft_train,rl_train,test}.jsonl + metrics/prepare.json.

Sources (data.source): `synthetic` (embedded generator), `gsm8k` (datasets.load_dataset from the
hub), `jsonl` (local GSM8K-format files). Every row goes through one parser and the quality checks;
`data.on_bad_rows` decides whether a defect stops the stage or the row is dropped and counted.
"""

from __future__ import annotations

import collections
import random
from pathlib import Path

from ..answers import strip_calculator_annotations
from ..common import get_logger, peak_rss_mb, write_metrics
from ..config import DataParams, Params, load_params_or_exit
from ..data import (
    RawRow,
    check_rows,
    generate_synthetic,
    messages,
    normalized_questions,
    read_jsonl,
    rl_record,
    seeded_subset,
    sft_record,
    test_record,
    write_jsonl,
)
from ..envs.registry import EnvironmentSpec, environment_spec

OUT_DIR = Path("data/prepared")
METRICS = Path("metrics/prepare.json")
log = get_logger("prepare")


class BadRowsError(ValueError):
    """Rows refused by the checks (data.on_bad_rows: error); the message lists them."""

    pass


def check_sources_tracked(data: DataParams, dvc_file: Path = Path("dvc.yaml")) -> None:
    """A jsonl source must be a dependency of the prepare stage (inputs/ in dvc.yaml): DVC re-runs prepare
    only when a dependency changes, so a file outside them would be read once and its edits ignored.
    Checked where a dvc.yaml with a prepare stage is present (running `python -m agentrl.stages.prepare` elsewhere,
    e.g. on a scratch directory, is not a pipeline run).
    """
    import yaml

    if data.source != "jsonl" or not dvc_file.is_file():
        return
    stage = (yaml.safe_load(dvc_file.read_text()) or {}).get("stages", {}).get("prepare")
    if not stage:
        return
    root = dvc_file.resolve().parent
    deps = [(root / d).resolve() for d in stage.get("deps", []) if "${" not in str(d)]
    for field, file in (("data.train_file", data.train_file), ("data.test_file", data.test_file)):
        path = (root / str(file)).resolve()
        if not any(path == d or d in path.parents for d in deps):
            raise ValueError(
                f"{field}={file}: not a dependency of the prepare stage in {dvc_file}, so `dvc repro` "
                "would not re-run prepare when the file changes; move it into inputs/ (a dependency "
                "of prepare) or add it to the stage's deps"
            )


def source_name(data: DataParams, split: str) -> str:
    """Where a split's rows come from, as error messages name it.

    Args:
        split: train or test.

    Returns:
        A file path, `dataset:split` or `synthetic:split`.
    """
    if data.source == "jsonl":
        return str(data.train_file if split == "train" else data.test_file)
    return f"{data.hub_dataset}:{split}" if data.source == "gsm8k" else f"synthetic:{split}"


def load_raw(data: DataParams, seed: int) -> tuple[list[RawRow], list[RawRow]]:
    """The raw train and test rows of data.source (synthetic, GSM8K from the hub, or local JSONL files).

    Returns:
        (train rows, test rows), each with its source and line.
    """
    if data.source == "synthetic":
        synthetic = data.synthetic
        train, test = generate_synthetic(
            seed,
            synthetic.num_train,
            synthetic.num_test,
            synthetic.operand_min,
            synthetic.operand_max,
            list(synthetic.operations),
            dict(synthetic.steps),
            synthetic.max_value,
            synthetic.direct_answer_rate,
            synthetic.digit_steps_rate,
            synthetic.multiplier_max,
            synthetic.distractor_rate,
            synthetic.compare_rate,
        )
        return (
            [RawRow("synthetic:train", i, r) for i, r in enumerate(train, 1)],
            [RawRow("synthetic:test", i, r) for i, r in enumerate(test, 1)],
        )
    if data.source == "gsm8k":
        from datasets import load_dataset

        ds = load_dataset(data.hub_dataset, data.hub_config, revision=data.hub_revision)
        return tuple(
            [RawRow(f"{data.hub_dataset}:{split}", i, dict(r)) for i, r in enumerate(ds[split], 1)]
            for split in ("train", "test")
        )
    return list(read_jsonl(data.train_file)), list(read_jsonl(data.test_file))


def strip_annotations(params: Params) -> bool:
    """data.strip_calculator_annotations, where 'auto' keeps GSM8K's <<a*b=c>> annotations (the tool calls the
    policy learns to make) exactly when agent.tools or agent.environment is set (a custom environment class replays
    them through its own tool, docs/environments.md).
    """
    setting = params.data.strip_calculator_annotations
    return not (params.agent.tools or params.agent.environment) if setting == "auto" else bool(setting)


def mix_tool_use(examples: list, share: float, seed: int) -> float:
    """Keep the calculator annotations in a seeded `share` of the training solutions; the others do their
    arithmetic in text (annotations stripped), so the policy sees both and RL can learn when to call.
    Returns the share of annotated solutions that keep a call.

    Args:
        examples: the training examples (edited in place).
    """
    rng = random.Random(seed + 2)
    with_calls = [e for e in examples if "<<" in e.reasoning]
    for example in with_calls:
        if rng.random() >= share:
            example.reasoning = strip_calculator_annotations(example.reasoning)
    kept = sum("<<" in e.reasoning for e in with_calls)
    return kept / len(with_calls) if with_calls else 0.0


def calculator_is_the_tool(params: Params) -> bool:
    """Whether the demonstrations' <<...>> calls are the calculator's, the only ones data.calculator_share thins
    out (agent.tools [calculator] or agent.environment calculator); a user's own tool keeps every call."""
    agent = params.agent
    return agent.environment == "calculator" or (agent.environment is None and list(agent.tools) == ["calculator"])


def tool_of(params: Params) -> str:
    """The tool the demonstrations call, as params name it (for log lines)."""
    agent = params.agent
    return f"agent.environment {agent.environment}" if agent.environment else f"agent.tools {list(agent.tools)}"


def environment(params: Params) -> EnvironmentSpec:
    """agent.environment resolved with its knobs (registry.environment_spec)."""
    return environment_spec(params.agent.environment, params.environments)


def environment_rows(params: Params) -> tuple[list[dict], list[dict]]:
    """(train, test) rows generated by a built-in environment (agent.environment countdown/gridworld) with its
    knobs from params.environments.<name>: its own seeded generator and solver-made demonstrations, the test
    instances excluded from training.

    Returns:
        (train rows, test rows).
    """
    spec = environment(params)
    task, rng = spec.task, random.Random(params.seed)
    test = task.make_rows(spec.knobs["num_test"], rng, "test", env_knobs=spec.env, **spec.gen)
    seen = {task.instance_key(r) for r in test}
    train = task.make_rows(spec.knobs["num_train"], rng, "train", env_knobs=spec.env, exclude=seen, **spec.gen)
    return train, test


class TestOverlapError(ValueError):
    """Held-out instances that are also training rows (data.allow_test_overlap is false)."""


def environment_overlap(params: Params, train: list[dict], test: list[dict]) -> dict:
    """How far the held-out rows are from training: test rows whose prompt is also a training prompt (expected where
    the prompt hides the instance, e.g. FrozenLake's hidden map), whose instance (the task's instance_key: the
    initial state) is also a training row's, and how many distinct instances the test rows hold. Instances in
    both splits are refused (TestOverlapError naming the first) unless data.allow_test_overlap."""
    task = environment(params).task
    train_prompts = {" ".join(r["question"].split()) for r in train}
    train_keys = {task.instance_key(r) for r in train}
    test_keys = [task.instance_key(r) for r in test]
    shared = [k for k in test_keys if k in train_keys]
    overlap = {
        "test_rows": len(test),
        "test_prompts_in_train": sum(" ".join(r["question"].split()) in train_prompts for r in test),
        "test_instances_in_train": len(shared),
        "distinct_test_instances": len(set(test_keys)),
    }
    if shared and not params.data.allow_test_overlap:
        raise TestOverlapError(
            f"environment {params.agent.environment}: {len(shared)} of {len(test)} held-out instances are also "
            f"training rows (first: {shared[0][:120]}); its make_rows must honour `exclude`, or set "
            "data.allow_test_overlap: true to train on them knowingly"
        )
    return overlap


def prepare_environment(params: Params, out_dir: Path, metrics_path: Path) -> dict:
    """The prepare stage for a built-in environment: its generated rows as SFT, RL and test JSONL."""
    name = params.agent.environment
    train, test = environment_rows(params)
    overlap = environment_overlap(params, train, test)  # refused before anything is written
    sp = params.data.system_prompt

    def fields(index: int, split: str, row: dict) -> dict:
        env_fields = {k: v for k, v in row.items() if k not in ("question", "answer", "ground_truth")}
        return {"id": f"{name}-{split}-{index}", "prompt": messages(sp, row["question"]), **env_fields}

    n_sft = write_jsonl(
        out_dir / "sft_train.jsonl",
        (
            {**fields(i, "train", r), "completion": [{"role": "assistant", "content": r["answer"]}]}
            for i, r in enumerate(train)
        ),
    )
    n_rl = write_jsonl(
        out_dir / "rl_train.jsonl",
        ({**fields(i, "train", r), "ground_truth": r["ground_truth"]} for i, r in enumerate(train)),
    )
    n_test = write_jsonl(
        out_dir / "test.jsonl",
        (
            {
                **fields(i, "test", r),
                "question": r["question"],
                "ground_truth": r["ground_truth"],
                "answer": r["answer"],
            }
            for i, r in enumerate(test)
        ),
    )
    calls = [r["answer"].count("<<") for r in train]
    metrics = {
        "source": f"environment:{name}",
        "written": {"sft_train": n_sft, "rl_train": n_rl, "test": n_test},
        "overlap": overlap,
        "demo_calls_per_example": round(sum(calls) / len(calls), 4) if calls else 0.0,
        "demo_failed_try_share": round(sum(c > 1 for c in calls) / len(calls), 4) if calls else 0.0,
    }
    spec = environment(params)
    if hasattr(spec.task, "ceiling"):  # what any policy can reach on the test rows (gridworld: slips end episodes)
        metrics["test_ceiling"] = spec.task.ceiling(test, spec.env, spec.gen)
        log.info("environment %s: test ceiling %s", name, metrics["test_ceiling"])
    # the generator package's version: the rows' lineage, on record (a mixture: its reasoning-gym member's rows)
    if version := next((r["reasoning_gym_version"] for r in test if "reasoning_gym_version" in r), None):
        metrics["reasoning_gym_version"] = version
    metrics["peak_rss_mb"] = peak_rss_mb()
    write_metrics(metrics_path, metrics)
    log.info("environment %s: wrote %d sft/rl train and %d test rows to %s", name, n_sft, n_test, out_dir)
    return metrics


def prepare(params: Params, out_dir: Path = OUT_DIR, metrics_path: Path = METRICS) -> dict:
    """The prepare stage: load, check, subsample and write data/prepared/{sft_train,rl_train,test}.jsonl.

    Returns:
        The metrics written. BadRowsError naming the rows when data.on_bad_rows is error.
    """
    if environment(params).task is not None:
        return prepare_environment(params, out_dir, metrics_path)
    data = params.data
    log.info("source=%s on_bad_rows=%s", data.source, data.on_bad_rows)
    check_sources_tracked(data)
    raw_train, raw_test = load_raw(data, params.seed)
    log.info("read %d train and %d test rows", len(raw_train), len(raw_test))

    strip = strip_annotations(params)
    test = check_rows(raw_test, "test", strip)
    train = check_rows(raw_train, "train", strip, exclude_questions=normalized_questions(test.examples))
    bad = train.bad + test.bad
    if bad and data.on_bad_rows == "error":
        shown = "\n  ".join(str(b) for b in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise BadRowsError(
            f"{len(bad)} bad row(s) (data.on_bad_rows=error; set it to 'drop' to drop and count them):\n  {shown}{more}"
        )
    for bad_row in bad[:20]:
        log.warning("dropped %s", bad_row)
    for split, kept, raw in (("train", train, raw_train), ("test", test, raw_test)):
        if not kept.examples:  # zero rows is never a result: name the source and why nothing is left
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(collections.Counter(b.reason for b in kept.bad).items()))
            raise BadRowsError(
                f"{source_name(data, split)}: no usable {split} rows ({len(raw)} read"
                + (f"; dropped: {reasons}" if reasons else "")
                + ")"
            )

    train_ex = seeded_subset(train.examples, data.max_samples, params.seed)
    share_applies = not strip and calculator_is_the_tool(params)
    tool_share = mix_tool_use(train_ex, data.calculator_share, params.seed) if share_applies else 0.0
    if not strip and not share_applies:  # the <<...>> calls in demonstrations of a user's own tool: all kept
        tool_share = float(any("<<" in e.reasoning for e in train_ex))
        log.info("data.calculator_share not applied: the demonstrations call %s, not the calculator", tool_of(params))
    test_ex = seeded_subset(test.examples, data.eval_max_samples, params.seed + 1)
    sp = data.system_prompt
    n_sft = write_jsonl(out_dir / "sft_train.jsonl", (sft_record(e, sp) for e in train_ex))
    n_rl = write_jsonl(out_dir / "rl_train.jsonl", (rl_record(e, sp) for e in train_ex))
    n_test = write_jsonl(out_dir / "test.jsonl", (test_record(e, sp) for e in test_ex))

    def by_reason(rows):
        return dict(sorted(collections.Counter(b.reason for b in rows).items()))

    metrics = {
        "source": data.source,
        "raw": {"train": len(raw_train), "test": len(raw_test)},
        "valid": {"train": len(train.examples), "test": len(test.examples)},
        "written": {"sft_train": n_sft, "rl_train": n_rl, "test": n_test},
        "subsampled_away": {"train": len(train.examples) - n_sft, "test": len(test.examples) - n_test},
        "dropped": {"train": by_reason(train.bad), "test": by_reason(test.bad), "total": len(bad)},
        # held-out questions are never trained on: a training row repeating one is a bad row (train_test_overlap)
        "overlap": {
            "test_rows": n_test,
            "test_prompts_in_train": len(normalized_questions(test_ex) & normalized_questions(train_ex)),
            "train_rows_dropped_as_test": sum(b.reason == "train_test_overlap" for b in train.bad),
        },
        "calculator_annotations": "stripped" if strip else "kept",
        "tool_solution_share": round(tool_share, 4),
        "calculator_share_applied": share_applies,
        "steps_histogram_test": dict(sorted(collections.Counter(str(e.steps) for e in test_ex).items())),
    }
    metrics["peak_rss_mb"] = peak_rss_mb()
    write_metrics(metrics_path, metrics)
    log.info("wrote %d sft/rl train and %d test rows to %s", n_sft, n_test, out_dir)
    return metrics


def check_environment_server(params: Params) -> None:
    """agent.environment_url (a URL): the server's kind detected and its tools checked before any stage trains
    (envs/openenv_client.py: ours, MCP tools or a typed step action); OpenEnvError in one line naming the URL and
    what the server lacks, or which agent.environment it needs."""
    from ..envs.contract import environment_tools
    from ..envs.openenv_client import remote_environment_class

    agent = params.agent
    if agent.environment_url in (None, "serve"):
        return
    runtime = environment(params).env  # the knobs the server must run
    served = remote_environment_class(agent.environment_url, agent.environment, runtime, agent.tool_timeout_s)
    names = ", ".join(environment_tools(served()))  # an instance opens no session until its reset
    log.info("agent.environment_url %s: server kind %s, tools %s", agent.environment_url, served.kind, names)


def main() -> None:
    """`python -m agentrl.stages.prepare`: exit status 1 with the message on bad data or an unusable OpenEnv
    server (agent.environment_url)."""
    from ..envs.openenv_client import OpenEnvError

    params = load_params_or_exit()
    try:
        check_environment_server(params)
        prepare(params)
    except (BadRowsError, FileNotFoundError, ValueError, OpenEnvError) as error:
        log.error("%s", error)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
