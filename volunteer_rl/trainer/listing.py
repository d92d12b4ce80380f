"""Which shards a poll reads: the window's folders listed within caps, the keys admitted by
turns among volunteers, and their bytes fetched a few at a time ahead of the checks.

What one volunteer can cost a poll is bounded here, whatever it wrote: a LIST of at most
MAX_OBJECTS_PER_VOLUNTEER_VERSION + 1 keys per version folder (none once the folder is found
over the cap, none for a denied volunteer) and at most MAX_SHARDS_PER_VOLUNTEER_POLL GETs.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator

from volunteer_rl.protocol import layout
from volunteer_rl.storage.base import Storage, StorageError
from volunteer_rl.trainer.checks import fetch_shard
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.groups import IngestStats
from volunteer_rl.trainer.shares import FleetShare

FETCH_WORKERS = 8
"""Shard GETs in flight at once. Each GET of a small object is mostly round trip (and, on a
server, its request handling), so a few in parallel keep the link busy while this thread
decodes and checks the shards that already arrived."""
PREFETCH = 16
"""Shards fetched ahead of the one being checked: bounds memory at PREFETCH x MAX_SHARD_BYTES
(128 MiB) whatever a hostile fleet uploads."""
MAX_OBJECTS_PER_VOLUNTEER_VERSION = 1024
"""Objects of one volunteer under one version folder the trainer considers (in key order,
which is upload order for shard names); the rest are never listed, read or recorded. Bounds
the LIST pages, GETs, ledger records and quarantine writes any one id can cause per version,
junk or not. A folder found over it is counted once in `ingest/over_cap`, and its first
objects are remembered, so it is not listed again in that version. An honest volunteer that
outruns it (a trainer stuck on one version for hours) loses only the excess."""
MAX_SHARDS_PER_VOLUNTEER_POLL = 16
"""Shards of one volunteer fetched and parsed per poll (its share of the poll): one id with a
thousand big shards waiting costs a poll this many parses, and everyone else's shards are
still read in that poll. The rest wait for the next poll."""


class Listing:
    """Lists, admits and fetches the shards of each poll."""

    def __init__(self, storage: Storage, fleet: Fleet, share: FleetShare | None,
                 waits: Callable[[str, str, IngestStats], bool], log: Callable[[str], None],
                 fetch_workers: int = FETCH_WORKERS):
        self.storage = storage
        self.fleet = fleet
        self.share = share
        """Under ranks, this rank's share of the fleet: only its own volunteers are listed.
        None: a single process, which lists every volunteer."""
        self.waits = waits  # AuditDesk.waits: due for an audit the budget has no room for
        self.log = log
        self.fetch_workers = max(1, fetch_workers)
        self.polls = 0
        """Polls so far (counted by admit): turns the order in which volunteers are
        admitted, and numbers the arrival of the groups each poll takes."""
        self.capped: dict[str, list[str]] = {}
        """Folder -> its first MAX_OBJECTS_PER_VOLUNTEER_VERSION keys, for the folders found
        over the cap: those keys are all the trainer will ever take from them."""

    def list_version(self, version: int, stats: IngestStats) -> list[str]:
        """The keys of one version folder the trainer considers, sorted: up to
        MAX_OBJECTS_PER_VOLUNTEER_VERSION of each volunteer folder that is not denied, the
        first ones in key order. Objects directly in the version folder are no volunteer's
        (only the trainer's credentials can write there): up to the cap of them are kept, to
        be rejected as `bad_key` like any other object that is no shard."""
        cap = MAX_OBJECTS_PER_VOLUNTEER_VERSION
        try:
            entries = self.storage.list_level(layout.rollout_version_prefix(version))
        except StorageError as exc:
            self.log(f"warning: {exc}")
            return []
        nobodys = self.share is None or self.share.owns_nobodys
        keys = [e for e in entries if not e.endswith("/")][:cap] if nobodys else []
        for folder in (e for e in entries if e.endswith("/")):
            if not self._mine(folder):
                continue
            if self.denied(folder, stats):
                continue
            if folder in self.capped:
                keys += self.capped[folder]
                continue
            try:
                listed = self.storage.list(folder, limit=cap + 1)
            except StorageError as exc:
                self.log(f"warning: {exc}")
                continue
            if len(listed) > cap:
                stats.over_cap += 1
                listed = self.capped[folder] = listed[:cap]
            keys += listed
        return sorted(keys)

    def _mine(self, folder: str) -> bool:
        """True if this process reads `folder` (a volunteer's folder in a version): always
        for a single process; under ranks, if the volunteer is this rank's (trainer.shares).
        A folder whose name is no volunteer id is the writer's, to reject its objects."""
        if self.share is None:
            return True
        author = layout.rollout_author(folder)  # as for a key inside it
        if author is None:
            return self.share.owns_nobodys
        return self.share.owns(author[1])

    def denied(self, key: str, stats: IngestStats) -> bool:
        """True (and counted) if `key` is a denied volunteer's."""
        parsed = layout.rollout_author(key)
        if parsed and self.fleet.is_denied(parsed[1]):
            stats.denied += 1
            return True
        return False

    def admit(self, keys: list[str], stats: IngestStats) -> list[str]:
        """The keys to fetch this poll, in key order: of each volunteer, its first keys up to
        MAX_SHARDS_PER_VOLUNTEER_POLL, skipping (unfetched) those due for an audit that the
        budget has no room for. Volunteers take turns, one key each, from a first volunteer
        that changes every poll, so the budget's room goes round the fleet instead of to the
        id that sorts first."""
        chosen = [k for k in keys if layout.rollout_author(k) is None]  # nobody's: bad_key
        queues: dict[str, deque[str]] = {}
        for key in keys:
            author = layout.rollout_author(key)
            if author is not None:
                queues.setdefault(author[1], deque()).append(key)
        order = sorted(queues)
        self.polls += 1
        if order:
            turn = self.polls % len(order)
            order = order[turn:] + order[:turn]
        room = dict.fromkeys(order, MAX_SHARDS_PER_VOLUNTEER_POLL)
        while order:
            for volunteer in list(order):
                key = queues[volunteer].popleft()
                if not self.waits(key, volunteer, stats):
                    chosen.append(key)
                    room[volunteer] -= 1
                if not queues[volunteer] or not room[volunteer]:
                    order.remove(volunteer)
        return sorted(chosen)

    def prefetch(self, keys: list[str]) -> Iterator[tuple[str, Future]]:
        """(key, future of its bytes) in the order of `keys`, with at most PREFETCH fetched
        ahead of the consumer and FETCH_WORKERS GETs in flight."""
        if not keys:
            return
        ahead: deque[tuple[str, Future]] = deque()
        with ThreadPoolExecutor(min(self.fetch_workers, len(keys))) as pool:
            try:
                for key in keys:
                    ahead.append((key, pool.submit(fetch_shard, self.storage, key)))
                    if len(ahead) >= PREFETCH:
                        yield ahead.popleft()
                while ahead:
                    yield ahead.popleft()
            finally:  # the consumer stopped early (an exception): drop what was queued
                for _, fut in ahead:
                    fut.cancel()

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the capped folders that left the window."""
        self.capped = {k: v for k, v in self.capped.items() if keep(k)}
