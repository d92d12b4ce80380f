"""Tasks for task.bounded's tests: a reward with a trap for each way a completion can take it
over its bounds, and an ordinary one with many distinct values.

The worker imports this module by the name the test imported it under (`TrapTask.__module__`,
`helpers.trap_tasks` under pytest), through the PYTHONPATH it inherits from the test's
sys.path: nothing here is installed.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import zlib

from volunteer_rl.task.base import Row, Task


BURN_SECONDS = 0.2
"""CPU seconds the reward of a completion starting with "burn" takes (TrapTask's bound: 0.5)."""


class TrapTask(Task):
    """Reward 1.0 for "ok", 0.0 for other plain text, and a trap for each keyword."""

    name = "trap"
    columns = ("question",)
    reward_seconds = 0.5
    reward_memory_mb = 64

    def prompt(self, row: Row) -> str:
        return row["question"]

    def reward(self, completion: str, row: Row) -> float:
        if completion == "spin":  # pure Python, holds the CPU forever
            while True:
                pass
        if completion == "regex":  # catastrophic backtracking inside _sre (C): 2**40 steps
            return 1.0 if re.match(r"(a+)+$", "a" * 40 + "!") else 0.5
        if completion == "bigint":  # one C call of some 6 s on this machine
            return float(10 ** 10 ** 7 > 0)
        if completion == "grab":  # 2 GiB of address space; bytes(n) is calloc'd, so without
            return float(len(bytes(2 << 30)) > 0)  # the bound no page is touched (bytearray's are)
        if completion == "sleep":  # blocks without using CPU
            time.sleep(60)
            return 1.0
        if completion.startswith("burn"):  # BURN_SECONDS of CPU, within the bound, then 0.0
            end = time.process_time() + BURN_SECONDS
            while time.process_time() < end:
                pass
            return 0.0
        if completion == "die":
            os._exit(3)
        if completion == "spawn":  # leaves a process behind, row["question"] in its command line
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", row["question"]])
            os._exit(4)
        if completion == "raise":
            raise ValueError("no reward for you")
        if completion == "nan":
            return float("nan")
        if completion == "inf":
            return float("inf")
        if completion == "seven":
            return 7  # clamped to 1.0
        if completion == "negative":
            return -2.5  # clamped to 0.0
        if completion == "none":
            return None  # type: ignore[return-value]
        if completion == "true":
            return True  # a bool is not a number here
        if completion == "string":
            return "1.0"  # type: ignore[return-value]
        if completion == "huge":
            return 10 ** 400  # clamp_reward raises OverflowError on it: 0.0
        if completion == "recurse":
            return self.reward(completion, row)  # RecursionError: an Exception, so 0.0
        if completion == "print":  # the worker's stdout is its protocol: this must not reach it
            print("[1.0, 0.0]\nnot json {", flush=True)
            return 1.0
        if completion == "shout":  # more than a pipe holds on stderr
            sys.stderr.write("x" * (1 << 20) + "\n")
            sys.stderr.flush()
            return 1.0
        if completion == "read":  # stdin is the requests' pipe: a task must read nothing
            return 0.25 if sys.stdin.read() == "" else 0.75
        return 1.0 if completion == "ok" else 0.0


class ScoreTask(Task):
    """An ordinary deterministic reward with many distinct float values (a hash of the text and
    the row), some above 1 and below 0, to compare worker and in-process results exactly."""

    name = "score"
    columns = ("question", "answer")

    def prompt(self, row: Row) -> str:
        return row["question"]

    def reward(self, completion: str, row: Row) -> float:
        key = f"{completion}\x00{row.id}\x00{row['question']}\x00{row['answer']}"
        h = zlib.crc32(key.encode("utf-8", "surrogatepass"))
        return h / 2**32 * 1.4 - 0.2


class DiesOnLoad(Task):
    """A task whose construction ends the process, after a word on stderr."""

    name = "dies"
    columns = ("question",)

    def __init__(self):
        sys.stderr.write("Traceback (most recent call last):\nboom: this task cannot start here\n")
        sys.stderr.flush()
        os._exit(5)
