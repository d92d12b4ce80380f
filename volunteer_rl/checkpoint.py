"""Publishing and fetching immutable checkpoint folders (`checkpoints/v000042/...`).

Write order (restic's rule): every file of the version first, each verified present at its
size, and only then the manifest that points at them (see `trainer.publish`). Read order is
the reverse: the manifest, then each file, each checked against the manifest's sha256 before
anything is loaded from it.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from . import layout
from .faults import crash_point
from .progress import progress
from .manifest import FileEntry, Manifest
from .storage import Storage

# A checkpoint file larger than this is refused before download (volunteers bound what they
# read too). 64 GiB leaves room for multi-billion-parameter models in one safetensors file.
MAX_CHECKPOINT_FILE_BYTES = 64 << 30


class CheckpointError(Exception):
    """A checkpoint file is missing, too large, or its bytes do not match the manifest."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def publish_checkpoint(storage: Storage, version: int, folder: Path) -> dict[str, FileEntry]:
    """Upload every file of `folder` under checkpoints/vNNNNNN/ and verify each one landed.

    Returns the per-file sha256 and size for the manifest. Objects are created write-once:
    a version folder that already holds the file is an error (AlreadyExists), not an overwrite.
    """
    entries: dict[str, FileEntry] = {}
    paths = [p for p in sorted(Path(folder).iterdir()) if p.is_file()]
    total = sum(p.stat().st_size for p in paths)
    with progress(f"upload v{version}", total, unit_bytes=True) as advance:
        for path in paths:
            data = path.read_bytes()
            entry = FileEntry(sha256_bytes(data), len(data))
            storage.create(layout.checkpoint_key(version, path.name), data)
            crash_point("checkpoint_upload")
            entries[path.name] = entry
            advance(len(data))
    for name, entry in entries.items():
        key = layout.checkpoint_key(version, name)
        if storage.size(key) != entry.size:
            raise CheckpointError(f"{key}: size after upload differs from {entry.size} bytes")
    return entries


def fetch_checkpoint(storage: Storage, manifest: Manifest, dest: Path,
                     only: list[str] | None = None) -> Path:
    """Download the manifest's checkpoint into `dest`, verifying every sha256 and size.

    `only` restricts the download to some files (a volunteer swapping weights needs only the
    safetensors). Files land under a temp name and are renamed when verified, so `dest` never
    holds bytes that did not match. A full fetch also removes files the manifest does not name
    (left by another version or bucket), so a loader reading the whole folder reads only
    files checked against this manifest.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {n: e for n, e in manifest.files.items() if only is None or n in only}
    with progress(f"fetch v{manifest.version}", sum(e.size for e in wanted.values()),
                  unit_bytes=True) as advance:
        for name, entry in wanted.items():
            _fetch_file(storage, f"{manifest.checkpoint}/{name}", entry, dest / name)
            advance(entry.size)
    if only is None:
        for path in dest.iterdir():
            if path.is_file() and path.name not in manifest.files:
                path.unlink()
    return dest


def _fetch_file(storage: Storage, key: str, entry: FileEntry, path: Path) -> None:
    """Download one file, check it against the manifest, then move it into place."""
    if entry.size > MAX_CHECKPOINT_FILE_BYTES:
        raise CheckpointError(f"{key}: {entry.size} bytes exceeds the checkpoint file limit")
    data = storage.read(key, max_bytes=entry.size)
    if len(data) != entry.size or sha256_bytes(data) != entry.sha256:
        raise CheckpointError(f"{key}: sha256 or size does not match manifest.json")
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_bytes(data)
    tmp.replace(path)


def clear_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
