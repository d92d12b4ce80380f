"""A task's reward under a time and memory bound per completion, in a worker process.

The trainer recomputes the reward of every completion a volunteer uploads, and the text is the
volunteer's to choose. A task's reward (vrl's own or a third-party plugin) can be slow or
hungry on crafted text: catastrophic regex backtracking, `10**10**7`, a Python loop, a sleep,
a GB allocation. Most of that runs in C, where nothing inside the process can interrupt it,
so the reward runs in a separate worker process the trainer can kill. A completion that
takes its reward over a bound ends as RewardBoundExceeded with a reason code; the trainer
refuses the shard holding it. Never a stall, never a crash of the trainer.

`BoundedRewards` here is the trainer's end: it sends the requests and decides what is a
breach. task.bounded_process is its handle on the worker process (started with Popen, never a
fork of the trainer, a large torch process, with PYTHONPATH set to the trainer's sys.path so a
plugin the trainer can import imports in the worker too), and task.bounded_worker is the
worker (`python -m volunteer_rl.task.bounded_worker MODULE:CLASS MEMORY_MB PARENT_PID`). It
loads the task once (START_SECONDS at most, or WorkerStartError) and answers one JSON line per
request, in order; requests are ASCII-only JSON, so any completion text (newlines, U+2028,
lone surrogates) arrives exactly. A breach kills the worker; the next call starts a fresh one,
so one hostile completion costs one bound and one start (~0.15 s). The overhead is ~15 us a
completion against ~2 us in-process for a cheap task: some 50,000 rewards a second.

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

A batch (one shard's rewards, in the trainer) can be bounded as a whole too, with a `Spend`:
its completions' CPU time together over `Spend.cpu_bound`, or its wall clock over
`Spend.wall_bound` -> `reward_budget`, so a shard of many completions each just under the
per-completion bound is refused after a few of them, not paid in full. A Spend can also cut
the batch short without blaming it: past `Spend.until` (a time.monotonic() deadline: the
poll's reward time is spent) or once `Spend.stop()` says so (a stop signal), the worker is
killed, even mid-completion, and the rewards computed so far are returned. The Spend says
what the batch took (`cpu`, `wall`), for the caller's accounting (trainer.reward_budget).

What the worker returns is exactly what base.completion_reward gives for the same text
in-process (the volunteer computes its claimed reward that way and the two must agree): the
task's reward through base.clamp_reward, and 0.0 when the task raises an Exception or
returns a non-number. The one deliberate difference is MemoryError, which in-process is an
Exception like any other (0.0) and here is a breach.

Limits: POSIX only (poll on pipes, RLIMIT_AS; Windows is not supported). The worker runs in its
own session, so a Ctrl-C at the trainer's terminal does not kill it mid-batch; the trainer
ending kills it (close(), the finalizer at interpreter exit, and on Linux PR_SET_PDEATHSIG
even when the trainer is SIGKILLed). Elsewhere a trainer killed while a reward runs leaves the
worker running until that reward ends. Processes a task starts are killed with the worker
(its PID namespace, task.sandbox; else its process group), but their CPU time is not counted.
What the worker can reach (environment, files, network): task.bounded_process, task.sandbox.
Not thread-safe: one BoundedRewards per thread, which also suits PDEATHSIG (it fires when the
*thread* that started the worker ends; a worker found dead between calls is replaced without
blaming a completion).
"""

from __future__ import annotations

import json
import math
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

from volunteer_rl.protocol.printable import printable
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded_process import WorkerProcess
from volunteer_rl.task.bounded_worker import MEMORY_EXIT
from volunteer_rl.task.registry import TaskError

# -----------------------------------------------------------------------------
# Limits

START_SECONDS = 60.0
"""Wall clock a worker gets to start and load its task (a plugin's imports can be slow on a
busy machine); past it, WorkerStartError."""
POLL_MAX = 0.05
"""Seconds between two reads of the worker's CPU time while a completion runs: a breach
overshoots its bound by at most this (plus a clock tick)."""
WRITE_AHEAD = 1 << 16
"""Request bytes encoded ahead of what the worker's pipe has taken: keeps a large batch from
sitting in memory twice, and the parent never blocks on a write (the pipe is non-blocking
and poll tells when it takes more), so it keeps watching the clock and reading results."""
CODES = ("reward_timeout", "reward_memory", "reward_crash", "reward_budget")


