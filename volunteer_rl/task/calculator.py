"""The calculator task's arithmetic: the safe evaluator and the canonical spelling of
expressions.

A problem's target is a Python expression such as ``(12 + 3 + 37) * 14 - 15`` and a
completion is judged by the value of the expression it wrote, so model output of any kind is
evaluated here: safe_eval walks the AST of numeric literals and + - * / // % ** only, and can
be fed arbitrary text without hanging, allocating huge ints or running code. render and
canonicalize give the one spelling the dataset's targets use. Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import ast
import math
import operator
import warnings
from typing import Callable

# -----------------------------------------------------------------------------
# Safe evaluator

MAX_EXPRESSION_CHARS = 200  # longer text is not even parsed: reward 0
MAX_AST_NODES = 512  # 200 chars of "1+1+..." is ~300 nodes (operators count), a backstop
# recursion guard: "1+1+...+1" in 200 chars nests ~100 deep; "---...1" is refused
MAX_AST_DEPTH = 100
MAX_EXPONENT = 64  # |exponent| bound for **
MAX_MAGNITUDE = 1e15  # any literal or intermediate value beyond this -> None
# floats are exact for integers up to 2**53 ~ 9e15, so 1e15 keeps int and float
# arithmetic agreeing, and products of two allowed values stay cheap (< 1e30).

_BINOPS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARYOPS: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Reject(Exception):
    """Internal: the expression is not allowed or its value is out of bounds."""


def _parse(text: str) -> ast.Expression | None:
    """Parse text as a single expression; None on any parse problem or if too big."""
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION_CHARS:
        return None  # checked before parsing so a 10 MB string costs nothing
    try:
        with warnings.catch_warnings():
            # garbage like "1 is 1" or "'\d'" makes the parser emit SyntaxWarning
            warnings.simplefilter("ignore")
            tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    # count nodes with an early exit rather than materialising the whole walk
    for count, _ in enumerate(ast.walk(tree), start=1):
        if count > MAX_AST_NODES:
            return None
    return tree


def _check(value):
    """Return value if it is a finite real number within MAX_MAGNITUDE, else reject."""
    if type(value) not in (int, float):  # complex (e.g. (-8) ** 0.5), bool, ...
        raise _Reject
    if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise _Reject
    return value


def _check_pow(base, exponent) -> None:
    """Reject a ** b before computing it if the result could be huge."""
    if abs(exponent) > MAX_EXPONENT:
        raise _Reject
    # |base| ** exponent > MAX_MAGNITUDE  <=>  exponent * log10|base| > 15.
    # The small slack leaves the exact boundary to _check on the computed value.
    if abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE) + 1:
            raise _Reject


def _eval_node(node: ast.AST, depth: int):
    """Evaluate one allowed AST node recursively; raise _Reject on anything else."""
    if depth > MAX_AST_DEPTH:
        raise _Reject
    if isinstance(node, ast.Constant):
        return _check(node.value)  # type() check inside excludes bool/complex/str
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
        return _check(_UNARYOPS[type(node.op)](_eval_node(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left = _eval_node(node.left, depth + 1)
        right = _eval_node(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_pow(left, right)
        return _check(_BINOPS[type(node.op)](left, right))
    raise _Reject  # names, calls, attributes, strings, comparisons, lambdas, ...


def safe_eval(text: str) -> float | None:
    """Evaluate an arithmetic expression safely; None if not allowed/invalid/too large/error.

    Only numeric literals, + - * / // % ** and unary + - are allowed. Length,
    AST size/depth, exponents and every intermediate magnitude are bounded, so
    hostile input such as ``9**9**9`` returns None at once. Never raises.
    """
    tree = _parse(text)
    if tree is None:
        return None
    try:
        return float(_eval_node(tree.body, 0))
    except (_Reject, ZeroDivisionError, ArithmeticError, ValueError, TypeError,
            RecursionError, MemoryError):
        return None


# -----------------------------------------------------------------------------
# Canonical rendering of expressions
# Used both by the generator (targets are built as AST trees) and by
# canonicalize(). Parentheses appear only where Python's precedence would
# otherwise change the left-to-right meaning of the tree.

_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/",
            ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
OP_CLASSES = {symbol: cls for cls, symbol in _SYMBOLS.items()}
_PREC_ADD, _PREC_MUL, _PREC_UNARY, _PREC_POW, _PREC_ATOM = 1, 2, 3, 4, 5


def _precedence(node: ast.AST) -> int:
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, (ast.Add, ast.Sub)):
            return _PREC_ADD
        return _PREC_POW if isinstance(node.op, ast.Pow) else _PREC_MUL
    if isinstance(node, ast.UnaryOp):
        return _PREC_UNARY
    return _PREC_ATOM


def render(node: ast.AST) -> str:
    """Render an arithmetic AST canonically: `(12 + 3 + 37) * 14 - 15` style."""
    if isinstance(node, ast.Constant):
        return str(node.value) if isinstance(node.value, int) else repr(node.value)
    if isinstance(node, ast.UnaryOp):
        sign = "-" if isinstance(node.op, ast.USub) else "+"
        inner = render(node.operand)
        return sign + (f"({inner})" if _precedence(node.operand) < _PREC_UNARY else inner)
    prec = _precedence(node)
    left, right = render(node.left), render(node.right)
    if prec == _PREC_POW:
        # ** is right-associative: a ** b ** c means a ** (b ** c)
        left_parens = _precedence(node.left) <= prec
        right_parens = _precedence(node.right) < prec
    else:
        # left-associative: a - b - c means (a - b) - c, so a same-precedence
        # right operand needs parentheses, a same-precedence left one does not
        left_parens = _precedence(node.left) < prec
        right_parens = _precedence(node.right) <= prec
    left = f"({left})" if left_parens else left
    right = f"({right})" if right_parens else right
    return f"{left} {_SYMBOLS[type(node.op)]} {right}"


def canonicalize(text: str) -> str | None:
    """The canonical spelling of an allowed expression, e.g. '((1+2))*3' -> '(1 + 2) * 3';
    None if not safe_eval-able."""
    if safe_eval(text) is None:
        return None
    return render(_parse(text).body)
