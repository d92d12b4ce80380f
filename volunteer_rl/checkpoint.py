"""Publishing and fetching immutable checkpoint folders (`checkpoints/v000042/...`).

Write order (restic's rule): every file of the version first, each verified present at its
size, and only then the manifest that points at them (see `trainer.publish`). Read order is
the reverse: the manifest, then each file, each checked against the manifest's sha256 before
anything is loaded from it.

Big files stream: the trainer's weights go from its tensors straight into the bucket object
(`publish_checkpoint`'s `streams`), hashed on the way, and a volunteer's come from the bucket
into one buffer, hashed as the pieces land (`read_verified`), and are copied into the model
only after the sha256 matched. Hashing runs in a thread of its own (hashlib releases the GIL
on big buffers), so it overlaps the writing or the reading of the next piece.
"""

from __future__ import annotations

import hashlib
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Callable

from . import layout
from .faults import crash_point
from .progress import progress
from .manifest import FileEntry, Manifest
from .storage import ShortObject, Storage, TooLarge

# A checkpoint file larger than this is refused before download (volunteers bound what they
# read too). 64 GiB leaves room for multi-billion-parameter models in one safetensors file.
MAX_CHECKPOINT_FILE_BYTES = 64 << 30


class CheckpointError(Exception):
    """A checkpoint file is missing, too large, or its bytes do not match the manifest."""


CHUNK = 16 << 20
"""Bytes per piece handed to the hash thread and to the sink."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Hasher:
    """sha256 of a stream, computed in a thread of its own while the caller moves the next
    piece. Pieces must stay unchanged until hashed (they are views, never copies); at most
    `depth` wait at once, so a fast producer cannot pile up memory."""

    def __init__(self, depth: int = 4):
        self.depth = depth
        self.pool = ThreadPoolExecutor(1)
        self.pending: deque[Future] = deque()
        self.reset()

    def reset(self) -> None:
        """Start over (a retried read begins again at offset 0)."""
        self._drain()
        self.h, self.size = hashlib.sha256(), 0

    def update(self, piece) -> None:
        piece = memoryview(piece).cast("B")
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.pending.append(self.pool.submit(self.h.update, piece))
        self.size += len(piece)

    def add(self, offset: int, piece: memoryview) -> None:
        """`Storage.read_into`'s on_chunk: pieces in order; offset 0 again means a retry."""
        if offset == 0 and self.size:
            self.reset()
        if offset != self.size:
            raise CheckpointError(f"piece at {offset} out of order (expected {self.size})")
        self.update(piece)

    def _drain(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def entry(self) -> FileEntry:
        """sha256 and size of everything so far; the hash thread is shut down."""
        self._drain()
        self.pool.shutdown()
        return FileEntry(self.h.hexdigest(), self.size)


class HashingSink:
    """A file-like for `Storage.create_from` writers: every write is hashed (in the Hasher's
    thread) and passed on to the storage sink in CHUNK pieces, so both proceed together."""

    def __init__(self, sink: BinaryIO):
        self.sink, self.hasher = sink, Hasher()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK):
            piece = view[start:start + CHUNK]
            self.hasher.update(piece)
            self.sink.write(piece)
        return len(view)


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


def publish_checkpoint(storage: Storage, version: int, folder: Path,
                       streams: dict[str, Callable[[BinaryIO], None]] | None = None
                       ) -> dict[str, FileEntry]:
    """Upload every file of `folder` under checkpoints/vNNNNNN/, and each of `streams` (file
    name -> a writer that produces its bytes, e.g. the weights straight from the model's
    tensors, never staged on disk), then verify each one landed.

    Returns the per-file sha256 and size for the manifest, hashed from the very bytes sent.
    Objects are created write-once: a version folder that already holds the file is an
    error (AlreadyExists), not an overwrite.
    """
    entries: dict[str, FileEntry] = {}
    writers = {p.name: _copy_file(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}
    writers.update(streams or {})
    sizes = {p.name: p.stat().st_size for p in Path(folder).iterdir() if p.is_file()}
    with progress(f"upload v{version}", sum(sizes.values()), unit_bytes=True) as advance:
        for name, write in sorted(writers.items()):
            entry = upload_stream(storage, layout.checkpoint_key(version, name), write)
            crash_point("checkpoint_upload")
            entries[name] = entry
            advance(sizes.get(name, 0))
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


def read_verified(storage: Storage, key: str, entry: FileEntry,
                  reuse: memoryview | None = None) -> memoryview:
    """The object's bytes in a buffer of exactly `entry.size`, hashed while they arrive;
    CheckpointError unless size and sha256 match the manifest. Nothing may use the buffer
    before this returns: it is the only check between an untrusted bucket and the model.

    `reuse`, a buffer an earlier call returned, is filled again if it has the right size: a
    fresh multi-GB buffer costs a page fault per 4 KiB page on first touch, which took longer
    than reading the file into it. On failure its content is garbage, never used."""
    import numpy as np

    if entry.size > MAX_CHECKPOINT_FILE_BYTES:
        raise CheckpointError(f"{key}: {entry.size} bytes exceeds the checkpoint file limit")
    if reuse is not None and len(reuse) == entry.size:
        buf = reuse
    else:  # not zero-filled: every byte is overwritten
        buf = memoryview(np.empty(entry.size, dtype=np.uint8))
    hasher = Hasher()
    try:
        storage.read_into(key, buf, hasher.add)
    except (TooLarge, ShortObject):
        raise CheckpointError(f"{key}: sha256 or size does not match manifest.json") from None
    finally:
        got = hasher.entry()
    if got != entry:
        raise CheckpointError(f"{key}: sha256 or size does not match manifest.json")
    return buf


def fetch_weights(storage: Storage, manifest: Manifest, name: str,
                  reuse: memoryview | None = None) -> memoryview:
    """One file of the manifest's checkpoint (the weights), verified, in memory only: what a
    volunteer swapping weights needs, with no copy on disk (see policy.load_weights)."""
    if name not in manifest.files:
        raise CheckpointError(f"{layout.MANIFEST}: v{manifest.version} names no {name}")
    return read_verified(storage, f"{manifest.checkpoint}/{name}", manifest.files[name], reuse)


def _fetch_file(storage: Storage, key: str, entry: FileEntry, path: Path) -> None:
    """Download one file, check it against the manifest, then move it into place."""
    data = read_verified(storage, key, entry)
    tmp = path.with_name(f".{path.name}.part")
    with open(tmp, "wb") as f:
        f.write(data)
    tmp.replace(path)


def clear_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
