"""The countdown task: given a few numbers and a target, write one arithmetic expression that
uses each given number at most once (a subset will do) with + - * / and parentheses and equals
the target. Several answers are usually right, so it rewards search, not recall.

A row is ``numbers,target,solution`` such as ``3 7 25,46,25 + 7 * 3``; its prompt is
``numbers 3 7 25, target 46``. The shipped rows are in data/countdown-*.csv (made by
task.countdown_generate, `python -m volunteer_rl.task.generate --task countdown`).

The reward's rule, as strict as the calculator's (task.reward) and for the same reason (a
lenient reader rewards whatever rides along with a right answer): the completion, stripped of
surrounding whitespace, must be ONE expression written only with decimal integer literals,
+ - * /, parentheses and spaces. So: one line, no comment, no '.', no prefix such as "A:", no
"= 46" after it, no code fence, no ** // %, no unary minus or plus (`-3`, `--3`), no 0x or _
spellings. Every literal must be one of the given numbers, each used at most as many times as
it is given. The value is computed by the calculator's bounded evaluator (calculator.safe_eval,
never a second one) and compared with math.isclose(rel_tol=1e-9, abs_tol=1e-9) as the
calculator does. '/' is true division, so fractions may appear on the way (`8 / (3 - 8 / 3)`
makes 24 from 3 3 8 8). For rows of 3 or 4 numbers up to 100 (all the shipped ones) that comparison is
exact: a value of at least 1 made from them has a denominator of about 1e4 at most (larger
ones, as in 7 / (97 * 98 * 99), come with values below 1e-4), so a wrong value is at least 1e-4
from a whole target, far outside the tolerance (under 1e-6 below 1000), and the float error of
three operations on such values is about 1e-12 (tests/unit/test_countdown.py checks the rule
against exact Fractions on every expression over sample rows). check() allows rows of up to 6
numbers; there a wrong value within 1e-6 of the target is not ruled out by this argument.

Reward: 1 for a right answer, 0 for anything else; no partial reward for a well-formed wrong
answer (NEAR_MISS_REWARD says why). Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from pathlib import Path

from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.calculator import MAX_EXPRESSION_CHARS, _parse, safe_eval
from volunteer_rl.task.dataset import quoted

NUMBERS_COLUMN = "numbers"
TARGET_COLUMN = "target"
SOLUTION_COLUMN = "solution"
TRAIN_FILE = "countdown-train.csv"
EVAL_FILE = "countdown-eval.csv"

MIN_NUMBERS, MAX_NUMBERS = 2, 6  # numbers a row may give
MAX_NUMBER = 100  # each given number is 1..MAX_NUMBER
MAX_TARGET = 999  # the target is 1..MAX_TARGET (the TV game's range is 100..999)
MAX_STRATUM = 8

NEAR_MISS_REWARD = 0.0
"""Reward of a well-formed answer that uses only given numbers but misses the target: none.

