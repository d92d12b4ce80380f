"""Retention: which old checkpoints and rollout shards may leave the bucket, and removing them.

A run publishes a version every few seconds; without retention the bucket keeps every
checkpoint and shard it ever saw. What may go is decided by `plan`, a pure function of the
manifest's version, its staleness window and the listed keys, so it can be tested and shown
as a dry run; `execute` deletes through the Storage interface, one object at a time, and
reports the objects it could not delete without stopping at them.

The rules (docs/PROTOCOL.md, "Retention"):

- Kept: `manifest.json`, the `manifests/` history (the trainer derives the next version
  number from it), the manifest's version and anything newer (a publish in flight), every
  version of the staleness window `[current - max_staleness, current]`, the newest
  `keep_versions` version numbers, and every prefix not in `prefixes` (metrics/, datasets/,
  and whatever else other parts of the trainer file by version).
- Kept too, under checkpoints/: the folders the kept versions' weights are rebuilt from,
  from the keyframe of the lowest kept version on, and those of the patches the current
  manifest lists (`chain_floor`). When the lowest kept version's manifest copy cannot be
  read, no checkpoint below the kept range is removed that pass.
- Removed: objects under `prefixes` (checkpoints/, rollouts/) of versions below the kept
  range, whose shards can never be trained on again; and crash debris, the checkpoint
  objects of a version below the window that never got its `manifests/` copy (a publish
  interrupted before its commit, never named by any manifest).

`vrl gc` lists the prefixes whole; the trainer (`TrainerRetention`) lists them whole once per
start and afterwards only the versions that fell below the kept range since its last pass.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable

from volunteer_rl.config import TrainerConfig, check
from volunteer_rl.errors import VrlError
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    read_manifest,
)
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage.base import NotFound, Storage, StorageError

DEFAULT_PREFIXES = (layout.CHECKPOINTS, layout.ROLLOUTS)
"""Top-level prefixes whose old versions retention removes."""
DEBRIS_PREFIXES = (layout.CHECKPOINTS,)
"""Prefixes where objects of a never-committed version are crash debris."""
PROTECTED = frozenset({layout.MANIFEST, layout.MANIFESTS})
"""Never deleted whatever the caller asks: the commit point and the version history."""

BELOW_RANGE = "below the kept range"
UNCOMMITTED = "never committed"


# ---------------------------------------------------------------------------------------------
# Planning: pure, no I/O.

def kept_from(current: int, max_staleness: int, keep_versions: int) -> int:
    """The lowest version retention keeps: the staleness window and the newest
    `keep_versions` version numbers, whichever reaches further back."""
    return min(layout.window(current, max_staleness).start, max(0, current - keep_versions + 1))


def committed_versions(manifest_keys: Iterable[str]) -> set[int]:
    """Versions that have a `manifests/vNNNNNN.json` copy among the listed keys."""
    out = set()
    for key in manifest_keys:
        parsed = layout.split_versioned_key(key)
        if parsed is not None and parsed[0] == layout.MANIFESTS:
            out.add(parsed[1])
    return out


@dataclass(frozen=True)
class Removal:
    """Objects of one prefix removed for one reason."""

    prefix: str
    reason: str
    keys: tuple[str, ...]
    versions: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    current: int
    max_staleness: int
    keep_versions: int
    kept_from: int
    prefixes: tuple[str, ...]
    removals: tuple[Removal, ...]

    @property
    def keys(self) -> list[str]:
        return [k for r in self.removals for k in r.keys]


def check_rules(keep_versions: int, prefixes: Collection[str]) -> None:
    """ValueError for settings that would keep too little or touch protected objects."""
    check(TrainerConfig, "keep_versions", keep_versions)
    if PROTECTED & set(prefixes):
        raise ValueError(f"retention never deletes {sorted(PROTECTED & set(prefixes))}")


def chain_floor(current: Manifest, lowest: Manifest | None, low: int) -> int:
    """The lowest checkpoint folder the kept versions' weights need: the keyframe of the
    lowest kept version (`lowest`, its manifest; every kept version's keyframe is at or after
    it), and the first patch the current manifest lists (volunteers holding any version from
    there on patch forward). `lowest` None (its manifest unreadable): 0, keep them all."""
    if lowest is None:
        return 0
    floor = low
    for m in (current, lowest):
        if m.weights is not None:
            floor = min(floor, m.weights.keyframe.version,
                        *(p.version for p in m.weights.patches[:1]))
    return floor


def _reason(key: str, current: int, low: int, window_from: int,
            committed: Collection[int] | None, prefixes: Collection[str],
            debris_prefixes: Collection[str], checkpoints_from: int) -> tuple[str, str, int] | None:
    """(prefix, reason, version) if `key` goes, None if it stays."""
    parsed = layout.split_versioned_key(key)
    if parsed is None:
        return None
    prefix, version = parsed
    if prefix not in prefixes or version >= current:
        return None
    if version < (min(low, checkpoints_from) if prefix == layout.CHECKPOINTS else low):
        return prefix, BELOW_RANGE, version
    if (committed is not None and prefix in debris_prefixes and version < window_from
            and version not in committed):
        return prefix, UNCOMMITTED, version
    return None


def plan(keys: Iterable[str], current: int, max_staleness: int, keep_versions: int,
         committed: Collection[int] | None = None,
         prefixes: Collection[str] = DEFAULT_PREFIXES,
         debris_prefixes: Collection[str] = DEBRIS_PREFIXES,
         checkpoints_from: int | None = None) -> Plan:
    """The keys to delete, grouped by prefix and reason.

    `current` and `max_staleness` are the manifest's; `committed` is the set of versions with
    a manifests/ copy (None: unknown, so no version is treated as crash debris);
    `checkpoints_from` (chain_floor) keeps the checkpoint folders from it on as well (None:
    nothing beyond the kept range). Keys outside `prefixes`, or that do not parse as
    versioned keys, are kept."""
    prefixes = tuple(prefixes)
    check_rules(keep_versions, prefixes)
    if current < 0 or max_staleness < 0:
        raise ValueError(f"bad manifest version {current} or max_staleness {max_staleness}")
    low = kept_from(current, max_staleness, keep_versions)
    window_from = layout.window(current, max_staleness).start
    groups: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    for key in keys:
        why = _reason(key, current, low, window_from, committed, prefixes, debris_prefixes,
                      low if checkpoints_from is None else checkpoints_from)
        if why is not None:
            groups[why[:2]].append((why[2], key))
    order = sorted(groups, key=lambda g: (prefixes.index(g[0]), g[1]))
    removals = tuple(_removal(prefix, reason, groups[prefix, reason]) for prefix, reason in order)
    return Plan(current, max_staleness, keep_versions, low, prefixes, removals)


def _removal(prefix: str, reason: str, items: list[tuple[int, str]]) -> Removal:
    """One group, keys in version order (so an interrupted run leaves the newest behind)."""
    items = sorted(items)
    return Removal(prefix, reason, tuple(k for _, k in items), tuple(sorted({v for v, _ in items})))


# ---------------------------------------------------------------------------------------------
# Executing: deletes through Storage, never stops at a failure.

@dataclass
class Tally:
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


def _remove(storage: Storage, key: str, dry_run: bool) -> int | None:
    """Bytes removed, or None if the object was already gone (lifecycle expiry, another gc)."""
    try:
        size = storage.size(key)
        if not dry_run:
            storage.delete(key)
    except NotFound:
        return None
    return size


def execute(storage: Storage, p: Plan, dry_run: bool = False) -> Outcome:
    """Delete every key of the plan, oldest version first; record failures and go on."""
    outcome = Outcome()
    for removal in p.removals:
        tally = outcome.removed.setdefault((removal.prefix, removal.reason), Tally())
        for key in removal.keys:
            try:
                size = _remove(storage, key, dry_run)
            except (StorageError, OSError) as exc:
                message = " ".join(str(exc).split())
                outcome.failed.append((key, message if key in message else f"{key}: {message}"))
                continue
            if size is not None:
                tally.objects += 1
                tally.bytes += size
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
    floor = chain_floor(m, _lowest(storage, m, low, trust), low)
    keys = [k for prefix in prefixes for k in storage.list(prefix)]
    committed = committed_versions(storage.list(layout.MANIFESTS))
    p = plan(keys, m.version, m.max_staleness, keep_versions, committed, prefixes,
             checkpoints_from=floor)
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


# ---------------------------------------------------------------------------------------------
# Reporting.

def human_bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def n_objects(n: int) -> str:
    """`1 object`, `3 objects`."""
    return f"{n} object" if n == 1 else f"{n} objects"


def version_ranges(versions: Iterable[int]) -> str:
    """`v0-v10, v13` for 0..10 and 13."""
    spans: list[list[int]] = []
    for v in sorted(versions):
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"v{a}" if a == b else f"v{a}-v{b}" for a, b in spans)


def summary_lines(p: Plan, outcome: Outcome, dry_run: bool = False) -> list[str]:
    """The kept range, then one line per prefix: objects and bytes removed, and why."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"kept: v{p.kept_from}-v{p.current} and anything newer (manifest v{p.current}, "
             f"staleness window {p.max_staleness}, newest {p.keep_versions} versions); "
             f"{layout.MANIFEST}, {layout.MANIFESTS}/ and other prefixes untouched"]
    for prefix in p.prefixes:
        removals = [r for r in p.removals if r.prefix == prefix]
        tallies = [outcome.removed.get((r.prefix, r.reason), Tally()) for r in removals]
        count, size = sum(t.objects for t in tallies), sum(t.bytes for t in tallies)
        why = "; ".join(f"{t.objects} {r.reason}: {version_ranges(r.versions)}"
                        for r, t in zip(removals, tallies) if t.objects)
        lines.append(f"{prefix}/: {verb} {n_objects(count)}, {human_bytes(size)}"
                     + (f" ({why})" if why else ""))
    return lines


