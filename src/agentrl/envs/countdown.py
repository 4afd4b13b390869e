"""Countdown (as in TinyZero / RAGEN): reach a target from given numbers with + - * / and parentheses.

The environment has TRL 1.16's `environment_factory` shape: `Countdown(**knobs)` makes one instance,
`reset(**row)` starts an episode from a dataset row (`numbers`, `target`; other keys ignored) and the one
tool, `check(expression)`, answers in a few tokens: `24 yes` (on target), `29 high`, `21 low`, or a short
`error: ...` (`7 not given`, `3 used twice`, `5 unused`, `division by zero`, `not an expression`, ...; with
`flag_repeats`, `tried before` for a legal off-target expression already tried in the episode, spaces aside).
With `feedback="none"` (the ablation) it answers `ok` to every string. The reward is not the env's: an
episode is solved when the completion's last `#### <expression>` line is a legal expression equal to the
target (`correct`), checked with exact arithmetic (`fractions.Fraction`).

`make_rows` generates solvable instances (a random integer expression over the numbers gives the target) with
demonstrations in the inline annotation syntax, `<<E=RESULT>>` per try, whose RESULTs are what `check` returns;
training demos include near-miss failed tries (other expressions over the same numbers) before the solution.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Iterable, Optional

from . import refuse_beyond_capacity, row_text

GEN_DEFAULTS: dict = {
    "num_numbers": 3,  # how many numbers an instance gives (2-5)
    "number_min": 1,  # the numbers are drawn from number_min..number_max
    "number_max": 20,
    "target_max": 100,  # targets are integers in 1..target_max
    "hard_share": 0.5,  # share of training demos drawn with failed first try(s) (before direct_share removes tries)
    "max_failed_tries": 2,  # a hard demo has 1..max_failed_tries failed tries before the solution (1-3)
    "direct_share": 0.0,  # share of training demos that write the solution without trying it with the tool
}
ENV_DEFAULTS: dict = {
    "feedback": "full",  # "full": value and yes/high/low or the error; "none": the tool answers "ok" to everything
    "use_all": True,  # True: each number exactly once (TinyZero); False: each at most once
    "flag_repeats": True,  # full feedback: a legal off-target expression tried before answers "error: tried before"
}
FEEDBACK = ("full", "none")
SPLITS = ("train", "test")
MAX_CHARS = 100  # longer tool arguments / answers are refused before parsing (bounds work and nesting depth)
MAX_NUMBERS = 8  # a row may give at most this many numbers
NEAR_MISS_SAMPLES = 30  # random expressions drawn to find a demo's near-miss tries
MAX_STALL_ATTEMPTS = 10_000  # draws in a row with no new instance: the knobs' instances are used up
DIGITS = "0123456789"  # ASCII only: str.isdigit() also accepts e.g. '２' or '٣'
_PREC_ATOM, _PREC_MUL, _PREC_ADD = 3, 2, 1


class IllegalExpression(ValueError):
    """The expression is not a legal answer; the message (short) goes back to the policy as `error: <message>`."""


# ----------------------------------------------------------------------------------- checker
def _tokenize(text: str) -> list[str]:
    tokens, i = [], 0
    while i < len(text):
        ch = text[i]
        if ch == " ":
            i += 1
        elif ch in DIGITS:
            j = i
            while j < len(text) and text[j] in DIGITS:
                j += 1
            tokens.append(text[i:j])
            i = j
        elif ch in "+-*/()":
            tokens.append(ch)
            i += 1
        else:
            raise IllegalExpression("not an expression")
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*; factor := NUMBER | '(' expr ')'.
    No unary minus. Recursion depth is bounded by MAX_CHARS (checked before parsing)."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.i = tokens, 0

    def _peek(self) -> Optional[str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def parse(self):
        node = self._expr()
        if self.i != len(self.tokens):
            raise IllegalExpression("not an expression")
        return node

    def _expr(self):
        node = self._term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.i]
            self.i += 1
            node = (op, node, self._term())
        return node

    def _term(self):
        node = self._factor()
        while self._peek() in ("*", "/"):
            op = self.tokens[self.i]
            self.i += 1
            node = (op, node, self._factor())
        return node

    def _factor(self):
        tok = self._peek()
        if tok is None:
            raise IllegalExpression("not an expression")
        self.i += 1
        if tok == "(":
            node = self._expr()
            if self._peek() != ")":
                raise IllegalExpression("not an expression")
            self.i += 1
            return node
        if tok[0] in DIGITS:
            return ("n", tok)
        raise IllegalExpression("not an expression")


def _literals(node, out: list[str]) -> list[str]:
    if node[0] == "n":
        out.append(node[1])
    else:
        _literals(node[1], out)
        _literals(node[2], out)
    return out


def _value(node) -> Fraction:
    if node[0] == "n":
        return Fraction(int(node[1]))
    left, right = _value(node[1]), _value(node[2])
    if node[0] == "+":
        return left + right
    if node[0] == "-":
        return left - right
    if node[0] == "*":
        return left * right
    if right == 0:
        raise IllegalExpression("division by zero")
    return left / right


def evaluate(expression: str, numbers: list[int], use_all: bool) -> Fraction:
    """The exact value of `expression` if it is a legal answer over `numbers`, else IllegalExpression.

    Legal: ASCII digits, + - * / ( ) and spaces (no unary minus), at most MAX_CHARS characters, every number
    literal one of `numbers` (written without leading zeros) and used at most as often as it is given; with
    `use_all`, every given number used exactly as often as it is given; no division by zero.
    """
    if not isinstance(expression, str):
        raise IllegalExpression("expression must be a string")
    if len(expression) > MAX_CHARS:
        raise IllegalExpression(f"longer than {MAX_CHARS} characters")
    tokens = _tokenize(expression)
    if not tokens:
        raise IllegalExpression("not an expression")
    tree = _Parser(tokens).parse()
    available = Counter(numbers)
    used: Counter = Counter()
    for text in _literals(tree, []):
        number = int(text)
        if text != str(number) or number not in available:
            raise IllegalExpression(f"{text} not given")
        used[number] += 1
        if used[number] > available[number]:
            times = "twice" if used[number] == 2 else f"{used[number]} times"
            raise IllegalExpression(f"{number} used {times}")
    if use_all:
        for number in numbers:
            if used[number] < available[number]:
                raise IllegalExpression(f"{number} unused")
    return _value(tree)


def format_value(value: Fraction) -> str:
    """24 -> '24', 7/3 -> '7/3', -3 -> '-3'."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


