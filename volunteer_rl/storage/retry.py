"""Retry as a wrapper around any Storage: Transient failures are tried again, nothing else.

Which faults are transient is decided by each backend where it still knows what happened
(an HTTP status, an S3 error code, an OSError type) and raised as base.Transient; this
module only spaces the tries out, says so, and knows when to give up:

- every failed try that will be tried again is one line (the error, which names the object,
  the bucket and for S3 the endpoint, then the wait), from the first one on;
- a call gets `attempts` tries, but a bucket that has never answered gets `patience`
  seconds in all (PATIENCE_SECONDS): a wrong or unreachable endpoint is a one-line error
  within that time, for a one-shot command (status, eval, gc, volunteers) as for the first
  call of a trainer or volunteer, instead of minutes of silence. Once it has answered, a
  later outage gets the full `attempts` per call, as it always did;
- for a bucket that never answered, a stop signal ends the wait at once (stopping.sleep) and
  the call fails with its last error; one that answered keeps its tries after a stop, for
  the writes a stopping process still makes (the trainer's last publish, a volunteer's last
  shard). In an abortable phase the signal's Stopped ends any wait.
"""

from __future__ import annotations

import random
import sys
import time
from typing import BinaryIO, Callable, Sequence, TypeVar

from volunteer_rl.progress import LOG
from volunteer_rl.stopping import sleep as stop_sleep
from volunteer_rl.storage.base import Storage, StorageError, Transient, one_line

T = TypeVar("T")

ATTEMPTS = 5
"""Tries per call (of Retrying; the S3 client's own retries come on top: storage/s3.py)."""

PATIENCE_SECONDS = 30.0
"""Seconds of failed tries a bucket that has never answered gets before calls stop being
tried again."""


def warn(line: str) -> None:
    """Where retry lines go: stderr, as a warning, flushed (stdout is the command's output),
    unless --log-level error hides warnings; a trainer rank's prefix first (progress.LOG)."""
    if LOG.shows("warning"):
        print(f"{LOG.prefix}warning: {line}", file=sys.stderr, flush=True)


class Retrying:
    """Wraps a Storage: Transient failures are retried with jittered exponential backoff
    (see the module docstring for when it gives up); other storage errors are raised at
    once, and any other exception once, as StorageError naming the object."""

    def __init__(self, inner: Storage, attempts: int = ATTEMPTS, base_delay: float = 0.2,
                 sleep: Callable[[float], bool | None] | None = None,
                 patience: float = PATIENCE_SECONDS, log: Callable[[str], None] = warn,
                 clock: Callable[[], float] = time.monotonic):
        self.inner = inner
        self.uri = inner.uri
        self.attempts = attempts
        self.base_delay = base_delay
        self.patience = patience
        self.log = log
        self._sleep = sleep
        self._clock = clock
        self._answered = False  # has any call succeeded (or failed with a real answer)?
        self._first_failure: float | None = None  # when the never-answered bucket first failed

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        for attempt in range(self.attempts):
            try:
                result = fn()
            except Transient as exc:
                wait = self.base_delay * 2**attempt * (0.5 + random.random())
                give_up = self._give_up(attempt, wait)
                if give_up:
                    raise Transient(f"{exc} ({give_up})") from exc
                self.log(f"{exc}; try {attempt + 2} of {self.attempts} in {wait:.1f}s")
                if self._wait(wait):
                    raise Transient(f"{exc} (stopping: not tried again)") from exc
                continue
            except StorageError:
                self._answered = True  # an answer (not found, refused, ...): the bucket is there
                raise
            except Exception as exc:  # noqa: BLE001 - unclassified: the backend's or a writer's
                raise StorageError(f"{key}: {what} failed in {self.uri}: {one_line(exc)}") from exc
            self._answered = True
            return result
        raise AssertionError("unreachable")

    def _wait(self, seconds: float) -> bool:
        """Wait before the next try; True if a stop signal ended it and the call gives up,
        which only a bucket that never answered does (see the module docstring). `sleep`,
        when given (tests), stands in for the wait and says whether a stop came."""
        if self._sleep is not None:
            return bool(self._sleep(seconds)) and not self._answered
        if self._answered:
            time.sleep(seconds)
            return False
        return stop_sleep(seconds)

    def _give_up(self, attempt: int, wait: float) -> str | None:
        """Why no further try is made after this failed one, or None to try again."""
        if attempt == self.attempts - 1:
            return f"gave up after {self.attempts} tries"
        if self._answered:
            return None
        now = self._clock()
        if self._first_failure is None:
            self._first_failure = now
        if now + wait - self._first_failure > self.patience:
            return f"no answer from the bucket in {now - self._first_failure:.0f}s; gave up"
        return None

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        return self._call("read", key, lambda: self.inner.read(key, max_bytes))

    def write(self, key: str, data: bytes) -> None:
        return self._call("write", key, lambda: self.inner.write(key, data))

    def exists(self, key: str) -> bool:
        return self._call("exists", key, lambda: self.inner.exists(key))

    def size(self, key: str) -> int:
        return self._call("size", key, lambda: self.inner.size(key))

    def list(self, prefix: str, limit: int | None = None) -> list[str]:
        return self._call("list", prefix, lambda: self.inner.list(prefix, limit))

    def list_level(self, prefix: str) -> list[str]:
        return self._call("list", prefix, lambda: self.inner.list_level(prefix))

    def delete(self, key: str) -> None:
        return self._call("delete", key, lambda: self.inner.delete(key))

    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """A retry sends the whole batch again: deleting an object twice is harmless."""
        first = keys[0] if keys else ""
        return self._call("delete", first, lambda: self.inner.delete_many(keys))

    def create(self, key: str, data: bytes) -> None:
        return self._call("create", key, lambda: self.inner.create(key, data))

    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """A retry calls `write` again from the start, on a fresh sink."""
        return self._call("create", key, lambda: self.inner.create_from(key, write))

    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None,
                  piece: int | None = None) -> None:
        """A retry reads the object again from the start: `on_chunk` sees offset 0 again."""
        return self._call("read", key,
                          lambda: self.inner.read_into(key, buf, on_chunk, piece=piece))

    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]:
        return self._call("read", key, lambda: self.inner.read_if_changed(key, etag, max_bytes))

    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        return self._call("write", key, lambda: self.inner.write_if_match(key, data, etag))
