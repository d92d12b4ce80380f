"""SIGINT and SIGTERM for the trainer and the volunteer: stop at a point where nothing is
half-made, and within seconds whatever the process is doing.

Installed explicitly, because neither default will do: a job a script starts with `&`
inherits SIGINT set to SIG_IGN (bash does that to background jobs, so Python never installs
its KeyboardInterrupt handler and `kill -INT` does nothing), and SIGTERM's default ends the
process wherever it is, mid-step. Installing a handler overrides the inherited SIG_IGN on
purpose: a user who sends SIGINT to a process means it, however the shell started it. The
CLI installs the handlers first, before it imports torch or transformers (seconds in which a
signal must count too), which is why this module is stdlib only and sits below every room.

The first signal sets a flag. Where the process is only reading or computing (imports,
building or loading a model, the warm start, an evaluation), code runs
inside `abortable()` and the handler also raises `Stopped` there and then: nothing is lost by
cutting that short. Everywhere else (the loop, a publish, any write to the bucket), the code
sees the request at its next check and finishes what it was doing first; so does a
volunteer's batch being sampled, whose group numbers are reserved (volunteer.numbering). A signal that finds
an abortable phase inside an import ends the process there (exit 0): an exception raised
into a C extension's initialisation cannot be undone (`_stop_here`). A second signal
while stopping ends the process at once (exit 128 + signal), as `kill -9` would: the
manifest is the commit point, so even that leaves no half-made version visible.

An exception raised from a signal handler lands wherever the main thread happens to be, and
some places swallow it: a `__del__` (Python prints "Exception ignored in: ...__del__" and
goes on; the regex module's Group.__del__ runs while transformers compiles its patterns at
import), or a library's `except BaseException`. So the handler does not raise inside a
finalizer, and while an abortable phase still runs after a stop, the stop is delivered again
every REDELIVER_SECONDS until it lands (`_redeliver`); long loops of our own also call
`check()` between their steps.

The handler takes no lock. It runs in the main thread between two bytecodes, wherever that
thread is, and a lock the main thread already holds there is never released: a
`threading.Event` set from the handler deadlocked the process whenever the signal landed
inside that event's own `wait` (a volunteer waiting out its quota in 0.1-s waits, SIGKILLed
by the demo after 60 s; each further signal ran into the same lock). So the stop request is a
plain attribute, `wait` sleeps in slices of WAIT_SLICE_SECONDS looking at it, and the
redelivery thread is started by `install`, not by the handler (starting a thread takes
threading's own locks).
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

REDELIVER_SECONDS = 0.5
"""How often a stop is raised again in an abortable phase that is still running after it."""
WAIT_SLICE_SECONDS = 0.05
"""`wait` sleeps at most this long between two looks at the stop request: how late a stop
can end a wait (a signal cuts the sleep short, but the sleep resumes after the handler)."""

_installed: StopSignal | None = None  # the process's, once install() ran (signals are per process)


class Stopped(BaseException):
    """A signal cut short a phase that writes nothing. A BaseException, like
    KeyboardInterrupt, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class StopSignal:
    """The stop request (a flag), the handlers that set it, and the abortable phases.
    `then` is what the process says it does when a signal finds it outside such a phase."""

    def __init__(self, log: Callable[[str], None] = print,
                 then: str = "finishing the current step and stopping",
                 last_words: Callable[[int], str] | None = None):
        self.log = log
        self.then = then
        self.last_words = last_words or (
            lambda signum: f"stopped by signal {signum} while loading libraries; nothing written")
        """The line the process ends with when a stop finds it inside an import (_stop_here)."""
        self.requested = False
        """The stop request: set by the handler (or `set`), never cleared. A plain attribute,
        not a threading.Event: the handler may take no lock (module docstring)."""
        self.signum: int | None = None
        self._abortable = False
        self._under_abortable = False  # a write inside an abortable phase: Stopped comes after it
        self._again = False  # the next call of the handler is _redeliver's, not a new signal
        self._redeliverer: threading.Thread | None = None

    def is_set(self) -> bool:
        return self.requested

    def set(self) -> None:
        """Request the stop without a signal (a program of its own, a test): what the
        handler records."""
        self.requested = True

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, ending within WAIT_SLICE_SECONDS of a stop request; True
        if one came. From any thread."""
        deadline = time.monotonic() + seconds
        while not self.requested:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, WAIT_SLICE_SECONDS))
        return True

    def install(self) -> StopSignal:
        """SIGINT and SIGTERM to `_handle`, whatever the process inherited (SIG_IGN
        included), and the redelivery thread. Main thread only."""
        global _installed
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        _installed = self
        if self._redeliverer is None:
            self._redeliverer = threading.Thread(target=self._redeliver, daemon=True,
                                                 name="stop-redelivery")
            self._redeliverer.start()
        return self

    def _handle(self, signum, frame) -> None:
        if self._again:  # _redeliver's call: the stop again, not a second signal
            self._again = False
            if self._abortable and not _in_finalizer(frame):
                self._stop_here(frame)
            return
        if self.requested:
            self._say(f"signal {signum} again: exiting now")
            os._exit(128 + signum)
        self.signum = signum
        self.requested = True
        if self._abortable:
            if not _in_finalizer(frame):
                self._stop_here(frame)
            return
        if not self._under_abortable:  # else the same: Stopped at the end of the write
            self._say(f"signal {signum}: {self.then}")

    def _stop_here(self, frame) -> None:
        """Cut the abortable phase short: raise Stopped, whose catcher says what was cut short
        in one line. Inside an import the process ends at once instead (exit 0): an exception
        raised while a C extension initialises leaves it half-made, and the next import of it
        fails ("cannot load module more than once per process", numpy's), a traceback where a
        stop was asked for; an abortable phase has written nothing, so there is nothing to
        finish."""
        if _in_import(frame):
            self._say(self.last_words(self.signum))
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError, RuntimeError):
                    pass
            os._exit(0)
        raise Stopped(self.signum)

    def _redeliver(self) -> None:
        """While the main thread is still in an abortable phase after the stop (the Stopped
        raised there was swallowed, or deferred out of a finalizer), raise it again. Only
        for the installed handlers: interrupt_main reaches whatever handles the signal."""
        while True:
            time.sleep(REDELIVER_SECONDS)
            if _installed is not self:
                return
            if self.requested and self._abortable and not self._again:
                self._again = True
                _thread.interrupt_main(self.signum)  # runs _handle in the main thread

    def _say(self, line: str) -> None:
        # The handler runs between two bytecodes of the main thread, which may be inside a
        # print of its own: the buffered stdout then refuses a reentrant write.
        try:
            self.log(line)
        except RuntimeError:
            os.write(2, (line + "\n").encode())

    @contextmanager
    def _mode(self, abortable: bool) -> Iterator[None]:
        outer, under = self._abortable, self._under_abortable
        self._abortable, self._under_abortable = abortable, outer or under
        try:
            if abortable and self.requested:
                raise Stopped(self.signum)  # it came before this phase began
            yield
        finally:
            self._abortable, self._under_abortable = outer, under
        if (outer or abortable) and self.requested:
            # It came while shielded: stop as soon as it is safe. Or this abortable phase
            # ran to its end although a stop came during it (swallowed on the way).
            raise Stopped(self.signum)

    def abortable(self):
        """A phase that writes nothing: a signal (or an earlier one) raises Stopped here."""
        return self._mode(True)

    def shielded(self):
        """A phase that writes, inside an abortable one: a signal waits for its end."""
        return self._mode(False)

    def check(self) -> None:
        """Raise Stopped if a stop was requested and this is an abortable phase: for a long
        loop of our own, between its steps, in case the handler's Stopped was swallowed."""
        if self._abortable and self.requested:
            raise Stopped(self.signum)


def _in_finalizer(frame) -> bool:
    """Is the main thread inside a `__del__`? An exception raised there is printed as
    "Exception ignored" and lost."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _in_import(frame) -> bool:
    """Is the main thread inside an import (importlib's frozen bootstrap on its stack)?"""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def check_stop() -> None:
    """StopSignal.check of the process's installed handlers (nothing if none is installed)."""
    if _installed is not None:
        _installed.check()


def stop_requested() -> bool:
    """Has the process been asked to stop (a signal to its installed handlers)?"""
    return _installed is not None and _installed.is_set()


def sleep(seconds: float) -> bool:
    """Sleep up to `seconds`, at once cut short by a stop request; True if one came. In an
    abortable phase the signal raises Stopped out of it instead."""
    if _installed is None:
        time.sleep(seconds)
        return False
    return _installed.wait(seconds)
