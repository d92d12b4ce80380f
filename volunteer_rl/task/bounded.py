"""A task's reward under a time and memory bound per completion, in a worker process.

The trainer recomputes the reward of every completion a volunteer uploads, and the text is the
volunteer's to choose. A task's reward (vrl's own or a third-party plugin) can be slow or
hungry on crafted text: catastrophic regex backtracking, `10**10**7`, a Python loop, a sleep,
a GB allocation. Most of that runs in C, where nothing inside the process can interrupt it,
so the reward runs in a separate worker process the trainer can kill. A completion that
takes its reward over a bound ends as RewardBoundExceeded with a reason code; the trainer
refuses the shard holding it. Never a stall, never a crash of the trainer.

This module owns both ends: `BoundedRewards` in the trainer, and `main`, the worker
(`python -m volunteer_rl.task.bounded MODULE:CLASS MEMORY_MB PARENT_PID`). The worker is
started with Popen, never a fork of the trainer (a large torch process), with PYTHONPATH set
to the trainer's sys.path so a plugin the trainer can import (`pip install --target X` plus
PYTHONPATH, a checkout, pytest's rootdir) imports in the worker too. It loads the task once
(START_SECONDS at most, or TaskError) and answers one JSON line per request, in order;
requests are ASCII-only JSON, so any completion text (newlines, U+2028, lone surrogates)
arrives exactly. A breach kills the worker; the next call starts a fresh one, so one hostile
completion costs one bound and one start (~0.15 s). The overhead is ~15 us a completion
against ~2 us in-process for a cheap task: some 50,000 rewards a second.

The bounds, per completion:

- CPU time (`seconds`, the task's reward_seconds): the rule. The machine is shared and noisy,
  so wall clock would refuse honest shards whenever the trainer is descheduled. On Linux the
  parent reads the worker's utime+stime from /proc/<pid>/stat while it waits for a result
  (polling every POLL_MAX seconds at most) and kills it once the completion has used more
  than `seconds` -> `reward_timeout`. The worker reports its own CPU clock after each result,
  so each completion is charged from where the previous one ended.
- Wall clock backstop: a reward that blocks without using CPU (time.sleep, a lock, a read)
  never trips the CPU rule, so there is also a wall bound of `wall_backstop(seconds)` =
  max(10 * seconds, seconds + 5) per completion (10 s for the default 1 s) ->
  `reward_timeout`. Generous on purpose: it is there to end a stall, not to measure work.
- Without /proc (macOS, the BSDs) there is no cheap way to read another process's CPU time
  with the stdlib, so the rule is wall clock over `seconds`: stricter on a busy machine (an
  honest shard can be refused while the trainer is starved of CPU), never looser.
- Memory (`memory_mb`, the task's reward_memory_mb): after loading the task, the worker sets
  RLIMIT_AS to its address space at that point (VmSize) plus `memory_mb` MiB. An allocation
  past it fails with MemoryError -> the worker reports it and exits -> `reward_memory`. This
  bounds address space, not resident memory: threads a task starts later reserve stacks and
  malloc arenas (64 MiB each with glibc) against it, and whatever a task keeps between
  rewards (a cache) counts too, so size `memory_mb` with room. On macOS there is no
  /proc/self/status and the kernel does not enforce RLIMIT_AS: memory is NOT bounded there.
- Anything else that ends the worker mid-completion (os._exit, a segfault, the OOM killer) ->
  `reward_crash`.

What the worker returns is exactly what base.completion_reward gives for the same text
in-process (the volunteer computes its claimed reward that way and the two must agree): the
task's reward through base.clamp_reward, and 0.0 when the task raises an Exception or
returns a non-number. The one deliberate difference is MemoryError, which in-process is an
Exception like any other (0.0) and here is a breach.

Limits: POSIX only (poll on pipes, RLIMIT_AS; Windows is not supported). The worker runs in its
own session, so a Ctrl-C at the trainer's terminal does not kill it mid-batch; the trainer
ending kills it (close(), the finalizer at interpreter exit, and on Linux PR_SET_PDEATHSIG
even when the trainer is SIGKILLed). Elsewhere a trainer killed while a reward runs leaves the
worker running until that reward ends. Processes a task starts are killed with the worker's
process group, but their CPU time is not counted. Not thread-safe: one BoundedRewards per
thread, which also suits PDEATHSIG (it fires when the *thread* that started the worker ends;
a worker found dead between calls is replaced without blaming a completion).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Sequence

from volunteer_rl.protocol.printable import printable
from volunteer_rl.task.base import Row, clamp_reward
from volunteer_rl.task.registry import TaskError, load_object

# -----------------------------------------------------------------------------
# Limits

START_SECONDS = 60.0
"""Wall clock a worker gets to start and load its task (a plugin's imports can be slow on a
busy machine); past it, TaskError."""
POLL_MAX = 0.05
"""Seconds between two reads of the worker's CPU time while a completion runs: a breach
overshoots its bound by at most this (plus a clock tick)."""
WRITE_AHEAD = 1 << 16
"""Request bytes encoded ahead of what the worker's pipe has taken: keeps a large batch from
sitting in memory twice, and the parent never blocks on a write (the pipe is non-blocking
and poll tells when it takes more), so it keeps watching the clock and reading results."""
MEMORY_EXIT = 86
"""The worker's exit code after a MemoryError, in case it could not even write the line."""
STDERR_TAIL = 4096
"""Bytes of the worker's stderr kept (the last ones), for the one-line error when it fails."""
CODES = ("reward_timeout", "reward_memory", "reward_crash")


