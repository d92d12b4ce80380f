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
