"""SIGINT and SIGTERM to a `vrl trainer` that a script started in the background.

bash starts `vrl trainer ... &` with SIGINT ignored, so Python installs no KeyboardInterrupt
handler: `kill -INT` used to leave such a trainer polling forever, and `kill -TERM` ended it
mid-step. Here the trainer is started the way bash starts it (vrlproc.as_background_job)
and stopped by a signal while a real volunteer feeds it, and once during its warm start.
It must exit 0 (within STOP_SECONDS, a hang guard), leaving a valid manifest whose checkpoint is complete,
metrics for every step it took, fleet.json and dashboard/ of its last version, and nothing
of any version above the manifest's. The phases of the handler are unit-tested in-process.
"""
from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import TEMPLATE_VERSION

from helpers.bucket_objects import assert_manifest_complete
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.protocol import layout
from volunteer_rl.storage import open_storage
from volunteer_rl.stopping import Stopped, StopSignal

STOP_SECONDS = 60.0
"""Signal to exit: a hang guard. The stop itself takes about a second (the current step, the
last publish, the views), then the interpreter's teardown, which a busy machine slows most;
the failures this catches never exit (a trainer that ignored the signal polls forever, or
runs its 100000 warm-start steps)."""
VERSIONED = (layout.CHECKPOINTS, layout.MANIFESTS, layout.METRICS, layout.LEDGER,
             layout.CREDIT, layout.ROLLOUTS, layout.QUARANTINE)


def background_trainer(bucket: Path, root: Path, *args: str) -> Proc:
    return Proc(["trainer", "--bucket", str(bucket), "--threads", "1", "--poll-seconds", "0.05",
                 "--work-dir", str(root / "tw"), *args], root / "trainer.log", root,
                {"OMP_NUM_THREADS": "1"}, background_job=True)


def signal_and_time(proc: Proc, signum: int) -> float:
    """Send `signum`; seconds until the process exited, which must be with 0."""
    sent = time.time()
    proc.p.send_signal(signum)
    try:
        code = proc.p.wait(STOP_SECONDS)
    except Exception:
        proc.kill()
        raise AssertionError(f"still running {STOP_SECONDS}s after signal {signum}:\n"
                             f"{proc.text()[-3000:]}")
    assert code == 0, proc.text()[-3000:]
    return time.time() - sent


def versions_above(bucket: Path, version: int) -> list[str]:
    """Keys of any version above `version`, and temp files left anywhere in the bucket."""
    storage = open_storage(str(bucket))
    keys = [k for top in VERSIONED for k in storage.list(top)
            if (layout.split_versioned_key(k) or (top, -1))[1] > version]
    return keys + [str(p) for p in bucket.rglob(".*") if p.is_file() and "tmp" in p.name]


def logged_steps(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"^step (\d+) v\d+ ", log, re.M)]


