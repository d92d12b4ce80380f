"""Finding processes by their command line, from outside any namespace a worker made (a
process in a PID namespace of its own has another pid inside): the tests of the reward
worker's kill give what they start a marker argument and look for it here."""
from __future__ import annotations

import os
import time


def holders(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
        except OSError:
            continue
        found.append(int(pid))
    return found


def wait_until(condition, seconds: float = 60.0) -> bool:
    """Whether `condition()` became true within `seconds` (a hang guard, not a pace)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def kill_all(marker: str) -> None:
    """SIGKILL what holds `marker` (a test's clean-up when the defence failed)."""
    for pid in holders(marker):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
