"""The trainer's handle on one reward worker process (task.bounded_worker): starting it, its
pipes, its CPU clock, and ending it with every process it started.

The worker is started with Popen, never a fork of the trainer (a large torch process), with
PYTHONPATH set to the trainer's sys.path so a plugin the trainer can import (`pip install
--target X` plus PYTHONPATH, a checkout, pytest's rootdir) imports in the worker too. It runs
in its own session, so a Ctrl-C at the trainer's terminal does not kill it mid-batch, and
ending it kills its process group. Requests are written without ever blocking (the pipe is
non-blocking and poll tells when it takes more); its stderr is drained all the time and its
last line kept for errors. task.bounded decides what is a breach; this module only reports
what the process did.
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import sys
import threading

from volunteer_rl.protocol.printable import printable

STDERR_TAIL = 4096
"""Bytes of the worker's stderr kept (the last ones), for the one-line error when it fails."""


class WorkerProcess:
    """One worker process and the parent's ends of its pipes."""

    def __init__(self, value: str, memory_mb: int):
        env = dict(os.environ)
        # The worker imports from exactly where we do: our sys.path, absolute ('' is our cwd).
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path
                                            if isinstance(p, str))
        # ...and not also from its cwd, which `-m` would put first: a `vrl` run from inside
        # another checkout would load that checkout's code (Python 3.11+; 3.10 ignores it).
        env["PYTHONSAFEPATH"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "volunteer_rl.task.bounded_worker", value, str(int(memory_mb)),
             str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            close_fds=True, start_new_session=True)
        self.pid = self.proc.pid
        self.w = self.proc.stdin.fileno()
        self.r = self.proc.stdout.fileno()
        os.set_blocking(self.w, False)
        # poll, not select: a trainer holding many files can have fds past select's 1024.
        self.poller = select.poll()
        self.poller.register(self.r, select.POLLIN)
        self.polling_w = False
        self.buf = b""  # bytes read from the worker after its last complete line
        self.tail = b""
        # stderr is drained all the time: a task that logs a lot would otherwise fill the
        # pipe, block in write and look like a timeout.
        self.drain = threading.Thread(target=self._drain, daemon=True,
                                      name=f"reward-stderr-{self.pid}")
        self.drain.start()
        self.stat = f"/proc/{self.pid}/stat"
        self.has_proc = os.path.exists(self.stat)
        self.tick = os.sysconf("SC_CLK_TCK") if self.has_proc else 100

    def _drain(self) -> None:
        # This thread owns the stderr pipe and closes it at EOF: closed from another thread
        # while it reads (a grandchild that left the group can hold it open), the fd number
        # could be reused and this read would take another file's bytes.
        stderr = self.proc.stderr
        try:
            while True:
                chunk = os.read(stderr.fileno(), 65536)
                if not chunk:
                    return
                self.tail = (self.tail + chunk)[-STDERR_TAIL:]
        except OSError:
            return
        finally:
            stderr.close()

    def last_stderr_line(self) -> str:
        self.drain.join(timeout=1.0)
        lines = [x for x in self.tail.decode("utf-8", "replace").splitlines() if x.strip()]
        return printable(lines[-1].strip()) if lines else ""

    def cpu(self) -> float:
        """The worker's CPU seconds (user + system, all its threads) from /proc."""
        with open(self.stat, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime: fields 14, 15

    def lines(self, timeout: float,
              writing: bytes | bytearray = b"") -> tuple[list[bytes], bool, int]:
        """Wait up to `timeout` for the worker; write what it takes of `writing`. Returns the
        complete lines it wrote, whether its stdout ended, and how many bytes it took (-1:
        its stdin is closed)."""
        if bool(writing) != self.polling_w:
            if writing:
                self.poller.register(self.w, select.POLLOUT)
            else:
                self.poller.unregister(self.w)
            self.polling_w = bool(writing)
        events = dict(self.poller.poll(max(0, math.ceil(timeout * 1000))))
        took = 0
        if self.w in events:
            try:
                took = os.write(self.w, writing)
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                took = -1  # the worker is gone; its stdout says how (EOF next)
        if self.r not in events:
            return [], False, took
        chunk = os.read(self.r, 1 << 16)
        if not chunk:
            return [], True, took
        parts = (self.buf + chunk).split(b"\n")
        self.buf = parts.pop()
        return parts, False, took

    def exited(self) -> bool:
        """Whether the worker has ended, without reaping it: until it is reaped its pid, and
        so its process group's id, cannot be reused, and kill() may still signal the group."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except (AttributeError, OSError):  # no waitid here
            return self.proc.poll() is not None

    def end(self) -> int:
        """Kill the worker and any process it started (its own session), reap it, and return
        its exit code (negative: the signal). An exit code it had already made stands."""
        if self.proc.returncode is None:  # not reaped: the group id is still its own
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> None:
        self.end()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.drain.join(timeout=1.0)
