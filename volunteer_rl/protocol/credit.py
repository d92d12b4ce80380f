"""Credit: what each volunteer's work became, as the trainer counts it, not as volunteers say.

A volunteer is credited for its groups the trainer trained, and for nothing else: the ledger's
`trained` records (protocol.ledger) are the only input. So a shard that was rejected, stale,
a duplicate or left untrained when its volunteer was denied earns nothing, and credit follows
the committed versions exactly as the ledger does.

`credit/vN.json` is the running total as of version N: the total of version N-1's object plus
the `trained` records of `ledger/vN.jsonl`. The trainer writes it once, right after that ledger
object and before the manifest that commits N (data before the index), so the object of a
committed version counts exactly the committed versions up to it; one left by a crash before
its commit is debris, as its ledger object is. A resumed trainer carries on from the object of
the version it resumes (never from a newer one), and `vrl status`, the dashboard and `vrl
volunteers credit` read the object of the version manifest.json names: one bounded read.

Per volunteer: `groups` and `tokens` (completion tokens of those groups, the ledger's
`tokens`) trained, and `first_seen` / `last_seen`, the trainer's clock at the optimizer step
that first / last trained a group of theirs (the ledger record's `time`; for a record from a
build that did not write it, the time the version was written, or null when rebuilt from such
records alone). A volunteer's share of the run is its groups over `total_groups`.

Bounded: ids come from volunteers, and a fleet that makes up a fresh id for every group could
grow the object without end. At most MAX_ROWS volunteers are named; the groups and tokens of
ids first trained after that go to `others` (so the totals stay exact), and the object is read
with MAX_CREDIT_BYTES. Schema in docs/PROTOCOL.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from volunteer_rl.errors import VrlError
from volunteer_rl.protocol import jsonbounds, layout
from volunteer_rl.protocol.ledger import read_ledger
from volunteer_rl.storage.base import NotFound, Storage

CREDIT_SCHEMA = 1
MAX_ROWS = 50_000
"""Volunteers named in one credit object; later newcomers are counted in `others`. A row is
about 100 bytes, so the object stays under ~5 MB."""
MAX_CREDIT_BYTES = 16 << 20
"""A credit object is read whole: at most this much."""
CREDIT_NESTING = 4  # {"volunteers": {id: {field: number}}}


class CreditError(VrlError):
    """A credit object that is not one this trainer writes."""


@dataclass
class Row:
    """One volunteer's credit (or `others`')."""

    groups: int = 0
    tokens: int = 0
    first_seen: float | None = None
    last_seen: float | None = None

    def add(self, groups: int, tokens: int, at: float | None) -> None:
        self.groups += groups
        self.tokens += tokens
        if at is not None:
            self.first_seen = at if self.first_seen is None else min(self.first_seen, at)
            self.last_seen = at if self.last_seen is None else max(self.last_seen, at)

    def to_json(self) -> dict:
        return {"groups": self.groups, "tokens": self.tokens, "first_seen": self.first_seen,
                "last_seen": self.last_seen}


@dataclass
class Credit:
    """The credit object of `version` (-1: none yet, before v0)."""

    version: int = -1
    volunteers: dict[str, Row] = field(default_factory=dict)
    others: Row = field(default_factory=Row)
    """Groups and tokens of ids beyond MAX_ROWS."""
    updated_at: float | None = None

    @property
    def total_groups(self) -> int:
        return sum(r.groups for r in self.volunteers.values()) + self.others.groups

    @property
    def total_tokens(self) -> int:
        return sum(r.tokens for r in self.volunteers.values()) + self.others.tokens

    def share(self, volunteer: str) -> float:
        """`volunteer`'s share of the groups trained (0 when none were)."""
        total = self.total_groups
        row = self.volunteers.get(volunteer)
        return row.groups / total if total and row else 0.0

    def fold(self, records: list[dict], version: int, now: float | None) -> "Credit":
        """A new Credit: this one plus the `trained` records of `version`'s ledger. `now`:
        the time for records that carry none (None: leave the times as they are)."""
        out = replace(self, version=version, volunteers={k: replace(r) for k, r in
                                                          self.volunteers.items()},
                      others=replace(self.others), updated_at=now)
        for rec in records:
            if rec.get("outcome") != "trained":
                continue
            author = layout.rollout_author(rec["key"])
            if author is None:  # the trainer trains shards only: a bug, never a volunteer's doing
                raise CreditError(f"trained record of no volunteer's key: {rec['key'][:100]!r}")
            volunteer = author[1]
            row = out.volunteers.get(volunteer)
            if row is None:  # a newcomer: named while there is room, else one of `others`
                row = out.others if len(out.volunteers) >= MAX_ROWS else \
                    out.volunteers.setdefault(volunteer, Row())
            at = rec.get("time", now)
            row.add(len(rec["lines"]), int(rec.get("tokens", 0)), at)
        return out

    def to_json(self) -> dict:
        return {"schema_version": CREDIT_SCHEMA, "version": self.version,
                "updated_at": self.updated_at, "total_groups": self.total_groups,
                "total_tokens": self.total_tokens, "others": self.others.to_json(),
                "volunteers": {k: self.volunteers[k].to_json() for k in sorted(self.volunteers)}}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()


