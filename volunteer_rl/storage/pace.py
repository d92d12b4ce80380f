"""Bandwidth caps as a wrapper around any Storage: `Paced` holds what passes through it to a
rate in bytes per second, one for reads and one for writes (`vrl volunteer
--max-download-rate / --max-upload-rate`, for volunteers on a laptop's link).

A cap is a token bucket (`TokenBucket`), shared by every thread that uses the storage (the
volunteer's heartbeat writes from a thread of its own): a transfer takes its bytes from it and
sleeps while it is in debt, so over any stretch of time no more than BURST_SECONDS of the rate
plus the rate times that time gets through. What is charged, and when:

- `read_into` (checkpoint files: keyframes, patches, adapters) asks the backend for pieces of
  a quarter second of the cap (`piece_bytes`) and sleeps after each piece for its share: the
  stream is read a piece at a time, so the sender waits on the link between two pieces
  instead of the link running flat out and then idling (a paced S3 read is one stream, never
  split into parallel ranged GETs, whose parts would land unpaced; storage/s3_transfer.py);
- `create_from` hands its writer a sink that takes each write's bytes, a piece at a time,
  before it passes them on;
- `read`, `read_if_changed` (manifest polls, grants, the dataset) charge what they returned,
  `write`, `create`, `write_if_match` (shards, asks, heartbeats) what they send, before
  sending. These go at the link's speed and the caller then waits out their share;
- `exists`, `size`, `list`, `list_level`, `delete`, `delete_many` carry no object bytes and
  are not charged.

Integrity checks are the caller's and see the same bytes in the same order (the sleep is
after `on_chunk` has seen a piece); a retried transfer is charged again, as its bytes cross
the link again. Pacing never raises: a stop signal ends a sleep the way it ends any other
wait in the process (stopping.py).
"""

from __future__ import annotations

import threading
import time
from typing import BinaryIO, Callable, Sequence

from volunteer_rl.storage.base import Storage

BURST_SECONDS = 0.1
"""Seconds of the cap an idle bucket saves up: what the first bytes after a pause may take at
the link's own speed. Small, so a transfer of a few seconds keeps within a few % of the cap."""
PIECE_SECONDS = 0.25
"""A paced streamed read asks for pieces of this many seconds of its cap..."""
MIN_PIECE = 64 << 10
"""...but not under this many bytes (a piece is one call of the hasher and one sleep)..."""
MAX_PIECE = 16 << 20
"""...nor over this many (a folder's and S3's unpaced piece size)."""


class TokenBucket:
    """`rate` bytes per second, with up to `burst` bytes saved while idle; thread-safe.

    `take(n)` charges n bytes and sleeps until the bucket is out of debt: a caller that takes
    more than it holds waits for the rest, and callers in other threads meanwhile wait for
    that debt too, so together they keep to the rate. `clock` and `sleep` are for tests."""

    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if not rate > 0:
            raise ValueError(f"a token bucket's rate must be more than 0, not {rate!r}")
        self.rate = float(rate)
        self.burst = self.rate * BURST_SECONDS if burst is None else float(burst)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = self.burst
        self._last = clock()

    def take(self, n: int) -> float:
        """Charge `n` bytes; sleep while the bucket is in debt. Returns the seconds slept."""
        if n <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait

    def piece_bytes(self) -> int:
        """Bytes per piece of a paced stream: PIECE_SECONDS of the rate, within MIN_PIECE
        and MAX_PIECE."""
        return int(min(MAX_PIECE, max(MIN_PIECE, self.rate * PIECE_SECONDS)))


class _PacedSink:
    """The sink `Paced.create_from` hands its writer: every write's bytes are taken from the
    upload bucket a piece at a time, each before it goes on to the backend's sink."""

    def __init__(self, sink: BinaryIO, bucket: TokenBucket):
        self._sink, self._bucket, self._piece = sink, bucket, bucket.piece_bytes()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self._piece):
            piece = view[start:start + self._piece]
            self._bucket.take(len(piece))
            self._sink.write(piece)
        return len(view)

    def __getattr__(self, name: str):
        return getattr(self._sink, name)


class Paced:
    """Wraps a Storage: reads held to `download`, writes to `upload` (None: that way is not
    capped). See the module docstring for what is charged when."""

    def __init__(self, inner: Storage, download: TokenBucket | None = None,
                 upload: TokenBucket | None = None):
        self.inner = inner
        self.uri = inner.uri
        self.download, self.upload = download, upload

    def caps(self) -> str:
        """The caps in force, for the log: `downloads at most 2 MB/s, uploads not capped`."""
        return ", ".join(f"{way} " + (f"at most {rate_text(b.rate)}" if b else "not capped")
                         for way, b in (("downloads", self.download), ("uploads", self.upload)))

    def _got(self, data: bytes | None) -> None:
        if self.download is not None and data:
            self.download.take(len(data))

    def _send(self, data: bytes) -> None:
        if self.upload is not None:
            self.upload.take(len(data))

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        data = self.inner.read(key, max_bytes)
        self._got(data)
        return data

    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]:
        data, new = self.inner.read_if_changed(key, etag, max_bytes)
        self._got(data)
        return data, new

    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None,
                  piece: int | None = None) -> None:
        """The backend's read_into, in pieces of at most the cap's piece_bytes, each seen by
        `on_chunk` first and then paid for."""
        bucket = self.download
        if bucket is None:
            return self.inner.read_into(key, buf, on_chunk, piece=piece)

        def paced(offset: int, view: memoryview) -> None:
            if on_chunk is not None:
                on_chunk(offset, view)
            bucket.take(len(view))

        own = bucket.piece_bytes()
        return self.inner.read_into(key, buf, paced, piece=min(piece or own, own))

    def write(self, key: str, data: bytes) -> None:
        self._send(data)
        return self.inner.write(key, data)

    def create(self, key: str, data: bytes) -> None:
        self._send(data)
        return self.inner.create(key, data)

    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        self._send(data)
        return self.inner.write_if_match(key, data, etag)

    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """A retry calls `write` again on a fresh sink, paced the same way."""
        bucket = self.upload
        if bucket is None:
            return self.inner.create_from(key, write)
        return self.inner.create_from(key, lambda sink: write(_PacedSink(sink, bucket)))

    # No object bytes: not charged.
    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str, limit: int | None = None) -> list[str]:
        return self.inner.list(prefix, limit)

    def list_level(self, prefix: str) -> list[str]:
        return self.inner.list_level(prefix)

    def delete(self, key: str) -> None:
        return self.inner.delete(key)

    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        return self.inner.delete_many(keys)


def rate_text(rate: float) -> str:
    """Bytes per second for people, in SI units as the flags take them: `500 kB/s`."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if rate >= size:
            return f"{rate / size:.3g} {unit}/s"
    return f"{rate:.3g} B/s"


def paced(storage: Storage, download: int = 0, upload: int = 0) -> Storage:
    """`storage` with reads capped at `download` and writes at `upload` bytes per second (0:
    no cap); `storage` itself when neither is capped."""
    if not download and not upload:
        return storage
    return Paced(storage, TokenBucket(download) if download else None,
                 TokenBucket(upload) if upload else None)
