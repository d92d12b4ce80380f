"""The credit leaderboard: each volunteer's groups and tokens trained and its share of the run,
from the credit object of the version manifest.json names (protocol.credit), as `vrl status`
(the top LEADERS rows), the dashboard (the same rows, from status's document) and `vrl
volunteers credit` (every row: a table, or CSV with --csv) show it.

`rows` ranks the volunteers by groups trained, then tokens, then id; `leaderboard` is the part
of status's document; `credit_table` its rich table; `credit_csv` the CSV (COLUMNS). Ids in a
credit object were checked as volunteer ids when it was read (protocol.credit.parse_credit),
and are still escaped wherever they are shown.
"""

from __future__ import annotations

import csv
import io
import time

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.credit import Credit, CreditError, read_credit
from volunteer_rl.protocol.printable import markup_safe, printable
from volunteer_rl.storage.base import Storage, StorageError

LEADERS = 10
"""Rows of the leaderboard in `vrl status` and on the dashboard."""
COLUMNS = ("volunteer", "groups_trained", "tokens_trained", "share", "first_seen", "last_seen")
"""The CSV's columns, and the keys of a leaderboard row."""
OTHERS = "(others)"
"""The row of the ids beyond protocol.credit.MAX_ROWS (never a volunteer id: no parentheses)."""


def rows(credit: Credit) -> list[dict]:
    """Every credited volunteer as a row of COLUMNS, most groups first (then most tokens, then
    id), and OTHERS last when it holds any groups. `share`: of the groups trained."""
    total = credit.total_groups
    out = [{"volunteer": vid, "groups_trained": r.groups, "tokens_trained": r.tokens,
            "share": r.groups / total if total else 0.0, "first_seen": r.first_seen,
            "last_seen": r.last_seen}
           for vid, r in sorted(credit.volunteers.items(),
                                key=lambda kv: (-kv[1].groups, -kv[1].tokens, kv[0]))]
    o = credit.others
    if o.groups or o.tokens:
        out.append({"volunteer": OTHERS, "groups_trained": o.groups, "tokens_trained": o.tokens,
                    "share": o.groups / total if total else 0.0, "first_seen": o.first_seen,
                    "last_seen": o.last_seen})
    return out


def leaderboard(credit: Credit | None, version: int, error: str | None = None,
                top: int = LEADERS) -> dict:
    """status's `credit`: the totals as of `version` and the `top` rows (`leaders`).
    `available` False: no credit object for that version (a run from before credit), or
    `error` says why it could not be read."""
    c = credit or Credit(version)
    return {"version": version, "available": credit is not None, "error": error,
            "updated_at": c.updated_at, "total_groups": c.total_groups,
            "total_tokens": c.total_tokens, "volunteers": len(c.volunteers),
            "others_groups": c.others.groups, "leaders": rows(c)[:top]}


def read_leaderboard(storage: Storage, version: int, top: int = LEADERS) -> dict:
    """`leaderboard` of `version`'s credit object; an unreadable one is an `error`, never an
    exception (status shows the rest)."""
    try:
        return leaderboard(read_credit(storage, version), version, top=top)
    except (CreditError, StorageError) as exc:
        return leaderboard(None, version, printable(exc, 200), top)


def load_credit(storage: Storage, version: int) -> Credit:
    """The credit object of `version` (the one manifest.json names), for `vrl volunteers
    credit`. Raises CreditError (none for that version: a run from before credit) or
    StorageError."""
    credit = read_credit(storage, version)
    if credit is None:
        raise CreditError(f"{layout.credit_key(version)}: not in the bucket (a trainer from "
                          "before credit objects published that version)")
    return credit


def iso(t: float | None) -> str:
    """`2026-05-01T14:03:27Z` (UTC, whole seconds); "" when unknown."""
    return "" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def credit_csv(credit: Credit) -> str:
    """Every row, COLUMNS first: share as a fraction of 1 (6 decimals), times in UTC."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(COLUMNS)
    for r in rows(credit):
        w.writerow([printable(r["volunteer"], 64), r["groups_trained"], r["tokens_trained"],
                    f"{r['share']:.6f}", iso(r["first_seen"]), iso(r["last_seen"])])
    return out.getvalue()


def summary_line(doc: dict) -> str:
    """`credit as of v12: 1,024 groups (210,332 tokens) trained from 3 volunteers` (plain)."""
    if doc["error"]:
        return f"credit of v{doc['version']}: unreadable ({doc['error']})"
    if not doc["available"]:
        return f"credit: none for v{doc['version']} (a trainer from before credit objects)"
    n = doc["volunteers"]
    others = f", {doc['others_groups']:,} of them from ids past the named ones" \
        if doc["others_groups"] else ""
    return (f"credit as of v{doc['version']}: {doc['total_groups']:,} groups "
            f"({doc['total_tokens']:,} tokens) trained from {n:,} volunteer{'s' * (n != 1)}"
            f"{others}")


def _ago(t: float | None, now: float) -> str:
    if t is None:
        return "-"
    s = max(0.0, now - t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


HEAD = ("#", "volunteer", "groups", "tokens", "share", "first trained", "last trained")


def credit_table(leaders: list[dict], now: float):
    """A rich table of leaderboard rows (their ids escaped)."""
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for h in HEAD:
        table.add_column(h, justify="left" if h == "volunteer" else "right",
                         overflow="fold" if h == "volunteer" else "ellipsis")
    for i, r in enumerate(leaders, 1):
        table.add_row(str(i), markup_safe(r["volunteer"], 64), f"{r['groups_trained']:,}",
                      f"{r['tokens_trained']:,}", f"{r['share']:.1%}",
                      _ago(r["first_seen"], now), _ago(r["last_seen"], now))
    return table