def wall_backstop(seconds: float) -> float:
    """The wall-clock bound of one completion whose reward has CPU bound `seconds`."""
    return max(10.0 * seconds, seconds + 5.0)


class WorkerStartError(TaskError):
    """The reward worker could not start or load its task (out of descriptors or processes, a
    slow or failing import, a worker that died before it was ready): a fault of the trainer's
    machine, never of a completion, since none was sent yet. The intake leaves the shard for a
    later poll."""
@dataclass
class Spend:
    """The bounds of one batch as a whole, and what it took (written by BoundedRewards.rewards,
    breach and cut included). Unbounded by default."""

    cpu_bound: float = math.inf
    """CPU seconds all the batch's completions may take together; over it, `reward_budget`."""
    wall_bound: float = math.inf
    """Wall-clock seconds the batch may take (a reward that blocks uses no CPU); over it,
    `reward_budget`."""
    until: float = math.inf
    """A time.monotonic() deadline: past it the batch is cut (not a breach)."""
    stop: Callable[[], bool] | None = None
    """True once the batch must end now (a stop signal): it is cut (not a breach)."""
    cpu_before: float = 0.0
    """CPU seconds earlier calls spent on the same work (a shard resumed after a cut): they
    count against cpu_bound."""
    wall_before: float = 0.0
    """Wall-clock seconds earlier calls spent on it: they count against wall_bound."""
    cpu: float = 0.0
    """CPU seconds the batch's completions took (the worker's clock; wall clock without /proc)."""
    wall: float = 0.0
    """Wall-clock seconds the call took, the worker's start included."""
    start: float = 0.0
    """Of `wall`, the seconds spent starting the worker (after another batch's breach or cut
    killed it, or the first): the trainer's cost, not the batch's."""

    def cut(self, now: float) -> bool:
        """Whether the batch must end here without blame."""
        return now >= self.until or (self.stop is not None and bool(self.stop()))


class RewardBoundExceeded(Exception):
    """A completion took its task's reward over a bound. `code` is one of CODES; `detail` is
    one printable line ("completion 3: over 1.0 s of CPU"); `index` is the completion's
    position in the batch."""

    def __init__(self, code: str, detail: str, index: int):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail
        self.index = index


