"""The fleet as the trainer sees it: shards accepted and rejected per volunteer, and the
denylist that stops reading volunteers who mostly send garbage.

`denylist.json` lives in the bucket so a person can read and edit it with the CLI
(`vrl volunteers list / deny / allow`); the trainer and the CLI both change it with a
compare-and-swap, so neither overwrites the other's edit. A volunteer stays denied until a
person lifts it; lifting also resets its counts, so it is not denied again for the past.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

from . import layout
from .storage import NotFound, PreconditionFailed, Storage, StorageError

MAX_DENYLIST_BYTES = 4 << 20
CAS_ATTEMPTS = 5


class DenylistError(Exception):
    """denylist.json is unreadable or could not be updated."""


def parse_denylist(data: bytes) -> dict[str, dict]:
    """{volunteer id: entry} from denylist.json bytes; DenylistError if malformed."""
    try:
        raw = json.loads(data)
        entries = raw["volunteers"]
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            raise TypeError("volunteers must map ids to objects")
    except (ValueError, KeyError, TypeError) as exc:
        raise DenylistError(f"{layout.DENYLIST}: malformed ({exc})") from None
    return entries


def encode_denylist(entries: dict[str, dict]) -> bytes:
    return json.dumps({"schema_version": 1, "volunteers": entries}, indent=1,
                      sort_keys=True).encode()


def read_denylist(storage: Storage) -> tuple[dict[str, dict], str | None]:
    """(entries, etag); ({}, None) when there is no denylist yet."""
    try:
        data, etag = storage.read_if_changed(layout.DENYLIST, None, MAX_DENYLIST_BYTES)
    except NotFound:
        return {}, None
    except StorageError as exc:
        raise DenylistError(str(exc)) from None
    return parse_denylist(data), etag


def update_denylist(storage: Storage, change: Callable[[dict[str, dict]], bool]) -> dict[str, dict]:
    """Apply `change` (edits the entries in place, returns True if it changed anything) with a
    compare-and-swap, retrying when another writer got there first. Returns the entries."""
    for _ in range(CAS_ATTEMPTS):
        entries, etag = read_denylist(storage)
        if not change(entries):
            return entries
        try:
            storage.write_if_match(layout.DENYLIST, encode_denylist(entries), etag)
            return entries
        except PreconditionFailed:
            continue
    raise DenylistError(f"{layout.DENYLIST}: changed by others {CAS_ATTEMPTS} times in a row")


@dataclass
class Counts:
    accepted: int = 0
    rejected: int = 0


@dataclass
class Fleet:
    """Per-volunteer shard counts and the denylist as last read."""

    deny_after: int = 5
    """Rejected shards before a volunteer can be denied (0: never deny automatically)."""
    deny_rate: float = 0.5
    """...and the share of its shards that were rejected."""
    counts: dict[str, Counts] = field(default_factory=dict)
    denied: dict[str, dict] = field(default_factory=dict)
    etag: str | None = None

    def is_denied(self, volunteer: str) -> bool:
        return volunteer in self.denied

    def refresh(self, storage: Storage) -> None:
        """Re-read denylist.json if it changed; ids a person lifted start from zero again."""
        try:
            data, etag = storage.read_if_changed(layout.DENYLIST, self.etag, MAX_DENYLIST_BYTES)
        except NotFound:
            data, etag = b'{"volunteers": {}}', None
        if data is None:
            return
        entries = parse_denylist(data)
        for lifted in set(self.denied) - set(entries):
            self.counts.pop(lifted, None)
        self.denied, self.etag = entries, etag

    def note(self, volunteer: str, accepted: bool) -> bool:
        """Count one shard; True if this volunteer now crosses the denial threshold."""
        c = self.counts.setdefault(volunteer, Counts())
        if accepted:
            c.accepted += 1
        else:
            c.rejected += 1
        total = c.accepted + c.rejected
        return (self.deny_after > 0 and not self.is_denied(volunteer)
                and c.rejected >= self.deny_after and c.rejected / total >= self.deny_rate)

    def deny(self, storage: Storage, volunteer: str, reason: str) -> None:
        """Put `volunteer` on the denylist in the bucket (and here)."""
        c = self.counts.get(volunteer, Counts())
        entry = {"since": time.time(), "by": "trainer", "reason": reason,
                 "accepted": c.accepted, "rejected": c.rejected}

        def add(entries: dict[str, dict]) -> bool:
            if volunteer in entries:
                return False
            entries[volunteer] = entry
            return True

        self.denied = update_denylist(storage, add)
        self.etag = None  # our own write: read it again next refresh

    def to_json(self) -> dict:
        return {v: [c.accepted, c.rejected] for v, c in self.counts.items()}

    def load_counts(self, raw: dict) -> None:
        self.counts = {v: Counts(int(a), int(r)) for v, (a, r) in raw.items()}
