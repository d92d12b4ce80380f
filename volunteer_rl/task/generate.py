"""The calculator task's problem generator: a seeded procedural generator of English
arithmetic sentences with many phrasings, and the train/eval split written to data/. A data
tool: nothing imports it at run time.

Regenerate the shipped data with:  python -m volunteer_rl.task.generate --out data
(`--task countdown` makes the countdown task's files instead: task.countdown_generate)
"""

from __future__ import annotations

import argparse
import ast
import math
import operator
import random
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator

from volunteer_rl.task import countdown_generate
from volunteer_rl.task.calculator import OP_CLASSES, render, safe_eval
from volunteer_rl.task.dataset import Problem, file_sha256, load_csv, write_csv

# -----------------------------------------------------------------------------
# Procedural problem generator
#
# A problem is a chain: a *start* clause that makes a first value from a few
# numbers ("add 12, 3, and 37"), then zero or more *steps* that each apply one
# operation to the running value ("multiply that sum by 14", "then subtract
# 15"). Each clause is a small template function; the target expression is the
# AST of the chain rendered canonically, and the exact value is tracked
# alongside as a Fraction so we know when divisions are exact.

MAX_TARGET_MAGNITUDE = 1e9  # reject problems whose value (or any step) exceeds this
EXACT_DIVISION_PROB = 0.9  # how often a division is forced to come out even


@dataclass
class _Value:
    """The running value of a chain: its AST, exact value, and a noun for 'that sum'."""

    node: ast.expr
    value: Fraction
    noun: str  # "sum", "difference", "product", "quotient", "result" or "number"


@dataclass(frozen=True)
class _Template:
    name: str
    ops: tuple[int, ...]  # how many binary operators this clause may add
    weight: float
    fn: Callable


_STARTS: list[_Template] = []
_STEPS: list[_Template] = []


def _start(name: str, ops: tuple[int, ...], weight: float = 1.0):
    """Register a start template: fn(rng, n_ops) -> (text, is_noun_phrase, _Value) or None."""
    def register(fn):
        _STARTS.append(_Template(name, ops, weight, fn))
        return fn
    return register


def _step(name: str, ops: int = 1, weight: float = 1.0):
    """Register a step template: fn(rng, current) -> (text, is_bare, _Value) or None."""
    def register(fn):
        _STEPS.append(_Template(name, (ops,), weight, fn))
        return fn
    return register


def _num(rng: random.Random) -> int:
    """A number for a prompt: mostly 1-99, occasionally three digits."""
    return rng.randint(1, 99) if rng.random() < 0.95 else rng.randint(100, 999)


def _apply(symbol: str, left: _Value, right: _Value, noun: str) -> _Value:
    """Combine two values with a binary operator (may raise ZeroDivisionError)."""
    exact = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
             "//": operator.floordiv, "%": operator.mod, "**": operator.pow}[symbol]
    node = ast.BinOp(left=left.node, op=OP_CLASSES[symbol](), right=right.node)
    value = exact(left.value, right.value)
    return _Value(node, Fraction(value), noun)


def _lit(n: int) -> _Value:
    return _Value(ast.Constant(n), Fraction(n), "number")


def _fold(symbol: str, numbers: list[int], noun: str) -> _Value:
    """Left-nested chain: [12, 3, 37] with '+' -> ((12 + 3) + 37)."""
    acc = _lit(numbers[0])
    for n in numbers[1:]:
        acc = _apply(symbol, acc, _lit(n), noun)
    return acc


def _listing(rng: random.Random, numbers: list[int]) -> str:
    """'12 and 3' or '12, 3, and 37' (Oxford comma optional)."""
    words = [str(n) for n in numbers]
    if len(words) == 2:
        return f"{words[0]} and {words[1]}"
    comma = "," if rng.random() < 0.5 else ""
    return ", ".join(words[:-1]) + f"{comma} and {words[-1]}"


def _ref(rng: random.Random, current: _Value) -> str:
    """How a step refers to the running value: 'that', 'it', 'that sum', ..."""
    return rng.choice(["that", "it", "the result", "this", f"that {current.noun}",
                       f"the {current.noun}"])


def _divisor(rng: random.Random, value: Fraction) -> int | None:
    """A divisor for value: one that divides evenly most of the time, None to skip."""
    if value.denominator == 1:
        v = abs(value.numerator)
        evens = [d for d in range(2, 100) if v % d == 0]  # v == 0: everything
        if evens and rng.random() < EXACT_DIVISION_PROB:
            return rng.choice(evens)
    # no even divisor (or the dice say so): allow an inexact division rarely
    return _num(rng) if rng.random() < 0.15 else None