_QUESTION = re.compile(r"Make (\d{1,6}) from ((?:\d{1,6} ){0,7}\d{1,6}) using")


def _instance(row: dict) -> tuple[list[int], int]:
    """(numbers, target) of a row, or ValueError naming the row and the field. A row with neither field but
    a question in this task's words ("Make 24 from 3 8 5 using ...": a served prompt) is read from the text."""
    where = f"countdown row {row.get('id')!r}" if "id" in row else "countdown row"
    if "numbers" not in row and "target" not in row and (m := _QUESTION.search(row_text(row) or "")):
        row = {"numbers": [int(x) for x in m.group(2).split()], "target": int(m.group(1))}
    numbers, target = row.get("numbers"), row.get("target")
    if (
        not isinstance(numbers, (list, tuple))
        or not 1 <= len(numbers) <= MAX_NUMBERS
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in numbers)
    ):
        raise ValueError(f"{where}: 'numbers' must be a list of 1-{MAX_NUMBERS} non-negative integers, got {numbers!r}")
    if not isinstance(target, int) or isinstance(target, bool):
        raise ValueError(f"{where}: 'target' must be an integer, got {target!r}")
    return list(numbers), target


# ----------------------------------------------------------------------------------- environment
class Countdown:
    """One countdown episode per `reset`; the policy tries expressions with `check` and reads the answer.

    Public attributes read after an episode: `turns` (tool calls), `failed_tries` (calls whose true outcome was
    not on target: illegal or off-target; counted the same with feedback="none", where the policy is not told),
    `solved` (some call hit the target).
    """

    def __init__(
        self,
        feedback: str = ENV_DEFAULTS["feedback"],
        use_all: bool = ENV_DEFAULTS["use_all"],
        flag_repeats: bool = ENV_DEFAULTS["flag_repeats"],
    ):
        if feedback not in FEEDBACK:
            raise ValueError(f"countdown: feedback must be one of {', '.join(FEEDBACK)}, got {feedback!r}")
        for name, value in (("use_all", use_all), ("flag_repeats", flag_repeats)):
            if not isinstance(value, bool):
                raise ValueError(f"countdown: {name} must be true or false, got {value!r}")
        self.feedback = feedback
        self.use_all = use_all
        self.flag_repeats = flag_repeats
        self._numbers: Optional[list[int]] = None
        self._target: Optional[int] = None
        self._tried: set[tuple[str, ...]] = set()  # the token tuples of legal off-target tries
        self.turns = 0
        self.failed_tries = 0
        self.solved = False

    def reset(self, **row) -> Optional[str]:
        self._numbers, self._target = _instance(row)
        self._tried = set()
        self.turns = 0
        self.failed_tries = 0
        self.solved = False
        return None  # the prompt already states the numbers and the target

    def check(self, expression: str) -> str:
        """Try an expression over the given numbers.

        Args:
            expression: the given numbers combined with + - * / and parentheses, e.g. "(3+5)*3".

        Returns:
            The value and "yes" (on target), "high" or "low", e.g. "24 yes"; or "error: ..." if not legal.
        """
        self.turns += 1
        if self._numbers is None:
            self.failed_tries += 1
            return "error: no episode, call reset first"
        if not isinstance(expression, str):
            self.failed_tries += 1
            return "error: expression must be a string"
        try:
            value = evaluate(expression, self._numbers, self.use_all)
        except IllegalExpression as e:
            self.failed_tries += 1
            result, key = f"error: {e}", None
        else:
            key = tuple(_tokenize(expression))  # parsed, so short: the same tokens are the same try, spaces aside
            if value == self._target:
                self.solved = True
                result, key = f"{format_value(value)} yes", None  # on target is always said so
            else:
                self.failed_tries += 1
                result = f"{format_value(value)} {'high' if value > self._target else 'low'}"
        repeat = key is not None and key in self._tried
        if key is not None:
            self._tried.add(key)
        if self.feedback == "none":
            return "ok"
        return "error: tried before" if repeat and self.flag_repeats else result


