"""A volunteer's heartbeat: `volunteers/<id>.json`, overwritten every few seconds.

It is how people (and `vrl status`) see the fleet: who is up, on which version, how fast it
produces. It is the one object a volunteer overwrites, so it is written with a plain write,
from a daemon thread: a slow or failing bucket never holds up generation, and a failed write
is a warning once per outage, never fatal. Nothing in it is trusted by the trainer; the
trainer's own view of each volunteer is in fleet.json (see fleet_summary).

The writer thread and the counters are the volunteer's (volunteer/heartbeat.py); this module is
the object's schema, size bound and encoding, which `vrl status` reads too.
"""

from __future__ import annotations

import json

HEARTBEAT_SCHEMA = 2
"""2 adds `paused` (why the owner's host controls paused it, or null); readers take a
schema-1 heartbeat, which has none, as not paused."""
MAX_HEARTBEAT_BYTES = 64 << 10
"""Readers cap a heartbeat at this size: anyone may write their own, so none is believed large."""


def encode_heartbeat(payload: dict) -> bytes:
    return json.dumps(payload, sort_keys=True).encode()
