"""Fitting `vrl status` to the width it is printed at: whole values, fewer of them.

A terminal of 80 columns, or a pipe (rich prints 80 columns there, or $COLUMNS), gets fewer
table columns, each shown whole, rather than every column cut to an ellipsis; a line of
several parts breaks between parts, never inside one. Pure: strings of rich markup in, the
kept columns or the lines out.
"""

from __future__ import annotations

from typing import Sequence

GAP = 2
"""Columns between two table columns: rich's default padding (one each side), no edges."""


def cells(markup: str) -> int:
    """Terminal cells `markup` takes once rendered (markup tags take none)."""
    from rich.text import Text

    return Text.from_markup(markup).cell_len


def pack(parts: Sequence[str], width: int | None, sep: str = ", ", indent: str = "  ") -> list[str]:
    """`parts` joined by `sep` on as few lines as fit in `width` (None: one line), a new line
    (indented) only between two parts; a part longer than a line gets a line of its own."""
    lines: list[str] = []
    for part in parts:
        if not lines:
            lines.append(part)
        elif width is None or cells(lines[-1] + sep + part) <= width:
            lines[-1] += sep + part
        else:
            lines[-1] += sep.rstrip()
            lines.append(indent + part)
    return lines


def newest_that_fit(head: str, parts: Sequence[str], width: int | None, sep: str) -> str:
    """`head` and the newest (last) of `parts` joined by `sep` that fit in `width` on one
    line; at least the newest one, however long (None: all of them)."""
    kept: list[str] = []
    for part in reversed(parts):
        line = head + sep.join([part, *kept])
        if kept and width is not None and cells(line) > width:
            break
        kept.insert(0, part)
    return head + sep.join(kept)


def fit_columns(widths: Sequence[int], drop_order: Sequence[int], width: int | None,
                gap: int = GAP) -> list[int]:
    """Indices of the columns kept, in order: columns of `widths` (each its widest cell or
    header) are dropped in `drop_order` until the rest fit in `width` (None: all kept).
    Columns not named in `drop_order` are always kept."""
    kept = list(range(len(widths)))
    for i in drop_order:
        if width is None or sum(widths[k] for k in kept) + gap * (len(kept) - 1) <= width:
            break
        kept.remove(i)
    return kept
