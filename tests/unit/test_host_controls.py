"""The volunteer's host controls as pure logic (volunteer.host), with clocks and machine
readings stood in: the duty cycle of --cpu-share, the decisions of --pause-when-busy and the
battery, and the hold that keeps granted numbers from going stale. Real processes:
tests/integration/test_host_controls_live.py."""
from __future__ import annotations

import pytest

from volunteer_rl.stopping import StopSignal
from volunteer_rl.volunteer import host
from volunteer_rl.volunteer.host import CpuShare, HostControls, HostGate, Reading, owed_due


class Machine:
    """A fake clock with a process that burns CPU while it runs and none while it sleeps."""

    def __init__(self, cores: int = 1):
        self.wall = 0.0
        self.cpu_used = 0.0
        self.cores = cores

    def run(self, seconds: float, threads: int = 1) -> None:
        self.wall += seconds
        self.cpu_used += seconds * threads

    def sleep(self, seconds: float) -> None:
        self.wall += seconds


@pytest.mark.parametrize("share,cores,threads", [(0.5, 1, 1), (0.25, 2, 2), (0.8, 4, 4), (0.1, 1, 1)])
def test_cpu_share_holds_the_average(share, cores, threads):
    m = Machine()
    throttle = CpuShare(share, cores, cpu=lambda: m.cpu_used, clock=lambda: m.wall, sleep=m.sleep)
    for _ in range(2000):  # decode steps of 20 ms each
        m.run(0.02, threads)
        throttle.tick()
    assert m.cpu_used / m.wall == pytest.approx(share * cores, rel=0.02)


def test_cpu_share_banks_at_most_a_burst_while_idle():
    m = Machine()
    throttle = CpuShare(0.5, 1, cpu=lambda: m.cpu_used, clock=lambda: m.wall, sleep=m.sleep)
    m.sleep(600)  # ten idle minutes
    throttle.tick()
    slept = 0.0
    for _ in range(100):  # 2 s of work right after
        m.run(0.02)
        slept += throttle.tick()
    # 2 s of CPU at 0.5 needs 4 s of wall; the bank, at most BURST_SECONDS x 0.5 CPU-seconds
    # however long the idle time, pays for 1 s of it: about 1 s of rest is left.
    banked = host.BURST_SECONDS * 0.5
    assert slept >= (2.0 - banked) / 0.5 - 2.0 - 0.05


def test_no_share_means_no_rest():
    m = Machine()
    throttle = CpuShare(1.0, 1, cpu=lambda: m.cpu_used, clock=lambda: m.wall, sleep=m.sleep)
    for _ in range(500):
        m.run(0.02)
        assert throttle.tick() == 0.0


class Readings:
    """Machine readings: the rest of the machine uses `others` of `cores`, this process `mine`."""

    def __init__(self, cores: int = 2):
        self.t = 0.0
        self.busy = 0.0
        self.own = 0.0
        self.cores = cores
        self.others = 0.0
        self.mine = 0.0
        self.battery: bool | None = False

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.busy += seconds * self.cores * (self.others + self.mine)
        self.own += seconds * self.cores * self.mine

    def read(self) -> Reading:
        return Reading(self.t, self.busy, self.own, self.cores, self.battery)


def gate_on(r: Readings, busy_above: float, on_battery: bool = True, log=None) -> HostGate:
    return HostGate(busy_above, on_battery, log or (lambda m: None), read=r.read, clock=lambda: r.t)


def test_busy_machine_pauses_and_resumes_with_a_margin():
    r = Readings()
    gate = gate_on(r, 0.5)
    assert gate.reason() is None  # the first reading only sets the baseline
    r.mine = 0.5  # this process's own use never counts
    r.advance(host.SAMPLE_SECONDS)
    assert gate.reason() is None
    r.others = 0.9
    r.advance(host.SAMPLE_SECONDS)
    why = gate.reason()
    assert why is not None and "90%" in why and "--pause-when-busy 0.5" in why
    r.others = 0.45  # under the threshold, not under RESUME_SHARE of it: still paused
    r.advance(host.SAMPLE_SECONDS)
    assert gate.reason() is not None
    r.others = 0.3
    r.advance(host.SAMPLE_SECONDS)
    assert gate.reason() is None


