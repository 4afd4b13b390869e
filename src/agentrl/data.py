"""Data: the embedded synthetic GSM8K-style generator, GSM8K row parsing and quality checks.

All three sources (synthetic, gsm8k from the hub, local jsonl) yield raw GSM8K rows
`{"question": ..., "answer": "<reasoning>\\n#### <number>"}` and go through the same parser.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

from .answers import normalize_number, strip_calculator_annotations
from .common import atomic_write

# ------------------------------------------------------------------------- synthetic generator
NAMES = [
    ("Tom", "he", "his"),
    ("Anna", "she", "her"),
    ("Liam", "he", "his"),
    ("Mia", "she", "her"),
    ("Noah", "he", "his"),
    ("Emma", "she", "her"),
    ("Omar", "he", "his"),
    ("Sara", "she", "her"),
    ("Ivan", "he", "his"),
    ("Lena", "she", "her"),
    ("Ravi", "he", "his"),
    ("Yuki", "she", "her"),
    ("Paul", "he", "his"),
    ("Nina", "she", "her"),
    ("Carl", "he", "his"),
    ("Zoe", "she", "her"),
]
ITEMS = [
    "apples",
    "books",
    "coins",
    "stamps",
    "marbles",
    "pencils",
    "cookies",
    "shells",
    "cards",
    "stickers",
    "eggs",
    "flowers",
    "toys",
    "candies",
    "balls",
    "beads",
]
ADD = ["{P} buys {b} more {items}.", "{P} finds {b} more {items}.", "A friend gives {o} {b} more {items}."]
SUB = ["{P} gives away {b} {items}.", "{P} loses {b} {items}.", "{P} sells {b} {items}."]
MUL = ["Then {p} gets {b} times as many {items} as {p} has.", "The number of {items} {p} has grows {b} times."]
# One line per step, GSM8K-style calculator annotation included (prepare strips it by default).
ADD_SOL = "{x}+{b}=<<{x}+{b}={y}>>{y}"
SUB_SOL = "{x}-{b}=<<{x}-{b}={y}>>{y}"
MUL_SOL = "{x}*{b}=<<{x}*{b}={y}>>{y}"
MULTIPLIER_MAX = 5  # "b times as many": keeps products in a range a tiny model can learn
MAX_STALL_ATTEMPTS = 10_000  # draws in a row with no new problem: the knobs' problems are used up


def digit_line(x: int, op: str, b: int) -> str:
    """One step worked digit by digit, units then tens, carries and borrows written out, e.g.
    '19+7: 9+7=16, 1+0+1=2, 19+7=26'  '43-17: 13-7=6, 4-1-1=2, 43-17=26'  '18*4: 8*4=32, 1*4+3=7, 18*4=72'.
    Values stay below 100 (max_value), so two digit columns suffice; one-digit results skip the tens."""
    y = {"+": x + b, "-": x - b, "*": x * b}[op]
    (xt, xu), (bt, bu) = divmod(x, 10), divmod(b, 10)
    if op == "+":
        units, carry = f"{xu}+{bu}={xu + bu}", (xu + bu) // 10
        tens = f"{xt}+{bt}+{carry}={xt + bt + carry}" if carry else f"{xt}+{bt}={xt + bt}"
    elif op == "-":
        borrow = int(xu < bu)
        units = f"{xu + 10 * borrow}-{bu}={xu + 10 * borrow - bu}"
        tens = f"{xt}-{bt}-1={xt - bt - 1}" if borrow else f"{xt}-{bt}={xt - bt}"
    else:
        units, carry = f"{xu}*{b}={xu * b}", (xu * b) // 10
        tens = f"{xt}*{b}+{carry}={xt * b + carry}" if carry else f"{xt}*{b}={xt * b}"
    parts = [units] if y < 10 and x < 10 and b < 10 else [units, tens]
    return f"{x}{op}{b}: " + ", ".join(parts) + f", {x}{op}{b}={y}"


OTHER = ["{O} has {d} {items}.", "{O} owns {d} {items}.", "{O} keeps {d} {items} in a box."]


def _one_problem(
    rng: random.Random,
    steps: int,
    lo: int,
    hi: int,
    ops: list[str],
    max_value: int,
    multiplier_max: int = MULTIPLIER_MAX,
    distractor_rate: float = 0.0,
    compare_rate: float = 0.0,
) -> dict | None:
    """One problem: a chain of `steps` operations on one person's count. With `distractor_rate` the text
    also states another person's count; with `compare_rate` (of those) the question asks how many more
    the first person has than the other (one more step: the other count matters), otherwise that count
    is a distractor to ignore."""
    (name, p, o), (other, _, _) = rng.sample(NAMES, 2)
    items = rng.choice(ITEMS)
    x = rng.randint(max(lo, 1), hi)
    fmt = dict(Name=name, P=p.capitalize(), p=p, o="him" if p == "he" else "her", items=items)
    question = [f"{name} has {x} {items}."]
    solution, digits = [], []
    for _ in range(steps):
        for _attempt in range(50):  # keep every intermediate value within [0, max_value]
            op = rng.choice([op for op in ops if op != "-" or x >= max(lo, 1)] or ["+"])
            if op == "+":
                b = rng.randint(max(lo, 1), hi)
                y, q, s = x + b, rng.choice(ADD), ADD_SOL
            elif op == "-":
                b = rng.randint(max(lo, 1), min(hi, x))
                y, q, s = x - b, rng.choice(SUB), SUB_SOL
            else:
                b = rng.randint(2, max(2, min(hi, multiplier_max)))
                y, q, s = x * b, rng.choice(MUL), MUL_SOL
            if y <= max_value:
                break
        else:
            return None  # no operation keeps this chain within max_value: the caller draws another problem
        question.append(q.format(b=b, **fmt))
        solution.append(s.format(x=x, b=b, y=y, **fmt))
        digits.append(digit_line(x, op, b) if max_value < 100 else solution[-1])
        x = y
    ask = f"How many {items} does {name} have now?"
    if rng.random() < distractor_rate and x > 1:
        d = rng.randint(1, min(hi, x - 1))
        # first or last, so that every he/she still refers to the person the chain is about
        question.insert(rng.choice([0, len(question)]), rng.choice(OTHER).format(O=other, d=d, items=items))
        if rng.random() < compare_rate:
            ask = f"How many more {items} does {name} have than {other} in the end?"
            solution.append(SUB_SOL.format(x=x, b=d, y=x - d))
            digits.append(solution[-1])
            x, steps = x - d, steps + 1
    question.append(ask)
    return {
        "question": " ".join(question),
        "answer": "\n".join(solution) + f"\n#### {x}",
        "steps": steps,
        "digits_answer": "\n".join(digits) + f"\n#### {x}",
    }


def generate_synthetic(
    seed: int,
    num_train: int,
    num_test: int,
    operand_min: int,
    operand_max: int,
    operations: list[str],
    steps: dict[int, float],
    max_value: int = 10**9,
    direct_answer_rate: float = 0.0,
    digit_steps_rate: float = 0.0,
    multiplier_max: int = MULTIPLIER_MAX,
    distractor_rate: float = 0.0,
    compare_rate: float = 0.0,
) -> tuple[list[dict], list[dict]]:
    """Seeded GSM8K-format problems; train and test questions are unique and disjoint.

    A share `direct_answer_rate` of the *training* solutions states only the final answer
    ('#### 31', no worked steps), as real solution sets mix worked and terse answers. A share
    `digit_steps_rate` of the other training solutions works each step digit by digit (see
    `digit_line`). Test rows always keep the compact worked solution (it is only a reference there).
    """
    rng = random.Random(seed)
    step_values, weights = list(steps), [steps[k] for k in steps]
    seen: set[str] = set()
    rows: list[dict] = []
    target = num_train + num_test
    attempts = last_new = 0
    while len(rows) < target:
        attempts += 1
        # the budget, or far sooner a long run of draws with nothing new (the default's longest is 1 draw)
        if attempts > 50 * target + 1000 or attempts - last_new > MAX_STALL_ATTEMPTS:
            raise ValueError(
                f"data.synthetic: could only generate {len(rows)} unique problems of {target} requested "
                f"(num_train + num_test) in {attempts - 1} draws; widen the operand range or ask for fewer"
            )
        row = _one_problem(
            rng,
            rng.choices(step_values, weights)[0],
            operand_min,
            operand_max,
            operations,
            max_value,
            multiplier_max,
            distractor_rate,
            compare_rate,
        )
        if row is None or row["question"] in seen:
            continue
        seen.add(row["question"])
        last_new = attempts
        rows.append(row)
    train = rows[:num_train]
    style = random.Random(seed + 1)
    for row in train:
        draw = style.random()
        if draw < direct_answer_rate:
            row["answer"] = "#### " + row["answer"].rsplit("####", 1)[1].strip()
            row["style"] = "direct"
        elif draw < direct_answer_rate + (1 - direct_answer_rate) * digit_steps_rate:
            row["answer"] = row["digits_answer"]
            row["style"] = "digits"
    for row in rows:
        del row["digits_answer"]
    return train, rows[num_train:]


# ---------------------------------------------------------------------------- parsing, checks
@dataclass
class RawRow:
    """One row as read, with where it came from (for errors naming the file and line)."""

    source: str  # file or dataset name
    line: int  # 1-based line / row number in source
    data: object


@dataclass
class Example:
    """One checked problem: question, reasoning (with any calculator annotations) and final answer."""

    id: str
    question: str
    reasoning: str
    final: str
    answer: str
    steps: int
    source: str
    line: int


@dataclass
class BadRow:
    """A row refused by the checks, with the file, line and reason."""

    source: str
    line: int
    reason: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class CheckResult:
    """The rows the checks kept and those they refused."""

    examples: list[Example] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)


def stable_id(split: str, question: str) -> str:
    """An id from the split and the question's text: the same problem keeps its id across runs."""
    return f"{split}-{hashlib.sha1(question.strip().encode()).hexdigest()[:12]}"


