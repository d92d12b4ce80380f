"""Retention's deleting: what trainer.retention_plan says may go, removed through the Storage
interface, by `vrl gc` (`collect`) and by the trainer (`TrainerRetention`).

`execute` deletes in batches (`delete_many`: one request per 1,000 objects on S3), and reports
the objects it could not delete without stopping at them.

`vrl gc` lists the prefixes whole. The trainer (`TrainerRetention`) runs its passes on a
thread of their own, off the publish path, and bounds each one: it walks the version folders
below the kept range in order, each listed at most LIST_LIMIT keys at a time, and stops after
MAX_LISTINGS_PER_PASS listings or MAX_DELETES_PER_PASS deletes; the next pass goes on where it
stopped. A volunteer can write any number of objects under rollouts/, so what one pass costs
must not depend on them; over passes everything expired still goes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Collection, Sequence

from volunteer_rl.config import TrainerConfig, check
from volunteer_rl.errors import VrlError
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    read_manifest,
)
from volunteer_rl.protocol.printable import printable
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage.base import DELETE_BATCH, NotFound, Storage, StorageError, one_line
from volunteer_rl.trainer.retention_plan import (
    DEFAULT_PREFIXES,
    Plan,
    base_folders,
    chain_floor,
    check_rules,
    committed_versions,
    kept_from,
    plan,
)

LIST_LIMIT = 1000
"""Keys one listing of the trainer's pass asks for (one S3 LIST page)."""
MAX_LISTINGS_PER_PASS = 64
"""Listings one trainer pass makes at most, the version folders it walks included."""
MAX_DELETES_PER_PASS = 4 * LIST_LIMIT
"""Objects one trainer pass deletes at most (four DeleteObjects requests on S3)."""
MAX_REFUSED_PER_FOLDER = LIST_LIMIT
"""Objects of one version folder the bucket may refuse to delete before a trainer pass gives up
the rest of that folder: each listing of it asks for as many keys more, so it bounds what a
listing costs (at most twice LIST_LIMIT keys)."""


# ---------------------------------------------------------------------------------------------
# Executing: deletes through Storage, never stops at a failure.

@dataclass
class Tally:
    """What one (prefix, reason) lost: objects, and bytes where sizes were read (`execute`)."""

    objects: int = 0
    bytes: int = 0


@dataclass
class Outcome:
    removed: dict[tuple[str, str], Tally] = field(default_factory=dict)
    """(prefix, reason) -> objects and bytes removed (or, in a dry run, that would be)."""
    failed: list[tuple[str, str]] = field(default_factory=list)
    """(key, one-line error) of every object that could not be removed."""

    @property
    def objects(self) -> int:
        return sum(t.objects for t in self.removed.values())

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.removed.values())


def _failure(key: str, exc: BaseException) -> tuple[str, str]:
    """(key, one-line error naming it) of an object that could not be removed."""
    message = one_line(exc)
    return key, message if key in message else f"{key}: {message}"


