"""Named crash points, for the tests that kill the trainer at chosen moments of its loop.

`VRL_CRASH_AT=<point>[:<n>]` makes the process SIGKILL itself the n-th time (default 1st)
it reaches `crash_point(<point>)`: no cleanup, no flush, exactly what `kill -9` or a power
cut does. Unset (always, outside tests) a crash point costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = ("ingest", "optimizer_step", "checkpoint_upload", "before_manifest", "state_save",
          "local_write", "manifest_copy")
_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    spec = os.environ.get("VRL_CRASH_AT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        print(f"crash point {name}: SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
