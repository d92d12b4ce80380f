"""Volunteer-written text made safe to show an operator.

Object keys, heartbeat fields and error details that quote them come from strangers. Printed
raw, a control sequence in one of them can move the cursor, rewrite the operator's clipboard
(OSC 52), plant a hyperlink (OSC 8) or retitle the window; rich would also read `[...]` in
them as markup (`[/]` crashes a table). So every such string goes through `printable` before
a log line or the terminal, and through `markup_safe` before rich. HTML escaping is the
dashboard's own job (html.escape); it uses `printable` too, for the control characters.
"""

from __future__ import annotations

import unicodedata

MAX_SHOWN = 200
"""Characters of one volunteer string shown; the rest becomes `…(+N)`."""


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(value: object, limit: int = MAX_SHOWN) -> str:
    """`value` as text with every control, format (bidi overrides, zero-width) and unassigned
    or surrogate character written as a Python-style escape, cut to `limit` characters."""
    text = value if isinstance(value, str) else str(value)
    extra = len(text) - limit
    text = text[:limit] if extra > 0 else text
    out = "".join(_escape(ch) if unicodedata.category(ch)[0] == "C" else ch for ch in text)
    return out + (f"…(+{extra})" if extra > 0 else "")


def markup_safe(value: object, limit: int = MAX_SHOWN) -> str:
    """`printable`, with rich markup escaped, for strings that go into rich renderables."""
    from rich.markup import escape

    return escape(printable(value, limit))