def _count(raw: object, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise CreditError(f"{what}: not a count")
    return raw


def _time(raw: object, what: str) -> float | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise CreditError(f"{what}: not a time")
    return float(raw)


def _row(raw: object, what: str) -> Row:
    if not isinstance(raw, dict):
        raise CreditError(f"{what}: not an object")
    return Row(_count(raw.get("groups"), f"{what}.groups"), _count(raw.get("tokens"), f"{what}.tokens"),
               _time(raw.get("first_seen"), f"{what}.first_seen"),
               _time(raw.get("last_seen"), f"{what}.last_seen"))


def parse_credit(data: bytes) -> Credit:
    """A Credit from the bytes of a credit object; CreditError (one line) for anything else:
    another schema, a field of the wrong type, an id no volunteer may have, too many rows,
    totals that do not add up."""
    where = "credit object"
    try:
        raw = jsonbounds.loads(data, CREDIT_NESTING)
    except ValueError as exc:
        raise CreditError(f"{where}: not JSON ({exc})") from None
    if not isinstance(raw, dict) or raw.get("schema_version") != CREDIT_SCHEMA:
        raise CreditError(f"{where}: not a schema-{CREDIT_SCHEMA} credit object")
    rows = raw.get("volunteers")
    if not isinstance(rows, dict) or len(rows) > MAX_ROWS:
        raise CreditError(f"{where}: volunteers must map at most {MAX_ROWS:,} ids to rows")
    volunteers = {}
    for vid, row in rows.items():
        if not layout.is_safe_name(vid):
            raise CreditError(f"{where}: {vid[:80]!r} is not a volunteer id")
        volunteers[vid] = _row(row, "a volunteer's row")
    credit = Credit(_count(raw.get("version"), f"{where}: version"), volunteers,
                    _row(raw.get("others"), "others"), _time(raw.get("updated_at"), "updated_at"))
    if (raw.get("total_groups"), raw.get("total_tokens")) != (credit.total_groups, credit.total_tokens):
        raise CreditError(f"{where}: its totals are not the sums of its rows")
    return credit


def read_credit(storage: Storage, version: int) -> Credit | None:
    """The credit object of `version` (None if there is none: a run from before credit, or a
    version not published yet). Raises CreditError or StorageError."""
    try:
        data = storage.read(layout.credit_key(version), max_bytes=MAX_CREDIT_BYTES)
    except NotFound:
        return None
    credit = parse_credit(data)
    if credit.version != version:
        raise CreditError(f"{layout.credit_key(version)}: says it is v{credit.version}'s")
    return credit


def write_credit(storage: Storage, credit: Credit) -> None:
    """Write `credit` as its version's object, once (before that version's manifest)."""
    storage.create(layout.credit_key(credit.version), credit.encode())


def rebuild_credit(storage: Storage, versions: list[int]) -> Credit:
    """Credit summed from the ledger objects of the committed `versions` (a run from before
    credit objects, or one whose object is unreadable): one read of each."""
    credit = Credit()
    for v in sorted(versions):
        credit = credit.fold(read_ledger(storage, v), v, None)
    return credit
