"""Writing test objects into a bucket folder and checking what a trainer left there: shared by
the live tests (hostile, crash, signals, stale liar, default dashboard)."""
from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path

from conftest import TEMPLATE_VERSION

from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import read_manifest
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage import open_storage


class FolderBucket:
    """A folder bucket written with plain file calls (not the code under test)."""

    def __init__(self, path: Path):
        self.path, self.args = path, ["--bucket", str(path)]

    def put(self, key: str, data: bytes) -> str:
        path = self.path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(".tmp-" + path.name[:200])
        tmp.write_bytes(data)
        tmp.replace(path)  # the trainer must never see half a test object either
        return key

    def read(self, key: str) -> bytes:
        return (self.path / key).read_bytes()


def as_dicts(groups, volunteer: str) -> list[dict]:
    """Groups as shard lines, relabelled as made by `volunteer`."""
    out = []
    for g in groups:
        d = asdict(g)
        d["volunteer_id"] = volunteer
        out.append(d)
    return out


def gz_lines(rows: list) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())


def key(volunteer: str, name: str, version: int = TEMPLATE_VERSION) -> str:
    return f"rollouts/{layout.version_dir(version)}/{volunteer}/{name}.jsonl.gz"


def honest_shards(template, bucket: Path, count: int) -> list[str]:
    """`count` shards of 4 real groups into a copy of the template's bucket, one from each of
    vol-0, vol-1, ... (volunteer i's groups 4i to 4i + 3, so no two shards share a group);
    their keys. Hand-picked numbers: a trainer fed them needs conftest.PICKED."""
    return [FolderBucket(bucket).put(key(f"vol-{i}", "s"), gz_lines(as_dicts(
                template.groups(f"vol-{i}")[4 * i: 4 * i + 4], f"vol-{i}")))
            for i in range(count)]


def assert_manifest_complete(bucket: Path, tmp: Path) -> int:
    """The version the bucket's manifest names, after checking its signature and fetching
    every file of its checkpoint (which raises on any missing or altered file)."""
    storage = open_storage(str(bucket))
    m = read_manifest(storage, trust=Trust(allow_unsigned=False))
    fetch_checkpoint(storage, m, tmp / f"check-v{m.version}")
    return m.version


def published_versions(bucket: Path) -> list[int]:
    """The versions whose manifest copy is in a folder bucket, in order."""
    return sorted(layout.parse_version_dir(p.stem) for p in (bucket / "manifests").glob("v*.json"))


def committed(bucket: Path) -> list[int]:
    """The committed versions of a folder bucket: its manifest copies and manifest.json's."""
    history = {layout.parse_version_dir(p.stem) for p in (bucket / "manifests").glob("v*.json")}
    return sorted(history | {json.loads((bucket / "manifest.json").read_text())["version"]})


def trained_lines(bucket: Path) -> Counter:
    """(shard key, line) -> how often committed ledger records say it was trained."""
    seen: Counter = Counter()
    for v in committed(bucket):
        path = bucket / layout.ledger_key(v)
        if path.exists():
            for rec in map(json.loads, path.read_text().splitlines()):
                assert rec["outcome"] == "trained", rec
                seen.update((rec["key"], line) for line in rec["lines"])
    return seen


def ledger_sums(bucket: Path, versions: list[int]) -> dict[str, dict]:
    """Per volunteer, summed over the `trained` records of the ledger objects of `versions`:
    groups (lines), tokens, and the first and last record time."""
    out: dict[str, dict] = defaultdict(lambda: {"groups": 0, "tokens": 0, "times": []})
    for v in versions:
        path = bucket / layout.ledger_key(v)
        if not path.exists():
            continue
        for rec in map(json.loads, path.read_text().splitlines()):
            if rec["outcome"] != "trained":
                continue
            row = out[layout.rollout_author(rec["key"])[1]]
            row["groups"] += len(rec["lines"])
            row["tokens"] += rec["tokens"]
            row["times"].append(rec["time"])
    return dict(out)