def wall_backstop(seconds: float) -> float:
    """The wall-clock bound of one completion whose reward has CPU bound `seconds`."""
    return max(10.0 * seconds, seconds + 5.0)


class RewardBoundExceeded(Exception):
    """A completion took its task's reward over a bound. `code` is one of CODES; `detail` is
    one printable line ("completion 3: over 1.0 s of CPU"); `index` is the completion's
    position in the batch."""

    def __init__(self, code: str, detail: str, index: int):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.index = index


# -----------------------------------------------------------------------------
# The trainer's side


class _Worker:
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
            [sys.executable, "-m", "volunteer_rl.task.bounded", value, str(int(memory_mb)),
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


def _kill_quietly(worker: _Worker) -> None:
    try:
        worker.kill()
    except Exception:
        pass


class BoundedRewards:
    """Rewards of `value` ("module:Class", registry.TaskInfo.value) computed in a worker
    process, each completion under `seconds` of CPU time and `memory_mb` MiB of memory (see
    the module doc). Use as a context manager, or call close()."""

    def __init__(self, value: str, seconds: float, memory_mb: int):
        if not seconds > 0 or int(memory_mb) <= 0:
            raise ValueError(f"reward bounds must be positive (seconds={seconds}, "
                             f"memory_mb={memory_mb})")
        self.value = value
        self.seconds = float(seconds)
        self.memory_mb = int(memory_mb)
        self.wall = wall_backstop(self.seconds)
        self.poll = max(0.005, min(POLL_MAX, self.seconds / 10))
        self._worker: _Worker | None = None
        self._finalizer: weakref.finalize | None = None
        self._cpu = 0.0  # the worker's CPU clock where its last completion ended
        self.memory_limit: int | None = None
        """The running worker's RLIMIT_AS in bytes; None before it starts, or where memory is
        not bounded (no /proc/self/status: macOS), for the trainer to say so."""

    @property
    def pid(self) -> int | None:
        """The running worker's process id, or None (for logs and tests)."""
        return self._worker.pid if self._worker is not None else None

    def __enter__(self) -> "BoundedRewards":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the worker, if there is one. Safe to call twice; a later call to rewards()
        starts a new one."""
        worker, self._worker = self._worker, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if worker is not None:
            worker.kill()

    # -- starting ------------------------------------------------------------

    def _start(self) -> _Worker:
        try:
            worker = _Worker(self.value, self.memory_mb)
        except OSError as exc:
            raise TaskError(f"task {self.value}: cannot start the reward worker ({exc})"
                            .replace("\n", " ")) from None
        try:
            self._cpu = self._handshake(worker)
        except BaseException:
            worker.kill()
            raise
        self._worker = worker
        # The worker must not outlive the trainer's interpreter (weakref.finalize runs at exit).
        self._finalizer = weakref.finalize(self, _kill_quietly, worker)
        return worker

    def _handshake(self, worker: _Worker) -> float:
        """Wait for the worker's first line: ready (its CPU clock) or why it could not load."""
        deadline = time.monotonic() + START_SECONDS
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TaskError(f"task {self.value}: the reward worker did not load the task "
                                f"within {START_SECONDS:g} s")
            lines, eof, _ = worker.lines(min(left, 1.0))
            if lines:
                try:
                    msg = json.loads(lines[0])
                except ValueError:
                    msg = None
                if isinstance(msg, dict) and isinstance(msg.get("ready"), (int, float)):
                    limit = msg.get("memory_limit")
                    self.memory_limit = limit if isinstance(limit, int) else None
                    return float(msg["ready"])
                if isinstance(msg, dict) and isinstance(msg.get("error"), str):
                    raise TaskError(printable(msg["error"], 500))
                raise TaskError(f"task {self.value}: the reward worker said {printable(lines[0])}")
            if eof:
                worker.proc.wait()
                why = worker.last_stderr_line() or f"exit code {worker.proc.returncode}"
                raise TaskError(f"task {self.value}: the reward worker did not start ({why})")

    # -- rewards -------------------------------------------------------------

    def rewards(self, items: Sequence[tuple[str, Row]]) -> list[float]:
        """The task's reward of each (completion text, row), in [0, 1], as base.completion_reward
        computes it in-process. RewardBoundExceeded at the first completion over a bound (the
        worker is then killed; the next call starts another)."""
        if not items:
            return []
        worker = self._worker
        if worker is not None and worker.exited():
            # Died while idle (killed from outside): no completion of ours to blame.
            self.close()
            worker = None
        if worker is None:
            worker = self._start()
        try:
            return self._run(worker, items)
        except BaseException:
            # A breach, or anything else mid-batch (KeyboardInterrupt, a bad item): the
            # worker's state is unknown, so it goes.
            self.close()
            raise

    def _run(self, worker: _Worker, items: Sequence[tuple[str, Row]]) -> list[float]:
        n = len(items)
        out: list[float] = []
        pending = bytearray()
        sent = 0
        started = checked = time.monotonic()  # wall clock when the current completion began
        cpu_mark = self._cpu
        while len(out) < n:
            while sent < n and len(pending) < WRITE_AHEAD:
                text, row = items[sent]
                request = json.dumps([text, row.id, dict(row.fields)], ensure_ascii=True)
                pending += request.encode("ascii")
                pending += b"\n"
                sent += 1
            lines, eof, took = worker.lines(self.poll, pending)
            if took < 0:  # broken pipe: stop writing, read to EOF
                pending.clear()
                sent = n
            elif took:
                del pending[:took]
            if lines:
                for line in lines:
                    r, c = self._result(worker, line, len(out))
                    out.append(r)
                    cpu_mark = c
                started = checked = time.monotonic()
                continue
            if eof:
                self._died(worker, len(out))
            now = time.monotonic()
            if now - started >= self.poll and now - checked >= self.poll:
                checked = now
                self._check(worker, len(out), now - started, cpu_mark)
        self._cpu = cpu_mark
        return out

    def _result(self, worker: _Worker, line: bytes, index: int) -> tuple[float, float]:
        try:
            msg = json.loads(line)
        except ValueError:
            msg = None
        if type(msg) is list and len(msg) == 2:
            r, c = msg
            if type(r) is float and 0.0 <= r <= 1.0 and type(c) in (int, float):
                return r, float(c)
        if isinstance(msg, dict) and "memory" in msg:
            raise RewardBoundExceeded(
                "reward_memory", f"completion {index}: over {self.memory_mb} MiB of memory", index)
        raise RewardBoundExceeded("reward_crash", f"completion {index}: the reward worker "
                                  f"wrote {printable(line, 80)}", index)

    def _died(self, worker: _Worker, index: int) -> None:
        # Its stdout ended, so it has exited (its files close as it does) and its exit code
        # is made; end() also takes down any process it left behind.
        code = worker.end()
        if code == MEMORY_EXIT:
            raise RewardBoundExceeded(
                "reward_memory", f"completion {index}: over {self.memory_mb} MiB of memory", index)
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        raise RewardBoundExceeded(
            "reward_crash", f"completion {index}: the reward worker died ({how})", index)

    def _check(self, worker: _Worker, index: int, waited: float, cpu_mark: float) -> None:
        if worker.has_proc:
            try:
                used = worker.cpu() - cpu_mark
            except (OSError, IndexError, ValueError):
                used = 0.0  # just exited: its stdout's EOF comes next
            if used > self.seconds:
                raise RewardBoundExceeded(
                    "reward_timeout", f"completion {index}: over {self.seconds:g} s of CPU", index)
            if waited > self.wall:
                raise RewardBoundExceeded(
                    "reward_timeout", f"completion {index}: over {self.wall:g} s of wall clock "
                    f"({max(used, 0.0):.2f} s of CPU)", index)
        elif waited > self.seconds:
            raise RewardBoundExceeded(
                "reward_timeout", f"completion {index}: over {self.seconds:g} s of wall clock "
                "(no /proc to read CPU time from)", index)


# -----------------------------------------------------------------------------
# The worker's side


def _limit_memory(memory_mb: int) -> int | None:
    """Set RLIMIT_AS to the address space now plus `memory_mb` MiB; the limit, or None where
    it cannot be set (no /proc/self/status, no resource module)."""
    try:
        import resource

        with open("/proc/self/status", "rb") as f:
            vm = next(line for line in f if line.startswith(b"VmSize:"))
        limit = int(vm.split()[1]) * 1024 + memory_mb * (1 << 20)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        # Hard too: the bound is not the task's to lift.
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        return limit
    except (ImportError, OSError, StopIteration, ValueError):
        return None


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this worker when the thread that started it ends
    (PR_SET_PDEATHSIG). Else a trainer killed while a reward spins (SIGKILL, the OOM killer)
    would leave the worker burning a core until the reward ends, which for a regex that
    backtracks can be never."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before we asked
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """The worker: load the task, then one result line per request line until stdin ends."""
    value, memory_mb, parent = (sys.argv[1:] if argv is None else argv)[:3]
    _die_with_parent(int(parent))
    # The pipes are the protocol's alone: keep them on fds of our own and point 0 and 1
    # elsewhere, so a task's print() goes to stderr and its input() reads nothing, instead of
    # corrupting or eating the requests.
    requests = os.fdopen(os.dup(0), "rb")
    out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)

    def send(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]

    try:
        task = load_object(value)
    except TaskError as exc:
        send((json.dumps({"error": str(exc)}, ensure_ascii=True) + "\n").encode("ascii"))
        return 1
    limit = _limit_memory(int(memory_mb))
    send((json.dumps({"ready": time.process_time(), "memory_limit": limit}) + "\n").encode("ascii"))
    try:
        for line in requests:
            text, row_id, fields = json.loads(line)
            row = Row(row_id, fields)
            # base.completion_reward's semantics, MemoryError excepted (the bound).
            try:
                reward = clamp_reward(task.reward(text, row)) or 0.0
            except MemoryError:
                raise
            except Exception:
                reward = 0.0
            send(b"[%r, %r]\n" % (reward, time.process_time()))
    except MemoryError:
        try:
            os.write(out, b'{"memory": true}\n')  # a constant, under PIPE_BUF: nothing to allocate
        finally:
            os._exit(MEMORY_EXIT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