# --- start clauses -----------------------------------------------------------
# Each returns (text, is_noun_phrase, value). Noun phrases ("the sum of 3 and
# 4", "12 times 5") get wrapped in "compute ..." or "what is ...?" later.

@_start("add_list", ops=(1, 2, 3))
def _start_add(rng, n_ops):
    nums = [_num(rng) for _ in range(n_ops + 1)]
    return f"add {_listing(rng, nums)}", False, _fold("+", nums, "sum")


@_start("sum_of", ops=(1, 2, 3))
def _start_sum_of(rng, n_ops):
    nums = [_num(rng) for _ in range(n_ops + 1)]
    return f"the sum of {_listing(rng, nums)}", True, _fold("+", nums, "sum")


@_start("total_of", ops=(1, 2, 3))
def _start_total_of(rng, n_ops):
    nums = [_num(rng) for _ in range(n_ops + 1)]
    return f"the total of {_listing(rng, nums)}", True, _fold("+", nums, "sum")


@_start("plus", ops=(1, 2))
def _start_plus(rng, n_ops):
    nums = [_num(rng) for _ in range(n_ops + 1)]
    return " plus ".join(map(str, nums)), True, _fold("+", nums, "sum")


@_start("subtract_from", ops=(1,))
def _start_subtract_from(rng, n_ops):
    a, b = _num(rng), _num(rng)
    return f"subtract {b} from {a}", False, _fold("-", [a, b], "difference")


@_start("minus", ops=(1,))
def _start_minus(rng, n_ops):
    a, b = _num(rng), _num(rng)
    return f"{a} minus {b}", True, _fold("-", [a, b], "difference")


@_start("take_away", ops=(1,))
def _start_take_away(rng, n_ops):
    a, b = _num(rng), _num(rng)
    text = rng.choice([f"take {b} away from {a}", f"take away {b} from {a}"])
    return text, False, _fold("-", [a, b], "difference")


@_start("difference", ops=(1,))
def _start_difference(rng, n_ops):
    # "the difference between a and b" is read as a - b; keep a > b so nobody
    # could argue it means |a - b| or b - a
    a, b = sorted(rng.sample(range(1, 100), 2), reverse=True)
    return f"the difference between {a} and {b}", True, _fold("-", [a, b], "difference")


@_start("multiply_list", ops=(1, 2, 3))
def _start_multiply(rng, n_ops):
    nums = [_num(rng) for _ in range(n_ops + 1)]
    if len(nums) == 2:
        text = f"multiply {nums[0]} by {nums[1]}"
    else:
        text = f"multiply {_listing(rng, nums)}"
    return text, False, _fold("*", nums, "product")


@_start("product_of", ops=(1, 2, 3))
def _start_product_of(rng, n_ops):
    nums = [_num(rng) for _ in range(n_ops + 1)]
    return f"the product of {_listing(rng, nums)}", True, _fold("*", nums, "product")


@_start("times", ops=(1, 2))
def _start_times(rng, n_ops):
    nums = [_num(rng) for _ in range(n_ops + 1)]
    return " times ".join(map(str, nums)), True, _fold("*", nums, "product")


def _even_division(rng) -> tuple[int, int]:
    """(a, b) for 'a / b', where b divides a most of the time and a stays small."""
    if rng.random() < EXACT_DIVISION_PROB:
        b = rng.randint(2, 20)
        q_max = 99 // b if rng.random() < 0.7 else 999 // b
        return b * rng.randint(1, max(1, q_max)), b
    return _num(rng), rng.randint(2, 99)


@_start("divide", ops=(1,))
def _start_divide(rng, n_ops):
    a, b = _even_division(rng)
    return f"divide {a} by {b}", False, _fold("/", [a, b], "quotient")


@_start("divided_by", ops=(1,))
def _start_divided_by(rng, n_ops):
    a, b = _even_division(rng)
    return f"{a} divided by {b}", True, _fold("/", [a, b], "quotient")


@_start("quotient_of", ops=(1,))
def _start_quotient_of(rng, n_ops):
    a, b = _even_division(rng)
    return f"the quotient of {a} and {b}", True, _fold("/", [a, b], "quotient")


@_start("start_with", ops=(0,), weight=1.5)
def _start_with(rng, n_ops):
    a = _num(rng)
    verb = rng.choice(["start with", "begin with", "take", "start from", "take the number"])
    return f"{verb} {a}", False, _lit(a)


