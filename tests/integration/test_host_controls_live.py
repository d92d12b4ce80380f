"""A real `vrl volunteer` under its owner's host controls (volunteer.host): --cpu-share holds
its process CPU time (not wall time) to a share of the cores it may use, and
--pause-when-busy stops it beside a CPU hog and starts it again once the hog is gone, and
on battery (psutil's reading faked: helpers/fake_battery) it pauses until it is on mains.

Most of them run no trainer: the volunteer samples the template's v2 with numbers dealt as
the trainer would grant them, by a feeder that deals more before it runs out (`Dealer`) or
one that answers each ask (`AskDealer`), so it always has work. The measured checks (a
minute of sampling at half a core, the pause beside a hog, the pause beside a live trainer)
need an otherwise idle machine and are marked slow; in the default suite, one checks that
--cpu-share rests, with nothing granted in hand, and one the battery pause."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers.grants import deal
from helpers.vrlproc import Proc, wait_for

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.grants import GRANT_BLOCK, parse_ask_key
from volunteer_rl.protocol.signing import parse_private_key, public_key_text

VID = "laptop"
DEAL_BLOCKS = 64  # a grant's most (protocol.grants.MAX_GRANT_BLOCKS): 512 numbers


class Dealer:
    """Deals the volunteer numbers under v2, 512 at a time, whenever fewer than 256 of those
    dealt are left: the volunteer is never out of work while a test measures it."""

    def __init__(self, template, bucket, work):
        self.template, self.bucket, self.work = template, bucket, work
        self.blocks = DEAL_BLOCKS
        deal(bucket, template.key, template.run_id, VID, 2, work, blocks=DEAL_BLOCKS)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _place(self) -> int:
        try:
            return json.loads((self.work / VID / "group-numbers.json").read_text())["next"]
        except (OSError, ValueError, KeyError):
            return 0

    def _run(self) -> None:
        while not self.done.wait(0.5):
            if self.blocks * 8 - self._place() < 256:
                deal(self.bucket, self.template.key, self.template.run_id, VID, 2, None,
                     blocks=DEAL_BLOCKS, first_block=self.blocks)
                self.blocks += DEAL_BLOCKS


class AskDealer:
    """Answers each of the volunteer's asks under v2 with the blocks it asked for, as a trainer
    would, and notes at each new ask how many numbers it had dealt and how many groups the
    volunteer had uploaded by then (`seen`)."""

    def __init__(self, template, bucket, work):
        self.template, self.bucket = template, bucket
        self.folder = bucket / layout.rollout_volunteer_prefix(2, VID)
        self.answered: set[str] = set()
        self.dealt = 0
        self.seen: list[tuple[int, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def uploaded(self) -> int:
        return sum(len(gzip.decompress(f.read_bytes()).splitlines())
                   for f in self.folder.glob(f"*{layout.SHARD_SUFFIX}"))

    def _run(self) -> None:
        while not self.done.wait(0.05):
            for ask in sorted(self.folder.glob("ask-*")):
                if ask.name in self.answered:
                    continue
                self.seen.append((self.dealt, self.uploaded()))
                _, _, first, blocks = parse_ask_key(ask.relative_to(self.bucket).as_posix())
                deal(self.bucket, self.template.key, self.template.run_id, VID, 2, None,
                     blocks=blocks, first_block=first)
                self.answered.add(ask.name)
                self.dealt += blocks * GRANT_BLOCK


def start(template, tmp_path, *flags, cpus=None, env=None, dealer=Dealer):
    bucket = template.copy(tmp_path / "bucket")
    key = public_key_text(parse_private_key(template.key.read_bytes(), str(template.key)))
    dealer = dealer(template, bucket, tmp_path / "vw")
    vol = Proc(["volunteer", "--bucket", str(bucket), "--id", VID, "--trust-key", key,
                "--threads", "1", "--poll-seconds", "0.2", "--heartbeat-seconds", "0.5",
                "--device", "cpu", "--work-dir", str(tmp_path / "vw"), *flags],
               tmp_path / "vol.log", tmp_path, env=env, cpus=cpus)
    beat = bucket / layout.heartbeat_key(VID)
    wait_for(lambda: "uploaded" in vol.text() or vol.p.poll() is not None, 240, "a first upload")
    assert vol.p.poll() is None, vol.text()[-3000:]
    return vol, dealer, beat


def heartbeat(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # between the write's temp file and its rename
        return {}


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def cores_used(pid: int, seconds: float) -> float:
    """Cores the process used on average over the next `seconds` (CPU time / wall time)."""
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def one_cpu() -> set[int]:
    return {min(os.sched_getaffinity(0))}


def finish(vol: Proc, dealer: Dealer) -> str:
    dealer.done.set()
    try:
        code = vol.terminate()
    finally:
        vol.kill()
    log = vol.text()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    return log


def test_cpu_share_makes_the_volunteer_rest(template, tmp_path):
    """A quarter of the one core it may use: well under the whole core it takes without
    --cpu-share, whatever else runs here (another process can only take more from it). And it
    rests with nothing granted in hand: it asks for its next numbers only once the last are
    sampled and uploaded (no ask ahead), since numbers granted and not sampled hold the
    trainer's publish back (bench.host_share: the fleet stalled when it rested with them)."""
    vol, dealer, beat = start(template, tmp_path, "--cpu-share", "0.25", "--nice", "0",
                              "--prompts-per-batch", "8", cpus=one_cpu(), dealer=AskDealer)
    try:
        made = heartbeat(beat).get("groups_total", 0)
        used = cores_used(vol.p.pid, 15)
        wait_for(lambda: heartbeat(beat).get("groups_total", 0) > made, 60, "sampling meanwhile")
    finally:
        log = finish(vol, dealer)
    assert used <= 0.35, (used, log[-2000:])
    # (numbers dealt, groups uploaded) when each ask came: every number dealt was uploaded
    assert len(dealer.seen) >= 3 and all(d == u for d, u in dealer.seen), (dealer.seen, log[-2000:])