class InputFileError(ValueError):
    """An input file that cannot be read as JSON lines at all; the message names the file."""


# Size limits on input rows, far above any real problem (GSM8K's longest training row is 1.7 kB): a runaway row (a
# 100 MB line once grew the `base` stage to 20 GB) is a bad row named by file and line, never read whole into memory.
MAX_ROW_BYTES = 1 << 20  # one jsonl line, in bytes (newline included)
MAX_FIELD_CHARS = 100_000  # a row's question or answer, in characters (every source: jsonl, gsm8k, synthetic)
_SKIP_CHUNK = 1 << 20  # an oversized line's rest is read and discarded in pieces of this size


def _bounded_lines(stream, max_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Each line of a binary file read with a bound: a line over `max_bytes` is skipped in bounded pieces, so no
    line is ever held whole in memory.

    Args:
        max_bytes: the longest line returned, newline included.

    Returns:
        An iterator of (1-based line number, the line's bytes, or None for a line longer than max_bytes).
    """
    number = 0
    while True:
        raw = stream.readline(max_bytes + 1)
        if not raw:
            return
        number += 1
        if len(raw) <= max_bytes:
            yield number, raw
            continue
        while not raw.endswith(b"\n"):  # discard up to the end of the oversized line
            raw = stream.readline(_SKIP_CHUNK)
            if not raw:
                break
        yield number, None


def _json_row(text: str, source: str, line: int) -> object:
    """One line's JSON value, with every failure of the parser caught (a syntax error, nesting too deep for the
    decoder, an integer over Python's digit limit): no line can stop prepare past data.on_bad_rows.

    Args:
        source: the file, as a BadRow names it.
        line: its 1-based line number.

    Returns:
        The decoded value, or a BadRow (invalid_json) naming file, line and what is wrong.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(source, line, "invalid_json", str(e))
    except RecursionError:
        return BadRow(source, line, "invalid_json", "nested too deeply for the JSON decoder; expected a flat object")
    except ValueError as e:  # e.g. an integer literal of more than sys.get_int_max_str_digits() digits
        return BadRow(source, line, "invalid_json", str(e).split(";")[0])


def read_jsonl(path: str | Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[RawRow]:
    """Rows of a UTF-8 JSON-lines file (a UTF-8 BOM is allowed). A missing path, a directory, a file that is
    not UTF-8 (UTF-16 is recognised by its BOM) or one with no row at all is an error naming the file. A line
    that is not JSON or is longer than `max_row_bytes` is a row whose data is a BadRow naming file and line
    (data.on_bad_rows decides whether it stops prepare).

    Args:
        max_row_bytes: the longest line accepted, in bytes; longer ones are never read whole.

    Returns:
        An iterator of RawRow, one per non-blank line.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: file not found")
    if not path.is_file():
        raise InputFileError(
            f"{path}: is a directory, not a JSON-lines file" if path.is_dir() else f"{path}: not a regular file"
        )
    with path.open("rb") as f:
        head = f.read(2)
    if head in (b"\xff\xfe", b"\xfe\xff"):
        raise InputFileError(f"{path}: UTF-16 encoded; save it as UTF-8 JSON lines")
    rows = 0
    with path.open("rb") as f:
        for i, raw in _bounded_lines(f, max_row_bytes):
            if raw is None:
                rows += 1
                detail = f"longer than {max_row_bytes:,} bytes; expected one problem per line"
                yield RawRow(str(path), i, BadRow(str(path), i, "row_too_large", detail))
                continue
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise InputFileError(
                    f"{path}:{i}: not UTF-8 text ({e.reason} at byte {e.start + 1} of the line); "
                    "save the file as UTF-8 JSON lines"
                ) from None
            if not line.strip():
                continue
            rows += 1
            yield RawRow(str(path), i, _json_row(line, str(path), i))
    if not rows:
        raise InputFileError(f"{path}: no rows (the file is empty or holds only whitespace)")


def parse_row(raw: RawRow, split: str, strip_annotations: bool) -> Example | BadRow:
    """One GSM8K row -> Example, or the reason it is unusable."""
    if isinstance(raw.data, BadRow):
        return raw.data
    data = raw.data
    if not isinstance(data, dict):
        return BadRow(raw.source, raw.line, "not_an_object", type(data).__name__)
    for key in ("question", "answer"):
        if key not in data:
            return BadRow(raw.source, raw.line, "missing_field", key)
        if not isinstance(data[key], str) or not data[key].strip():
            return BadRow(raw.source, raw.line, "empty_value", key)
        if len(data[key]) > MAX_FIELD_CHARS:
            detail = f"{key} has {len(data[key]):,} characters; expected at most {MAX_FIELD_CHARS:,}"
            return BadRow(raw.source, raw.line, "field_too_large", detail)
        if not data[key].isascii():  # JSON's \ud800 escapes decode to lone surrogates, which no UTF-8 output can hold
            try:
                data[key].encode("utf-8")
            except UnicodeEncodeError as error:
                detail = f"{key} holds {data[key][error.start]!r} at character {error.start + 1}; expected UTF-8 text"
                return BadRow(raw.source, raw.line, "invalid_text", detail)
    question, answer = data["question"].strip(), data["answer"].strip()
    if "####" not in answer:
        return BadRow(raw.source, raw.line, "missing_final_answer", "answer has no '####'")
    reasoning, _, final_raw = answer.rpartition("####")
    final = normalize_number(final_raw)
    if final is None:
        return BadRow(raw.source, raw.line, "non_numeric_answer", final_raw.strip()[:40])
    reasoning = reasoning.strip()
    steps = int(data["steps"]) if isinstance(data.get("steps"), int) else max(1, reasoning.count("<<"))
    if strip_annotations:
        reasoning = strip_calculator_annotations(reasoning)
    return Example(stable_id(split, question), question, reasoning, final, answer, steps, raw.source, raw.line)


def check_rows(
    rows: Iterable[RawRow], split: str, strip_annotations: bool, exclude_questions: Optional[set[str]] = None
) -> CheckResult:
    """Parse and quality-check one split: fields, empties, numeric answers, duplicates, leakage."""
    out = CheckResult()
    seen: dict[str, tuple[str, int]] = {}
    norm = lambda q: " ".join(q.lower().split())  # noqa: E731
    for raw in rows:
        ex = parse_row(raw, split, strip_annotations)
        if isinstance(ex, BadRow):
            out.bad.append(ex)
            continue
        key = norm(ex.question)
        if key in seen:
            src, line = seen[key]
            out.bad.append(BadRow(ex.source, ex.line, "duplicate_question", f"same as {src}:{line}"))
            continue
        if exclude_questions is not None and key in exclude_questions:
            out.bad.append(BadRow(ex.source, ex.line, "train_test_overlap", "question also in the other split"))
            continue
        seen[key] = (ex.source, ex.line)
        out.examples.append(ex)
    return out


def normalized_questions(examples: Iterable[Example]) -> set[str]:
    """The questions lower-cased with whitespace collapsed (train/test overlap is checked on these)."""
    return {" ".join(e.question.lower().split()) for e in examples}


def seeded_subset(examples: list[Example], count: Optional[int], seed: int) -> list[Example]:
    """A seeded random subset of `count` examples (all when count is None or >= len), original order kept."""
    if count is None or count >= len(examples):
        return list(examples)
    keep = sorted(random.Random(seed).sample(range(len(examples)), count))
    return [examples[i] for i in keep]


# ---------------------------------------------------------------------------------- outputs
def messages(system_prompt: str, question: str) -> list[dict]:
    """The chat prompt: the system prompt (when set) and the question."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": question}]


def completion_text(ex: Example) -> str:
    """The demonstration's completion: its reasoning, then `#### <answer>`."""
    return f"{ex.reasoning}\n#### {ex.final}" if ex.reasoning else f"#### {ex.final}"


def sft_record(ex: Example, system_prompt: str) -> dict:
    """An SFT row (TRL's prompt/completion format)."""
    return {
        "id": ex.id,
        "prompt": messages(system_prompt, ex.question),
        "completion": [{"role": "assistant", "content": completion_text(ex)}],
    }


def rl_record(ex: Example, system_prompt: str) -> dict:
    """A GRPO row: the prompt and the ground truth the rewards compare with."""
    return {"id": ex.id, "prompt": messages(system_prompt, ex.question), "ground_truth": ex.final}


def test_record(ex: Example, system_prompt: str) -> dict:
    """A held-out row: what evaluation needs, the reference answer included."""
    return {
        "id": ex.id,
        "question": ex.question,
        "prompt": messages(system_prompt, ex.question),
        "ground_truth": ex.final,
        "answer": ex.answer,
        "steps": ex.steps,
    }


def write_jsonl(path: str | Path, records: Iterable[dict]) -> int:
    """Atomic write (common.atomic_write): a crash never leaves a half-written file in place of an earlier
    result. Returns the number of records written."""
    written = 0
    with atomic_write(path) as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    return written


def load_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL file (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
