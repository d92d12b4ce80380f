"""stopping.py in-process: a stop that Python would swallow is not lost. The real processes
are tests/integration/test_stops.py."""
from __future__ import annotations

import signal
import sys
import time

import pytest

from volunteer_rl import stopping
from volunteer_rl.stopping import Stopped, StopSignal


@pytest.fixture
def installed():
    """A StopSignal with its handlers installed in this process, put back afterwards."""
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopSignal(lambda line: None).install()
    try:
        yield stop
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        stopping._installed = None


def test_a_stop_landing_in_a_finalizer_is_raised_again_outside_it(installed):
    class Finalized:
        def __del__(self):  # the signal arrives while a finalizer runs
            installed._handle(signal.SIGTERM, sys._getframe())

    with pytest.raises(Stopped):
        with installed.abortable():
            Finalized()  # dropped at once; raising in its __del__ would be "Exception ignored"
            assert installed.is_set()
            deadline = time.time() + 10 * stopping.REDELIVER_SECONDS
            while time.time() < deadline:
                time.sleep(0.01)  # where the redelivered stop lands
            pytest.fail("the stop was not raised again")


def test_a_swallowed_stop_ends_the_phase_at_its_next_check_or_its_end():
    stop = StopSignal(lambda line: None)
    checked = []
    with pytest.raises(Stopped):
        with stop.abortable():
            try:
                stop._handle(signal.SIGTERM, None)
            except Stopped:
                pass  # a library's `except BaseException`
            checked.append("went on")
            stop.check()  # a loop of our own, between steps
            checked.append("past the check")
    assert checked == ["went on"]
    other = StopSignal(lambda line: None)
    with pytest.raises(Stopped):
        with other.abortable():
            try:
                other._handle(signal.SIGTERM, None)
            except Stopped:
                pass
    # outside any abortable phase check() never raises: the loop decides when to stop
    other.check()


# A module that receives the stop in the middle of its own import: the handler then runs with
# importlib's bootstrap on the stack, as when a signal lands while torch loads numpy's C core
# (an exception raised there left numpy half-made and its next import failed with "cannot load
# module more than once per process", a traceback instead of a stop).
IMPORT_STOPPED = '''
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from volunteer_rl.stopping import Stopped, StopSignal
stop = StopSignal(print, last_words=lambda n: f"last words after signal {n}").install()
try:
    with stop.abortable():
        import stopped_here
except Stopped:
    print("Stopped raised out of the import")
    sys.exit(3)
print("the import ran to its end")
'''


def test_a_stop_inside_an_import_ends_the_process_there_with_its_last_words(tmp_path):
    import subprocess

    (tmp_path / "stopped_here.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGTERM)\n"
        "for _ in range(100):\n    time.sleep(0.01)\n")
    r = subprocess.run([sys.executable, "-c", IMPORT_STOPPED, str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"last words after signal {signal.SIGTERM}\n"), r
    assert "Traceback" not in r.stderr, r.stderr


# The volunteer waits out its quota and the trainer its rollouts in short waits, so a signal
# often lands while the main thread is inside `wait`. The handler ran `threading.Event.set`,
# whose lock `Event.wait` holds around its own sleep: a signal landing there deadlocked the
# process for good (every further signal ran into the same lock). Many trials, each a new
# stop signalled at a random moment of a tight loop of zero-length waits, must all end.
WAITING_STOPPED = '''
import os, random, signal, sys, threading
sys.path.insert(0, sys.argv[1])
from volunteer_rl.stopping import StopSignal
rng = random.Random(0)
for trial in range(int(sys.argv[2])):
    stop = StopSignal(lambda line: None).install()
    threading.Timer(rng.uniform(0, 0.002), os.kill, (os.getpid(), signal.SIGTERM)).start()
    while not stop.wait(0):
        pass
print("all stopped")
'''


def test_a_signal_landing_inside_a_wait_stops_it_every_time():
    import subprocess
    from pathlib import Path

    root = str(Path(stopping.__file__).resolve().parents[1])
    try:
        r = subprocess.run([sys.executable, "-c", WAITING_STOPPED, root, "300"],
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a stop signal that landed inside StopSignal.wait hung the process")
    assert (r.returncode, r.stdout) == (0, "all stopped\n"), r


def test_wait_returns_at_its_timeout_or_soon_after_a_stop_from_another_thread():
    import threading

    stop = StopSignal(lambda line: None)
    started = time.monotonic()
    assert stop.wait(0.1) is False
    assert time.monotonic() - started >= 0.1
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    assert stop.wait(30) is True
    assert time.monotonic() - started < 10  # a slice, not the 30 s asked for
