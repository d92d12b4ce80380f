"""SIGINT and SIGTERM for the trainer: stop at a point where nothing is half-made.

Installed explicitly, because neither default will do: a job a script starts with `&`
inherits SIGINT set to SIG_IGN (bash does that to background jobs, so Python never installs
its KeyboardInterrupt handler and `kill -INT` does nothing), and SIGTERM's default ends the
process wherever it is, mid-step.

The first signal sets an event. Where the trainer is only reading or computing (imports,
loading, the warm start, an evaluation), code runs inside `abortable()` and the handler also
raises `Stopped` there and then: nothing is lost by cutting that short. Everywhere else, the
loop, a publish, any write to the bucket, the code sees the event at its next check and
finishes what it was doing first. A second signal while stopping ends the process at once
(exit 128 + signal), as `kill -9` would: the manifest is the commit point, so even that leaves
no half-made version visible, only the state of the previous one.

Only stdlib here: the CLI installs it before it imports torch (seconds in which a signal must
count too).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class Stopped(BaseException):
    """A signal cut short a phase that writes nothing. A BaseException, like
    KeyboardInterrupt, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class StopSignal:
    """The stop request (an event), the handlers that set it, and the abortable phases."""

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log
        self.event = threading.Event()
        self.signum: int | None = None
        self._abortable = False
        self._under_abortable = False  # a write inside an abortable phase: Stopped comes after it

    def is_set(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking at once when a stop is requested."""
        return self.event.wait(seconds)

    def install(self) -> StopSignal:
        """SIGINT and SIGTERM to `_handle`, whatever the process inherited. Main thread only."""
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():
            self._say(f"signal {signum} again: exiting now")
            os._exit(128 + signum)
        self.signum = signum
        self.event.set()
        if self._abortable:
            raise Stopped(signum)  # whoever catches it says what was cut short, in one line
        if not self._under_abortable:  # else the same: Stopped at the end of the write
            self._say(f"signal {signum}: finishing the current step and stopping")

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
            if abortable and self.event.is_set():
                raise Stopped(self.signum)  # it came before this phase began
            yield
        finally:
            self._abortable, self._under_abortable = outer, under
        if outer and self.event.is_set():
            raise Stopped(self.signum)  # it came while shielded: stop as soon as it is safe

    def abortable(self):
        """A phase that writes nothing: a signal (or an earlier one) raises Stopped here."""
        return self._mode(True)

    def shielded(self):
        """A phase that writes, inside an abortable one: a signal waits for its end."""
        return self._mode(False)
