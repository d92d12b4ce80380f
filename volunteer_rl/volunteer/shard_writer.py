"""The volunteer's outbox: groups of one policy version buffered and uploaded as rollout
shards, each written once under rollouts/<version>/<volunteer id>/ (protocol.shards is the
format, protocol.layout the key)."""

from __future__ import annotations

import time
from typing import Callable

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.protocol.shards import MAX_GROUPS_PER_SHARD, Group, encode_shard, new_shard_name
from volunteer_rl.storage.base import Storage


class ShardWriter:
    """Buffers groups of one policy version; uploads a shard every N groups or T seconds.
    `limit` is the manifest's max_shard_groups: no shard holds more, whatever N is."""

    def __init__(self, storage: Storage, volunteer_id: str, max_groups: int, max_seconds: float,
                 log: Callable[[str], None] | None, on_upload: Callable[[int], None] | None = None):
        self.storage, self.volunteer_id = storage, volunteer_id
        self.log = log  # a line per shard uploaded (--log-shards); None: none
        self.on_upload = on_upload  # told the group count of each uploaded shard
        self.max_groups, self.max_seconds = max_groups, max_seconds
        self.limit = MAX_GROUPS_PER_SHARD
        self.groups: list[Group] = []
        self.version: int | None = None
        self.opened = 0.0
        self.seq = 0
        self.uploaded_groups = 0
        self.per_version: dict[int, int] = {}

    def add(self, groups: list[Group], version: int) -> None:
        if self.version is not None and version != self.version:
            self.flush()  # a shard holds one version: it lives under that version's prefix
        if not self.groups:
            self.opened = time.time()
        self.version = version
        self.groups.extend(groups)
        self.per_version[version] = self.per_version.get(version, 0) + len(groups)
        if len(self.groups) >= min(self.max_groups, self.limit) or time.time() - self.opened >= self.max_seconds:
            self.flush()

    def version_groups(self, manifest: Manifest | None) -> int:
        """Groups made so far with the manifest's version."""
        return self.per_version.get(manifest.version, 0) if manifest is not None else 0

    def flush(self) -> None:
        """Upload what is buffered, as several shards if it is more than `limit` groups."""
        while self.groups:
            shard, self.groups = self.groups[:self.limit], self.groups[self.limit:]
            key = layout.shard_key(self.version, self.volunteer_id, new_shard_name(self.seq))
            self.storage.create(key, encode_shard(shard))
            if self.log is not None:
                rewards = [c.reward for g in shard for c in g.completions]
                self.log(f"uploaded {key}: {len(shard)} groups, reward {sum(rewards) / len(rewards):.3f}")
            self.uploaded_groups += len(shard)
            if self.on_upload is not None:
                self.on_upload(len(shard))
            self.seq += 1
