"""Stage `prepare`: raw problems -> data/prepared/{sft_train,rl_train,test}.jsonl + metrics/prepare.json.

Sources (data.source): `synthetic` (embedded generator), `gsm8k` (datasets.load_dataset from the
hub), `jsonl` (local GSM8K-format files). Every row goes through one parser and the quality checks;
`data.on_bad_rows` decides whether a defect stops the stage or the row is dropped and counted.
"""
from __future__ import annotations

import collections
from pathlib import Path

from .common import get_logger, peak_rss_mb, write_json
from .config import DataParams, Params, load_params_or_exit
from .data import (
    RawRow, check_rows, generate_synthetic, normalized_questions, read_jsonl, rl_record, seeded_subset,
    sft_record, test_record, write_jsonl,
)

OUT_DIR = Path("data/prepared")
METRICS = Path("metrics/prepare.json")
log = get_logger("prepare")


class BadRowsError(ValueError):
    pass


def load_raw(data: DataParams, seed: int) -> tuple[list[RawRow], list[RawRow]]:
    if data.source == "synthetic":
        s = data.synthetic
        train, test = generate_synthetic(seed, s.num_train, s.num_test, s.operand_min, s.operand_max,
                                         list(s.operations), dict(s.steps), s.max_value,
                                         s.direct_answer_rate, s.digit_steps_rate)
        return ([RawRow("synthetic:train", i, r) for i, r in enumerate(train, 1)],
                [RawRow("synthetic:test", i, r) for i, r in enumerate(test, 1)])
    if data.source == "gsm8k":
        from datasets import load_dataset

        ds = load_dataset(data.hub_dataset, data.hub_config, revision=data.hub_revision)
        return tuple(
            [RawRow(f"{data.hub_dataset}:{split}", i, dict(r)) for i, r in enumerate(ds[split], 1)]
            for split in ("train", "test")
        )
    return list(read_jsonl(data.train_file)), list(read_jsonl(data.test_file))


def prepare(params: Params, out_dir: Path = OUT_DIR, metrics_path: Path = METRICS) -> dict:
    data = params.data
    log.info("source=%s on_bad_rows=%s", data.source, data.on_bad_rows)
    raw_train, raw_test = load_raw(data, params.seed)
    log.info("read %d train and %d test rows", len(raw_train), len(raw_test))

    test = check_rows(raw_test, "test", data.strip_calculator_annotations)
    train = check_rows(raw_train, "train", data.strip_calculator_annotations,
                       exclude_questions=normalized_questions(test.examples))
    bad = train.bad + test.bad
    if bad and data.on_bad_rows == "error":
        shown = "\n  ".join(str(b) for b in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise BadRowsError(
            f"{len(bad)} bad row(s) (data.on_bad_rows=error; set it to 'drop' to drop and count them):\n  "
            f"{shown}{more}"
        )
    for b in bad[:20]:
        log.warning("dropped %s", b)

    train_ex = seeded_subset(train.examples, data.max_samples, params.seed)
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
        "steps_histogram_test": dict(sorted(collections.Counter(str(e.steps) for e in test_ex).items())),
    }
    metrics["peak_rss_mb"] = peak_rss_mb()
    write_json(metrics_path, metrics)
    log.info("wrote %d sft/rl train and %d test rows to %s", n_sft, n_test, out_dir)
    return metrics


def main() -> None:
    params = load_params_or_exit()
    try:
        prepare(params)
    except (BadRowsError, FileNotFoundError, ValueError) as e:
        log.error("%s", e)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
