"""The fleet as the trainer sees it: shards and groups accepted and rejected per volunteer, and
when a volunteer that mostly sends garbage goes on the denylist (protocol.fleet owns that
object)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.fleet import MAX_DENYLIST_BYTES, parse_denylist, update_denylist
from volunteer_rl.storage.base import NotFound, Storage


@dataclass
class Counts:
    accepted: int = 0
    rejected: int = 0
    clean: int = 0
    """Groups in the shards accepted since its last rejected one: what its audit rate is made
    from (trainer.audit)."""
    audited: int = 0
    """Shards whose every group was replayed (passed or not)."""
    numbered: int = 0
    """Group numbers it used in versions that left the window (highest seq + 1 each)..."""
    missing: int = 0
    """...and how many of them the trainer never received: withheld, or uploaded too late."""
    accepted_groups: int = 0
    rejected_groups: int = 0
    """Groups in its accepted and rejected shards (a shard rejected before its groups were
    counted, junk or unparseable, counts as one)."""


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
    received: Counter = field(default_factory=Counter)
    """Groups in the shards accepted from each volunteer since take_received last ran (the
    trainer's balance counts them per step)."""

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

    def note(self, volunteer: str, accepted: bool, groups: int = 1) -> bool:
        """Count one shard of `groups` groups; True if this volunteer now crosses the denial
        threshold: `deny_after` rejected shards, and a share of `deny_rate` of its shards or of
        its groups rejected (in groups, so many small honest shards do not hide a few big
        lying ones)."""
        c = self.counts.setdefault(volunteer, Counts())
        groups = max(1, groups)
        if accepted:
            c.accepted += 1
            c.accepted_groups += groups
            c.clean += groups
            self.received[volunteer] += groups
        else:
            c.rejected += 1
            c.rejected_groups += groups
            c.clean = 0
        shards = c.rejected / (c.accepted + c.rejected)
        in_groups = c.rejected_groups / max(1, c.accepted_groups + c.rejected_groups)
        return (self.deny_after > 0 and not self.is_denied(volunteer)
                and c.rejected >= self.deny_after and max(shards, in_groups) >= self.deny_rate)

    def revoke(self, volunteer: str, groups: int) -> None:
        """Take back the acceptance of a shard of `groups` groups that is now rejected (its
        re-audit failed): it is counted once, as rejected."""
        c = self.counts.setdefault(volunteer, Counts())
        c.accepted = max(0, c.accepted - 1)
        c.accepted_groups = max(0, c.accepted_groups - max(1, groups))

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

    def take_received(self) -> Counter:
        """Groups accepted per volunteer since the last call."""
        received, self.received = self.received, Counter()
        return received

    def count_audit(self, volunteer: str) -> None:
        self.counts.setdefault(volunteer, Counts()).audited += 1

    def count_numbers(self, volunteer: str, used: int, missing: int) -> None:
        c = self.counts.setdefault(volunteer, Counts())
        c.numbered += used
        c.missing += missing

    def clean(self, volunteer: str) -> int:
        c = self.counts.get(volunteer)
        return c.clean if c else 0

    def to_json(self) -> dict:
        return {v: [c.accepted, c.rejected, c.clean, c.audited, c.numbered, c.missing,
                    c.accepted_groups, c.rejected_groups] for v, c in self.counts.items()}

    def load_counts(self, raw: dict) -> None:
        """Counts saved by to_json (states saved before audits hold the first two only, before
        group counts the first six; their `clean`, then counted in shards, is read as groups:
        less trust, never more)."""
        self.counts = {v: Counts(*(int(x) for x in row[:8])) for v, row in raw.items()}
