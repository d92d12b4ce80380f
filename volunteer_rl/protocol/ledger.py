"""The ledger: what the trainer did with every group of every shard it read.

Each group of an accepted shard gets exactly one outcome: `trained` (in an optimizer step),
`zero_variance` (every completion scored the same: no gradient), `stale` (fell out of the
window while waiting) or `duplicate` (the same content was already taken, from this or any
other key or volunteer). A rejected shard gets one `rejected` record with its reason.

A `trained` record also carries the completion tokens of its groups and the time of the
step (what protocol.credit counts); a ledger written before those fields is read the same,
its records counting no tokens.

Records go to the bucket as `ledger/vN.jsonl` together with version N, written before the
manifest that commits N (restic's order: data, then the index). So after a crash the ledger
objects of committed versions say exactly which groups reached committed weights; the rest
is read again. Only versions inside the staleness window matter for what may still be
taken, so a trainer rebuilds its ledger from those few objects, not from the whole history.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from volunteer_rl.protocol import layout
from volunteer_rl.storage.base import NotFound, Storage

OUTCOMES = ("trained", "zero_variance", "stale", "duplicate", "rejected")
MAX_LEDGER_BYTES = 64 << 20  # one version's records; far above what a step can produce
MAX_RECORD_KEY = 160
"""Keys longer than this (only junk: a shard key is at most ~100 characters) are recorded as
their first 100 characters, `#` and 16 hex of their sha256, so no name a volunteer picks can
make a record large; the same form is used to look them up."""


def record_key(key: str) -> str:
    """The form `key` takes in the ledger (itself unless longer than MAX_RECORD_KEY)."""
    if len(key) <= MAX_RECORD_KEY:
        return key
    return f"{key[:100]}#{hashlib.sha256(key.encode(errors='surrogatepass')).hexdigest()[:16]}"


def group_digest(prompt_id: int, policy_version: int, token_ids: list[list[int]]) -> str:
    """Content hash of a group: what was asked, under which policy, and what came back.

    Logprobs, text, reward and volunteer id are left out on purpose: a replay with those
    edited is still the same sample."""
    body = json.dumps([prompt_id, policy_version, token_ids], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


@dataclass
class Ledger:
    """In memory: the shards of the window and the digests of the groups taken from them."""

    groups: dict[str, int] = field(default_factory=dict)
    """shard key -> number of groups it holds (known once read)."""
    done: dict[str, set[int]] = field(default_factory=dict)
    """shard key -> indices of its groups that have an outcome."""
    rejected: dict[str, str] = field(default_factory=dict)
    """shard key -> reason code."""
    digests: dict[str, tuple[int, str]] = field(default_factory=dict)
    """digest of every group taken -> its policy version (for pruning) and the volunteer whose
    shard it was taken from (a copy under another id is told apart by that)."""
    pending: list[dict] = field(default_factory=list)
    """Records not yet written to the bucket."""

    def finished(self, key: str) -> bool:
        """True if nothing is left to take from `key`."""
        key = record_key(key)
        if key in self.rejected:
            return True
        return key in self.groups and len(self.done.get(key, ())) >= self.groups[key]

    def is_done(self, key: str, line: int) -> bool:
        return line in self.done.get(key, ())  # shard keys only: never shortened

    def set_size(self, key: str, groups: int) -> None:
        """Note how many groups shard `key` holds (known once it is read)."""
        self.groups[key] = groups

    def owner(self, digest: str) -> str | None:
        """The volunteer a group with this content was taken from, or None."""
        taken = self.digests.get(digest)
        return taken[1] if taken else None

    def claim(self, digest: str, version: int, volunteer: str) -> bool:
        """Take a group's content; False if the same content was taken before."""
        if digest in self.digests:
            return False
        self.digests[digest] = (version, volunteer)
        return True

    def release(self, digests: list[str]) -> None:
        """Give back claims of groups that were never trained (their shard was rejected after
        intake), so an honest shard with the same content can still be taken."""
        for d in digests:
            self.digests.pop(d, None)

    def record(self, key: str, outcome: str, lines: list[int], groups: int,
               digests: list[str] = (), reason: str = "", step: int | None = None,
               tokens: int | None = None, at: float | None = None) -> None:
        """Give `lines` of `key` their outcome and queue the record for the bucket. A
        `trained` record also says, in `tokens`, the completion tokens of those lines and, in
        `time`, when the step trained them (`at`, the trainer's clock): what credit counts
        (protocol.credit)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        rec = {"key": record_key(key), "outcome": outcome, "lines": sorted(lines), "groups": groups}
        if digests:
            rec["digests"] = list(digests)
        if reason:
            rec["reason"] = reason
        if step is not None:
            rec["step"] = step
        if tokens is not None:
            rec["tokens"] = tokens
        if at is not None:
            rec["time"] = round(at, 3)
        self.apply(rec)
        self.pending.append(rec)

    def apply(self, rec: dict) -> None:
        """Update the in-memory state with one record (also used when rebuilding)."""
        key = rec["key"]
        if rec["outcome"] == "rejected":
            self.rejected[key] = rec.get("reason", "")
            return
        self.groups[key] = int(rec["groups"])
        self.done.setdefault(key, set()).update(rec["lines"])
        author = layout.rollout_author(key)
        version, volunteer = (author[0], author[1]) if author else (-1, "")
        for d in rec.get("digests", ()):
            self.digests.setdefault(d, (version, volunteer))

    def prune(self, low: int) -> None:
        """Forget shards and digests of versions below the window: they can never be taken."""
        for table in (self.groups, self.done, self.rejected):
            for key in [k for k in table if _key_version(k) < low]:
                del table[key]
        self.digests = {d: t for d, t in self.digests.items() if t[0] >= low}

    def flush(self, storage: Storage, version: int) -> None:
        """Write the pending records as `ledger/v<version>.jsonl` (before the manifest)."""
        body = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n"
                       for r in self.pending)
        storage.create(layout.ledger_key(version), body.encode())
        self.pending = []


def _key_version(key: str) -> int:
    """The version folder of a rollouts key (shard or junk), -1 for anything else."""
    parsed = layout.rollout_author(key)
    return parsed[0] if parsed else -1


def read_ledger(storage: Storage, version: int) -> list[dict]:
    """The records of `ledger/v<version>.jsonl` ([] if that version wrote none)."""
    try:
        data = storage.read(layout.ledger_key(version), max_bytes=MAX_LEDGER_BYTES)
    except NotFound:
        return []
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def rebuild(storage: Storage, versions: list[int]) -> Ledger:
    """The ledger as the committed `versions` left it (the trainer passes those of its window)."""
    ledger = Ledger()
    for v in sorted(versions):
        for rec in read_ledger(storage, v):
            ledger.apply(rec)
    return ledger