def _kill_quietly(worker: WorkerProcess) -> None:
    """The finalizer: the worker ends with the interpreter, whatever state either is in."""
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
        self._worker: WorkerProcess | None = None
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

    def _start(self) -> WorkerProcess:
        try:
            worker = WorkerProcess(self.value, self.memory_mb)
        except OSError as exc:
            raise WorkerStartError(f"task {self.value}: cannot start the reward worker ({exc})"
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

    def _handshake(self, worker: WorkerProcess) -> float:
        """Wait for the worker's first line: ready (its CPU clock) or why it could not load."""
        deadline = time.monotonic() + START_SECONDS
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(f"task {self.value}: the reward worker did not load the "
                                       f"task within {START_SECONDS:g} s")
            lines, eof, _ = worker.lines(min(left, 1.0))
            if lines:
                try:
                    msg = json.loads(lines[0])
                except ValueError:
                    msg = None
                if isinstance(msg, dict) and isinstance(msg.get("ready"), (int, float)):
                    limit = msg.get("memory_limit")
                    self.memory_limit = limit if isinstance(limit, int) else None
                    worker.take_ready(msg)
                    return float(msg["ready"])
                if isinstance(msg, dict) and isinstance(msg.get("error"), str):
                    raise WorkerStartError(printable(msg["error"], 500))
                raise WorkerStartError(f"task {self.value}: the reward worker said "
                                       f"{printable(lines[0])}")
            if eof:
                worker.proc.wait()
                why = worker.last_stderr_line() or f"exit code {worker.proc.returncode}"
                raise WorkerStartError(f"task {self.value}: the reward worker did not start "
                                       f"({why})")

    # -- rewards -------------------------------------------------------------

    def rewards(self, items: Sequence[tuple[str, Row]],
                spend: Spend | None = None) -> list[float]:
        """The task's reward of each (completion text, row), in [0, 1], as base.completion_reward
        computes it in-process. RewardBoundExceeded at the first completion over a bound, or
        when the batch breaks `spend`'s bounds (the worker is then killed; the next call
        starts another). Cut short by `spend` (Spend.cut), it returns the rewards of the first
        completions only, fewer than `items`. What the batch took is written into `spend`."""
        spend = spend if spend is not None else Spend()
        began = time.monotonic()
        try:
            if not items or spend.cut(began):
                return []
            worker = self._worker
            if worker is not None and worker.exited():
                # Died while idle (killed from outside): no completion of ours to blame.
                self.close()
                worker = None
            if worker is None:
                try:
                    worker = self._start()
                finally:
                    spend.start = time.monotonic() - began
            try:
                return self._run(worker, items, spend)
            except BaseException:
                # A breach, or anything else mid-batch (KeyboardInterrupt, a bad item): the
                # worker's state is unknown, so it goes.
                self.close()
                raise
        finally:
            spend.wall = time.monotonic() - began

    def _run(self, worker: WorkerProcess, items: Sequence[tuple[str, Row]],
             spend: Spend) -> list[float]:
        n = len(items)
        out: list[float] = []
        pending = bytearray()
        sent = 0
        started = checked = began = time.monotonic()  # began: the batch's wall clock (not
        cpu_mark = cpu_start = self._cpu  # counting the worker's start, which is not its doing)
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
                    spend.cpu = c - cpu_start
                    self._over_batch(spend, len(out) - 1, time.monotonic() - began)
                started = checked = time.monotonic()
                if len(out) < n and spend.cut(started):
                    return self._cut(out)
                continue
            if eof:
                self._died(worker, len(out))
            now = time.monotonic()
            if spend.cut(now):
                self._charge_running(worker, spend, cpu_start, now - began)
                return self._cut(out)
            if now - started >= self.poll and now - checked >= self.poll:
                checked = now
                self._check(worker, len(out), now - started, cpu_mark)
                self._charge_running(worker, spend, cpu_start, now - began)
                self._over_batch(spend, len(out), now - began)
        self._cpu = cpu_mark
        return out

    def _cut(self, out: list[float]) -> list[float]:
        """End a batch cut short: requests already sent are still queued in the worker, so it
        goes (the next call starts another); the rewards computed so far stand."""
        self.close()
        return out

    def _charge_running(self, worker: WorkerProcess, spend: Spend, cpu_start: float,
                        wall: float) -> None:
        """Bring spend.cpu up to the worker's clock while a completion runs (its wall clock
        without /proc, as the per-completion rule)."""
        if not worker.has_proc:
            spend.cpu = wall
            return
        try:
            spend.cpu = max(spend.cpu, worker.cpu() - cpu_start)
        except (OSError, IndexError, ValueError):
            pass  # just exited: its stdout's EOF comes next

    def _over_batch(self, spend: Spend, index: int, wall: float) -> None:
        cpu = spend.cpu_before + spend.cpu
        if cpu > spend.cpu_bound:
            raise RewardBoundExceeded(
                "reward_budget", f"completion {index}: the batch's rewards took over "
                f"{spend.cpu_bound:g} s of CPU in all", index)
        if spend.wall_before + wall > spend.wall_bound:
            raise RewardBoundExceeded(
                "reward_budget", f"completion {index}: the batch's rewards took over "
                f"{spend.wall_bound:g} s of wall clock in all ({cpu:.2f} s of CPU)", index)

    def _result(self, worker: WorkerProcess, line: bytes, index: int) -> tuple[float, float]:
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

    def _died(self, worker: WorkerProcess, index: int) -> None:
        # Its stdout ended, so it has exited (its files close as it does) and its exit code
        # is made; end() also takes down any process it left behind.
        code = worker.end()
        if code == MEMORY_EXIT:
            raise RewardBoundExceeded(
                "reward_memory", f"completion {index}: over {self.memory_mb} MiB of memory", index)
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        raise RewardBoundExceeded(
            "reward_crash", f"completion {index}: the reward worker died ({how})", index)

    def _check(self, worker: WorkerProcess, index: int, waited: float, cpu_mark: float) -> None:
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
