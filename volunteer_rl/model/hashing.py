"""sha256 of checkpoint bytes while they move, and the buffers they move in.

Every file of a checkpoint is checked against the manifest's sha256 (the weights file: its
pieces' sha256s) before anything is loaded from it. Hashing runs in threads of its own
(hashlib releases the GIL on big buffers), so it overlaps the writing or the reading of the
next piece: Hasher and HashingSink hash a stream, piece_hashes a buffer in memory on every
core, PieceHasher a buffer that `Storage.read_into` is filling (each piece as soon as it has
landed), and Filling lets threads follow a buffer that is being made.

CheckpointError, raised by every checkpoint module, lives here, below them all.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Callable

from volunteer_rl.errors import VrlError
from volunteer_rl.protocol.manifest import FileEntry


class CheckpointError(VrlError):
    """A checkpoint file is missing, too large, or its bytes do not match the manifest. The
    message is one line naming the file."""


CHUNK = 16 << 20
"""Bytes per piece handed to the hash thread and to the sink."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def byte_buffer(size: int, reuse: memoryview | None = None) -> memoryview:
    """A buffer of `size` bytes: `reuse` if it has that size (a fresh multi-GB buffer costs a
    page fault per 4 KiB page on first touch, which took longer than reading a file into it),
    else a new one, not zero-filled: its callers overwrite every byte."""
    import numpy as np

    if reuse is not None and len(reuse) == size:
        return reuse
    return memoryview(np.empty(size, dtype=np.uint8))


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


class PieceSink:
    """A file-like for `Storage.create_from` writers that hashes the stream by pieces of
    `piece_bytes` (the sha256 of each, as piece_hashes gives for the same bytes in one buffer)
    and passes every byte on to `sink`: a file hashed by pieces while it is written, never
    held whole."""

    def __init__(self, sink: BinaryIO, piece_bytes: int):
        self.sink, self.piece_bytes = sink, piece_bytes
        self.pieces: list[str] = []
        self.h, self.in_piece, self.size = hashlib.sha256(), 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        at = 0
        while at < len(view):
            take = min(self.piece_bytes - self.in_piece, len(view) - at)
            self.h.update(view[at:at + take])
            self.in_piece += take
            at += take
            if self.in_piece == self.piece_bytes:
                self.pieces.append(self.h.hexdigest())
                self.h, self.in_piece = hashlib.sha256(), 0
        self.sink.write(view)
        self.size += len(view)
        return len(view)

    def finish(self) -> list[str]:
        """Every piece's sha256, the last (shorter) one included."""
        if self.in_piece:
            self.pieces.append(self.h.hexdigest())
            self.h, self.in_piece = hashlib.sha256(), 0
        return self.pieces


def piece_hashes(buf, piece_bytes: int, workers: int = 0,
                 ready: Callable[[int], None] = lambda end: None) -> list[str]:
    """sha256 of every `piece_bytes` slice of `buf`, computed on `workers` threads (0: one per
    CPU; hashlib releases the GIL on big buffers, so they run on all cores). Each piece is
    hashed once `ready(its end)` returns (Filling.wait: while the buffer is being made)."""
    view = memoryview(buf).cast("B")
    starts = range(0, len(view), piece_bytes)

    def one(start: int) -> str:
        end = min(start + piece_bytes, len(view))
        ready(end)
        return sha256_bytes(view[start:end])

    if len(starts) <= 1:
        return [one(i) for i in starts]
    with ThreadPoolExecutor(min(len(starts), workers or os.cpu_count() or 1)) as pool:
        return list(pool.map(one, starts))


class Filling:
    """How much of a buffer being made is made, for threads that follow the maker: each waits
    (`wait(end)`) for the bytes it needs, and the maker says how far it got (`made`) or that
    it failed (`fail`: every waiter raises instead of waiting for ever)."""

    def __init__(self):
        import threading

        self.cond = threading.Condition()
        self.end, self.error = 0, None

    def made(self, end: int) -> None:
        with self.cond:
            self.end = end
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def wait(self, end: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.end >= end or self.error is not None)
            if self.end < end:
                raise CheckpointError(f"the weights file was not made ({self.error})")


class PieceHasher:
    """`Storage.read_into`'s on_chunk: hashes each piece of the buffer being filled as soon as
    its last byte has landed, on a pool of one thread per CPU, while the read goes on."""

    def __init__(self, buf: memoryview, piece_bytes: int):
        self.buf, self.piece_bytes = buf, piece_bytes
        self.pool = ThreadPoolExecutor(os.cpu_count() or 1)
        self.futures: list[Future] = []
        self.filled = 0

    def add(self, offset: int, piece: memoryview) -> None:
        if offset == 0 and self.filled:  # a retried read starts again
            for f in self.futures:
                f.cancel()
            self.futures, self.filled = [], 0
        if offset != self.filled:
            raise CheckpointError(f"piece at {offset} out of order (expected {self.filled})")
        self.filled += len(piece)
        done = self.filled // self.piece_bytes
        if self.filled == len(self.buf):
            done = -(-len(self.buf) // self.piece_bytes)
        while len(self.futures) < done:
            i = len(self.futures) * self.piece_bytes
            self.futures.append(self.pool.submit(sha256_bytes, self.buf[i:i + self.piece_bytes]))

    def hashes(self) -> list[str]:
        """The pieces' sha256s so far (every piece, after a read that filled the buffer)."""
        try:
            return [f.result() for f in self.futures]
        finally:
            self.pool.shutdown()
