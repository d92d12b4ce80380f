"""The fleet objects people read and edit: `denylist.json` (volunteers whose shards the
trainer skips) and the size bound of the trainer's `fleet.json`.

`denylist.json` lives in the bucket so a person can read and edit it with the CLI
(`vrl volunteers list / deny / allow`); the trainer and the CLI both change it with a
compare-and-swap, so neither overwrites the other's edit. A volunteer stays denied until a
person lifts it; lifting also resets its counts, so it is not denied again for the past.
"""

from __future__ import annotations

import json
from typing import Callable

from volunteer_rl.errors import VrlError
from volunteer_rl.protocol import jsonbounds, layout
from volunteer_rl.storage.base import NotFound, PreconditionFailed, Storage, StorageError

MAX_SUMMARY_BYTES = 16 << 20
"""fleet.json is read whole by `vrl status` and the trainer's own resume: at most this much."""
MAX_DENYLIST_BYTES = 4 << 20
DENYLIST_NESTING = 8
"""An entry nests 3 deep ({"volunteers": {id: {...}}}); room for a person's notes in it."""
CAS_ATTEMPTS = 5


class DenylistError(VrlError):
    """denylist.json is unreadable or could not be updated."""


def parse_denylist(data: bytes) -> dict[str, dict]:
    """{volunteer id: entry} from denylist.json bytes; DenylistError if malformed."""
    try:
        raw = jsonbounds.loads(data, DENYLIST_NESTING)
        entries = raw["volunteers"]
        if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
            raise TypeError("volunteers must map ids to objects")
    except (ValueError, KeyError, TypeError) as exc:
        raise DenylistError(f"{layout.DENYLIST}: malformed ({exc})") from None
    return entries


def encode_denylist(entries: dict[str, dict]) -> bytes:
    return json.dumps({"schema_version": 1, "volunteers": entries}, indent=1,
                      sort_keys=True).encode()


def read_denylist(storage: Storage) -> tuple[dict[str, dict], str | None]:
    """(entries, etag); ({}, None) when there is no denylist yet."""
    try:
        data, etag = storage.read_if_changed(layout.DENYLIST, None, MAX_DENYLIST_BYTES)
    except NotFound:
        return {}, None
    except StorageError as exc:
        raise DenylistError(str(exc)) from None
    return parse_denylist(data), etag


def update_denylist(storage: Storage, change: Callable[[dict[str, dict]], bool]) -> dict[str, dict]:
    """Apply `change` (edits the entries in place, returns True if it changed anything) with a
    compare-and-swap, retrying when another writer got there first. Returns the entries."""
    for _ in range(CAS_ATTEMPTS):
        entries, etag = read_denylist(storage)
        if not change(entries):
            return entries
        try:
            storage.write_if_match(layout.DENYLIST, encode_denylist(entries), etag)
            return entries
        except PreconditionFailed:
            continue
    raise DenylistError(f"{layout.DENYLIST}: changed by others {CAS_ATTEMPTS} times in a row")
