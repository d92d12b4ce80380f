"""Named crash points, for the tests that kill the trainer at chosen moments of its loop.

`VRL_CRASH_AT=<point>[:<n>]` makes the process SIGKILL itself the n-th time (default 1st)
it reaches `crash_point(<point>)`: no cleanup, no flush, exactly what `kill -9` or a power
cut does. Unset (always, outside tests) a crash point costs one dict lookup.

`<point>[:<n>]@<rank>`: only the trainer rank of that number (torchrun's RANK), and only in
torchrun's first start of the ranks (TORCHELASTIC_RESTART_COUNT 0), so the ranks it restarts
run on: one rank killed once, as `kill -9` of one rank would.
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
    spec, _, rank = spec.partition("@")
    point, _, nth = spec.partition(":")
    if point != name:
        return
    if rank and (os.environ.get("RANK") != rank
                 or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        print(f"crash point {name}: SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
