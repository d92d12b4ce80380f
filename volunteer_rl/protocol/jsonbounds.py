"""JSON from bytes someone else wrote, parsed with bounds.

Python's json recurses once per nesting level: a megabyte of "[" raises RecursionError (not
ValueError) from inside the parser, and a reader that catches ValueError dies on it. So the
nesting is measured on the raw bytes first, by a linear scan, and the parser runs only on
what is shallow enough; numbers are parsed with bounds (integers of at most MAX_INT_DIGITS
digits, no NaN/Infinity, floats finite). Shards (shards.py) use the scan with their own number
rules and reason codes; manifests, the denylist and the volunteer's own trust files use
`loads`, each after a size cap of its own.
"""

from __future__ import annotations

import json
import math
import re

MAX_INT_DIGITS = 100
"""Far more than any count, size or version holds (a signed manifest may carry a version past
2**64, and readers follow it), far fewer than where int() of a string gets costly."""

_BRACKETS = re.compile(rb'"(?:[^"\\]|\\.)*"|".*|[\[\]{}]', re.DOTALL)
"""A string, a string left open (it runs to the end of the data), or a bracket."""


class JsonError(ValueError):
    """Bytes that are not JSON within the bounds: one line saying what is off."""


def too_deep(data: bytes, limit: int) -> bool:
    """Whether `data` nests arrays and objects deeper than `limit`, counting brackets outside
    strings, so the parser never recurses beyond that on input that passes.

    A string left open swallows the rest of the data: the parser fails on it before it gets
    to anything after it, and the scan stays linear. (Retrying from every later quote made
    a line of escaped quotes quadratic: 26 KB of them cost almost two seconds.)"""
    depth = 0
    for m in _BRACKETS.finditer(data):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JsonError(f"an integer of {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)  # never raises for what the JSON grammar calls a number
    if not math.isfinite(value):
        raise JsonError(f"{text[:20]} is not a finite number")
    return value


def _no_constant(text: str):
    raise JsonError(f"{text} is not JSON")


def loads(data: bytes, max_depth: int) -> object:
    """The JSON value of UTF-8 `data`, nested at most `max_depth` deep. Raises JsonError (one
    line) on anything off, and nothing else: an unforeseen error inside the parser too."""
    if too_deep(data, max_depth):
        raise JsonError(f"nested deeper than {max_depth}")
    try:
        # decoded here, strictly: json.loads on bytes would also take UTF-16/32 or a BOM,
        # where the byte-level nesting scan above does not see the brackets the parser sees
        return json.loads(bytes(data).decode("utf-8"), parse_int=_bounded_int,
                          parse_float=_finite_float, parse_constant=_no_constant)
    except JsonError:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise JsonError(str(exc)[:120]) from None