def correct(row: dict, text: str, env: Optional[Countdown]) -> bool:
    """Solved: the last `#### <expression>` line of `text` is a legal expression over row["numbers"] equal to
    row["target"]. `env` supplies use_all (None: ENV_DEFAULTS["use_all"]); its episode state is not used."""
    numbers, target = _instance(row)
    use_all = ENV_DEFAULTS["use_all"] if env is None else env.use_all
    if not isinstance(text, str):
        return False
    answers = [line[4:] for line in text.splitlines() if line.startswith("####")]
    if not answers:
        return False
    try:
        return evaluate(answers[-1].strip(), numbers, use_all) == target
    except IllegalExpression:
        return False


# ----------------------------------------------------------------------------------- solver
def _render(op: str, a: tuple[str, int], b: tuple[str, int]) -> tuple[str, int]:
    """(text, precedence) of `a op b` with only the parentheses needed (the value is exact either way)."""
    (ta, pa), (tb, pb) = a, b
    if op == "+":
        return f"{ta}+{tb}", _PREC_ADD
    if op == "-":
        return f"{ta}-({tb})" if pb == _PREC_ADD else f"{ta}-{tb}", _PREC_ADD
    ta = f"({ta})" if pa == _PREC_ADD else ta
    if op == "*":
        return f"{ta}*({tb})" if pb == _PREC_ADD else f"{ta}*{tb}", _PREC_MUL
    return f"{ta}/({tb})" if pb != _PREC_ATOM else f"{ta}/{tb}", _PREC_MUL


def _table(numbers: list[int], integer_only: bool) -> list[dict]:
    """Subset DP: table[mask] = {value: (expression text, precedence)} for every value an expression using each
    number of the subset `mask` exactly once can take (first expression found per value). With integer_only,
    only expressions whose every intermediate value is a non-negative integer."""
    n = len(numbers)
    table: list[dict] = [{} for _ in range(1 << n)]
    for i, x in enumerate(numbers):
        table[1 << i][Fraction(x)] = (str(x), _PREC_ATOM)
    for mask in range(1, 1 << n):
        if mask & (mask - 1) == 0:
            continue
        out = table[mask]
        sub = (mask - 1) & mask
        while sub:
            other = mask ^ sub
            for a, ea in table[sub].items():
                for b, eb in table[other].items():
                    candidates = [("-", a - b)]
                    if sub < other:  # + and * are commutative: one order is enough
                        candidates += [("+", a + b), ("*", a * b)]
                    if b != 0:
                        candidates.append(("/", a / b))
                    for op, value in candidates:
                        if integer_only and (value.denominator != 1 or value < 0):
                            continue
                        if value not in out:
                            out[value] = _render(op, ea, eb)
            sub = (sub - 1) & mask
    return table


