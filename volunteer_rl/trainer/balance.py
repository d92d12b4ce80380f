"""Balance: how many groups of each version the trainer asks of each volunteer (the manifest's
`quota`), and what share of the groups it receives it trains on (the useful fraction).

Volunteers that sample until the next version make far more groups than a version needs
whenever the trainer is the slower side (issue 27: the demo received 2.7 groups for each one
it trained). So at every publish the trainer works out, from what it measured over the last
WINDOW_SECONDS, how many groups each volunteer should sample with the new version:

    quota = ceil(headroom * max(1, need - buffered) / (usable * volunteers))

- `need`: groups one version trains (--groups-per-step times the steps per publish, the mean
  of the last BUSY_VERSIONS publishes, at least --publish-every);
- `buffered`: usable groups already in hand that will still be fresh after the publish (they
  fill the next step too, so asking for them again would only make groups that go stale);
- `usable`: the share of groups received that have reward variance and are no duplicates
  (at least USABLE_FLOOR, so an all-zero window asks for much more, not for infinitely much);
- `volunteers`: the volunteers the groups came from, counted by their shares (the
  participation ratio (sum of r)^2 / sum of r^2 of the groups r each sent), so a thousand ids
  that sent one shard each count as little as they delivered, and a volunteer that delivers
  half of what the others do counts half;
- `headroom`: --quota-headroom, for what the estimate gets wrong.

`wait_seconds` (how long a volunteer at its quota waits for a newer version before it samples
another quota of the same one) is WAIT_FACTOR times the median seconds the trainer was busy
(not waiting for rollouts) per version over the last BUSY_VERSIONS publishes, inside
WAIT_BOUNDS: long enough for the trainer to take the last groups, step and publish, short
enough that a fleet stopped at quotas too small resumes quickly. It uses busy time, not the
time between publishes, so a trainer starved by a quota too small does not stretch its next
wait too.

Until the window holds a version's `need` of received groups (a new run's v0, a trainer just
restarted) the trainer has measured nothing: it assumes PRIOR_USABLE and one volunteer, so
each volunteer is asked for a whole version's worth. A volunteer that waits out
`wait_seconds` samples another quota, and twice as much at each further wait of the same
version (volunteer/quota.py), so an estimate that was short costs a few waits, never a stall.

All of it is pure but for the clock passed in; the trainer feeds it after each step and asks
it at each publish.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

from volunteer_rl.protocol.manifest import MAX_QUOTA_GROUPS, Quota

WINDOW_SECONDS = 60.0
"""The recent window of the useful and usable fractions, and of the volunteers counted."""
USABLE_FLOOR = 0.01
"""The usable share a quota is computed with when fewer groups were usable."""
PRIOR_USABLE = 0.5
"""The usable share assumed before any was measured (the demo's v0 measured 0.58)."""
BUSY_VERSIONS = 16
"""Publishes whose busy time and steps the wait and `need` are taken from (median, mean)."""
WAIT_FACTOR = 3.0
WAIT_BOUNDS = (2.0, 120.0)
"""`wait_seconds` is at least 2 s (twice a volunteer's default poll interval, so a volunteer
sees a new version before it gives up on it) and at most 2 minutes."""


def participation(received: dict[str, int]) -> float:
    """Volunteers counted by their shares: (sum r)^2 / sum r^2 over the groups r each sent
    (n equal senders count n; one sender of most groups counts about 1). 0 for none."""
    total = sum(received.values())
    squares = sum(r * r for r in received.values())
    return total * total / squares if squares else 0.0


def quota_groups(need: float, buffered: int, usable: float, volunteers: float,
                 headroom: float) -> int:
    """Groups each volunteer should sample with the next version (the module's formula),
    1..MAX_QUOTA_GROUPS."""
    wanted = max(1.0, need - buffered)
    per = headroom * wanted / (max(usable, USABLE_FLOOR) * max(volunteers, 1.0))
    return int(min(MAX_QUOTA_GROUPS, max(1, math.ceil(per))))


def quota_wait(busy_seconds: list[float]) -> float:
    """`wait_seconds`: WAIT_FACTOR times the median busy seconds per version, in WAIT_BOUNDS
    (the lower bound when nothing was measured), rounded to a tenth of a second."""
    median = statistics.median(busy_seconds) if busy_seconds else 0.0
    lo, hi = WAIT_BOUNDS
    return round(min(hi, max(lo, WAIT_FACTOR * median)), 1)


@dataclass
class _Step:
    time: float
    received: Counter  # volunteer id -> groups accepted from its shards since the last step
    trained: Counter  # volunteer id -> groups of it in this step
    groups: int  # groups accepted since the last step (ingest/groups)
    unusable: int  # of them: one reward for all K, or duplicates


@dataclass
class Balance:
    """The trainer's measurements (after_step, after_publish) and the quota (quota)."""

    groups_per_step: int
    publish_every: int = 1
    headroom: float = 1.5
    """--quota-headroom; 0: no quota at all."""
    window: float = WINDOW_SECONDS
    steps: deque = field(default_factory=deque)
    busy: deque = field(default_factory=lambda: deque(maxlen=BUSY_VERSIONS))
    """Seconds the trainer was busy (not waiting for rollouts) for each recent version."""
    step_counts: deque = field(default_factory=lambda: deque(maxlen=BUSY_VERSIONS))
    """Optimizer steps of each recent version."""
    waited: float = 0.0  # seconds waiting for rollouts since the last publish
    steps_since_publish: int = 0
    last_publish: float | None = None
    current: Quota | None = None
    """The quota of the version published last."""

    def after_step(self, now: float, received: Counter, trained: Counter, groups: int,
                   unusable: int, waited: float) -> None:
        """One optimizer step: groups received per volunteer since the last one, the step's
        groups per volunteer, groups received and how many of them were unusable, and the
        seconds spent waiting for rollouts before it."""
        self.steps.append(_Step(now, Counter(received), Counter(trained), groups, unusable))
        self.waited += waited
        self.steps_since_publish += 1
        self._expire(now)

    def after_publish(self, now: float) -> None:
        """A version went out: the busy seconds and steps since the last publish are its."""
        if self.last_publish is not None:
            self.busy.append(max(0.0, now - self.last_publish - self.waited))
            self.step_counts.append(self.steps_since_publish)
        self.last_publish, self.waited, self.steps_since_publish = now, 0.0, 0

    def _expire(self, now: float) -> None:
        while self.steps and self.steps[0].time < now - self.window:
            self.steps.popleft()

    def _summed(self, now: float, field: str) -> Counter:
        """Groups per volunteer of the window's steps, `received` or `trained`."""
        self._expire(now)
        out: Counter = Counter()
        for s in self.steps:
            out.update(getattr(s, field))
        return out

    def received(self, now: float) -> Counter:
        return self._summed(now, "received")

    def trained(self, now: float) -> Counter:
        return self._summed(now, "trained")

    def usable_fraction(self, now: float) -> float | None:
        """Share of the window's received groups with reward variance, no duplicates."""
        self._expire(now)
        groups = sum(s.groups for s in self.steps)
        return 1 - sum(s.unusable for s in self.steps) / groups if groups else None

    def useful_fraction(self, now: float) -> float | None:
        """Groups trained / groups received over the window (None: none received)."""
        received = sum(self.received(now).values())
        return min(1.0, sum(self.trained(now).values()) / received) if received else None

    def need(self) -> float:
        """Groups one version trains: groups per step times steps per publish."""
        steps = statistics.fmean(self.step_counts) if self.step_counts else 0.0
        return self.groups_per_step * max(float(self.publish_every), steps)

    def quota(self, now: float, buffered: int) -> Quota | None:
        """The quota of the version about to be published, `buffered` the usable groups in
        hand that stay fresh after it; None with no headroom. Before a version's need of
        groups was received in the window: PRIOR_USABLE and one volunteer. Remembered as
        `current`."""
        self.current = None
        if self.headroom > 0:
            usable, received = self.usable_fraction(now), self.received(now)
            measured = usable is not None and sum(received.values()) >= self.need()
            usable, volunteers = (usable, participation(received)) if measured else (PRIOR_USABLE, 1.0)
            self.current = Quota(quota_groups(self.need(), buffered, usable, volunteers, self.headroom),
                                 quota_wait(list(self.busy)))
        return self.current

    def summary(self, now: float) -> tuple[dict, dict[str, dict]]:
        """(fleet-wide figures, per-volunteer figures) of the window, for fleet.json."""
        received, trained = self.received(now), self.trained(now)
        useful = self.useful_fraction(now)
        usable = self.usable_fraction(now)
        fleet = {"window_seconds": self.window, "groups_received": sum(received.values()),
                 "groups_trained": sum(trained.values()),
                 "useful_fraction": None if useful is None else round(useful, 4),
                 "usable_fraction": None if usable is None else round(usable, 4),
                 "volunteers": round(participation(received), 2),
                 "quota": None if self.current is None else
                 {"groups": self.current.groups, "wait_seconds": self.current.wait_seconds}}
        rows = {vid: {"groups_received_recent": received[vid],
                      "groups_trained_recent": trained[vid],
                      "useful_fraction": round(min(1.0, trained[vid] / received[vid]), 4)
                      if received[vid] else None}
                for vid in set(received) | set(trained)}
        return fleet, rows