def metrics_steps(bucket: Path) -> list[int]:
    return [m["step"] for f in sorted((bucket / "metrics").glob("v*.jsonl"))
            for m in map(json.loads, f.read_text().splitlines()) if m["kind"] == "step"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_a_background_trainer_cleanly(template, tmp_path, signum):
    bucket = template.copy(tmp_path / "bucket")
    # Three steps per version: a signal most likely finds steps not yet published.
    trainer = background_trainer(bucket, tmp_path, "--groups-per-step", "4", "--publish-every", "3",
                                 "--max-staleness", "4", "--eval-dataset", str(template.eval_csv),
                                 "--signing-key", str(template.key))
    volunteer = Proc(["volunteer", "--bucket", str(bucket), "--id", "vol-1", "--threads", "1",
                      "--trust-key", f"{template.key}.pub", "--seed", "1", "--prompts-per-batch", "8",
                      "--shard-groups", "8", "--shard-seconds", "2", "--heartbeat-seconds", "2",
                      "--work-dir", str(tmp_path / "vw")], tmp_path / "vol.log", tmp_path)
    try:
        wait_for(lambda: len(logged_steps(trainer.text())) >= 4, 240, "four steps")
        seconds = signal_and_time(trainer, signum)
        assert volunteer.terminate() == 0
    finally:
        trainer.kill()
        volunteer.kill()
    log = trainer.text()
    print(f"signal {signum}: exited {seconds:.2f}s after it; {log.count('dashboard/ in')} dashboard writes")
    assert f"signal {signum}: finishing the current step and stopping" in log
    version = assert_manifest_complete(bucket, tmp_path)
    assert version > TEMPLATE_VERSION and f"trainer stopped at v{version}\n" in log
    assert versions_above(bucket, version) == []
    assert (bucket / layout.metrics_key(version)).exists()
    # every step it took went out with a version, metrics included, and none twice
    assert metrics_steps(bucket) == logged_steps(log) == list(range(1, len(logged_steps(log)) + 1))
    fleet = json.loads((bucket / layout.FLEET).read_text())
    assert fleet["trainer"]["version"] == version and "vol-1" in fleet["volunteers"]
    assert f"version {version}</h1>" in (bucket / "dashboard" / "index.html").read_text()
    assert "Traceback" not in log


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_during_the_warm_start_publishes_nothing(tmp_path, signum):
    bucket = tmp_path / "bucket"
    trainer = background_trainer(bucket, tmp_path, "--warm-start-steps", "100000")
    try:
        wait_for(lambda: "warm start step 1/" in trainer.text(), 120, "the warm start")
        seconds = signal_and_time(trainer, signum)
    finally:
        trainer.kill()
    print(f"signal {signum} in the warm start: exited {seconds:.2f}s after it")
    last = trainer.text().strip().splitlines()[-1]
    assert last == f"trainer stopped by signal {signum} before its first step; nothing published"
    assert not bucket.exists() or [p for p in bucket.rglob("*") if p.is_file()] == []


# --- the handler's phases, in-process ---------------------------------------------------------

def test_a_signal_mid_write_waits_for_the_write_then_stops():
    logs = []
    stop = StopSignal(logs.append)
    wrote = []
    with pytest.raises(Stopped) as exc:
        with stop.abortable():  # loading: nothing written yet
            with stop.shielded():  # a write
                stop._handle(signal.SIGINT, None)
                wrote.append("all of it")  # noted, the write goes on
            pytest.fail("the end of the write must stop an abortable phase")
    assert wrote == ["all of it"] and exc.value.signum == signal.SIGINT
    assert logs == []  # before the loop, whoever catches Stopped says it, in one line
    with pytest.raises(Stopped):  # an abortable phase entered after the signal stops at once
        with stop.abortable():
            pytest.fail("must not run")
    with stop.shielded():  # a write after it still runs (the loop's last publish)
        wrote.append("the last publish")
    assert wrote[-1] == "the last publish"


def test_a_signal_in_the_loop_is_logged_and_only_sets_the_event():
    logs = []
    stop = StopSignal(logs.append)
    stop._handle(signal.SIGTERM, None)  # the loop: no phase, nothing raised
    assert stop.is_set() and stop.wait(0)
    assert logs == [f"signal {signal.SIGTERM}: finishing the current step and stopping"]


def test_signal_in_an_abortable_phase_raises_there_and_a_second_one_exits(monkeypatch):
    stop = StopSignal(lambda line: None)
    with pytest.raises(Stopped):
        with stop.abortable():
            stop._handle(signal.SIGTERM, None)
            pytest.fail("the handler raises")
    assert stop.wait(0) and stop.signum == signal.SIGTERM

    def exit_now(code):
        raise SystemExit(code)
    monkeypatch.setattr("volunteer_rl.stopping.os._exit", exit_now)
    with pytest.raises(SystemExit) as exc:
        stop._handle(signal.SIGINT, None)
    assert exc.value.code == 128 + signal.SIGINT
