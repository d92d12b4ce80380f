"""What the intake may spend on rewards: each shard's budget, each volunteer's share of a poll
and of the trainer's time, the poll's cap, and a stop that cuts a poll short.

A task's reward is bounded per completion (task.bounded), but a completion's cost is the
volunteer's to choose: a shard of 2,048 completions each just under the bound would take the
trainer half an hour, and a rank busy that long loses the others (they wait for it in a
collective for at most --rank-timeout). So the intake spends on rewards within three budgets:

- A shard's rewards may take --shard-reward-seconds of CPU together (and max(10x, +5 s) of
  it in wall clock, for a reward that blocks): over it, the shard is rejected
  (`reward_budget`), counted like any rejection. A shard cut short (below) keeps what it
  spent: the next poll resumes it (its computed rewards are cached) with the rest of its
  budget, so no shard is read for more than its budget, however many polls it takes.
- A poll's rewards may take --poll-reward-seconds of wall clock (a quarter of --rank-timeout
  by default); a shard still being scored when they run out is cut (the worker is killed,
  even mid-completion), and it and the shards after it wait for the next poll.
- Each volunteer with shards in a poll gets an equal share of the poll's reward time (at
  least one shard's budget, at most the poll's): once its shards used it, its other shards
  wait for a later poll, not rejected, so one volunteer cannot take the whole poll and
  everyone else's shards still get in.
- Each volunteer's rewards may take --reward-share of the trainer's wall time (RewardShares):
  a token bucket of reward seconds per volunteer, filled at that rate up to
  SHARE_BURST_SECONDS. Its shards are scored while its bucket is above zero, and what each
  took is then taken from it, so one shard may overdraw it (by at most the shard's budget):
  its next shards wait, not fetched, not rejected, not blamed, until the bucket is above
  zero again. So whatever it sends, over T seconds one volunteer costs the rewards at most
  SHARE_BURST_SECONDS + one shard's budget + share x T, and the per-poll caps above, which
  a volunteer takes at every poll, no longer add up to most of the trainer's time. Under
  torchrun each rank keeps the buckets of its own volunteers against its own clock.

A stop signal cuts the poll the same way: the shard being scored is cut, the rest wait, and
the loop ends as on any stop. Wall clock decides the poll's cap (it is the time the other
ranks wait), CPU time the shard's budget (a shard is not charged for a busy machine).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from volunteer_rl.task.bounded import Spend, wall_backstop

SHARE_BURST_SECONDS = 0.5
"""Reward seconds a volunteer's bucket holds when full (--reward-share): what it may spend at
once after an idle spell, besides the one shard that may overdraw it. Honest rewards take
milliseconds a shard, so this only absorbs their jitter; it is small because a new id starts
with a full bucket."""


@dataclass
class RewardStats:
    """What the intake's rewards took, over the polls since the last step."""

    seconds: float = 0.0
    """Wall-clock seconds spent computing rewards."""
    poll_max: float = 0.0
    """The most wall-clock seconds one poll spent on rewards (under ranks: any rank's)."""
    deferred: int = 0
    """Shards left for a later poll: their volunteer's share (of the poll or of the trainer's
    time) or the poll's reward time was spent, or a stop came."""
    waiting: int = 0
    """The most volunteers waiting for their share of the trainer's time at one poll (under
    ranks: any rank's; a follower reports after every poll, so its counts cannot be added)."""

    def add(self, other: dict) -> None:
        """Another rank's (dataclasses.asdict of its RewardStats)."""
        self.seconds += other["seconds"]
        self.poll_max = max(self.poll_max, other["poll_max"])
        self.deferred += other["deferred"]
        self.waiting = max(self.waiting, other["waiting"])