TinyZero's countdown gives such answers 0.1, to teach a base model its answer format. Here the
supervised warm start teaches the format, and binary rewards already leave RL room: the tiny
model warm-started for 400 steps on the shipped recipe, sampling K = 8 at T = 1 on 300 held-out
rows, wrote 4 % malformed answers, 42 % with a number not given (or used too often), 38 %
well-formed but wrong and 16 % right (greedy: 28 %); 55 % of its groups had reward variance
(the calculator's demo: 42 %). A 0.1 would lift that to 97 %, but every group it adds has no
right answer and is told apart by number use alone, and GRPO divides a group's advantages by
its reward's spread, so such a group pushes as hard as one with a right answer: toward
well-formed guesses, not the target. The cheapest well-formed guess, one given number alone,
would earn 0.1 on every row, a sure thing to retreat to on hard rows; and the curriculum
would count those groups useful and keep drawing their prompts. data/README.md has the
measurement."""

_ANSWER = re.compile(r"[0-9+\-*/() ]+")  # all an answer may be written with
_INTEGER = re.compile(r"0|[1-9][0-9]*")  # how a number is written in a row
_BINARY_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_STRATUM_OPERATOR = re.compile(r"[-+*/]")


# -----------------------------------------------------------------------------
# Rows


def parse_numbers(text: str) -> tuple[int, ...] | None:
    """The given numbers of a row ("3 7 25"), or None unless they are MIN_NUMBERS..MAX_NUMBERS
    whole numbers from 1 to MAX_NUMBER, written plainly and separated by spaces."""
    if not isinstance(text, str) or len(text) > 100:
        return None
    words = text.split()
    if not MIN_NUMBERS <= len(words) <= MAX_NUMBERS:
        return None
    if not all(_INTEGER.fullmatch(w) and 1 <= int(w) <= MAX_NUMBER for w in words):
        return None
    return tuple(int(w) for w in words)


def parse_target(text: str) -> int | None:
    """A row's target ("46"), or None unless it is a whole number from 1 to MAX_TARGET."""
    if not isinstance(text, str) or not _INTEGER.fullmatch(text.strip()):
        return None
    value = int(text)
    return value if 1 <= value <= MAX_TARGET else None


# -----------------------------------------------------------------------------
# The rule


def judge(completion: str, numbers: tuple[int, ...], target: int) -> tuple[float, str]:
    """(reward, why) of `completion` for `numbers` and `target`: (1.0, "") when it is right,
    else its reward (0.0, or NEAR_MISS_REWARD for a well-formed answer that misses) and a short
    reason. Raises nothing on any str."""
    if not isinstance(completion, str):
        return 0.0, "not text"
    text = completion.strip()
    # the length test comes first, so a megabyte of digits costs nothing
    if not text or len(text) > MAX_EXPRESSION_CHARS or not _ANSWER.fullmatch(text):
        return 0.0, "not one expression of whole numbers, + - * / and parentheses"
    tree = _parse(text)
    if tree is None:
        return 0.0, "not one expression"
    used = []
    for node in ast.walk(tree.body):  # iterative: no recursion on nested parentheses
        if isinstance(node, ast.BinOp):
            if not isinstance(node.op, _BINARY_OPS):
                return 0.0, "uses an operator other than + - * /"
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
        elif not isinstance(node, _BINARY_OPS):  # the operators themselves are nodes too
            return 0.0, "uses something other than numbers, + - * / and parentheses"
    extra = Counter(used) - Counter(numbers)
    if extra:
        n = min(extra)
        return 0.0, (f"uses {n} more often than given" if n in numbers
                     else f"uses {n}, which is not given")
    value = safe_eval(text)
    if value is None:
        return 0.0, "does not evaluate (division by zero)"
    if math.isclose(value, target, rel_tol=1e-9, abs_tol=1e-9):
        return 1.0, ""
    return NEAR_MISS_REWARD, f"equals {value:g}, not {target}"


def score(completion: str, numbers: tuple[int, ...], target: int) -> float:
    """The reward of `completion`: judge's, 0.0 on anything unexpected. Never raises."""
    try:
        return judge(completion, numbers, target)[0]
    except Exception:  # runs on strangers' uploads in the trainer: never take it down
        return 0.0


def operators(solution: str) -> int:
    """Binary operators in an answer (it has no unary ones): its numbers less one."""
    return len(_STRATUM_OPERATOR.findall(solution))


# -----------------------------------------------------------------------------
# The task


class CountdownTask(Task):
    name = "countdown"
    columns = (NUMBERS_COLUMN, TARGET_COLUMN, SOLUTION_COLUMN)
    instruction = (
        "Reach the target with the given numbers: write one arithmetic expression that uses "
        "some or all of them, each at most once, with only + - * / and parentheses (no other "
        "numbers, no minus sign in front of a number, no ** or //), and whose value is the "
        "target. Answer with the expression only, on one line.\n\n{question}")
    k = 8
    max_new_tokens = 24
    """Twice the longest shipped solution with its EOS: 11 + 1 tokens of the tiny model's
    tokenizer (a BPE trained on these prompts and solutions; 4.8 on average). A tokenizer
    with a token per digit, as chat models' are, needs at most 22 (21 characters and EOS)."""
    # An answer over 200 characters is refused before parsing and safe_eval bounds every
    # value: a reward takes microseconds, so these bounds only matter if that code breaks.
    reward_seconds = 1.0
    reward_memory_mb = 64

    def check(self, row: Row) -> str | None:
        numbers = parse_numbers(row[NUMBERS_COLUMN])
        if numbers is None:
            return (f"{NUMBERS_COLUMN} {quoted(row[NUMBERS_COLUMN])} is not {MIN_NUMBERS} to "
                    f"{MAX_NUMBERS} whole numbers from 1 to {MAX_NUMBER} separated by spaces")
        target = parse_target(row[TARGET_COLUMN])
        if target is None:
            return (f"{TARGET_COLUMN} {quoted(row[TARGET_COLUMN])} is not a whole number "
                    f"from 1 to {MAX_TARGET}")
        reward, why = judge(row[SOLUTION_COLUMN], numbers, target)
        if reward < 1.0:
            return (f"{SOLUTION_COLUMN} {quoted(row[SOLUTION_COLUMN])} is no answer for "
                    f"numbers {' '.join(map(str, numbers))}, target {target}: {why}")
        return None

    def prompt(self, row: Row) -> str:
        return f"numbers {' '.join(row[NUMBERS_COLUMN].split())}, target {row[TARGET_COLUMN]}"

    def reward(self, completion: str, row: Row) -> float:
        try:
            numbers = parse_numbers(row[NUMBERS_COLUMN])
            target = parse_target(row[TARGET_COLUMN])
            if numbers is None or target is None:
                return 0.0
            return score(completion, numbers, target)
        except Exception:
            return 0.0

    def reference(self, row: Row) -> str:
        return row[SOLUTION_COLUMN]

    def stratum(self, row: Row) -> int:
        """Operators in the row's solution (capped at 8). The generator makes every shipped
        solution as short as any answer can be, so this is the fewest operations that reach
        the target: 1, 2 or 3."""
        return min(operators(row[SOLUTION_COLUMN]), MAX_STRATUM)

    def data(self) -> tuple[Path, Path]:
        return PACKAGE_DATA / TRAIN_FILE, PACKAGE_DATA / EVAL_FILE