@_start("power", ops=(1,), weight=0.2)
def _start_power(rng, n_ops):
    a, k = rng.randint(2, 20), rng.choice([2, 2, 3])
    word = {2: "squared", 3: "cubed"}[k]
    text = rng.choice([f"{a} {word}", f"{a} to the power of {k}"])
    return text, True, _fold("**", [a, k], "result")


@_start("modulo", ops=(1,), weight=0.2)
def _start_modulo(rng, n_ops):
    a, b = _num(rng), rng.randint(2, 12)
    text = rng.choice([f"{a} modulo {b}", f"the remainder of {a} divided by {b}"])
    return text, True, _fold("%", [a, b], "remainder")


# --- steps -------------------------------------------------------------------
# Each returns (text, is_bare, value). "Bare" steps ("plus 5", "times 3") read
# as a continuation of the previous clause and are joined with a plain comma.

def _then(symbol: str, current: _Value, n: int, noun: str) -> _Value:
    """current <op> n, e.g. 'multiply that by 14'."""
    return _apply(symbol, current, _lit(n), noun)


def _into(symbol: str, n: int, current: _Value, noun: str) -> _Value:
    """n <op> current, e.g. 'subtract that from 100'."""
    return _apply(symbol, _lit(n), current, noun)


@_step("add")
def _step_add(rng, cur):
    n = _num(rng)
    return f"add {n}", False, _then("+", cur, n, "sum")


@_step("add_to")
def _step_add_to(rng, cur):
    n = _num(rng)
    return f"add {n} to {_ref(rng, cur)}", False, _then("+", cur, n, "sum")


@_step("plus")
def _step_plus(rng, cur):
    n = _num(rng)
    return f"plus {n}", True, _then("+", cur, n, "sum")


@_step("increase")
def _step_increase(rng, cur):
    n = _num(rng)
    return f"increase {_ref(rng, cur)} by {n}", False, _then("+", cur, n, "sum")


@_step("add_pair", ops=2, weight=0.5)
def _step_add_pair(rng, cur):
    a, b = _num(rng), _num(rng)
    return f"add {a} and {b}", False, _then("+", _then("+", cur, a, "sum"), b, "sum")


@_step("subtract")
def _step_subtract(rng, cur):
    n = _num(rng)
    text = rng.choice([f"subtract {n}", f"subtract {n} from {_ref(rng, cur)}"])
    return text, False, _then("-", cur, n, "difference")


@_step("minus")
def _step_minus(rng, cur):
    n = _num(rng)
    return f"minus {n}", True, _then("-", cur, n, "difference")


@_step("take_away")
def _step_take_away(rng, cur):
    n = _num(rng)
    text = rng.choice([f"take away {n}", f"take {n} away from {_ref(rng, cur)}"])
    return text, False, _then("-", cur, n, "difference")


@_step("decrease")
def _step_decrease(rng, cur):
    n = _num(rng)
    verb = rng.choice(["decrease", "reduce"])
    return f"{verb} {_ref(rng, cur)} by {n}", False, _then("-", cur, n, "difference")


@_step("less")
def _step_less(rng, cur):
    n = _num(rng)
    return f"less {n}", True, _then("-", cur, n, "difference")


@_step("subtract_from_number", weight=0.7)
def _step_subtract_from_number(rng, cur):
    n = _num(rng)
    return f"subtract {_ref(rng, cur)} from {n}", False, _into("-", n, cur, "difference")


@_step("multiply_by")
def _step_multiply_by(rng, cur):
    n = _num(rng)
    text = rng.choice([f"multiply {_ref(rng, cur)} by {n}", f"multiply by {n}"])
    return text, False, _then("*", cur, n, "product")


@_step("times")
def _step_times(rng, cur):
    n = _num(rng)
    return f"times {n}", True, _then("*", cur, n, "product")


@_step("double_triple", weight=0.5)
def _step_double_triple(rng, cur):
    n = rng.choice([2, 3])
    verb = {2: "double", 3: "triple"}[n]
    return f"{verb} {_ref(rng, cur)}", False, _then("*", cur, n, "product")


@_step("divide_by")
def _step_divide_by(rng, cur):
    n = _divisor(rng, cur.value)
    if n is None:
        return None
    text = rng.choice([f"divide {_ref(rng, cur)} by {n}", f"divide by {n}"])
    return text, False, _then("/", cur, n, "quotient")


@_step("divided_by")
def _step_divided_by(rng, cur):
    n = _divisor(rng, cur.value)
    if n is None:
        return None
    return f"divided by {n}", True, _then("/", cur, n, "quotient")


