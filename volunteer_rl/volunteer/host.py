"""Host controls: how much of the owner's machine a volunteer takes, and when it steps aside.

Volunteers run on laptops and desktops their owners also use, as BOINC's clients do, and the
controls are BOINC's:
- `CpuShare` (--cpu-share F): the process's CPU time is held to F of the cores it may run on,
  on average over a batch and its rest: it samples a batch, then rests. A token bucket of
  CPU-seconds: it fills at F x cores per second of wall time, holds at most BURST_SECONDS of
  that, and each call of `tick` pays the CPU time spent since the last one; when the bucket is
  empty it sleeps until it has paid. Everything the process does counts (its heartbeat and
  upload threads too), because that is what the owner sees in their task manager.
  It rests between batches, not between decode steps, and asks for its next numbers only
  after the rest: numbers granted to it and not sampled make the trainer hold its next
  publish back (trainer.loop.DRAIN_STEPS), and a volunteer resting in the middle of a batch
  at 0.1 cores held the demo's whole fleet to 0.31 of its intake (bench.host_share).
- `HostGate` (--pause-when-busy P, the battery): pause while the rest of the machine uses more
  than P of all its cores (this process's own use left out), resume once it falls under
  RESUME_SHARE of P; and, unless --run-on-battery, pause while the machine runs on battery. The
  machine is read with psutil, once every SAMPLE_SECONDS, the decision taken on the average
  over that time. A platform with no battery sensor is said once and treated as on mains.

What a pause does to the group numbers the trainer granted (volunteer.loop): nothing new is
asked for, and sampling stops between two decode steps; numbers already granted are sampled
as soon as the trainer publishes past their version (`owed_due`), so that a pause leaves no
number missing (the trainer would count it as withheld); a volunteer starved by what paused
it can still miss them (docs/LIMITS.md). These classes measure, decide and wait; the loop
says what is owed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from volunteer_rl.stopping import StopSignal

BURST_SECONDS = 1.0
"""Wall seconds of allowance a --cpu-share sampler may bank while idle: after a wait it may run
flat out for about this long (x F) before it rests."""
SAMPLE_SECONDS = 2.0
"""--pause-when-busy reads the machine's CPU use at most this often, as the average since the
last reading: a one-off spike shorter than this is smoothed, a pause or resume comes within
two readings."""
RESUME_SHARE = 0.8
"""A volunteer paused for a busy machine resumes once the rest of the machine uses less than
this share of --pause-when-busy (0.4 of the CPU at 0.5): a machine hovering at the threshold
does not make it flap."""


def owed_due(owed: tuple[int | None, ...], newest: int | None) -> int | None:
    """The oldest version of `owed` (versions of numbers granted and not sampled yet, None
    for none) that a paused volunteer must sample now, given the newest version published;
    None while nothing is owed or everything owed is of the newest version (or later, an
    ask ahead).

    Why as soon as a newer version is out, and not only once the owed version is the oldest in
    the trainer's window: the pause is there because the rest of the machine is busy, so at
    nice 10 the owed batch runs at a fraction of a core, and the trainer holds its publish for
    it only DRAIN_STEPS steps once the version leaves the window. Starting when the first newer
    version is published gives it the whole window's time instead of the last step's. What is
    owed is bounded (the batch in hand and the one granted ahead), so the pause then goes on
    with nothing left to sample, and a short pause that ends before the next publish samples
    nothing while paused."""
    versions = [v for v in owed if v is not None]
    if not versions or newest is None or min(versions) >= newest:
        return None
    return min(versions)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return max(1, os.cpu_count() or 1)


class CpuShare:
    """Hold the process's CPU time to `share` x `cores` CPU-seconds per wall second."""

    def __init__(self, share: float, cores: int | None = None,
                 cpu: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.rate = share * (cores or usable_cores())
        self.cpu, self.clock, self.sleep = cpu, clock, sleep
        self.cap = BURST_SECONDS * self.rate
        self.tokens = self.cap
        self.last_wall, self.last_cpu = clock(), cpu()

    def tick(self) -> float:
        """Pay for the CPU time spent since the last call; rest while in debt. Returns the
        seconds slept."""
        wall, cpu = self.clock(), self.cpu()
        self.tokens = min(self.cap, self.tokens + (wall - self.last_wall) * self.rate)
        self.tokens -= max(0.0, cpu - self.last_cpu)
        self.last_wall, self.last_cpu = wall, cpu
        if self.tokens >= 0:
            return 0.0
        rest = -self.tokens / self.rate
        self.sleep(rest)
        return rest


@dataclass(frozen=True)
class Reading:
    """One look at the machine: wall time, CPU-seconds busy on every core together, this
    process's CPU-seconds, the machine's cores, and its power source."""

    wall: float
    busy: float
    own: float
    cores: int
    on_battery: bool | None
    """True on battery, False on mains, None where the platform cannot tell."""
    total: float = 0.0
    """CPU-seconds of every state (busy, idle, I/O wait, steal) on every core together: the
    share busy is taken of this, as psutil.cpu_percent does, not of wall time x cores (a VM
    whose vCPUs the host descheduled accounts less time than the wall clock passed)."""


def read_machine() -> Reading:
    """The machine as psutil sees it (psutil imported here, when the first reading is taken:
    never with --run-on-battery and no --pause-when-busy)."""
    import psutil

    t = psutil.cpu_times()
    # Busy is what is neither idle nor waiting on I/O; guest time is already in user on Linux.
    busy = sum(getattr(t, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))
    total = busy + sum(getattr(t, name, 0.0) for name in ("idle", "iowait", "steal"))
    me = psutil.Process().cpu_times()
    own = (me.user + me.system + getattr(me, "children_user", 0.0)
           + getattr(me, "children_system", 0.0))
    try:
        battery = psutil.sensors_battery()
    except Exception:  # a sensor the platform lists but cannot read is no sensor
        battery = None
    plugged = None if battery is None else battery.power_plugged
    return Reading(time.monotonic(), busy, own, psutil.cpu_count() or 1,
                   None if plugged is None else not plugged, total)


class HostGate:
    """Decides whether to pause: `reason()` is why (a line for the log and the heartbeat) or
    None. `busy_above` 0 never pauses for CPU; `on_battery` False never pauses for power."""

    def __init__(self, busy_above: float, pause_on_battery: bool, log: Callable[[str], None],
                 read: Callable[[], Reading] = read_machine,
                 clock: Callable[[], float] = time.monotonic):
        self.busy_above, self.pause_on_battery = busy_above, pause_on_battery
        self.read, self.log, self.clock = read, log, clock
        self.read_at: float | None = None
        self.enabled = busy_above > 0 or pause_on_battery
        self.last: Reading | None = None
        self.others: float | None = None
        """The rest of the machine's CPU use, a share of all its cores, at the last reading."""
        self.busy = False
        self.battery = False
        self.cause: str | None = None
        """What the last `reason` paused for: `battery`, `busy` or None."""
        self.said_no_sensor = False

    def reason(self) -> str | None:
        """Why to pause now, or None; the machine is read again at most every SAMPLE_SECONDS."""
        if not self.enabled:
            return None
        t = self.clock()
        if self.read_at is None or t - self.read_at >= SAMPLE_SECONDS:
            self.read_at = t
            self._judge(self.read())
        self.cause = "battery" if self.battery else "busy" if self.busy else None
        if self.battery:
            return "on battery (--run-on-battery samples anyway)"
        if self.busy:
            return (f"the rest of the machine uses {self.others:.0%} of the CPU, over "
                    f"--pause-when-busy {self.busy_above:g}")
        return None

    def _judge(self, now: Reading) -> None:
        before, self.last = self.last, now
        if self.pause_on_battery:
            if now.on_battery is None and not self.said_no_sensor:
                self.log("no battery sensor here: sampling as on mains power (the battery pause "
                         "needs one psutil can read)")
                self.said_no_sensor = True
            self.battery = bool(now.on_battery)
        if self.busy_above <= 0 or before is None or now.wall <= before.wall:
            return
        wall_cpu = (now.wall - before.wall) * now.cores
        span = now.total - before.total if now.total > before.total else wall_cpu
        mine = (now.own - before.own) / wall_cpu
        self.others = min(1.0, max(0.0, (now.busy - before.busy) / span - mine))
        if self.busy:
            self.busy = self.others >= RESUME_SHARE * self.busy_above
        else:
            self.busy = self.others > self.busy_above


class HostControls:
    """The loop's side of the host controls: the rests of --cpu-share and the pauses.

    `follow()` keeps the volunteer's view of the trainer fresh while paused (the manifest and
    the grants); `owed_due()` names the version of numbers granted to us that must be sampled
    now, before they go stale (None: none); `flush()` uploads the groups in hand."""

    def __init__(self, cpu_share: float, pause_when_busy: float, run_on_battery: bool,
                 stop: StopSignal, log: Callable[[str], None], follow: Callable[[], None],
                 owed_due: Callable[[], int | None], flush: Callable[[], None],
                 poll_seconds: float, gate: HostGate | None = None):
        self.share = CpuShare(cpu_share, sleep=stop.wait) if cpu_share < 1 else None
        self.gate = gate or HostGate(pause_when_busy, not run_on_battery, log)
        self.stop, self.log, self.poll_seconds = stop, log, poll_seconds
        self.follow, self.owed_due, self.flush = follow, owed_due, flush
        self.paused: str | None = None
        """Why sampling is paused now (the heartbeat's `paused`), or None."""
        self.said_owed: int | None = None

    @property
    def rests(self) -> bool:
        """Does --cpu-share make the volunteer rest after its batches?"""
        return self.share is not None

    def may_ask(self) -> bool:
        """May the volunteer ask for numbers? Not while the gate says pause."""
        return self.gate.reason() is None

    def between_steps(self) -> None:
        """After every forward of the sampler: hold for a pause."""
        self.hold()

    def rest(self) -> None:
        """After a batch, with no numbers left in hand: rest until its CPU time is paid for
        (--cpu-share); a stop cuts the rest short."""
        if self.share is not None:
            self.share.tick()

    def hold(self, until: float | None = None) -> None:
        """Wait while the gate says pause, following the trainer meanwhile; go on when it
        clears, when a stop comes (a stop samples the numbers granted, as always), at the
        wall time `until`, or when numbers granted to us are due (`owed_due`): left
        unsampled, the trainer's next publish would count them missing, so they are sampled
        now and the pause goes on after them."""
        cause = self.gate.cause
        while not self.stop.is_set() and (until is None or time.time() < until):
            why = self.gate.reason()
            if why is None:
                break
            if self.paused is None:
                self.log(f"pausing: {why}")
                self.flush()  # the groups in hand go out now, not after the pause
            elif self.gate.cause != cause:
                self.log(f"still paused: {why}")  # another cause: the log says each once
            self.paused, cause = why, self.gate.cause  # the heartbeat shows the latest reading
            owed = self.owed_due()
            if owed is not None:  # sampled while the heartbeat says paused, at --nice
                if self.said_owed != owed:
                    self.log(f"paused, but first sampling the numbers granted for v{owed}: "
                             "the trainer has published past it")
                    self.said_owed = owed
                break
            self.stop.wait(self.poll_seconds)
            self.follow()
        if self.paused is not None and self.gate.reason() is None:
            self.log("resuming: the machine is free again")
            self.paused = None
