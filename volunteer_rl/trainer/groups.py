"""The intake's groups and counts: a checked group with the trainer's own rewards
(ScoredGroup), what a poll did (IngestStats), the versions whose groups may be taken (Window),
and the order in which groups are trained (train_order, split_fresh)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from volunteer_rl.protocol import layout
from volunteer_rl.trainer.audit import AuditStats
from volunteer_rl.trainer.reward_budget import RewardStats


@dataclass
class ScoredGroup:
    """A validated group with the trainer's own rewards."""

    prompt_id: int
    policy_version: int
    volunteer_id: str
    token_ids: list[list[int]]
    behavior_logprobs: list[list[float]]
    rewards: list[float]
    key: str
    seq: int = 0
    """The group's number among its volunteer's groups of its version (keys its draws)."""
    line: int = 0
    """Index of the group in its shard: with `key`, its identity in the ledger."""
    digest: str = ""
    """Content hash (ledger.group_digest)."""
    shard_size: int = 0
    """Groups in its shard (the ledger's completeness count)."""
    arrival: int = 0
    """The poll that took it (Ingest's count): groups of one version are trained in order of
    arrival, then key and line, the same order on every rank (split_fresh)."""
    nonce: str = ""
    """The nonce of its block of numbers under its version (protocol.grants): keys its draws."""
    verified: bool = False
    """Passed a replay with its version's weights (an intake audit, or trainer.verify before
    a step): not replayed again."""


_COUNTS = ("shards", "groups", "zero_variance", "duplicates", "denied", "over_cap", "trainer_errors",
           "held_missing")
"""IngestStats' plain counts."""


@dataclass
class IngestStats:
    shards: int = 0
    groups: int = 0
    zero_variance: int = 0
    duplicates: int = 0
    denied: int = 0
    """Shards of denied volunteers skipped: a whole folder, never listed, counts one per poll."""
    over_cap: int = 0
    """Volunteer folders found over MAX_OBJECTS_PER_VOLUNTEER_VERSION (once per version)."""
    trainer_errors: int = 0
    """Shards left after MAX_TRAINER_FAULTS faults of the trainer's own (not charged)."""
    held_missing: int = 0
    """Fresh groups held back from a batch, their volunteer's missing share over
    --missing-bound (withheld.hold_back), counted each round they wait."""
    audit: AuditStats = field(default_factory=AuditStats)
    reward: RewardStats = field(default_factory=RewardStats)
    rejected: Counter = field(default_factory=Counter)  # reason -> shards
    by_volunteer: dict = field(default_factory=dict)  # volunteer id -> [accepted, rejected] shards

    def to_json(self) -> dict:
        """For the writer rank, which counts every rank's intake in its step metrics.
        (Not dataclasses.asdict: it rebuilds a Counter from (key, count) pairs, which counts
        the pairs.)"""
        return {**{name: getattr(self, name) for name in _COUNTS},
                "rejected": dict(self.rejected), "by_volunteer": self.by_volunteer,
                "audit": dataclasses.asdict(self.audit), "reward": dataclasses.asdict(self.reward)}

    def add_json(self, raw: dict) -> None:
        """Add another rank's counts (to_json of its IngestStats: the trainer's own rank)."""
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + raw[name])
        self.rejected.update(raw["rejected"])
        for volunteer, (accepted, rejected) in raw["by_volunteer"].items():
            counts = self.by_volunteer.setdefault(volunteer, [0, 0])
            counts[0] += accepted
            counts[1] += rejected
        self.reward.add(raw["reward"])
        a, b = self.audit, raw["audit"]
        a.audited, a.skipped, a.deferred = a.audited + b["audited"], a.skipped + b["skipped"], a.deferred + b["deferred"]
        a.seconds += b["seconds"]
        a.verified, a.verify_failed = a.verified + b["verified"], a.verify_failed + b["verify_failed"]
        a.verify_seconds += b["verify_seconds"]
        for volunteer, n in b["by_volunteer"].items():
            a.by_volunteer[volunteer] = a.by_volunteer.get(volunteer, 0) + n


@dataclass
class Window:
    """The versions whose groups may be taken now, as the trainer knows them."""

    version: int
    max_staleness: int
    published: set[int]
    """Committed versions inside the window (a crashed publish leaves gaps)."""
    pools: dict[int, tuple[int, ...]] | None = None
    """Each published version's prompt pool (its manifest's `prompt_pool`): a group's prompt
    must be the one its number draws from it. The trainer always gives them; None only in
    unit tests of the other rules."""

    def versions(self) -> range:
        return layout.window(self.version, self.max_staleness)

    @property
    def low(self) -> int:
        return self.versions().start

    @property
    def leaving(self) -> int:
        """The next publish pushes the versions below this out of the window."""
        return layout.window(self.version + 1, self.max_staleness).start


def split_fresh(groups: list[ScoredGroup], version: int,
                max_staleness: int) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
    """(fresh, stale): fresh groups in training order (train_order), stale ones past the
    window.

    Newest first so the trainer learns from the most on-policy data it has; the rest waits
    for the next step or falls out of the window."""
    fresh = [g for g in groups if layout.in_window(version - g.policy_version, max_staleness)]
    stale = [g for g in groups if not layout.in_window(version - g.policy_version, max_staleness)]
    fresh.sort(key=train_order)
    return fresh, stale


def train_order(g: ScoredGroup) -> tuple:
    """Newest version first; within one, first arrived first, then key and line. The ranks
    sort the groups they took by it and agree on a step's batch as the first of their merged
    lists, so 2 ranks pick the very groups one process would."""
    return (-g.policy_version, g.arrival, g.key, g.line)