def solve(numbers: list[int], target: int, use_all: bool = True) -> Optional[str]:
    """An expression over `numbers` (each exactly once with use_all, else at most once; + - * / and parentheses,
    exact arithmetic, any intermediate value) equal to `target`, or None if there is none."""
    table = _table(list(numbers), integer_only=False)
    masks = [len(table) - 1] if use_all else range(1, len(table))
    for mask in masks:
        if Fraction(target) in table[mask]:
            return table[mask][Fraction(target)][0]
    return None


# ----------------------------------------------------------------------------------- generation
def _random_solution(numbers: list[int], rng: random.Random) -> tuple[int, str]:
    """(value, text) of a random expression using every number once, every intermediate a positive integer."""
    items = [(x, (str(x), _PREC_ATOM)) for x in numbers]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (a, ea), (b, eb) = items[i], items[j]
        ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if b > 1 and a % b == 0 else [])
        op = rng.choice(ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
        items = [item for k, item in enumerate(items) if k not in (i, j)] + [(value, _render(op, ea, eb))]
    return items[0][0], items[0][1][0]


def _gen_knobs(knobs: dict) -> dict:
    unknown = sorted(set(knobs) - set(GEN_DEFAULTS))
    if unknown:
        raise ValueError(f"countdown: unknown generation knob(s) {unknown}; known: {sorted(GEN_DEFAULTS)}")
    k = {**GEN_DEFAULTS, **knobs}
    ints = {"num_numbers": (2, 5), "number_min": (1, 10**6), "number_max": (1, 10**6), "target_max": (1, 10**9)}
    ints["max_failed_tries"] = (1, 3)
    for name, (lo, hi) in ints.items():
        if not isinstance(k[name], int) or isinstance(k[name], bool) or not lo <= k[name] <= hi:
            raise ValueError(f"countdown: {name} must be an integer in {lo}..{hi}, got {k[name]!r}")
    if k["number_max"] < k["number_min"]:
        raise ValueError(f"countdown: number_max ({k['number_max']}) must be >= number_min ({k['number_min']})")
    for name in ("hard_share", "direct_share"):
        share = k[name]
        if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share <= 1:
            raise ValueError(f"countdown: {name} must be a number in [0, 1], got {share!r}")
    return k


def instance_key(row: dict) -> str:
    """The instance (sorted numbers and target) as a string: rows with the same key are the same puzzle."""
    numbers, target = _instance(row)
    return " ".join(map(str, sorted(numbers))) + f" -> {target}"


def question(numbers: list[int], target: int, use_all: bool) -> str:
    """The task's text for these numbers and target."""
    once = "once each" if use_all else "at most once each"
    return f"Make {target} from {' '.join(map(str, numbers))} using + - * / {once}."


def _near_misses(numbers: list[int], target: int, k: int, rng: random.Random) -> list[str]:
    """Up to k plausible wrong tries: among NEAR_MISS_SAMPLES random expressions over all the numbers (positive
    integer intermediates), ones with distinct values != target, drawn from the closest to it."""
    by_value: dict[int, str] = {}
    for _ in range(NEAR_MISS_SAMPLES):
        value, text = _random_solution(numbers, rng)
        if value != target and value not in by_value:
            by_value[value] = text
    pool = [by_value[v] for v in sorted(by_value, key=lambda v: (abs(v - target), v))[: max(3, 2 * k)]]
    return rng.sample(pool, min(k, len(pool)))


def _expression_orders(num_numbers: int) -> int:
    """How many ways `_random_solution` can combine `num_numbers` numbers (an ordered pair and one of 4 operators per
    step): no instance has more distinct targets than this."""
    return 1 if num_numbers <= 1 else num_numbers * (num_numbers - 1) * 4 * _expression_orders(num_numbers - 1)


def instance_capacity(k: dict) -> int:
    """An upper bound on the distinct instances (number multiset, target) `make_rows` can draw with the knobs `k`:
    the multisets of num_numbers numbers from number_min..number_max, times the targets one multiset can have (at
    most target_max, the expression orders, and (number_max + 1) ** num_numbers - 1, above any value + - * / reach).

    Args:
        k: the generation knobs (checked by _gen_knobs).

    Returns:
        The bound.
    """
    count = k["num_numbers"]
    multisets = math.comb(k["number_max"] - k["number_min"] + count, count)
    targets = min(k["target_max"], _expression_orders(count), (k["number_max"] + 1) ** count - 1)
    return multisets * targets


def _drawable(key: str, k: dict) -> bool:
    """Whether an instance_key ('3 5 8 -> 24') is an instance these knobs can draw (excluding it leaves one fewer)."""
    numbers, _, target = key.partition(" -> ")
    values = numbers.split()
    if len(values) != k["num_numbers"] or not target.isdigit() or not all(v.isdigit() for v in values):
        return False
    return 1 <= int(target) <= k["target_max"] and all(k["number_min"] <= int(v) <= k["number_max"] for v in values)


def check_capacity(n: int, split: str, k: dict, exclude: set) -> None:
    """ValueError, before any draw, when `n` distinct instances cannot exist with the knobs `k` once `exclude` is
    left out (instead of drawing until the attempt budget runs out).

    Args:
        n: rows asked.
        split: "train" or "test" (named in the message: environments.countdown.num_<split>).
        k: the generation knobs (checked by _gen_knobs).
        exclude: instance_key()s that may not be drawn.
    """
    refuse_beyond_capacity(
        n,
        instance_capacity(k),
        exclude,
        lambda key: _drawable(key, k),
        f"countdown: {n} {split} instances asked (num_{split}) but num_numbers={k['num_numbers']}, numbers "
        f"{k['number_min']}..{k['number_max']}, target_max={k['target_max']} allow at most {{capacity}} distinct "
        "instances{other}: widen the number range, raise num_numbers or target_max, or ask for fewer",
    )


def make_rows(
    n: int,
    rng: random.Random,
    split: str,
    env_knobs: Optional[dict] = None,
    exclude: Iterable[str] = (),
    **gen_knobs,
) -> list[dict]:
    """`n` solvable instances with demonstrations. `split`: "train" (hard_share of demos start with 1..
    max_failed_tries near-miss tries; direct_share of them write the solution without any try, as the default
    task's demos do part of the arithmetic in text) or "test" (the reference solution, one try). `env_knobs`: the
    Countdown knobs the demos are run with (their RESULTs are what that env answers; default ENV_DEFAULTS). `exclude`:
    instance_key()s not to generate (e.g. the other split's). Only `rng` is drawn from: same seed, same rows."""
    if split not in SPLITS:
        raise ValueError(f"countdown: split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"countdown: n must be a non-negative integer, got {n!r}")
    k = _gen_knobs(gen_knobs)
    env = Countdown(**{**ENV_DEFAULTS, **(env_knobs or {})})
    seen = set(exclude)
    check_capacity(n, split, k, seen)
    rows: list[dict] = []
    attempts, max_attempts, last_new = 0, 1000 + 100 * n, 0
    while len(rows) < n:
        attempts += 1
        if attempts - last_new > MAX_STALL_ATTEMPTS:
            raise ValueError(
                f"countdown: no new instance in {MAX_STALL_ATTEMPTS} draws after {len(rows)} of {n} with "
                f"num_numbers={k['num_numbers']}, numbers {k['number_min']}..{k['number_max']}, "
                f"target_max={k['target_max']}: the instances these knobs draw are used up; widen the number range, "
                "raise target_max, or ask for fewer"
            )
        if attempts > max_attempts:
            raise ValueError(
                f"countdown: only {len(rows)} of {n} distinct instances found in {max_attempts} attempts with "
                f"num_numbers={k['num_numbers']}, numbers {k['number_min']}..{k['number_max']}, "
                f"target_max={k['target_max']}: widen the number range or raise target_max"
            )
        numbers = [rng.randint(k["number_min"], k["number_max"]) for _ in range(k["num_numbers"])]
        target, solution = _random_solution(numbers, rng)
        if not 1 <= target <= k["target_max"]:
            continue
        row = {"numbers": numbers, "target": target}
        key = instance_key(row)
        if key in seen:
            continue
        seen.add(key)
        last_new = attempts
        failed = rng.randint(1, k["max_failed_tries"]) if split == "train" and rng.random() < k["hard_share"] else 0
        tries = (_near_misses(numbers, target, failed, rng) if failed else []) + [solution]
        # drawn only when the knob is on, so that direct_share 0 leaves every other draw (and row) as it was
        if split == "train" and k["direct_share"] > 0 and rng.random() < k["direct_share"]:
            tries = []
        env.reset(**row)
        answer = " ".join(f"<<{e}={env.check(e)}>>" for e in tries) + ("\n" if tries else "") + f"#### {solution}"
        rows.append(
            {
                "question": question(numbers, target, env.use_all),
                "answer": answer,
                "ground_truth": str(target),
                **row,
                "demo_failed_tries": max(len(tries) - 1, 0),
            }
        )
    return rows
