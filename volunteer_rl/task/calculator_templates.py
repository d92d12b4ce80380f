"""The calculator generator's phrasing templates: the start clauses and the steps, each a small
function that writes a piece of English and builds the matching expression.

A problem is a chain: a *start* clause that makes a first value from a few numbers ("add 12,
3, and 37"), then zero or more *steps* that each apply one operation to the running value
("multiply that sum by 14", "then subtract 15"). The target expression is the AST of the
chain, and the exact value is tracked alongside as a Fraction so we know when divisions are
exact. task.calculator_generate picks templates and joins their text into a sentence. The
templates are registered in the order they are written here, and the generator's draws
depend on that order: reordering them changes every generated file.
"""

from __future__ import annotations

import ast
import operator
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from volunteer_rl.task.calculator import OP_CLASSES

MAX_TARGET_MAGNITUDE = 1e9  # reject problems whose value (or any step) exceeds this
EXACT_DIVISION_PROB = 0.9  # how often a division is forced to come out even


@dataclass
class Value:
    """The running value of a chain: its AST, exact value, and a noun for 'that sum'."""

    node: ast.expr
    value: Fraction
    noun: str  # "sum", "difference", "product", "quotient", "result" or "number"


@dataclass(frozen=True)
class Template:
    """One phrasing: its label, the operator counts it may add, its weight in the draw, and
    the function that writes it."""

    name: str
    ops: tuple[int, ...]  # how many binary operators this clause may add
    weight: float
    fn: Callable


STARTS: list[Template] = []
"""The start clauses, in the order they are written below."""
STEPS: list[Template] = []
"""The steps, in the order they are written below."""


def _start(name: str, ops: tuple[int, ...], weight: float = 1.0):
    """Register a start template: fn(rng, n_ops) -> (text, is_noun_phrase, Value) or None."""
    def register(fn):
        STARTS.append(Template(name, ops, weight, fn))
        return fn
    return register


def _step(name: str, ops: int = 1, weight: float = 1.0):
    """Register a step template: fn(rng, current) -> (text, is_bare, Value) or None."""
    def register(fn):
        STEPS.append(Template(name, (ops,), weight, fn))
        return fn
    return register


def _num(rng: random.Random) -> int:
    """A number for a prompt: mostly 1-99, occasionally three digits."""
    return rng.randint(1, 99) if rng.random() < 0.95 else rng.randint(100, 999)


def _apply(symbol: str, left: Value, right: Value, noun: str) -> Value:
    """Combine two values with a binary operator (may raise ZeroDivisionError)."""
    exact = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
             "//": operator.floordiv, "%": operator.mod, "**": operator.pow}[symbol]
    node = ast.BinOp(left=left.node, op=OP_CLASSES[symbol](), right=right.node)
    value = exact(left.value, right.value)
    return Value(node, Fraction(value), noun)


def _lit(n: int) -> Value:
    return Value(ast.Constant(n), Fraction(n), "number")


def _fold(symbol: str, numbers: list[int], noun: str) -> Value:
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


def _ref(rng: random.Random, current: Value) -> str:
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

def _then(symbol: str, current: Value, n: int, noun: str) -> Value:
    """current <op> n, e.g. 'multiply that by 14'."""
    return _apply(symbol, current, _lit(n), noun)


def _into(symbol: str, n: int, current: Value, noun: str) -> Value:
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