FAKE_BATTERY = Path(__file__).parent.parent / "helpers" / "fake_battery"


def power(path: Path, state: str) -> None:
    """What the volunteer's psutil reads as its power source (helpers/fake_battery)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(state)
    os.replace(tmp, path)


def test_on_battery_it_pauses_by_default_and_on_mains_it_resumes(template, tmp_path):
    """Issue 43's battery pause through a real volunteer, without --run-on-battery: this VM has
    no battery sensor, so psutil's reading of one is faked (helpers/fake_battery) and switched
    from mains to battery and back while it samples."""
    source = tmp_path / "power"
    power(source, "mains")
    path = os.pathsep.join(p for p in (str(FAKE_BATTERY), os.environ.get("PYTHONPATH")) if p)
    vol, dealer, beat = start(template, tmp_path,
                              env={"PYTHONPATH": path, "VRL_TEST_POWER_FILE": str(source)})
    try:
        assert heartbeat(beat).get("paused") is None
        power(source, "battery")
        wait_for(lambda: heartbeat(beat).get("paused"), 30, "a paused heartbeat")
        why = heartbeat(beat)["paused"]
        made = heartbeat(beat).get("groups_total", 0)
        time.sleep(3)  # paused: nothing more is made (the dealt numbers are all of v2, the newest)
        still = heartbeat(beat).get("groups_total", 0)
        power(source, "mains")
        wait_for(lambda: heartbeat(beat).get("paused") is None, 30, "a heartbeat not paused")
        wait_for(lambda: heartbeat(beat).get("groups_total", 0) > still, 60, "sampling again")
    finally:
        log = finish(vol, dealer)
    assert why == "on battery (--run-on-battery samples anyway)" and still == made, (why, made, still)
    assert "pausing: on battery" in log and "resuming: " in log, log[-2000:]
    assert "no battery sensor" not in log, log[-2000:]


@pytest.mark.slow
def test_cpu_share_holds_half_a_core_over_a_minute(template, tmp_path):
    """Issue 43: at --cpu-share 0.5, 0.5 +- 0.1 cores over 60 s of sampling, by process CPU
    time. The machine the volunteer may use is one core (its affinity), so half of it is half
    a core on any machine the suite runs on."""
    vol, dealer, beat = start(template, tmp_path, "--cpu-share", "0.5", cpus=one_cpu())
    try:
        used = cores_used(vol.p.pid, 60)
        made = heartbeat(beat).get("groups_total", 0)
        wait_for(lambda: heartbeat(beat).get("groups_total", 0) > made, 30,
                 "still sampling at the end of the minute")
    finally:
        log = finish(vol, dealer)
    assert 0.4 <= used <= 0.6, (used, log[-2000:])


@pytest.mark.slow
def test_a_busy_machine_pauses_it_and_a_free_one_resumes_it(template, tmp_path):
    """Issue 43: with a CPU hog beside it and --pause-when-busy 0.5 it pauses within 10 s (its
    heartbeat says why, and it stops using the CPU) and resumes within 10 s of the hog
    stopping."""
    vol, dealer, beat = start(template, tmp_path, "--pause-when-busy", "0.5")
    hogs = []
    try:
        assert heartbeat(beat).get("paused") is None
        spin = "while True: pass"
        hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
        hog_started = time.monotonic()
        wait_for(lambda: heartbeat(beat).get("paused"), 30, "a paused heartbeat")
        paused_after = time.monotonic() - hog_started
        idle_use = cores_used(vol.p.pid, 5)
        why = heartbeat(beat)["paused"]
        for h in hogs:
            h.kill()
            h.wait()
        hog_stopped = time.monotonic()
        wait_for(lambda: heartbeat(beat).get("paused") is None, 30, "a heartbeat not paused")
        resumed_after = time.monotonic() - hog_stopped
        made = heartbeat(beat).get("groups_total", 0)
        wait_for(lambda: heartbeat(beat).get("groups_total", 0) > made, 60, "sampling again")
    finally:
        for h in hogs:
            h.kill()
        log = finish(vol, dealer)
    assert paused_after <= 10 and resumed_after <= 10, (paused_after, resumed_after, log[-2000:])
    assert "--pause-when-busy 0.5" in why and idle_use < 0.05, (why, idle_use)
    assert "pausing: " in log and "resuming: " in log, log[-2000:]


@pytest.mark.slow
def test_a_pause_beside_a_live_trainer_leaves_no_number_missing(template, tmp_path):
    """A paused volunteer asks for nothing, and samples what it was granted once the trainer
    publishes past its version (host.owed_due): with a second volunteer keeping the trainer
    publishing through the pause, every number of both is received and none is counted
    missing or held back.
    (Whether it resumes is test_a_busy_machine_pauses_it_and_a_free_one_resumes_it's: here the
    trainer and the other volunteer keep this 2-core machine busy without the hogs.)"""
    from helpers.grants import assert_none_missing

    bucket = template.copy(tmp_path / "bucket")
    targs = ["trainer", "--bucket", str(bucket), "--groups-per-step", "8", "--quota-headroom", "0",
             "--eval-every", "0", "--eval-dataset", str(template.eval_csv), "--dashboard-every", "0",
             "--threads", "1", "--poll-seconds", "0.05", "--work-dir", str(tmp_path / "tw"),
             "--signing-key", str(template.key)]

    def volunteer(vid: str, *flags: str) -> list[str]:
        return ["volunteer", "--bucket", str(bucket), "--id", vid, "--trust-key", f"{template.key}.pub",
                "--threads", "1", "--prompts-per-batch", "8", "--shard-groups", "8",
                "--shard-seconds", "1", "--poll-seconds", "0.1", "--heartbeat-seconds", "0.5",
                "--work-dir", str(tmp_path / "vw"), *flags]

    procs = [Proc(targs, tmp_path / "trainer.log", tmp_path),
             Proc(volunteer("steady", "--nice", "0"), tmp_path / "steady.log", tmp_path),
             Proc(volunteer(VID, "--pause-when-busy", "0.5"), tmp_path / "laptop.log", tmp_path)]
    trainer, steady, laptop = procs
    beat = bucket / layout.heartbeat_key(VID)
    hogs = []

    def version() -> int:
        return json.loads((bucket / layout.MANIFEST).read_text())["version"]
    try:
        wait_for(lambda: "uploaded" in laptop.text(), 240, "the laptop's first upload")
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(os.cpu_count() or 1)]
        wait_for(lambda: heartbeat(beat).get("paused"), 60, "the laptop paused")
        paused_at = version()
        # The trainer moves on with the steady volunteer's groups: the laptop's granted
        # numbers reach the bottom of the window while it is paused, and are closed.
        wait_for(lambda: version() >= paused_at + 6, 240, "six versions published during the pause")
        for p in (laptop, steady, trainer):
            assert p.terminate() == 0, p.text()[-3000:]
    finally:
        for h in hogs:
            h.kill()
        for p in procs:
            p.kill()
    assert "pausing: " in laptop.text(), laptop.text()[-3000:]
    assert_none_missing(bucket, {"steady", VID})