def delete_batch(storage: Storage, keys: Sequence[str]
                 ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Delete `keys` DELETE_BATCH at a time: (refused, unanswered), each a list of (key,
    one-line error): the objects the bucket refused to delete (its answer for each key:
    access denied, a file it cannot remove), and those of a request that failed as a whole
    (no answer, a fault: worth another try), which fails its keys, not the batches after it."""
    refused: list[tuple[str, str]] = []
    unanswered: list[tuple[str, str]] = []
    for start in range(0, len(keys), DELETE_BATCH):
        chunk = keys[start:start + DELETE_BATCH]
        try:
            refused += storage.delete_many(chunk)
        except (StorageError, OSError) as exc:
            unanswered += [_failure(key, exc) for key in chunk]
    return refused, unanswered


def execute(storage: Storage, p: Plan, dry_run: bool = False) -> Outcome:
    """Delete every key of the plan, oldest version first, in batches; record failures and go
    on. Each object's size is read first (a HEAD each) for the report: `vrl gc`, run by hand;
    the trainer's passes do without."""
    outcome = Outcome()
    for removal in p.removals:
        tally = outcome.removed.setdefault((removal.prefix, removal.reason), Tally())
        sizes: dict[str, int] = {}
        for key in removal.keys:
            try:
                sizes[key] = storage.size(key)
            except NotFound:  # already gone (lifecycle expiry, another gc)
                continue
            except (StorageError, OSError) as exc:
                outcome.failed.append(_failure(key, exc))
        failed = [] if dry_run else [f for fs in delete_batch(storage, list(sizes)) for f in fs]
        outcome.failed += failed
        for key, _ in failed:
            sizes.pop(key, None)
        tally.objects += len(sizes)
        tally.bytes += sum(sizes.values())
    return outcome


def collect(storage: Storage, keep_versions: int, dry_run: bool = False,
            prefixes: Collection[str] = DEFAULT_PREFIXES, *, trust: Trust) -> tuple[Plan, Outcome]:
    """What `vrl gc` does: read the manifest, list the prefixes whole, plan, delete.

    The manifest is read before anything is listed: a trainer that publishes meanwhile only
    moves the kept range up, so nothing the plan deletes can have become needed."""
    m = read_manifest(storage, trust=trust)
    if m is None:
        raise ManifestError(f"{layout.MANIFEST}: not found in {storage.uri}; without it "
                            "nothing is known to be safe to delete")
    low = kept_from(m.version, m.max_staleness, keep_versions)
    lowest = _lowest(storage, m, low, trust)
    floor, bases = chain_floor(m, lowest, low), base_folders(m, lowest)
    keys = [k for prefix in prefixes for k in storage.list(prefix)]
    committed = committed_versions(storage.list(layout.MANIFESTS))
    p = plan(keys, m.version, m.max_staleness, keep_versions, committed, prefixes,
             checkpoints_from=floor, bases=bases)
    return p, execute(storage, p, dry_run)


def _lowest(storage: Storage, current: Manifest, low: int, trust: Trust | None) -> Manifest | None:
    """The manifest of version `low` (its signed copy under manifests/), None if unreadable.
    `trust` None: the trainer reading its own copies, whose fields are only used to keep more."""
    if low == current.version:
        return current
    try:
        if trust is None:
            data = storage.read(layout.manifest_history_key(low), max_bytes=MAX_MANIFEST_BYTES)
            return Manifest.from_json(data)
        return read_manifest(storage, low, trust=trust)
    except (ManifestError, StorageError, VrlError):
        return None


def n_objects(n: int) -> str:
    """`1 object`, `3 objects`."""
    return f"{n} object" if n == 1 else f"{n} objects"


# ---------------------------------------------------------------------------------------------
# Inside the trainer.

class TrainerRetention:
    """Retention run by the trainer every `every` publishes (0: off), on a thread of its own.

    `after_publish` only hands the new manifest over: a pass never delays a publish. One pass
    runs at a time; a pass that falls due while one runs is not started, the running one
    takes the newest manifest when it ends (so the last publish always gets its pass).

    A pass is bounded whatever the bucket holds (MAX_LISTINGS_PER_PASS listings of at most
    LIST_LIMIT keys, MAX_DELETES_PER_PASS deletes) and walks the version folders below the
    kept range in version order, rollouts/ before checkpoints/, from where the last pass
    stopped. The first pass after a (re)start finds where to begin from checkpoints/ and
    manifests/, which only the trainer writes: the lowest checkpoint folder left, and the
    checkpoint folders of never-committed versions (crash debris). A shard uploaded late
    into a version already walked is left for `vrl gc` (or the bucket's lifecycle expiry).
    An object the bucket refuses to delete is logged (keys escaped: volunteers name them),
    counted and stepped over, and the walk goes on (`_clear`); a delete request that goes
    unanswered ends the folder's turn, which the next pass takes again. Neither stops the
    trainer."""

    MAX_REPORTED = 3  # failed objects named per pass; all are counted in its summary line

    def __init__(self, storage: Storage, keep_versions: int, every: int,
                 log: Callable[[str], None] = print,
                 prefixes: Collection[str] = DEFAULT_PREFIXES,
                 stopping: Callable[[], bool] = lambda: False):
        check(TrainerConfig, "gc_every", every)
        if every:
            check_rules(keep_versions, prefixes)
        self.storage, self.keep_versions, self.every, self.log = storage, keep_versions, every, log
        # rollouts/ (and any prefix but checkpoints/) first: a checkpoint folder left means
        # every version from it on may still hold rollouts, which a restart relies on.
        self.prefixes = tuple(sorted(prefixes, key=lambda p: p == layout.CHECKPOINTS))
        self.stopping = stopping  # a stop signal: the pass ends at its next request
        self.publishes = 0
        self.next: dict[str, int] | None = None  # per prefix: every version below it is gone
        self.debris: list[int] = []  # checkpoint folders of never-committed versions
        self._lock = threading.Lock()
        self._lines: list[str] = []  # said on the pass's thread, logged on the caller's
        self._pending: Manifest | None = None
        self._thread: threading.Thread | None = None
        self._running = self._closed = False

    # --- the thread -----------------------------------------------------------------------

    def after_publish(self, manifest: Manifest) -> None:
        """Call once per published version; every `every` calls a pass is due."""
        if not self.every:
            return
        self._flush()
        self.publishes += 1
        if self.publishes % self.every:
            return
        with self._lock:
            if self._closed:
                return
            self._pending = manifest
            if self._running:  # the running pass takes it when it ends
                return
            self._running = True
            self._thread = threading.Thread(target=self._work, name="vrl-retention", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                m, self._pending = self._pending, None
                if m is None or self.stopping():
                    self._running = False
                    return
            self.run_pass(m)

    def close(self, timeout: float | None = None) -> None:
        """No new pass after this. Wait, at most `timeout` seconds (None: for good), for the
        pass in flight and the one due after it (the last publish's) to end; after a stop
        signal (`stopping`) the pass ends at its next request and none follows. A pass still
        in a request when the wait ends is abandoned with its thread (a daemon): it only
        deletes what is no longer needed, and the next start's pass takes what it left."""
        with self._lock:
            self._closed = True
        self.wait(timeout)

    def wait(self, timeout: float | None = None) -> None:
        """Wait, at most `timeout` seconds, until no pass runs or is due (tests, `close`)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._flush()

    def _say(self, line: str) -> None:
        """Log `line`: at once on the caller's thread; from the pass's thread, at the next
        publish or `wait`, so that only the trainer's thread writes its log (two threads
        printing can splice their lines)."""
        if threading.current_thread() is not self._thread:
            self.log(line)
            return
        with self._lock:
            self._lines.append(line)

    def _flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
        for line in lines:
            self.log(line)

    # --- one pass -------------------------------------------------------------------------

    def run_pass(self, m: Manifest) -> Outcome | None:
        """One bounded pass for manifest `m`; None if it could not run (logged, retried)."""
        try:
            return self._pass(m)
        except StorageError as exc:
            self._say(f"warning: retention pass skipped, will retry: {printable(one_line(exc))}")
        except Exception as exc:  # noqa: BLE001 - on its own thread: nothing may escape it
            self._say(f"warning: retention pass failed, will retry: {type(exc).__name__}: "
                     f"{printable(one_line(exc))}")
        return None

    def _pass(self, m: Manifest) -> Outcome:
        low = kept_from(m.version, m.max_staleness, self.keep_versions)
        lowest = _lowest(self.storage, m, low, None)
        floor, bases = chain_floor(m, lowest, low), base_folders(m, lowest)
        budget = _Budget(MAX_LISTINGS_PER_PASS, MAX_DELETES_PER_PASS)
        outcome = Outcome()
        if self.next is None:
            self._start(m, low, budget)
        # Debris folders are known never committed: planned as such (committed: none).
        while self.debris and self._clear(layout.CHECKPOINTS, self.debris[0], m, (floor, bases),
                                          set(), budget, outcome):
            self.debris.pop(0)
        for prefix in self.prefixes:
            end = low
            if prefix == layout.CHECKPOINTS:
                end = min([low, floor] + [self.next[p] for p in self.prefixes if p != prefix])
            while self.next[prefix] < end and self._clear(prefix, self.next[prefix], m,
                                                          (floor, bases), None, budget, outcome):
                self.next[prefix] += 1
        self._report(outcome, low, m.version, budget)
        return outcome

    def _start(self, m: Manifest, low: int, budget: _Budget) -> None:
        """Where the walk begins: the lowest checkpoint folder left (or the kept range), and
        which folders are crash debris. Lists checkpoints/ one level and manifests/, which
        only the trainer writes."""
        budget.listings -= 2
        folders = {v for e in self.storage.list_level(layout.CHECKPOINTS)
                   if e.endswith("/") and (v := _version(e)) is not None}
        committed = committed_versions(self.storage.list(layout.MANIFESTS))
        start = min(folders | {low})
        window_from = layout.window(m.version, m.max_staleness).start
        self.next = {p: start for p in self.prefixes}
        self.debris = sorted(v for v in folders
                             if v not in committed and start <= v < window_from and v < m.version)

    def _clear(self, prefix: str, version: int, m: Manifest, chain: tuple[int, frozenset[int]],
               committed: set[int] | None, budget: _Budget, outcome: Outcome) -> bool:
        """Remove what the plan says goes of `<prefix>/vNNNNNN/`, LIST_LIMIT keys at a time,
        within the budget (`chain`: chain_floor and base_folders, what checkpoints/ keeps).
        True once nothing of it is left to remove; False if the budget or a stop ran out
        first, or a delete request went unanswered (the next pass tries again).

        An object the bucket refuses to delete (access denied, a file it cannot remove) is
        reported and stepped over: the folder's listings then ask for that many keys more,
        and the folder counts as cleared with such objects left in it, so the walk goes on
        past it and later passes do not try them again (`vrl gc` and the bucket's lifecycle
        expiry are left with them). A folder with more than MAX_REFUSED_PER_FOLDER of them is
        given up, one line saying so."""
        folder = layout.versioned_prefix(prefix, version)
        refused: set[str] = set()
        while True:
            want = min(LIST_LIMIT, budget.deletes)
            if self.stopping() or budget.listings <= 0 or want <= 0:
                return False
            budget.listings -= 1
            limit = want + len(refused)
            keys = self.storage.list(folder, limit=limit)
            p = plan([k for k in keys if k not in refused], m.version, m.max_staleness,
                     self.keep_versions, committed, self.prefixes, checkpoints_from=chain[0],
                     bases=chain[1])
            if not p.keys:  # nothing (more) here goes
                return True
            if self.stopping():  # came while the listing ran
                return False
            budget.deletes -= len(p.keys)
            said_no, unanswered = delete_batch(self.storage, p.keys)
            outcome.failed += said_no + unanswered
            stayed = {key for key, _ in said_no + unanswered}
            for r in p.removals:
                tally = outcome.removed.setdefault((r.prefix, r.reason), Tally())
                tally.objects += sum(key not in stayed for key in r.keys)
            if unanswered:
                return False
            refused.update(key for key, _ in said_no)
            if len(refused) > MAX_REFUSED_PER_FOLDER:
                self._say(f"warning: retention leaves the rest of {folder}/: more than "
                          f"{n_objects(MAX_REFUSED_PER_FOLDER)} there could not be deleted")
                return True
            if len(keys) < limit:
                return True

    def _report(self, outcome: Outcome, low: int, current: int, budget: _Budget) -> None:
        more = "; more next pass" if budget.listings <= 0 or budget.deletes <= 0 else ""
        if outcome.failed:
            more = f"; could not delete {n_objects(len(outcome.failed))}{more}"
        if outcome.objects or outcome.failed:
            self._say(f"retention: removed {n_objects(outcome.objects)}; kept v{low}-v{current}{more}")
        for key, message in outcome.failed[: self.MAX_REPORTED]:
            self._say(f"warning: retention could not delete {printable(message)}")


@dataclass
class _Budget:
    """What is left of one pass's listings and deletes."""

    listings: int
    deletes: int


def _version(folder_key: str) -> int | None:
    """The version of a listed folder key such as `checkpoints/v000042/`."""
    parsed = layout.split_versioned_key(folder_key)
    return None if parsed is None else parsed[1]