class RewardShares:
    """Each volunteer's token bucket of reward seconds, filled at `share` seconds per second
    of `clock` up to SHARE_BURST_SECONDS (see the module doc). Only buckets below full are
    kept: a volunteer not in the table has a full one, so the table holds the volunteers
    charged within the last SHARE_BURST_SECONDS / share seconds or so, not every id seen."""

    def __init__(self, share: float = math.inf, clock: Callable[[], float] = time.monotonic):
        self.share = share
        """Reward seconds a volunteer earns per second of wall time (--reward-share)."""
        self.clock = clock
        self.buckets: dict[str, tuple[float, float]] = {}
        """Volunteer -> (its level, the clock then), for buckets below full."""

    def level(self, volunteer: str, now: float | None = None) -> float:
        """The reward seconds `volunteer` has in hand now (below zero: owed)."""
        held = self.buckets.get(volunteer)
        if held is None:
            return SHARE_BURST_SECONDS
        level, then = held
        now = self.clock() if now is None else now
        return min(SHARE_BURST_SECONDS, level + max(0.0, now - then) * self.share)

    def owes(self, volunteer: str) -> bool:
        """True if `volunteer`'s bucket is not above zero: its shards wait."""
        return self.level(volunteer) <= 0

    def take(self, volunteer: str, seconds: float) -> None:
        """Charge `volunteer` for `seconds` of rewards (its bucket may go below zero)."""
        if math.isinf(self.share):
            return
        now = self.clock()
        self.buckets[volunteer] = (self.level(volunteer, now) - seconds, now)

    def owing(self) -> int:
        """Drop the buckets that are full again; how many volunteers owe now."""
        now = self.clock()
        levels = {v: self.level(v, now) for v in self.buckets}
        self.buckets = {v: self.buckets[v] for v, level in levels.items()
                        if level < SHARE_BURST_SECONDS}
        return sum(1 for level in levels.values() if level <= 0)


class RewardBudget:
    """The intake's spending on rewards, poll by poll (see the module doc). Unbounded by
    default (benches and unit tests of other rules)."""

    def __init__(self, shard_seconds: float = math.inf, poll_seconds: float = math.inf,
                 stopping: Callable[[], bool] = lambda: False,
                 shares: RewardShares | None = None):
        self.shard_seconds = shard_seconds
        """CPU seconds a shard's rewards may take together (--shard-reward-seconds)."""
        self.shard_wall = wall_backstop(shard_seconds)
        """...and wall-clock seconds (a reward that blocks uses no CPU)."""
        self.poll_seconds = poll_seconds
        """Wall-clock seconds of rewards per poll (--poll-reward-seconds)."""
        self.stopping = stopping
        self.shares = shares or RewardShares()
        """Each volunteer's share of the trainer's time (--reward-share)."""
        self.carried: dict[str, tuple[float, float]] = {}
        """Key -> (CPU, wall) seconds spent on it by earlier polls that cut it short."""
        self._share = math.inf  # each volunteer's wall seconds this poll
        self._spent = 0.0  # wall seconds this poll
        self._by_volunteer: dict[str, float] = {}

    def begin(self, volunteers: int, stats: RewardStats) -> None:
        """Start a poll whose admitted shards are those of `volunteers` volunteers."""
        stats.waiting = max(stats.waiting, self.shares.owing())
        self._spent = 0.0
        self._by_volunteer = {}
        even = self.poll_seconds / max(1, volunteers)
        self._share = min(self.poll_seconds, max(even, self.shard_seconds))

    def spend(self, key: str, volunteer: str) -> Spend | None:
        """The bounds of scoring shard `key` of `volunteer` now, or None: it waits for a later
        poll (no reward time left to it, or a stop came)."""
        if self.stopping() or self.shares.owes(volunteer):
            return None
        left = min(self.poll_seconds - self._spent,
                   self._share - self._by_volunteer.get(volunteer, 0.0))
        if left <= 0:
            return None
        cpu, wall = self.carried.get(key, (0.0, 0.0))
        return Spend(cpu_bound=self.shard_seconds, wall_bound=self.shard_wall, cpu_before=cpu,
                     wall_before=wall, until=time.monotonic() + left, stop=self.stopping)

    def charge(self, key: str, volunteer: str, spend: Spend, cut: bool, stats: RewardStats) -> None:
        """Count what scoring `key` took; `cut`: it was cut short and will be read again."""
        self._spent += spend.wall
        self._by_volunteer[volunteer] = self._by_volunteer.get(volunteer, 0.0) + spend.wall
        # the worker's start follows another batch's breach or cut: not this one's doing
        self.shares.take(volunteer, spend.wall - spend.start)
        stats.seconds += spend.wall
        stats.poll_max = max(stats.poll_max, self._spent)
        cpu, wall = self.carried.pop(key, (0.0, 0.0))
        if cut:
            self.carried[key] = (cpu + spend.cpu, wall + spend.wall)

    def owes(self, volunteer: str) -> bool:
        """True if `volunteer`'s share of the trainer's time is spent: its shards wait unread."""
        return self.shares.owes(volunteer)

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop what is carried for keys that left the window."""
        self.carried = {k: v for k, v in self.carried.items() if keep(k)}
