"""How many groups of the version in hand a volunteer may sample now: the manifest's `quota`
(schema 7, what the trainer asks of each volunteer) and its own --max-groups-per-version,
whichever leaves less.

Each limit pauses, never stops. Reached, the volunteer waits for a newer version and says so
in its log and heartbeat (`waiting`); at the manifest's quota it first uploads the groups it
holds (the trainer is waiting for them; its own cap leaves them buffered, as it always did).
If no newer version comes within the limit's
patience, the trainer may still lack usable groups (fewer had reward variance than it
estimated, a volunteer left), so the limit grows and sampling resumes: the manifest's quota
after `quota.wait_seconds` by another `quota.groups`, then by twice as many at each further
wait of the same version (so a quota far too small costs a few waits, not one per quota), and
the volunteer's own cap by one batch after --cap-patience-seconds. Without that, a fleet
stopped at its quotas would wait forever for a version the trainer cannot make. A newcomer,
or a volunteer that just loaded a version, has sampled none of it: it starts at once.

Pure but for the clock passed in: the loop asks `room` before each batch (volunteer.loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from volunteer_rl.protocol.manifest import Manifest

LOG_EVERY_SECONDS = 30.0
"""A version's quota is reached every few seconds on a busy fleet: the log says that a wait
began, or that one ran out, at most once per this many seconds each (with how often it
happened since); the heartbeat's `waiting` says it always."""


@dataclass
class Limit:
    """One per-version limit: `size` groups, growing by `step` after `patience` seconds at it
    (and `step` doubling each time if `doubles`)."""

    name: str
    size: int
    step: int
    patience: float
    doubles: bool = False
    extra: int = 0
    reached_at: float | None = None

    def room(self, made: int) -> int:
        return max(0, self.size + self.extra - made)


@dataclass
class Allowance:
    """The limits of the version in hand and the wait they put the volunteer in."""

    cap: int = 0
    """--max-groups-per-version (0: none)."""
    batch: int = 16
    """Prompts per generate round (--prompts-per-batch, its auto value resolved when a model
    loads: devices.sampling_prompts); also what the own cap grows by after its patience."""
    cap_patience: float = 2.0
    log: Callable[[str], None] = print
    version: tuple[str, int] | None = None
    limits: list[Limit] = field(default_factory=list)
    waiting: str | None = None
    """Why the volunteer is not sampling now (its heartbeat's `waiting`), or None."""
    made: int = 0  # groups of the version made, as of the last `room`
    logged: dict[str, tuple[float, int]] = field(default_factory=dict)
    """For each kind of line: when it was last logged, and how many went unlogged since."""

    def _limits(self, m: Manifest) -> list[Limit]:
        """The limits of a version newly in hand, none of them reached."""
        limits = []
        if m.quota is not None:
            limits.append(Limit("quota", m.quota.groups, m.quota.groups, m.quota.wait_seconds,
                                doubles=True))
        if self.cap:
            limits.append(Limit("--max-groups-per-version", self.cap, self.batch, self.cap_patience))
        return limits

    def room(self, m: Manifest, made: int, now: float) -> int:
        """Groups of `m`'s version the volunteer may sample now, having made `made` of them;
        0: wait (poll for a newer version and ask again)."""
        if self.version != (m.run_id, m.version):
            self.version, self.limits, self.waiting = (m.run_id, m.version), self._limits(m), None
        self.made = made
        if not self.limits:
            return 1 << 30
        reached = [lim for lim in self.limits if lim.room(made) == 0]
        for lim in self.limits:
            if lim not in reached:
                lim.reached_at = None
        for lim in reached:
            if lim.reached_at is None:
                lim.reached_at = now
                self.waiting = f"{lim.name} of v{m.version} reached ({made} groups)"
                self._say("wait", now, f"waiting: {self.waiting}; for a newer version, or "
                                       f"{lim.patience:g}s before sampling {lim.step} more")
            elif now - lim.reached_at >= lim.patience:
                lim.extra += lim.step
                lim.reached_at = None
                self._say("resume", now, f"no version after v{m.version} for {lim.patience:g}s: "
                                         f"sampling {lim.step} more groups of it ({lim.name} now "
                                         f"{lim.size + lim.extra})")
                lim.step *= 2 if lim.doubles else 1
        room = min(lim.room(made) for lim in self.limits)
        if room:
            self.waiting = None
        return room

    @property
    def quota_reached(self) -> bool:
        """Whether the manifest's quota (not the volunteer's own cap) held it at the last `room`."""
        return any(lim.name == "quota" and lim.room(self.made) == 0 for lim in self.limits)

    def _say(self, kind: str, now: float, line: str) -> None:
        """Log `line` unless a line of this kind went out less than LOG_EVERY_SECONDS ago."""
        last, skipped = self.logged.get(kind, (float("-inf"), 0))
        if now - last < LOG_EVERY_SECONDS:
            self.logged[kind] = (last, skipped + 1)
            return
        self.log(line + (f" ({skipped} more like it since the last such line)" if skipped else ""))
        self.logged[kind] = (now, 0)
