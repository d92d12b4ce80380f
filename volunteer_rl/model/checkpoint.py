"""Publishing and fetching immutable checkpoint folders (`checkpoints/v000042/...`).

Write order (restic's rule): every file of the version first, each verified present at its
size, and only then the manifest that points at them (see `trainer.publish`). Read order is
the reverse: the manifest, then each file, each checked against the manifest's sha256 (the
weights file: its pieces' sha256s) before anything is loaded from it.

Big files stream: a file goes up hashed on the way (`upload_stream`), and the trainer's
weights file, made in memory, is hashed by pieces on every core while it uploads
(`trainer.publish`, `upload_buffer`). What a reader checks before it downloads anything is
in vetting.py, the hashing in hashing.py, and how a reader gets the weights file from the
keyframe and its patches in chain.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import BinaryIO, Callable

from volunteer_rl.faults import crash_point
from volunteer_rl.model.chain import build_weights, keyframe_weights
from volunteer_rl.model.hashing import CHUNK, CheckpointError, HashingSink
from volunteer_rl.model.vetting import (
    WEIGHTS_FILE,
    CheckpointRefused,
    check_checkpoint,
    file_refusal,
    read_verified,
)
from volunteer_rl.progress import progress
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import ADAPTER_FILE, FileEntry, Manifest, WeightsEntry
from volunteer_rl.storage.base import Storage


def _copy_file(path: Path) -> Callable[[BinaryIO], None]:
    """A writer that streams a local file in CHUNK pieces."""
    def write(out) -> None:
        with open(path, "rb", buffering=0) as f:
            while piece := f.read(CHUNK):
                out.write(piece)
    return write


def upload_stream(storage: Storage, key: str, write: Callable[[BinaryIO], None]) -> FileEntry:
    """Create `key` from what `write(f)` writes, hashing it on the way; its FileEntry.

    A retried attempt (Retrying) calls `write` again on a new sink, with a new hash."""
    entries: list[FileEntry] = []

    def attempt(sink: BinaryIO) -> None:
        hashing = HashingSink(sink)
        try:
            write(hashing)
        finally:
            entries.append(hashing.hasher.entry())

    storage.create_from(key, attempt)
    return entries[-1]


def upload_buffer(storage: Storage, key: str, buf: memoryview,
                  ready: Callable[[int], None] = lambda end: None) -> None:
    """Create `key` from `buf` and check the object's size after. Not hashed on the way, unlike
    upload_stream: the caller hashes this very buffer, immutable in memory once made, so a
    second pass over a multi-GB file would prove nothing and cost a core for seconds.
    `ready(end)` returns once buf[:end] is made (Filling.wait: the upload follows the making)."""
    view = memoryview(buf).cast("B")

    def write(sink: BinaryIO) -> None:
        for start in range(0, len(view), CHUNK):
            end = min(start + CHUNK, len(view))
            ready(end)
            sink.write(view[start:end])

    storage.create_from(key, write)
    if storage.size(key) != len(view):
        raise CheckpointError(f"{key}: size after upload differs from {len(view)} bytes")


def publish_checkpoint(storage: Storage, version: int, folder: Path
                       ) -> dict[str, FileEntry | WeightsEntry]:
    """Upload every file of `folder` under checkpoints/vNNNNNN/, then verify each one landed.
    (The trainer's folder holds no weights file: it uploads that from memory, upload_buffer.
    One that is there goes up whole, listed by its root; keyframe_weights gives the
    manifest's `weights` for it.)

    Returns the per-file sha256 (the weights file: its root) and size for the manifest,
    hashed from the very bytes sent.
    Objects are created write-once: a version folder that already holds the file is an
    error (AlreadyExists), not an overwrite. A file readers would refuse (check_files) is
    CheckpointRefused before anything is uploaded.
    """
    entries: dict[str, FileEntry | WeightsEntry] = {}
    writers = {p.name: _copy_file(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}
    sizes = {p.name: p.stat().st_size for p in Path(folder).iterdir() if p.is_file()}
    for name in writers:  # what readers refuse is not published
        reason = file_refusal(name, sizes[name])
        if reason:
            raise CheckpointRefused(f"{Path(folder) / name} {reason}; readers refuse a "
                                    f"checkpoint holding it, so v{version} is not published")
    with progress(f"upload v{version}", sum(sizes.values()), unit_bytes=True) as advance:
        for name, write in sorted(writers.items()):
            key = layout.checkpoint_key(version, name)
            if name == WEIGHTS_FILE:  # under its size cap: checked above
                data = memoryview((Path(folder) / name).read_bytes())
                upload_buffer(storage, key, data)
                entry = keyframe_weights(version, data)[0]
            else:
                entry = upload_stream(storage, key, write)
            crash_point("checkpoint_upload")
            entries[name] = entry
            advance(sizes.get(name, 0))
    for name, entry in entries.items():
        key = layout.checkpoint_key(version, name)
        if storage.size(key) != entry.size:
            raise CheckpointError(f"{key}: size after upload differs from {entry.size} bytes")
    return entries


def fetch_checkpoint(storage: Storage, manifest: Manifest, dest: Path,
                     only: list[str] | None = None, require_model: bool = False,
                     weights: memoryview | None = None) -> Path:
    """Download the manifest's checkpoint into `dest`, verifying every sha256 and size.

    Nothing is downloaded (nor `dest` created) before `check_checkpoint(storage, manifest,
    require_model)` passed: volunteers and `vrl eval` pass require_model=True.
    `only` restricts the download to some files. The weights file comes from `weights` if
    given (a buffer fetch_weights returned for this manifest), else from build_weights (the
    keyframe and the patches after it). Files land under a temp name and are renamed when
    verified, so `dest` never holds bytes that did not match. A full fetch also removes files
    the manifest does not name (left by another version or bucket), so a loader reading the
    whole folder reads only files checked against this manifest.
    """
    check_checkpoint(storage, manifest, require_model)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {n: e for n, e in manifest.files.items()
              if (only is None or n in only) and n != ADAPTER_FILE}
    with progress(f"fetch v{manifest.version}", sum(e.size for e in wanted.values()),
                  unit_bytes=True) as advance:
        for name, entry in wanted.items():
            if name == WEIGHTS_FILE:  # a manifest that lists it has weights (its schema)
                data = weights if weights is not None else build_weights(storage, manifest).buf
                _write_file(data, dest / name)
            else:
                _fetch_file(storage, layout.checkpoint_key(manifest.version, name), entry, dest / name)
            advance(entry.size)
    if only is None:
        for path in dest.iterdir():
            if path.is_file() and (path.name not in manifest.files or path.name == ADAPTER_FILE):
                path.unlink()
    return dest


def _fetch_file(storage: Storage, key: str, entry: FileEntry, path: Path) -> None:
    """Download one file, check it against the manifest, then move it into place."""
    _write_file(read_verified(storage, key, entry), path)


def _write_file(data, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "wb") as f:
        f.write(data)
    tmp.replace(path)


def clear_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