def test_readings_come_at_most_every_sample_seconds():
    r = Readings()
    calls = []
    gate = HostGate(0.5, False, lambda m: None, read=lambda: calls.append(1) or r.read(),
                    clock=lambda: r.t)
    for _ in range(50):
        gate.reason()
        r.advance(host.SAMPLE_SECONDS / 10)
    assert len(calls) == 50 // 10


def test_battery_pauses_unless_run_on_battery_and_no_sensor_is_said_once():
    r = Readings()
    r.battery = True
    assert "on battery" in gate_on(r, 0).reason()
    assert gate_on(r, 0, on_battery=False).reason() is None
    r.battery = None
    said = []
    gate = gate_on(r, 0, log=said.append)
    for _ in range(5):
        assert gate.reason() is None
        r.advance(host.SAMPLE_SECONDS)
    assert len(said) == 1 and "no battery sensor" in said[0]


class FakeGate:
    def __init__(self, reasons):
        self.reasons = list(reasons)
        self.cause = None

    def reason(self):
        why = self.reasons.pop(0) if len(self.reasons) > 1 else self.reasons[0]
        self.cause = why and why.split()[0]
        return why


def controls(gate, owed=lambda: None):
    said, flushed, followed = [], [], []
    stop = StopSignal(lambda m: None)
    c = HostControls(1.0, 0.5, True, stop, said.append, lambda: followed.append(1), owed,
                     lambda: flushed.append(1), poll_seconds=0.001, gate=gate)
    return c, said, flushed, followed


def test_hold_waits_out_a_pause_flushing_once_and_following_the_trainer():
    c, said, flushed, followed = controls(FakeGate(["busy 91%", "busy 93%", "busy 90%", "battery",
                                                    "battery", None]))
    c.hold()
    assert flushed == [1] and len(followed) >= 4 and c.paused is None
    # each cause said once, not each reading
    assert said == ["pausing: busy 91%", "still paused: battery", "resuming: the machine is free again"]


def test_hold_lets_numbers_that_would_go_stale_be_sampled():
    c, said, flushed, _ = controls(FakeGate(["busy"]), owed=lambda: 7)
    c.hold()  # returns at once: the granted numbers of v7 are due
    c.hold()  # between the next two steps: still due, said once
    # the pause is shown (and the shard in hand flushed) while the owed numbers are sampled
    assert flushed == [1] and c.paused == "busy" and not c.may_ask()
    assert said == ["pausing: busy", "paused, but first sampling the numbers granted for v7: "
                    "the trainer has published past it"]


def test_owed_numbers_are_due_once_a_newer_version_is_published():
    """The batch in hand (first) and the oldest version granted and not sampled (second):
    due as soon as the newest version is past the older of them, and not before; an ask ahead
    (a version not published yet) never is."""
    assert owed_due((None, None), 9) is None
    assert owed_due((5, None), None) is None  # no manifest read yet
    assert owed_due((5, None), 5) is None  # a short pause before the next publish samples nothing
    assert owed_due((5, 6), 6) == 5
    assert owed_due((None, 6), 7) == 6
    assert owed_due((None, 8), 7) is None  # granted ahead for v8
    assert owed_due((7, 8), 8) == 7


def test_hold_ends_at_its_deadline_and_a_stop():
    import time

    c, *_ = controls(FakeGate(["busy"]))
    c.hold(until=time.time() + 0.05)
    assert c.paused == "busy"
    c.stop.set()
    c.hold()


def test_the_busy_share_is_of_the_cpu_time_accounted_not_of_the_wall_clock():
    """A VM whose vCPUs the host descheduled accounts less CPU time than wall x cores: two
    cores busy for 1.2 s of accounted time in 2 s of wall are the whole machine, not 60 %."""
    t = [0.0]
    readings = iter([Reading(0.0, 0.0, 0.0, 2, False, 0.0), Reading(2.0, 2.4, 0.0, 2, False, 2.4)])
    gate = HostGate(0.7, False, lambda m: None, read=lambda: next(readings), clock=lambda: t[0])
    assert gate.reason() is None
    t[0] = 2.0
    assert gate.reason() is not None and gate.others == pytest.approx(1.0)
