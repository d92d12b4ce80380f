"""The countdown task's row generator and the train/eval split written to data/. A data tool:
nothing imports it at run time.

Regenerate the shipped data with:  python -m volunteer_rl.task.generate --task countdown --out data

A row is made backwards: pick 3 or 4 numbers, pick how many operations its answer takes, build a
random expression over that many numbers + 1 of them in which every step makes a positive
whole number (the TV game's rule, which keeps the references readable), and keep the row only
if its value is a target in range that no answer with fewer operations reaches, counting
answers with fractions or negative steps too (`fewest_operations`). So the reference is as
short as any answer can be and its operator count (the task's stratum) is the row's real
difficulty, not an accident of the reference: a row whose target is one of its numbers, or
the sum of two when the reference used three, is never made.

The recipe (numbers 1-25, targets 10-99, 3 or 4 numbers) was tuned so that the tiny model,
warm-started on the references, is right on some rows but far from all (data/README.md).
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from itertools import combinations
from pathlib import Path
from typing import Iterator

from volunteer_rl.task.calculator import OP_CLASSES, render
from volunteer_rl.task.countdown import (
    EVAL_FILE,
    NUMBERS_COLUMN,
    SOLUTION_COLUMN,
    TARGET_COLUMN,
    TRAIN_FILE,
    CountdownTask,
    score,
)
from volunteer_rl.task.dataset import file_sha256, load_rows, write_rows

# -----------------------------------------------------------------------------
# The recipe

COUNTS = (3, 4)
"""How many numbers a row gives, drawn equally often (more 4-number draws are dropped: 61 % of
the shipped rows give 3)."""
LOW, HIGH = 1, 25
"""The given numbers are drawn uniformly from LOW..HIGH (repeats allowed)."""
TARGET_LOW, TARGET_HIGH = 10, 99
"""The target range: two digits."""
OPERATIONS = {3: (1, 2), 4: (1, 2, 3)}
"""Operations the answer takes (its numbers less one), by how many numbers are given."""
OPERATION_WEIGHTS = {1: 1.0, 2: 1.5, 3: 6.0}
"""How often each operation count is tried. Most 3-operation draws have a shorter answer and
are dropped, so these weights make about 43 % of the rows 1-operation, 40 % 2 and 17 % 3
(with equal weights: 57, 36 and 6 %). The warm-started tiny model is right on 26, 10 and 1.5 %
of them (data/README.md)."""
SEED = 2024


@dataclass(frozen=True)
class CountdownRow:
    numbers: tuple[int, ...]  # ascending
    target: int
    solution: str

    @property
    def key(self) -> tuple[tuple[int, ...], int]:
        """What makes two rows the same problem: the numbers (as a multiset) and the target."""
        return self.numbers, self.target


# -----------------------------------------------------------------------------
# Every value a set of numbers makes


@lru_cache(maxsize=1 << 16)
def values(numbers: tuple[int, ...]) -> frozenset[Fraction]:
    """Every value of an expression that uses each of `numbers` (sorted) exactly once, with
    + - * / and any parentheses; steps may be fractions or negative, as in an answer."""
    if len(numbers) == 1:
        return frozenset((Fraction(numbers[0]),))
    made: set[Fraction] = set()
    first, rest = numbers[0], numbers[1:]
    # each split into two non-empty parts once: the part holding numbers[0] on the left
    for size in range(len(rest)):
        for others in set(combinations(rest, size)):
            left = (first,) + others
            right = list(rest)
            for n in others:
                right.remove(n)
            for a in values(tuple(sorted(left))):
                for b in values(tuple(right)):
                    made.update((a + b, a - b, b - a, a * b))
                    if b:
                        made.add(a / b)
                    if a:
                        made.add(b / a)
    return frozenset(made)


def fewest_operations(numbers: tuple[int, ...], target: int, most: int | None = None) -> int | None:
    """The fewest operations of any answer that makes `target` from `numbers` (each used at
    most once), or None if none does (with `most`: none of at most `most` operations)."""
    numbers = tuple(sorted(numbers))
    limit = len(numbers) - 1 if most is None else min(most, len(numbers) - 1)
    for ops in range(limit + 1):
        for subset in set(combinations(numbers, ops + 1)):
            if target in values(subset):
                return ops
    return None


# -----------------------------------------------------------------------------
# Making rows


def _combine(rng: random.Random, a: tuple[int, ast.expr], b: tuple[int, ast.expr]
             ) -> tuple[int, ast.expr] | None:
    """One random step over two (value, tree) items that makes a positive whole number, the
    larger operand first (so `25 - 7`, `21 / 3`, `25 + 7 * 3`); None if the drawn operator
    cannot (a - a, or a division that does not come out even)."""
    if a[0] < b[0]:
        a, b = b, a
    symbol = rng.choice("+-*/")
    if symbol == "+":
        value = a[0] + b[0]
    elif symbol == "-":
        value = a[0] - b[0]
    elif symbol == "*":
        value = a[0] * b[0]
    else:
        if a[0] % b[0]:
            return None
        value = a[0] // b[0]
    if value <= 0:
        return None
    return value, _join(a[1], symbol, b[1])


def _join(left: ast.expr, symbol: str, right: ast.expr) -> ast.expr:
    """left <symbol> right, re-associated for + and * so that it renders without parentheses
    it does not need: 10 + (10 - 3) is written 10 + 10 - 3, 9 * (3 * 3) is 9 * 3 * 3. Every
    step stays a positive whole number (a + (b - c) = (a + b) - c, a * (b / c) = (a * b) / c)."""
    same = {"+": (ast.Add, ast.Sub), "*": (ast.Mult, ast.Div)}.get(symbol, ())
    if isinstance(right, ast.BinOp) and isinstance(right.op, same):
        return ast.BinOp(left=_join(left, symbol, right.left), op=right.op, right=right.right)
    return ast.BinOp(left=left, op=OP_CLASSES[symbol](), right=right)


def _candidate(rng: random.Random) -> CountdownRow | None:
    """One random row, or None when this draw does not make a valid one."""
    count = rng.choice(COUNTS)
    numbers = [rng.randint(LOW, HIGH) for _ in range(count)]
    choices = OPERATIONS[count]
    ops = rng.choices(choices, weights=[OPERATION_WEIGHTS[o] for o in choices])[0]
    pool = [(n, ast.Constant(n)) for n in rng.sample(numbers, ops + 1)]
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        made = _combine(rng, pool[i], pool[j])
        if made is None:
            return None
        pool = [item for k, item in enumerate(pool) if k not in (i, j)] + [made]
    target, tree = pool[0]
    if not TARGET_LOW <= target <= TARGET_HIGH:
        return None
    if fewest_operations(tuple(numbers), target, most=ops - 1) is not None:
        return None  # a shorter answer exists (or the target is one of the numbers)
    row = CountdownRow(tuple(sorted(numbers)), target, render(tree))
    if score(row.solution, row.numbers, row.target) != 1.0:  # the task's own rule agrees
        raise AssertionError(f"generated a wrong solution: {row}")
    return row


def rows(seed: int) -> Iterator[CountdownRow]:
    """Endless deterministic stream of distinct rows (by numbers and target)."""
    rng = random.Random(seed)
    seen: set[tuple[tuple[int, ...], int]] = set()
    misses = 0
    while True:
        row = _candidate(rng)
        if row is None or row.key in seen:
            misses += 1
            if misses > 100_000:
                raise RuntimeError(f"countdown generator stuck after {len(seen)} rows")
            continue
        misses = 0
        seen.add(row.key)
        yield row


def generate_rows(n: int, seed: int = SEED,
                  exclude: frozenset | set = frozenset()) -> list[CountdownRow]:
    """The first `n` rows of the stream of `seed` whose key is not in `exclude`."""
    out = []
    for row in rows(seed):
        if len(out) == n:
            break
        if row.key not in exclude:
            out.append(row)
    return out


# -----------------------------------------------------------------------------
# Files


def write_countdown_csv(path, rows_: list[CountdownRow]) -> None:
    write_rows(path, (NUMBERS_COLUMN, TARGET_COLUMN, SOLUTION_COLUMN),
               ([" ".join(map(str, r.numbers)), str(r.target), r.solution] for r in rows_))


def make_splits(out_dir, n_train: int = 20000, n_eval: int = 500,
                seed: int = SEED) -> tuple[Path, Path]:
    """Write countdown-train.csv and a held-out countdown-eval.csv in out_dir; returns their
    paths. Eval is drawn first (seed + 1), an unbiased sample of the generator; train (seed)
    skips every row whose numbers and target are an eval row's, so no eval problem is a
    train problem in another order or with another solution."""
    out_dir = Path(out_dir)
    eval_rows = generate_rows(n_eval, seed + 1)
    train_rows = generate_rows(n_train, seed, exclude={r.key for r in eval_rows})
    train_path, eval_path = out_dir / TRAIN_FILE, out_dir / EVAL_FILE
    write_countdown_csv(train_path, train_rows)
    write_countdown_csv(eval_path, eval_rows)
    return train_path, eval_path


def main(out_dir, n_train: int = 20000, n_eval: int = 500, seed: int = SEED) -> None:
    """make_splits, then read every row back through the task's own check (everything we
    ship must load) and print each file's rows and sha256. task.generate's --task countdown."""
    task = CountdownTask()
    for path in make_splits(out_dir, n_train, n_eval, seed):
        rows = load_rows(path, task)  # DatasetError naming the row the task refuses
        print(f"{path}: {len(rows)} rows, sha256 {file_sha256(path)}")
