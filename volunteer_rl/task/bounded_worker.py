"""The reward worker: the process in which task.bounded computes a task's rewards, run as
`python -m volunteer_rl.task.bounded_worker MODULE:CLASS MEMORY_MB PARENT_PID` (started by
task.bounded_process).

It loads the task once and says so in one JSON line, `{"ready": <its CPU clock>,
"memory_limit": <bytes or null>}`, or `{"error": "..."}` if the task does not load. Then, for
each request line (`[text, row id, row fields]`, ASCII-only JSON, so any completion text
arrives exactly), one result line in order: `[reward, <its CPU clock>]`. After loading, its
address space is bounded (RLIMIT_AS, at `MEMORY_MB` MiB over what it holds then); a
MemoryError ends it with `{"memory": true}` and exit code MEMORY_EXIT. On Linux it dies with
the trainer's thread that started it (PR_SET_PDEATHSIG). The bounds and why: task.bounded.

It is walled in (task.sandbox) in two steps: namespaces first, while Python has one thread and
before the task's code runs; Landlock once the task has loaded (its constructor may read its
data where it lies) and before the first completion arrives. The ready line also names the
PID namespace's first process (`"reaper"`, the trainer kills it to end every process the
worker started) and says which walls the kernel refused (`"refused"`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from volunteer_rl.task import sandbox
from volunteer_rl.task.base import Row, clamp_reward
from volunteer_rl.task.registry import TaskError, load_object

MEMORY_EXIT = 86
"""The worker's exit code after a MemoryError, in case it could not even write the line."""


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
    """The worker: wall itself in, load the task, then one result line per request line until
    stdin ends."""
    value, memory_mb, parent = (sys.argv[1:] if argv is None else argv)[:3]
    refused: dict[str, str] = {}  # wall: why the kernel refused it
    reaper, why = sandbox.enter_namespaces()
    if why is not None:
        refused["namespaces"] = why
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
    abi = sandbox.restrict(os.getcwd())
    if isinstance(abi, str):
        refused["landlock"] = abi
    elif abi < sandbox.FULL_ABI:
        refused["landlock"] = f"ABI {abi} of {sandbox.FULL_ABI}"
    send((json.dumps({"ready": time.process_time(), "memory_limit": limit, "reaper": reaper,
                      "refused": refused}, ensure_ascii=True) + "\n").encode("ascii"))
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
