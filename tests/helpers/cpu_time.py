"""The CPU time a piece of code takes itself, for tests that bound it (hostile text judged
quickly). Not wall time (other processes stretch it), not the process's CPU time (another
test's threads in the same worker add to it), and not a garbage collection of what earlier
tests in the same worker left, which the code under test may happen to trigger."""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager


class Spent:
    seconds: float = 0.0


@contextmanager
def own_cpu_seconds():
    """`with own_cpu_seconds() as spent:` ...; then `spent.seconds` is this thread's CPU time
    in the block, with the collector off."""
    spent = Spent()
    gc.collect()
    gc.disable()
    start = time.thread_time()
    try:
        yield spent
    finally:
        spent.seconds = time.thread_time() - start
        gc.enable()
