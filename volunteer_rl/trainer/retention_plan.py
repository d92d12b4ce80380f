"""Retention's plan: which old checkpoints and rollout shards may leave the bucket. Pure, no
I/O: `plan` is a function of the manifest's version, its staleness window and the listed
keys, so it can be tested and shown as a dry run. trainer.retention deletes what it says.

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
- A LoRA run's base: the folders its weights are rebuilt from (its keyframe's to the base's)
  stay whatever their version (`base_folders`), while the adapter folders between the base
  and the kept range go.
- Removed: objects under `prefixes` (checkpoints/, rollouts/) of versions below the kept
  range, whose shards can never be trained on again; and crash debris, the checkpoint
  objects of a version below the window that never got its `manifests/` copy (a publish
  interrupted before its commit, never named by any manifest).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Collection, Iterable

from volunteer_rl.config import TrainerConfig, check
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Manifest

DEFAULT_PREFIXES = (layout.CHECKPOINTS, layout.ROLLOUTS)
"""Top-level prefixes whose old versions retention removes."""
DEBRIS_PREFIXES = (layout.CHECKPOINTS,)
"""Prefixes where objects of a never-committed version are crash debris."""
PROTECTED = frozenset({layout.MANIFEST, layout.MANIFESTS})
"""Never deleted whatever the caller asks: the commit point and the version history."""

BELOW_RANGE = "below the kept range"
UNCOMMITTED = "never committed"


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
    there on patch forward). `lowest` None (its manifest unreadable): 0, keep them all.
    A LoRA version's weights are its base's, kept by base_folders instead."""
    if lowest is None:
        return 0
    floor = low
    for m in (current, lowest):
        if m.weights is not None and m.adapter is None:
            floor = min(floor, m.weights.keyframe.version,
                        *(p.version for p in m.weights.patches[:1]))
    return floor


def base_folders(current: Manifest, lowest: Manifest | None) -> frozenset[int]:
    """The checkpoint folders a LoRA run's base is rebuilt from, for the kept versions that
    are adapters on it (`current`, and `lowest`, the lowest kept version's manifest): the
    base's keyframe and patches, from the keyframe's folder to the base's. Empty for versions
    published whole."""
    out: set[int] = set()
    for m in (current, lowest):
        if m is not None and m.adapter is not None and m.weights is not None:
            out.update(range(m.weights.keyframe.version, m.adapter.base + 1))
    return frozenset(out)


def _reason(key: str, current: int, low: int, window_from: int,
            committed: Collection[int] | None, prefixes: Collection[str],
            debris_prefixes: Collection[str], checkpoints_from: int,
            bases: Collection[int]) -> tuple[str, str, int] | None:
    """(prefix, reason, version) if `key` goes, None if it stays."""
    parsed = layout.split_versioned_key(key)
    if parsed is None:
        return None
    prefix, version = parsed
    if prefix not in prefixes or version >= current:
        return None
    if prefix == layout.CHECKPOINTS and version in bases:
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
         checkpoints_from: int | None = None, bases: Collection[int] = ()) -> Plan:
    """The keys to delete, grouped by prefix and reason.

    `current` and `max_staleness` are the manifest's; `committed` is the set of versions with
    a manifests/ copy (None: unknown, so no version is treated as crash debris);
    `checkpoints_from` (chain_floor) keeps the checkpoint folders from it on as well (None:
    nothing beyond the kept range), and `bases` (base_folders) those of these versions. Keys
    outside `prefixes`, or that do not parse as versioned keys, are kept."""
    prefixes = tuple(prefixes)
    check_rules(keep_versions, prefixes)
    if current < 0 or max_staleness < 0:
        raise ValueError(f"bad manifest version {current} or max_staleness {max_staleness}")
    low = kept_from(current, max_staleness, keep_versions)
    window_from = layout.window(current, max_staleness).start
    groups: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    for key in keys:
        why = _reason(key, current, low, window_from, committed, prefixes, debris_prefixes,
                      low if checkpoints_from is None else checkpoints_from, bases)
        if why is not None:
            groups[why[:2]].append((why[2], key))
    order = sorted(groups, key=lambda g: (prefixes.index(g[0]), g[1]))
    removals = tuple(_removal(prefix, reason, groups[prefix, reason]) for prefix, reason in order)
    return Plan(current, max_staleness, keep_versions, low, prefixes, removals)


def _removal(prefix: str, reason: str, items: list[tuple[int, str]]) -> Removal:
    """One group, keys in version order (so an interrupted run leaves the newest behind)."""
    items = sorted(items)
    return Removal(prefix, reason, tuple(k for _, k in items), tuple(sorted({v for v, _ in items})))
