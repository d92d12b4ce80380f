"""Retry as a wrapper around any Storage: Transient failures are tried again, nothing else.

Which faults are transient is decided by each backend where it still knows what happened
(an HTTP status, an S3 error code, an OSError type) and raised as base.Transient; this
module only spaces the tries out.
"""

from __future__ import annotations

import random
import time
from typing import BinaryIO, Callable, Sequence, TypeVar

from volunteer_rl.storage.base import Storage, StorageError, Transient, one_line

T = TypeVar("T")


class Retrying:
    """Wraps a Storage: Transient failures are retried with jittered exponential backoff;
    other storage errors are raised at once, and any other exception once, as StorageError
    naming the object."""

    def __init__(self, inner: Storage, attempts: int = 5, base_delay: float = 0.2,
                 sleep: Callable[[float], None] = time.sleep):
        self.inner = inner
        self.uri = inner.uri
        self.attempts = attempts
        self.base_delay = base_delay
        self._sleep = sleep

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        for attempt in range(self.attempts):
            try:
                return fn()
            except Transient as exc:
                if attempt == self.attempts - 1:
                    raise Transient(f"{exc} (gave up after {self.attempts} tries)") from exc
                self._sleep(self.base_delay * 2**attempt * (0.5 + random.random()))
            except StorageError:
                raise
            except Exception as exc:  # noqa: BLE001 - unclassified: the backend's or a writer's
                raise StorageError(f"{key}: {what} failed in {self.uri}: {one_line(exc)}") from exc
        raise AssertionError("unreachable")

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
                  on_chunk: Callable[[int, memoryview], None] | None = None) -> None:
        """A retry reads the object again from the start: `on_chunk` sees offset 0 again."""
        return self._call("read", key, lambda: self.inner.read_into(key, buf, on_chunk))

    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]:
        return self._call("read", key, lambda: self.inner.read_if_changed(key, etag, max_bytes))

    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        return self._call("write", key, lambda: self.inner.write_if_match(key, data, etag))
