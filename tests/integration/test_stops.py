"""Stop signals to real `vrl` processes in the phases before their loop: the imports, the
model build, the warm start (Linux: the tests see torch's import in /proc/<pid>/maps).

Each process is started the way a script's `vrl ... &` starts it (SIGINT ignored:
vrlproc.as_background_job), is signalled, and must exit 0 within STOP_SECONDS (generous for
a loaded machine; the bugs made it minutes, or never) with one line saying it stopped and no
"Exception ignored" or traceback. The trainer's stops in its loop are test_trainer_signals.py's.
"""
from __future__ import annotations

import signal
import textwrap
import time
from pathlib import Path

from helpers.vrlproc import Proc, wait_for

STOP_SECONDS = 20.0
"""Signal to the process's line saying it stopped: the stop itself."""
EXIT_SECONDS = 60.0
"""That line to the exit: the interpreter's teardown, which a busy machine slows most."""


def stopped_in_time(proc: Proc, signum: int) -> float:
    """Send `signum`; seconds until the process said it stopped, after which it must exit
    with 0, cleanly."""
    sent = time.time()
    proc.p.send_signal(signum)
    try:
        wait_for(lambda: proc.p.poll() is not None or " stopped " in proc.text(), STOP_SECONDS,
                 f"a line saying it stopped after signal {signum}", interval=0.1)
    except AssertionError:
        proc.kill()
        raise AssertionError(
            f"no stop {STOP_SECONDS}s after signal {signum}:\n{proc.text()[-3000:]}") from None
    said = time.time() - sent
    code = proc.wait(EXIT_SECONDS)
    log = proc.text()
    assert code == 0, log[-3000:]
    assert "Exception ignored" not in log and "Traceback" not in log, log[-3000:]
    return said


def importing_torch(proc: Proc) -> bool:
    """Has the process begun importing torch (its library mapped)? What follows is seconds of
    imports, in which a stop must count: the handlers came only after them."""
    try:
        return "libtorch" in Path(f"/proc/{proc.p.pid}/maps").read_text()
    except OSError:
        return False


def test_sigint_while_a_background_volunteer_imports_torch_stops_it(tmp_path):
    """The volunteer used to install its handlers after importing torch: until then SIGINT
    was ignored (a background job's), and it went on waiting for a manifest for ever. (The
    issue saw it in the volunteer's first second; on a busy machine the imports take longer.)"""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    volunteer = Proc(["volunteer", "--bucket", str(bucket), "--threads", "1",
                      "--work-dir", str(tmp_path / "vw")], tmp_path / "vol.log", tmp_path,
                     background_job=True)
    try:
        wait_for(lambda: importing_torch(volunteer), 60, "the volunteer importing torch")
        seconds = stopped_in_time(volunteer, signal.SIGINT)
    finally:
        volunteer.kill()
    print(f"volunteer stopped {seconds:.1f}s after SIGINT")
    last = volunteer.text().strip().splitlines()[-1]
    assert last in (f"volunteer stopped by signal {signal.SIGINT} before it started",
                    f"volunteer {last.split()[1]} stopped after uploading 0 groups")


def test_sigterm_while_the_trainer_imports_and_builds_stops_it(tmp_path):
    bucket = tmp_path / "bucket"
    trainer = Proc(["trainer", "--bucket", str(bucket), "--threads", "1",
                    "--work-dir", str(tmp_path / "tw")], tmp_path / "trainer.log", tmp_path,
                   background_job=True)
    try:
        wait_for(lambda: importing_torch(trainer), 60, "the trainer importing torch")
        stopped_in_time(trainer, signal.SIGTERM)
    finally:
        trainer.kill()
    last = trainer.text().strip().splitlines()[-1]
    assert last == (f"trainer stopped by signal {signal.SIGTERM} before its first step; "
                    "nothing published")
    assert not bucket.exists() or [p for p in bucket.rglob("*") if p.is_file()] == []


# Each warm-start step runs inside a __del__, as transformers' imports ran inside the regex
# module's Group.__del__ when the stop came: Python prints the Stopped raised there as
# "Exception ignored in: ...__del__" and goes on. Loaded through sitecustomize, before the CLI.
SWALLOWING_FINALIZER = textwrap.dedent('''
    import volunteer_rl.trainer.warmstart as warmstart

    _step = warmstart._step

    class _Finalized:
        def __init__(self, work):
            self.work = work

        def __del__(self):
            self.work()

    def step_in_a_finalizer(*args):
        out = []
        _Finalized(lambda: out.append(_step(*args)))  # dropped at once: __del__ runs the step
        return out[0] if out else float("nan")

    warmstart._step = step_in_a_finalizer
''')


def test_sigterm_swallowed_by_a_finalizer_still_stops_the_warm_start(tmp_path):
    """The stop used to be raised once, inside the finalizer, and lost there: the warm start
    went on (once for 10 minutes)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SWALLOWING_FINALIZER)
    bucket = tmp_path / "bucket"
    trainer = Proc(["trainer", "--bucket", str(bucket), "--threads", "1",
                    "--warm-start-steps", "100000", "--work-dir", str(tmp_path / "tw")],
                   tmp_path / "trainer.log", tmp_path, {"PYTHONPATH": str(inject)},
                   background_job=True)
    try:
        wait_for(lambda: "warm start step 1/" in trainer.text(), 180, "the warm start")
        seconds = stopped_in_time(trainer, signal.SIGTERM)
    finally:
        trainer.kill()
    print(f"trainer stopped {seconds:.1f}s after SIGTERM in the warm start")
    last = trainer.text().strip().splitlines()[-1]
    assert last == (f"trainer stopped by signal {signal.SIGTERM} before its first step; "
                    "nothing published")

