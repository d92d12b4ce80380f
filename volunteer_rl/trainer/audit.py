"""The replay audit's policy: which shards are audited, against which weights, and how much of
the trainer's time it may take. The replay itself (is each token the one its committed draw
selects?) is model.replay; trainer.step.audit_groups applies it to scored groups.

- **Rate per volunteer (BOINC's adaptive replication).** A volunteer with fewer than
  `full_shards` accepted shards since its last rejected one, new or just caught, has every
  shard audited; after n such shards the rate is full_shards / n, never below `floor`. Any
  rejected shard sets n back to 0.
- **Every group of an audited shard is replayed.** A shard is accepted or rejected whole, so
  one injected group among many is caught whenever its shard is audited.
- **Budget.** Audits may take `share` of the trainer's wall time (a token bucket holding at
  most BURST_SECONDS of audit time). A shard drawn for an audit while the bucket is empty is
  not taken yet, nor even fetched: it is listed again at a later poll and audited then, or
  falls out of the window. Shards are never taken unaudited because the trainer was busy, so a flood of new
  ids slows their own intake, not the audit.
- **Weights of the whole window.** The trainer keeps the published weights of every version
  inside the window (WindowWeights) and audits a stale group against its own version.

Which shards are drawn comes from the operating system's random generator and is decided once
per shard, so a liar can neither predict it nor get a second draw by being deferred.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

BURST_SECONDS = 10.0
"""Audit time that may be spent at once after an idle spell (the token bucket's size)."""
MAX_DECISIONS = 100_000
"""Remembered audit decisions (keys of the window); cleared when full, as a bound."""


def audit_rate(clean_shards: int, full_shards: int, floor: float) -> float:
    """The share of a volunteer's shards to audit, given its accepted shards since its last
    rejected one: 1 below `full_shards`, then full_shards / n, never below `floor`."""
    if clean_shards < full_shards:
        return 1.0
    return max(floor, full_shards / clean_shards)


class Budget:
    """A token bucket of audit seconds, filled at `share` seconds per second of wall time."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic):
        self.share, self.clock = share, clock
        self.tokens = min(BURST_SECONDS, share * BURST_SECONDS)
        self.last = clock()

    def allows(self) -> bool:
        now = self.clock()
        self.tokens = min(BURST_SECONDS, self.tokens + (now - self.last) * self.share)
        self.last = now
        return self.tokens > 0

    def spend(self, seconds: float) -> None:
        self.tokens -= seconds


@dataclass
class WindowWeights:
    """The published weights of the versions inside the window, as volunteers load them
    (bf16 publishing: the bf16 tensors; fp32: fp32 copies). Costs, per version kept, the
    weights' size in the published dtype: max_staleness + 1 copies in all."""

    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    loaded: tuple[int, torch.nn.Module] | None = None
    """The version whose weights a model holds now, and that model."""

    def add(self, version: int, model: torch.nn.Module, dtype: torch.dtype) -> None:
        with torch.no_grad():
            self.versions[version] = {n: p.detach().to(dtype).clone()
                                      for n, p in model.named_parameters()}

    def drop_below(self, low: int) -> None:
        for v in [v for v in self.versions if v < low]:
            del self.versions[v]
        if self.loaded is not None and self.loaded[0] < low:
            self.loaded = None

    def load_into(self, version: int, model: torch.nn.Module) -> bool:
        """Copy `version`'s weights into `model` (upcast exactly); False if not held."""
        if self.loaded is not None and self.loaded[0] == version and self.loaded[1] is model:
            return True
        weights = self.versions.get(version)
        if weights is None:
            return False
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n])
        self.loaded = (version, model)
        return True


class Unavailable(Exception):
    """The weights of a shard's version are not held (the trainer resumed since): the shard
    cannot be audited now."""


Replay = Callable[[int, list], "tuple[str, str] | None"]
"""(version, groups) -> (reason code, detail) of the first group that fails the replay, or
None; raises Unavailable when that version's weights are not held."""


@dataclass
class AuditStats:
    audited: int = 0
    skipped: int = 0
    """Shards taken without an audit (their volunteer's rate said so)."""
    deferred: int = 0
    """Shards left for a later poll: drawn for an audit while the budget was spent, or their
    version's weights were not held."""
    seconds: float = 0.0
    by_volunteer: dict[str, int] = field(default_factory=dict)
    """Shards audited per volunteer."""


class Auditor:
    """Decides, per shard, whether to audit; runs the replay within the budget."""

    def __init__(self, replay: Replay, budget: Budget, full_shards: int, floor: float,
                 rng: random.Random | None = None):
        self.replay, self.budget = replay, budget
        self.full_shards, self.floor = full_shards, floor
        # Not seeded: a liar must not be able to compute which of its shards are audited.
        self.rng = rng or random.SystemRandom()
        self.decisions: dict[str, bool] = {}

    def due(self, key: str, clean_shards: int) -> bool:
        """Is shard `key` to be audited? Drawn once per key."""
        if key not in self.decisions:
            if len(self.decisions) >= MAX_DECISIONS:
                self.decisions.clear()
            rate = audit_rate(clean_shards, self.full_shards, self.floor)
            self.decisions[key] = rate >= 1.0 or self.rng.random() < rate
        return self.decisions[key]

    def run(self, key: str, volunteer: str, clean_shards: int, version: int, groups: list,
            stats: AuditStats) -> tuple[str, tuple[str, str] | None]:
        """(outcome, problem): outcome is 'skipped', 'deferred', 'passed' or 'failed', and
        problem the replay's (reason code, detail) of a failure."""
        if not self.due(key, clean_shards):
            stats.skipped += 1
            return "skipped", None
        if not self.budget.allows():
            stats.deferred += 1
            return "deferred", None
        started = time.perf_counter()
        try:
            problem = self.replay(version, groups)
        except Unavailable:
            stats.deferred += 1
            return "deferred", None
        finally:
            spent = time.perf_counter() - started
            self.budget.spend(spent)
            stats.seconds += spent
        stats.audited += 1
        stats.by_volunteer[volunteer] = stats.by_volunteer.get(volunteer, 0) + 1
        self.decisions.pop(key, None)
        return ("failed", problem) if problem else ("passed", None)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the decisions of keys that left the window."""
        self.decisions = {k: d for k, d in self.decisions.items() if keep(k)}
