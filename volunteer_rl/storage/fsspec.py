"""The fsspec backend: a bucket on any fsspec file system (gs:// through gcsfs, memory:// for
tests, s3:// through s3fs when VRL_S3_BACKEND=fsspec).

fsspec offers no portable create-only write, compare-and-swap or ETag, so those are
check-then-write here (docs/PROTOCOL.md says what that costs); s3:// buckets normally use
storage/s3.py, which has the real conditional operations. fsspec itself is imported only when
a storage object is made: `vrl --help` must not pay for it.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import BinaryIO, Callable, Sequence

from volunteer_rl.storage.base import (
    AlreadyExists,
    NotFound,
    PreconditionFailed,
    ShortObject,
    StorageError,
    Transient,
    check_cap,
    classify_errors,
    delete_each,
    is_transient_os_error,
)


class FsspecStorage:
    """Any fsspec file system: s3:// (s3fs), gs:// (gcsfs), memory:// and others.

    fsspec reports failures as OSError types (s3fs maps S3's error codes onto them), which
    become the storage errors they mean (base.classify_errors). s3fs passes botocore's
    network errors on unchanged and keeps the ClientError of an unmapped answer (a 502) as
    the cause: those are classified by the S3 backend's rule (s3_errors.is_transient)."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        import fsspec  # deferred: `vrl --help` must not pay for it

        protocol, _, rest = uri.partition("://")
        self.protocol = protocol
        self.uri = uri.rstrip("/")
        self.root = rest.strip("/")
        options: dict = {}
        if protocol == "s3":
            # Listings must be fresh: the trainer polls for new shards.
            options["use_listings_cache"] = False
            if endpoint_url:
                options["client_kwargs"] = {"endpoint_url": endpoint_url}
        self.fs = fsspec.filesystem(protocol, skip_instance_cache=True, **options)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _transient(self, exc: BaseException) -> bool:
        """A fault worth another try: an OSError of that kind, or on s3:// a botocore error
        (raised as it is, or the cause of s3fs's OSError) that the S3 backend retries."""
        if is_transient_os_error(exc):
            return True
        if self.protocol != "s3":
            return False
        from volunteer_rl.storage.s3_errors import is_transient

        return is_transient(exc) or (exc.__cause__ is not None and is_transient(exc.__cause__))

    def _errors(self, key: str, what: str) -> contextlib.AbstractContextManager[None]:
        return classify_errors(key, what, self.uri, transient=self._transient)

    def _s3_capped(self, path: str, max_bytes: int) -> bytes:
        """At most max_bytes + 1 bytes of an s3:// object, from one ranged GET whose body is
        taken in chunks and dropped past the cap. s3fs's cat_file reads whatever body the
        server sends in one piece: a server that ignores the Range, or a man in the middle
        on plain http, could push any size into a 1 MiB read. (gcsfs has the same gap.)"""
        from fsspec.asyn import sync

        from volunteer_rl.storage.s3_transfer import STREAM_CHUNK

        bucket, key, _ = self.fs.split_path(path)

        async def get() -> bytes:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key,
                                              Range=f"bytes=0-{max_bytes}")
            body, data = response["Body"], bytearray()
            try:
                while len(data) <= max_bytes and (
                        chunk := await body.read(min(STREAM_CHUNK, max_bytes + 1 - len(data)))):
                    data += chunk
            finally:
                body.close()  # drops the connection: the rest of the body is never read
            return bytes(data)
        return sync(self.fs.loop, get)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with self._errors(key, "read"):
                try:
                    if max_bytes is None:
                        data = self.fs.cat_file(path)
                    elif self.protocol == "s3":
                        data = self._s3_capped(path, max_bytes)
                    else:  # one ranged GET: never more than the cap crosses the wire
                        data = self.fs.cat_file(path, start=0, end=max_bytes + 1)
                except (FileNotFoundError, PermissionError):
                    raise
                except OSError as exc:
                    if max_bytes is None or self._transient(exc) or self.fs.size(path) != 0:
                        raise
                    data = b""  # S3 answers any range of an empty object with 416
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None
        return check_cap(key, data, max_bytes)

    def write(self, key: str, data: bytes) -> None:
        with self._errors(key, "write"):
            self.fs.pipe_file(self._path(key), data)

    def create(self, key: str, data: bytes) -> None:
        # fsspec has no portable create-only PUT: check, then write. Two writers racing for
        # one key can both succeed; layout makes every key unique to its writer anyway.
        if self.exists(key):
            raise AlreadyExists(f"{key}: already exists in {self.uri}")
        self.write(key, data)

    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        if self.exists(key):  # check-then-write, as in `create`
            raise AlreadyExists(f"{key}: already exists in {self.uri}")
        with self._errors(key, "create"), self.fs.open(self._path(key), "wb") as f:
            write(f)

    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None,
                  piece: int | None = None) -> None:
        """The object read whole, then handed to `on_chunk` in one piece, or in pieces of
        `piece` bytes (base's docstring)."""
        data = self.read(key, max_bytes=len(buf))
        if len(data) != len(buf):
            raise ShortObject(f"{key}: {len(data)} bytes, not the expected {len(buf)}")
        buf[:] = data
        if on_chunk is not None:
            step = piece or len(buf) or 1
            for start in range(0, len(buf), step):
                on_chunk(start, buf[start:start + step])

    # These stores have no portable ETag through fsspec: the content's sha256 stands in.
    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]:
        data = self.read(key, max_bytes)
        current = hashlib.sha256(data).hexdigest()
        return (None, current) if current == etag else (data, current)

    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        # Check-then-write: not atomic on these stores (documented in docs/PROTOCOL.md).
        try:
            _, current = self.read_if_changed(key, None)
        except NotFound:
            current = None
        if current != etag:
            raise PreconditionFailed(f"{key}: changed since it was read (another writer?)")
        self.write(key, data)
        return hashlib.sha256(data).hexdigest()

    def exists(self, key: str) -> bool:
        with self._errors(key, "exists"):
            return self.fs.isfile(self._path(key))

    def size(self, key: str) -> int:
        try:
            with self._errors(key, "size"):
                return int(self.fs.size(self._path(key)))
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None

    def _relative(self, path: str) -> str:
        cut = len(self.root) + 1 if self.root else 0
        return path.lstrip("/")[cut:]

    def list(self, prefix: str, limit: int | None = None) -> list[str]:
        """fsspec has no portable paged listing: here `limit` bounds what is returned, not
        what is read (s3:// buckets use S3Storage, which stops paging)."""
        try:
            with self._errors(prefix, "list"):
                paths = self.fs.find(self._path(prefix))
        except FileNotFoundError:
            return []
        return sorted(self._relative(p) for p in paths)[:limit]

    def list_level(self, prefix: str) -> list[str]:
        """One `ls`: the objects directly in `prefix` and its folders, as keys ending in '/'."""
        base = self._path(prefix).strip("/")
        try:
            with self._errors(prefix, "list"):
                entries = self.fs.ls(base, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            name = e["name"].strip("/")
            if name.startswith(base + "/"):  # `ls` of an object's key answers the object
                out.append(self._relative(name) + ("/" if e["type"] == "directory" else ""))
        return sorted(out)

    def delete(self, key: str) -> None:
        with self._errors(key, "delete"):
            if not self.fs.isfile(self._path(key)):  # s3fs's rm_file is silent about missing keys
                raise NotFound(f"{key}: not found in {self.uri}")
            self.fs.rm_file(self._path(key))

    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """One batch `rm` (s3fs: one DeleteObjects per 1,000 keys). Where that fails for a
        reason other than a transient fault (some file systems refuse the whole batch for one
        missing path), each object is deleted on its own, missing ones skipped."""
        if not keys:
            return []
        try:
            with self._errors(keys[0], "delete"):
                self.fs.rm([self._path(k) for k in keys])
            return []
        except Transient:
            raise
        except (OSError, StorageError):
            pass
        return delete_each(self.delete, keys)