# ---------------------------------------------------------------------------------------------
# Inside the trainer.

class TrainerRetention:
    """Retention run by the trainer right after a publish, every `every` publishes (0: off).

    The first pass after a (re)start lists checkpoints/, rollouts/ and manifests/ whole, as
    `vrl gc` does. After a clean pass it remembers the floor below which everything is gone,
    so later passes list only `<prefix>/vNNNNNN/` of the versions that fell below the kept
    range since: a publish never pays for the run's whole history. A shard uploaded late into
    a version already below the floor is left for `vrl gc` (or the bucket's lifecycle expiry).
    Failures are logged and retried at the next pass; they never stop the trainer."""

    MAX_REPORTED = 3  # failed objects named per pass; the rest are counted

    def __init__(self, storage: Storage, keep_versions: int, every: int,
                 log: Callable[[str], None] = print,
                 prefixes: Collection[str] = DEFAULT_PREFIXES):
        check(TrainerConfig, "gc_every", every)
        if every:
            check_rules(keep_versions, prefixes)
        self.storage, self.keep_versions, self.every, self.log = storage, keep_versions, every, log
        self.prefixes = tuple(prefixes)
        self.publishes = 0
        self.floor: int | None = None  # every version below it is known to be gone

    def after_publish(self, manifest: Manifest) -> Outcome | None:
        """Call once per published version; runs a pass every `every` calls."""
        if not self.every:
            return None
        self.publishes += 1
        if self.publishes % self.every:
            return None
        try:
            return self._pass(manifest)
        except StorageError as exc:
            self.log(f"warning: retention pass skipped, will retry: {exc}")
            return None

    def _keys(self, low: int) -> tuple[list[str], set[int] | None]:
        """Keys to plan from: everything on the first pass, else only the newly old versions."""
        if self.floor is None:
            keys = [k for prefix in self.prefixes for k in self.storage.list(prefix)]
            return keys, committed_versions(self.storage.list(layout.MANIFESTS))
        return [k for v in range(self.floor, low) for prefix in self.prefixes
                for k in self.storage.list(layout.versioned_prefix(prefix, v))], None

    def _pass(self, m: Manifest) -> Outcome:
        low = kept_from(m.version, m.max_staleness, self.keep_versions)
        floor = chain_floor(m, _lowest(self.storage, m, low, None), low)
        keys, committed = self._keys(min(low, floor))
        p = plan(keys, m.version, m.max_staleness, self.keep_versions, committed, self.prefixes,
                 checkpoints_from=floor)
        outcome = execute(self.storage, p)
        if outcome.objects:
            self.log(f"retention: removed {n_objects(outcome.objects)}, "
                     f"{human_bytes(outcome.bytes)}; kept v{low}-v{m.version}")
        for key, message in outcome.failed[: self.MAX_REPORTED]:
            self.log(f"warning: retention could not delete {message}")
        if len(outcome.failed) > self.MAX_REPORTED:
            self.log(f"warning: retention could not delete {n_objects(len(outcome.failed))} in all")
        if not outcome.failed:
            self.floor = min(low, floor)
        return outcome
