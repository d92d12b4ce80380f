"""A grader taken over by a completion (what `sympy.sympify` on an answer allows): the
completion names a probe, the row's "question" its argument, and the reward says whether the
probe got what it went for (1.0) or not (0.0; a probe that raises gets 0.0 too). For
tests/unit/test_reward_sandbox.py; the worker imports it as `helpers.snoop_task`, through the
test's sys.path.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from volunteer_rl.task.base import Row, Task

PROBES = ("ok", "env", "parent_environ", "read", "fd", "tcp", "udp", "write", "signal_parent",
          "home", "write_home", "setsid", "escape")


def _probe(name: str, arg: str) -> bool:
    if name == "ok":
        return True
    if name == "env":  # the secret, or any cloud or vrl variable, in our own environment
        return any(arg in v or k.startswith(("AWS_", "GOOGLE_", "VRL_"))
                   for k, v in os.environ.items())
    if name == "parent_environ":  # the trainer's environment, through /proc
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            return arg.encode() in f.read()
    if name == "read":  # any byte of a file the trainer can read
        with open(arg, "rb") as f:
            return len(f.read(1)) == 1
    if name == "fd":  # a descriptor the trainer had open
        return len(os.read(int(arg), 1)) == 1
    if name == "tcp":
        socket.create_connection(("127.0.0.1", int(arg)), timeout=5).close()
        return True
    if name == "udp":
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return s.sendto(b"x", ("127.0.0.1", int(arg))) == 1
    if name == "write":  # a file outside the worker's folder
        with open(arg, "w") as f:
            f.write("pwned")
        return True
    if name == "signal_parent":  # signal 0: only asks whether a kill would be allowed
        os.kill(os.getppid(), 0)
        return True
    if name == "home":  # the working folder is HOME and TMPDIR, and it is empty
        here = os.getcwd()
        return (os.environ.get("HOME") == here == os.environ.get("TMPDIR")
                and here != arg and os.listdir(here) == [])
    if name == "write_home":  # the worker's own folder takes files
        with open("scratch", "w") as f:
            f.write("fine")
        return True
    if name == "setsid":  # leaves a process in a session of its own, holding our stderr
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", arg],
                         start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL)
        return True
    if name == "escape":  # the setsid child, behind a reaper moved out of our group
        return _escape(arg)
    raise ValueError(name)


def _escape(marker: str) -> bool:
    """Move our only child (the PID namespace's reaper, forked just after us) out of our
    process group, so killing the group misses it, then fork a child that keeps every
    descriptor we hold (the reaper's pipe among them, so the reaper does not see us end) in a
    session of its own, and have it start the setsid child."""
    me = os.getpid()
    for pid in range(me + 1, me + 1000):
        try:
            os.setpgid(pid, pid)  # succeeds only for a child of ours
            break
        except OSError:
            continue
    else:
        return False
    if os.fork() == 0:
        try:
            os.setsid()
            _probe("setsid", marker)
            signal.pause()
        finally:
            os._exit(0)
    return True


class SnoopTask(Task):
    name = "snoop"
    columns = ("question",)
    reward_seconds = 10.0
    reward_memory_mb = 256

    def prompt(self, row: Row) -> str:
        return row["question"]

    def reward(self, completion: str, row: Row) -> float:
        return 1.0 if _probe(completion, row["question"]) else 0.0