@_step("halve", weight=0.4)
def _step_halve(rng, cur):
    v = cur.value
    if not (v.denominator == 1 and v.numerator % 2 == 0) and rng.random() > 0.15:
        return None
    return f"halve {_ref(rng, cur)}", False, _then("/", cur, 2, "quotient")


@_step("divide_number_by", weight=0.4)
def _step_divide_number_by(rng, cur):
    v = cur.value
    if v == 0:
        return None
    if v.denominator == 1 and abs(v) <= 99:
        n = int(abs(v)) * rng.randint(1, 9)  # a multiple, so it comes out even
    elif rng.random() < 0.15:
        n = _num(rng)
    else:
        return None
    return f"divide {n} by {_ref(rng, cur)}", False, _into("/", n, cur, "quotient")


@_step("modulo", weight=0.25)
def _step_modulo(rng, cur):
    if cur.value.denominator != 1:
        return None
    n, ref = rng.randint(2, 12), _ref(rng, cur)
    text = rng.choice([f"take the remainder when {ref} is divided by {n}",
                       f"take {ref} modulo {n}", f"reduce {ref} modulo {n}"])
    return text, False, _then("%", cur, n, "remainder")


@_step("floor_divide", weight=0.25)
def _step_floor_divide(rng, cur):
    if cur.value.denominator != 1:
        return None
    n, ref = rng.randint(2, 12), _ref(rng, cur)
    text = rng.choice([f"floor-divide {ref} by {n}", f"integer-divide {ref} by {n}",
                       f"divide {ref} by {n} and round down"])
    return text, False, _then("//", cur, n, "quotient")


@_step("power", weight=0.25)
def _step_power(rng, cur):
    k = rng.choice([2, 2, 3])
    ref = _ref(rng, cur)
    word = {2: "square", 3: "cube"}[k]
    text = rng.choice([f"{word} {ref}", f"raise {ref} to the power of {k}"])
    return text, False, _then("**", cur, k, "result")


# --- assembling a sentence ---------------------------------------------------

def _pick(rng: random.Random, templates: list[_Template], n_ops: int) -> _Template | None:
    """Weighted choice among templates that can use exactly n_ops operators."""
    fits = [t for t in templates if n_ops in t.ops]
    if not fits:
        return None
    return rng.choices(fits, weights=[t.weight for t in fits])[0]


def _connector(rng: random.Random, i: int, n_steps: int, bare: bool) -> str:
    """The glue before step i: ', ' / ', then ' / ', and finally ' ..."""
    if bare:
        return ", "
    if i == n_steps - 1:
        if n_steps == 1:
            return rng.choice([", then ", ", and then ", ", then ", ", and "])
        return rng.choice([", then ", ", and then ", ", and finally ", ", finally "])
    if i == 0:
        return rng.choice([", ", ", then "])
    return rng.choice([", ", ", then ", "; then "])


def _in_bounds(v: _Value) -> bool:
    return abs(v.value) <= MAX_TARGET_MAGNITUDE


def _make_one(rng: random.Random, n_ops: int) -> tuple[str, str, tuple[str, ...]] | None:
    """One attempt at a problem with n_ops operators: (prompt, expression, template names) or
    None."""
    # the start clause uses some of the operators, the steps use the rest.
    # Only one start template ("start with 7") uses 0 operators, so give it a
    # modest share rather than 1/(n_ops+1) of all problems.
    start_ops = 0 if rng.random() < 0.2 else rng.randint(1, min(3, n_ops))
    start = _pick(rng, _STARTS, start_ops)
    made = start.fn(rng, start_ops)
    if made is None:
        return None
    text, is_noun_phrase, cur = made
    names = [f"start:{start.name}"]
    steps: list[tuple[str, bool]] = []
    remaining = n_ops - start_ops
    for _ in range(50):  # bounded: a step may decline (returns None) and we retry
        if remaining == 0:
            break
        # only "add 4 and 5" uses two operators; keep it an occasional treat
        step_ops = 2 if remaining >= 2 and rng.random() < 0.12 else 1
        step = _pick(rng, _STEPS, step_ops)
        made = step.fn(rng, cur)
        if made is None:
            continue  # e.g. no even divisor for this value: pick another step
        step_text, bare, cur = made
        if not _in_bounds(cur):
            return None
        steps.append((step_text, bare))
        names.append(f"step:{step.name}")
        remaining -= step.ops[0]
    if remaining or not _in_bounds(cur):
        return None

    if is_noun_phrase and not steps and rng.random() < 0.4:
        prompt = f"what is {text}?"
    else:
        if is_noun_phrase:
            verb = rng.choice(["compute", "calculate", "work out", "find", "evaluate"])
            text = f"{verb} {text}"
        for i, (step_text, bare) in enumerate(steps):
            text += _connector(rng, i, len(steps), bare) + step_text
        prompt = text + "."
    if rng.random() < 0.5:
        prompt = prompt[0].upper() + prompt[1:]

    # the rendered expression must evaluate (safely) to the exact tracked value
    expression = render(cur.node)
    value = safe_eval(expression)
    if value is None or not math.isclose(value, float(cur.value), rel_tol=1e-9, abs_tol=1e-9):
        return None
    return prompt, expression, tuple(names)


