"""The replay audit's policy: which shards are audited, against which weights, and how much of
the trainer's time it may take. The replay itself (is each token the one its committed draw
selects?) is model.replay; trainer.step.audit_groups applies it to scored groups.

- **Rate per volunteer, counted in groups (BOINC's adaptive replication).** A volunteer with
  fewer than `full_groups` groups accepted since its last rejected shard, new or just caught,
  has every shard audited; after n such groups each group is drawn at a rate full_groups / n,
  never below `floor`, and a shard is audited if any of its groups is drawn: a shard of g
  groups with probability 1 - (1 - rate)^g. So a big shard is as likely to be audited as the
  same groups sent in small shards, and trust earned with small shards buys no cover for big
  ones. Any rejected shard sets n back to 0. With --verify every (the default) the draws past
  `full_groups` are off (`Auditor.trusted`): every group trained is replayed before its step.
  What no step replays, a shard's zero-variance and repeated groups, is still drawn, each
  group on its own, at that rate but never below `cover_floor` (`Auditor.spot`,
  --audit-cover-floor): each counts its number as received, so one made up would cover a
  number its volunteer kept back.
- **Every group of an audited shard is replayed, up to the first that fails.** A shard is
  accepted or rejected whole, so one injected group among many is caught whenever its shard is
  audited. For a volunteer with no clean groups (new, or just caught) the replay goes in
  growing chunks (1, 4, 16, ... groups) and stops at the first failure, so its lying shards
  cost the audit budget little; a trusted volunteer's shard is replayed in one call (three
  calls for a 16-group shard cost the demo's trainer 12 s more audit time in 300 s).
- **A contested group is replayed on its own.** A group whose content is also under another
  volunteer's id (trainer.claims `Claims.contest`) is replayed whatever its shard's draw: the noise
  is keyed by the volunteer, so a copy fails. A shard not due by its draw has only those groups
  replayed, as honest volunteers often send identical groups (a confident policy, one prompt).
- **Budget, reserved before a byte is fetched.** Audits may take `share` of the trainer's wall
  time (a token bucket holding at most BURST_SECONDS of audit time). A shard known to be due
  for an audit when it is listed is fetched only if the bucket has room, and then the
  estimated cost of its audit is taken from the bucket at once (`admit`), so a poll admits
  no more audits than it can run; a shard found due only once parsed (its group count decides)
  and finding no room is not taken, and is remembered as due with its size, so it is reserved
  for before its next fetch. Shards are never taken unaudited because the trainer was busy,
  so a flood of new ids slows their own intake, not the audit.
- **Weights of the whole window.** The trainer keeps the published weights of every version
  inside the window (WindowWeights) and audits a stale group against its own version.

Which shards are drawn comes from the operating system's random generator: one uniform per
shard, drawn the first time the shard is seen, so a liar can neither predict it nor get a
second draw by being deferred; a shard once found due stays due.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

BURST_SECONDS = 10.0
"""Audit time that may be spent at once after an idle spell (the token bucket's size)."""
FIRST_CHUNK = 1
"""Groups of a shard replayed in the first call of an audit; each later call replays
CHUNK_GROWTH times more, until a group fails or all passed."""
CHUNK_GROWTH = 4
MAX_DECISIONS = 100_000
"""Audit draws remembered before the oldest of those not found due (and holding no reservation)
are dropped, MAX_DECISIONS / EVICT_SHARE of them at a time. A draw found due is never dropped: it
stays due until its key leaves the window (`forget`), so the due draws are bounded by the window's
keys the intake drew for, not by this; a dropped draw not due is drawn anew if its key comes
back, which only gives its volunteer another chance of an audit."""
EVICT_SHARE = 4
"""While the table is at or over MAX_DECISIONS (due draws can keep it there) it is looked over
once every MAX_DECISIONS / EVICT_SHARE new keys, so each look over it is paid for by that many
draws."""


def audit_rate(clean_groups: int, full_groups: int, floor: float, trusted: bool = True) -> float:
    """The rate at which a volunteer's groups are drawn, given its groups accepted since its
    last rejected shard: 1 below `full_groups`, then full_groups / n, never below `floor`;
    0 from there with `trusted` False (see Auditor)."""
    if clean_groups < full_groups:
        return 1.0
    return max(floor, full_groups / clean_groups) if trusted else 0.0


def shard_chance(rate: float, groups: int) -> float:
    """The chance that a shard of `groups` groups is audited: that any of its groups is drawn."""
    return 1.0 - (1.0 - rate) ** max(1, groups)


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
    (bf16 publishing: the bf16 tensors; fp32: fp32 copies). Only the trained parameters are
    kept: all of them with full fine-tuning, max_staleness + 1 copies of the weights in the
    published dtype; with --lora-rank the adapters alone, the frozen base being the same in
    every version (and the same tensors in the model they are loaded into)."""

    versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    loaded: tuple[int, torch.nn.Module] | None = None
    """The version whose weights a model holds now, and that model."""

    def add(self, version: int, model: torch.nn.Module, dtype: torch.dtype) -> None:
        with torch.no_grad():
            self.versions[version] = {n: p.detach().to(dtype).clone()
                                      for n, p in model.named_parameters() if p.requires_grad}

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
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in weights.items():
                params[n].copy_(t)
        self.loaded = (version, model)
        return True


class Unavailable(Exception):
    """The weights of a shard's version are not held (the trainer resumed since): the shard
    cannot be audited now."""


Replay = Callable[[int, list], "tuple[str, str] | None"]
"""(version, groups) -> (reason code, detail) of the first group that fails the replay, or
None; raises Unavailable when that version's weights are not held. Any other exception it
raises is a fault of the trainer's own (out of memory, a torch error), never the volunteer's."""


@dataclass
class AuditStats:
    audited: int = 0
    skipped: int = 0
    """Shards taken without an audit (their volunteer's rate said so)."""
    deferred: int = 0
    """Shards left for a later poll: due for an audit while the budget was spent, or their
    version's weights were not held."""
    seconds: float = 0.0
    by_volunteer: dict[str, int] = field(default_factory=dict)
    """Shards audited per volunteer."""
    verified: int = 0
    """Groups replayed before a step (trainer.verify): those of the batch no audit replayed."""
    verify_failed: int = 0
    """...of which failed (each dropped from the step, its shard rejected)."""
    verify_seconds: float = 0.0


@dataclass
class Draw:
    """What the auditor knows of one shard."""

    u: float
    """Its uniform, drawn once: the shard is due when u < shard_chance(rate, groups)."""
    due: bool = False
    """Found due once: stays due, whatever its volunteer's rate becomes."""
    groups: int = 0
    """Its group count, once parsed (0: not yet)."""
    reserved: float = 0.0
    """Audit seconds taken from the budget when it was admitted, not yet settled."""
    seed: float | None = None
    """The seed of its groups' own draws (Auditor.spot), drawn the first time they are made."""


class Auditor:
    """Decides, per shard, whether to audit; reserves the budget; runs the replay."""

    def __init__(self, replay: Replay, budget: Budget, full_groups: int, floor: float,
                 rng: random.Random | None = None, trusted: bool = True, cover_floor: float = 0.0):
        self.replay, self.budget = replay, budget
        self.full_groups, self.floor = full_groups, floor
        self.cover_floor = cover_floor
        """With `trusted` off, the least rate at which groups no step replays are drawn
        (--audit-cover-floor; `spot`)."""
        self.trusted = trusted
        """Whether a volunteer past `full_groups` clean groups is still drawn for audits. With
        --verify every it is not: every group it gets trained is replayed before its step
        anyway (trainer.verify), in the step's batch, one call per version for the whole batch
        instead of one per shard. Audits then serve the volunteers with no record
        (new, or just caught), whose shards are replayed at intake in growing chunks so a
        flood of junk is rejected there, cheaply, not in front of a step."""
        # Not seeded: a liar must not be able to compute which of its shards are audited.
        self.rng = rng or random.SystemRandom()
        self.draws: dict[str, Draw] = {}
        self.per_group: float | None = None
        """Seconds an audit takes per group replayed, as last measured (None: not yet)."""

    def _draw(self, key: str) -> Draw:
        d = self.draws.get(key)
        if d is None:
            size, share = len(self.draws), max(1, MAX_DECISIONS // EVICT_SHARE)
            if size >= MAX_DECISIONS and (size - MAX_DECISIONS) % share == 0:
                # Oldest first (a dict keeps the order keys were drawn in); never a due draw.
                spare = (k for k, x in self.draws.items() if not (x.due or x.reserved))
                for k in list(itertools.islice(spare, size - MAX_DECISIONS + share)):
                    del self.draws[k]
            d = self.draws[key] = Draw(self.rng.random())
        return d

    def surely_due(self, key: str, clean_groups: int) -> bool:
        """Is shard `key` due for an audit, as far as is known before it is read? A shard not
        yet parsed counts as one group: the least its chance can be."""
        d = self._draw(key)
        rate = audit_rate(clean_groups, self.full_groups, self.floor, self.trusted)
        d.due = d.due or d.u < shard_chance(rate, d.groups)
        return d.due

    def spot(self, key: str, clean_groups: int, lines: list[int]) -> set[int]:
        """With --verify every (`trusted` off): which of shard `key`'s groups at `lines`, groups
        no step will replay (zero-variance and repeated ones), are drawn for a replay. They
        are never trained, so the verification never sees them, yet each counts its number as
        received: a made-up group of equal rewards covers a number its volunteer disliked.
        Each group is drawn on its own, at its volunteer's rate but never below `cover_floor`,
        from a seed drawn once per shard, so a deferred shard gets the same draws again.
        Empty with sampled audits (`due` draws the whole shard at their rate)."""
        if self.trusted or not lines:
            return set()
        rate = max(self.cover_floor, audit_rate(clean_groups, self.full_groups, self.floor))
        d = self._draw(key)
        if d.seed is None:
            d.seed = self.rng.random()
        return {line for line in lines if random.Random(f"{d.seed}:{line}").random() < rate}

    def due(self, key: str, clean_groups: int, groups: int) -> bool:
        """Is shard `key`, parsed and holding `groups` groups, due for an audit?"""
        self._draw(key).groups = groups
        return self.surely_due(key, clean_groups)

    def admit(self, key: str, max_groups: int, replaying: int = 0) -> bool:
        """Take the estimated cost of `key`'s audit from the budget, if the budget has room;
        False if not (the shard is not to be fetched, or not taken, this poll). The audit is
        costed at `replaying` groups if given (a contest replays only some), else at the
        shard's groups, or at `max_groups` while it is unparsed; before any audit was timed,
        one audit at a time."""
        d = self._draw(key)
        if d.reserved:
            return True
        if not self.budget.allows():
            return False
        groups = replaying or d.groups or max_groups
        d.reserved = BURST_SECONDS if self.per_group is None else self.per_group * groups
        self.budget.spend(d.reserved)
        return True

    def settle(self) -> None:
        """Give back what was reserved for shards not audited (end of a poll)."""
        for d in self.draws.values():
            if d.reserved:
                self.budget.spend(-d.reserved)
                d.reserved = 0.0

    def run(self, key: str, volunteer: str, version: int, groups: list,
            stats: AuditStats, chunked: bool = True) -> tuple[str, tuple[str, str] | None]:
        """Replay `groups` of `key` now: (outcome, problem), outcome 'passed', 'failed' or
        'deferred' (its version's weights are not held), problem the replay's (reason code,
        detail) of a failure. `chunked`: in growing chunks, stopping at the first failure
        (for a volunteer with no clean groups: new, or just caught); else in one call, as
        batching makes an honest shard's replay cheapest. Its time is charged to the budget,
        net of what was reserved; an exception of the replay's own (a fault of the trainer)
        propagates."""
        d = self._draw(key)
        started = self.budget.clock()
        try:
            problem, replayed = (self._replay_until_failure(version, groups) if chunked
                                 else (self.replay(version, groups) if groups else None, len(groups)))
        except Unavailable:
            stats.deferred += 1
            return "deferred", None
        finally:
            spent = self.budget.clock() - started
            self.budget.spend(spent - d.reserved)
            d.reserved = 0.0
            stats.seconds += spent
        if replayed:
            self.per_group = spent / replayed
        stats.audited += 1
        stats.by_volunteer[volunteer] = stats.by_volunteer.get(volunteer, 0) + 1
        return ("failed", problem) if problem else ("passed", None)

    def _replay_until_failure(self, version: int, groups: list) -> tuple[tuple[str, str] | None, int]:
        """Replay `groups` in chunks of FIRST_CHUNK, then CHUNK_GROWTH times more each call,
        stopping at the first chunk with a failure: a shard is rejected whole, so a lying
        shard costs the replay up to its first lying group, not of all its groups (a new id's
        shards of 256 made-up groups took 6 s each on the demo model and, at the audit share,
        a minute of everyone's audit budget). A shard that passes costs the same forward
        passes in about log4(groups) calls. Returns (the first problem or None, groups replayed)."""
        start, size = 0, FIRST_CHUNK
        while start < len(groups):
            chunk = groups[start:start + size]
            problem = self.replay(version, chunk)
            if problem:
                return problem, start + len(chunk)
            start, size = start + len(chunk), size * CHUNK_GROWTH
        return None, len(groups)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the draws of keys that left the window."""
        self.draws = {k: d for k, d in self.draws.items() if keep(k)}
