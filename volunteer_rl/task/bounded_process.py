"""The trainer's handle on one reward worker process (task.bounded_worker): starting it, its
pipes, its CPU clock, and ending it with every process it started.

The worker is started with Popen, never a fork of the trainer (a large torch process), with
PYTHONPATH set to the trainer's sys.path so a plugin the trainer can import (`pip install
--target X` plus PYTHONPATH, a checkout, pytest's rootdir) imports in the worker too. What it
gets of the trainer is no more than that: an environment of ENV_KEPT alone (no cloud
credentials, no VRL_* settings, no key path), a fresh empty folder of its own as its working
folder, HOME and TMPDIR (removed when it ends), and no descriptor but its three pipes. It runs
in its own session, so a Ctrl-C at the trainer's terminal does not kill it mid-batch; inside,
it walls itself in (task.sandbox) and says how in its ready line (`take_ready`). Ending it
kills its PID namespace's first process, which takes every process the worker started
whatever group or session they moved to, and its process group. Requests are written
without ever blocking (the pipe is non-blocking and poll tells when it takes more); its
stderr is drained all the time and its last line kept for errors. task.bounded decides what
is a breach; this module only reports what the process did.
"""

from __future__ import annotations

import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from volunteer_rl.protocol.printable import printable

STDERR_TAIL = 4096
"""Bytes of the worker's stderr kept (the last ones), for the one-line error when it fails."""
ENV_KEPT = ("PATH", "LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED", "PYTHONUTF8", "PYTHONIOENCODING")
"""The trainer's environment variables a reward worker gets (with every LC_* locale variable):
what finds programs and decodes text the same way. Everything else, cloud credentials and
vrl's own settings included, stays with the trainer; HOME, TMPDIR, PYTHONPATH and
PYTHONSAFEPATH are set for it."""
FOLDER_PREFIX = "vrl-reward-"
"""The start of the name of each worker's own folder, made in the trainer's temporary folder."""

_said: set[str] = set()  # the walls this process already said a kernel refused


def worker_env(folder: str) -> dict[str, str]:
    """The environment of a worker whose own folder is `folder`."""
    env = {k: v for k, v in os.environ.items() if k in ENV_KEPT or k.startswith("LC_")}
    # The worker imports from exactly where we do: our sys.path, absolute ('' is our cwd)...
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path
                                        if isinstance(p, str))
    # ...and not also from its cwd, which `-m` would put first (Python 3.11+; 3.10 ignores it).
    env["PYTHONSAFEPATH"] = "1"
    env["HOME"] = env["TMPDIR"] = folder
    return env


class WorkerProcess:
    """One worker process, its folder, and the parent's ends of its pipes."""

    def __init__(self, value: str, memory_mb: int):
        self.folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "volunteer_rl.task.bounded_worker", value,
                 str(int(memory_mb)), str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=worker_env(self.folder), cwd=self.folder, close_fds=True,
                start_new_session=True)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self.pid = self.proc.pid
        self.reaper: int | None = None  # a pidfd of its PID namespace's first process
        self.refused: dict[str, str] = {}  # the walls the kernel refused it: why (take_ready)
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
        try:
            self.drain.start()
        except RuntimeError as exc:  # no thread to be had: a start-up fault like EMFILE
            self.proc.stderr.close()
            self.kill()
            raise OSError(f"cannot start a thread ({exc})") from None
        self.stat = f"/proc/{self.pid}/stat"
        self.has_proc = os.path.exists(self.stat)
        self.tick = os.sysconf("SC_CLK_TCK") if self.has_proc else 100

    def take_ready(self, msg: dict) -> None:
        """Keep what the worker's ready line says of its walls: a handle on its PID
        namespace's first process (checked to be the worker's child), and one line on stderr,
        once per process, for each wall the kernel refused."""
        pid = msg.get("reaper")
        if type(pid) is int and pid > 0 and hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                fd = None
            if fd is not None and self._parent_of(pid) == self.pid:
                self.reaper = fd
            elif fd is not None:
                os.close(fd)
        refused = msg.get("refused")
        self.refused = {printable(str(wall), 40): printable(str(why), 200)
                        for wall, why in (refused.items() if isinstance(refused, dict) else ())}
        for wall, why in self.refused.items():
            line = (f"warning: reward worker: the kernel refused its {wall} ({why}); a "
                    "completion that takes over the task's reward can reach more of this "
                    "machine (docs/THREATS.md, class 17)")
            if line not in _said:
                _said.add(line)
                print(line, file=sys.stderr, flush=True)

    @staticmethod
    def _parent_of(pid: int) -> int | None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None

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
        """Kill every process the worker started (its PID namespace's first process takes
        them all along), then the worker and its process group; reap it and return its exit
        code (negative: the signal). An exit code it had already made stands."""
        if self.reaper is not None:
            try:
                signal.pidfd_send_signal(self.reaper, signal.SIGKILL)
            except OSError:  # already gone
                pass
            os.close(self.reaper)
            self.reaper = None
        if self.proc.returncode is None:  # not reaped: the group id is still its own
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> None:
        """end() it, close the parent's ends of its pipes and remove its folder."""
        self.end()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        if self.drain.ident is not None:  # started
            self.drain.join(timeout=1.0)
        shutil.rmtree(self.folder, ignore_errors=True)