def _stream(seed: int, ops_range=(1, 4)) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """Endless deterministic stream of (prompt, expression, templates) with unique prompts."""
    lo, hi = ops_range
    if not 1 <= lo <= hi:
        raise ValueError(f"bad ops_range {ops_range!r}: need 1 <= lo <= hi")
    rng = random.Random(seed)
    seen: set[str] = set()
    misses = 0
    while True:
        try:
            made = _make_one(rng, rng.randint(lo, hi))
        except ZeroDivisionError:
            made = None  # e.g. 'subtract 5 from that', then 'divide 7 by it' with it == 0
        if made is None or made[0] in seen:
            misses += 1
            if misses > 100_000:  # only if the template space is exhausted
                raise RuntimeError(f"generator stuck after {len(seen)} unique problems")
            continue
        misses = 0
        seen.add(made[0])
        yield made


def generate_labelled(n: int, seed: int, ops_range=(1, 4)) -> list[tuple[Problem, tuple[str, ...]]]:
    """Like generate_problems, but each problem comes with the template labels that built it.

    Labels look like ('start:add_list', 'step:multiply_by', 'step:subtract').
    """
    stream = _stream(seed, ops_range)
    out = []
    for i in range(n):
        prompt, expression, names = next(stream)
        out.append((Problem(i, prompt, expression), names))
    return out


def generate_problems(n: int, seed: int, ops_range=(1, 4)) -> list[Problem]:
    """n procedurally generated problems with unique prompts; deterministic for a given seed.

    1-4 binary operators chained in English with many phrasings; targets are
    canonical Python expressions whose |value| <= 1e9, divisions mostly exact.
    """
    return [p for p, _ in generate_labelled(n, seed, ops_range)]


def template_names() -> list[str]:
    """All template labels, as used by generate_labelled: 'start:add_list', 'step:times', ..."""
    return [f"start:{t.name}" for t in _STARTS] + [f"step:{t.name}" for t in _STEPS]


# -----------------------------------------------------------------------------
# Train / eval splits


def make_splits(out_dir, n_train=20000, n_eval=500, seed=1234) -> tuple[Path, Path]:
    """Generate train.csv and a held-out eval.csv in out_dir; returns (train_path, eval_path).

    Eval is drawn first (so it is an unbiased sample of the generator), then
    train is drawn from a different seed, skipping any problem whose prompt OR
    expression appears in eval, so eval can't be solved by memorising train.
    """
    out_dir = Path(out_dir)
    eval_problems = generate_problems(n_eval, seed=seed + 1)
    eval_prompts = {p.prompt for p in eval_problems}
    eval_expressions = {p.expression for p in eval_problems}
    train_problems = []
    for prompt, expression, _ in _stream(seed):
        if len(train_problems) == n_train:
            break
        if prompt in eval_prompts or expression in eval_expressions:
            continue
        train_problems.append(Problem(len(train_problems), prompt, expression))
    train_path, eval_path = out_dir / "train.csv", out_dir / "eval.csv"
    write_csv(train_path, train_problems)
    write_csv(eval_path, eval_problems)
    return train_path, eval_path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate a built-in task's CSVs.")
    parser.add_argument("--task", choices=("calculator", "countdown"), default="calculator",
                        help="calculator: train.csv, eval.csv (default); countdown: "
                             "countdown-train.csv, countdown-eval.csv")
    parser.add_argument("--out", default="data", help="output directory (default: data)")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-eval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=None,
                        help=f"default: 1234 (calculator), {countdown_generate.SEED} (countdown)")
    args = parser.parse_args(argv)
    if args.task == "countdown":
        seed = countdown_generate.SEED if args.seed is None else args.seed
        countdown_generate.main(args.out, args.n_train, args.n_eval, seed)
        return
    args.seed = 1234 if args.seed is None else args.seed
    for path in make_splits(args.out, args.n_train, args.n_eval, args.seed):
        rows = load_csv(path)  # round-trip check: everything we ship must load
        print(f"{path}: {len(rows)} rows, sha256 {file_sha256(path)}")


if __name__ == "__main__":
    main()
