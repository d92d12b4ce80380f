"""One small storage interface over a bucket URI, and retry as a wrapper around it.

A bucket is addressed by URI: a plain folder path or `file://` (the embedded default, no
server), `s3://bucket/prefix` (s3fs; `endpoint_url` for MinIO, R2 and other S3-compatible
stores), `gs://bucket/prefix` (gcsfs), or `memory://name` for unit tests. Keys are always
relative, `/`-separated, and built by `layout`.

Guarantees every backend gives the rest of the code:
- `write` is all-or-nothing for readers: local files are written to a hidden temp name and
  renamed; object stores publish a PUT atomically anyway.
- `read` takes a byte cap and never returns more than it: a hostile object cannot make us
  allocate its full size.
- `list` never shows temp files of an interrupted local write.
- Listings cost what the caller asks for, not what the bucket holds: `list(prefix, limit)`
  stops after the first `limit` keys in sorted order, and `list_level(prefix)` names the
  folders one level down without reading what is in them. The trainer lists what volunteers
  wrote, and a volunteer can write without end.

Big objects (checkpoints) have two streaming forms, so a 2.4 GB file is never held twice:
`create_from(key, write)` calls `write(f)` with a file-like sink that goes straight to the
object (a temp file renamed into place, or a multipart upload), and `read_into(key, buf)`
fills a caller's buffer, telling `on_chunk(offset, piece)` about each piece in order (for
hashing while the rest arrives; a retried read starts again at offset 0).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Protocol, TypeVar

from volunteer_rl.errors import VrlError
from volunteer_rl.faults import crash_point

T = TypeVar("T")


def is_missing(exc: BaseException) -> bool:
    """Does a storage error mean the object is not there (any more)?

    NotFound, or access denied: a reader without list permission (volunteers on S3 and
    MinIO) gets 403, not 404, for a key that does not exist."""
    return isinstance(exc, (NotFound, PermissionError)) or isinstance(exc.__cause__, PermissionError)


class StorageError(VrlError):
    """A storage operation failed; the message names the object."""


class NotFound(StorageError):
    """The object does not exist."""


class TooLarge(StorageError):
    """The object is larger than the caller's byte cap."""


class ShortObject(StorageError):
    """The object has fewer bytes than the caller was told to expect (`read_into`)."""


class AlreadyExists(StorageError):
    """A create-only write found the key taken: written-once objects are never replaced."""


class PreconditionFailed(StorageError):
    """A compare-and-swap lost: the object changed since the caller read it."""


class Storage(Protocol):
    uri: str

    # read returns bytes-like data: bytes, or a bytearray when that saves a copy of a big object.
    def read(self, key: str, max_bytes: int | None = None) -> bytes: ...
    def write(self, key: str, data: bytes) -> None: ...
    def exists(self, key: str) -> bool: ...
    def size(self, key: str) -> int: ...
    # Sorted keys under `prefix`, recursive; with `limit`, only the first `limit` of them.
    def list(self, prefix: str, limit: int | None = None) -> list[str]: ...
    # One level under `prefix`, sorted: its objects, and its folders as keys ending in '/'.
    def list_level(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    # Conditional operations. `etag` is an opaque version token of one object.
    def create(self, key: str, data: bytes) -> None: ...
    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None: ...
    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None) -> None: ...
    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]: ...
    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str: ...


READ_CHUNK = 16 << 20
"""Bytes per piece of a streamed local read: big enough for few syscalls, small enough that
hashing one piece overlaps reading the next."""


def _fill_from(key: str, src: BinaryIO, buf: memoryview,
               on_chunk: Callable[[int, memoryview], None] | None) -> None:
    """Read exactly len(buf) bytes of `src` into `buf`; TooLarge if more follow, StorageError
    if fewer come."""
    done = 0
    while done < len(buf):
        n = src.readinto(buf[done:done + READ_CHUNK])
        if not n:
            raise ShortObject(f"{key}: {done} bytes, shorter than the expected {len(buf)}")
        if on_chunk is not None:
            on_chunk(done, buf[done:done + n])
        done += n
    if src.read(1):
        raise TooLarge(f"{key}: larger than the {len(buf)}-byte limit")


def _check_cap(key: str, data: bytes, max_bytes: int | None) -> bytes:
    if max_bytes is not None and len(data) > max_bytes:
        raise TooLarge(f"{key}: larger than the {max_bytes}-byte limit")
    return data


class LocalStorage:
    """A folder on a local or network file system (NFS and SMB shares work the same way)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents and path != self.root:
            raise StorageError(f"{key}: key escapes the bucket folder")
        return path

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None
        except IsADirectoryError:
            raise NotFound(f"{key}: is a folder in {self.uri}") from None
        return _check_cap(key, data, max_bytes)

    @staticmethod
    def _open_new(tmp: Path):
        """Open a temp file, creating its folder; again if a delete pruned the folder
        between the mkdir and the open (see `delete`)."""
        for attempt in range(3):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                return open(tmp, "wb")
            except FileNotFoundError:
                if attempt == 2:
                    raise

    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None) -> None:
        """Fill `buf` with the object, which must be exactly len(buf) bytes long."""
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                _fill_from(key, f, buf, on_chunk)
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None
        except IsADirectoryError:
            raise NotFound(f"{key}: is a folder in {self.uri}") from None

    def _put(self, key: str, data: bytes, create_only: bool) -> None:
        self._put_from(key, lambda f: f.write(data), create_only)

    def _put_from(self, key: str, write: Callable[[BinaryIO], None], create_only: bool) -> None:
        path = self._path(key)
        # Hidden temp name in the same folder, then an atomic rename (or, create-only, an
        # atomic hard link that fails if the name is taken): a reader sees the old object or
        # the complete new one, never a prefix of it.
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with self._open_new(tmp) as f:
                write(f)
                f.flush()
                crash_point("local_write")
                os.fsync(f.fileno())
            if create_only:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise AlreadyExists(f"{key}: already exists in {self.uri}") from None
            else:
                os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    def write(self, key: str, data: bytes) -> None:
        self._put(key, data, create_only=False)

    def create(self, key: str, data: bytes) -> None:
        self._put(key, data, create_only=True)

    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """Create-only, with `write` filling the temp file directly (no copy in memory)."""
        self._put_from(key, write, create_only=True)

    def _etag(self, key: str) -> str | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"

    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]:
        current = self._etag(key)
        if current is None:
            raise NotFound(f"{key}: not found in {self.uri}")
        if current == etag:
            return None, etag
        data = self.read(key, max_bytes)
        return data, current

    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        """Replace `key` only if it is still the version `etag` names (None: must not exist).

        Serialized by an advisory lock beside the object; every rename makes a new inode, so
        the etag of a replaced object never repeats."""
        import fcntl

        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.parent / f".{path.name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self._etag(key) != etag:
                raise PreconditionFailed(f"{key}: changed since it was read (another writer?)")
            self.write(key, data)
            return self._etag(key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None

    def list(self, prefix: str, limit: int | None = None) -> list[str]:
        """All keys under `prefix` (recursive), sorted; temp and hidden files excluded.

        With `limit`, the first `limit` of them, and the walk stops there: a folder of a
        million objects past them is never entered. A folder that is entered has its names
        read whole (one `scandir`, sorted), but no key is built past the limit."""
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return list(itertools.islice(self._walk(base), limit))

    def list_level(self, prefix: str) -> list[str]:
        """The objects directly in `prefix` and its sub-folders (as keys ending in '/'),
        sorted; one `scandir`, whatever the sub-folders hold. A folder left holding only a
        hidden temp file is named too, and lists empty."""
        base = self._path(prefix)
        if not base.is_dir():
            return []
        return [key for key, _ in self._entries(str(base), self._folder_key(base))]

    def _folder_key(self, folder: Path) -> str:
        """The key prefix of a folder of the bucket: '' for the root, else `a/b/`."""
        return "" if folder == self.root else folder.relative_to(self.root).as_posix() + "/"

    @staticmethod
    def _entries(folder: str, rel: str) -> list[tuple[str, str | None]]:
        """(key, path if a sub-folder else None) of a folder's visible entries, sorted by key,
        sub-folders as `rel/name/`: all of their keys sort exactly there among the folder's
        other entries, so walking them in this order yields every key in sorted order. As
        with os.walk, symlinked folders are not entered, and a folder that cannot be read
        (a concurrent delete prunes empty ones) is empty."""
        entries: list[tuple[str, str | None]] = []
        try:
            with os.scandir(folder) as it:
                for e in it:
                    if e.name.startswith("."):
                        continue
                    if not e.is_dir():
                        entries.append((rel + e.name, None))
                    elif not e.is_symlink():
                        entries.append((rel + e.name + "/", e.path))
        except OSError:
            return []
        entries.sort()
        return entries

    def _walk(self, base: Path) -> Iterator[str]:
        """Every key under `base`, lazily, in sorted order; depth-first with a stack, so a
        deeply nested folder cannot exhaust Python's recursion limit."""
        stack = [iter(self._entries(str(base), self._folder_key(base)))]
        while stack:
            for key, path in stack[-1]:
                if path is None:
                    yield key
                else:
                    stack.append(iter(self._entries(path, key)))
                    break
            else:
                stack.pop()

    def delete(self, key: str) -> None:
        """Remove the object, then the folders that leaves empty, so retention does not
        leave a folder bucket full of empty version folders."""
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None
        folder = path.parent
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (a hidden temp or lock file counts): stop here
                return
            folder = folder.parent


class FsspecStorage:
    """Any fsspec file system: s3:// (s3fs), gs:// (gcsfs), memory:// and others."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        import fsspec  # deferred: `vrl --help` must not pay for it

        protocol, _, rest = uri.partition("://")
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

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        try:
            if max_bytes is None:
                data = self.fs.cat_file(self._path(key))
            else:  # one ranged GET: never more than the cap crosses the wire
                data = self.fs.cat_file(self._path(key), start=0, end=max_bytes + 1)
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None
        except OSError:
            if max_bytes is None or self.fs.size(self._path(key)) != 0:
                raise
            data = b""  # S3 answers any range of an empty object with 416
        return _check_cap(key, data, max_bytes)

    def write(self, key: str, data: bytes) -> None:
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
        with self.fs.open(self._path(key), "wb") as f:
            write(f)

    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None) -> None:
        data = self.read(key, max_bytes=len(buf))
        if len(data) != len(buf):
            raise ShortObject(f"{key}: {len(data)} bytes, not the expected {len(buf)}")
        buf[:] = data
        if on_chunk is not None:
            on_chunk(0, buf)

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
        return self.fs.isfile(self._path(key))

    def size(self, key: str) -> int:
        try:
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
            paths = self.fs.find(self._path(prefix))
        except FileNotFoundError:
            return []
        return sorted(self._relative(p) for p in paths)[:limit]

    def list_level(self, prefix: str) -> list[str]:
        """One `ls`: the objects directly in `prefix` and its folders, as keys ending in '/'."""
        base = self._path(prefix).strip("/")
        try:
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
        if not self.fs.isfile(self._path(key)):  # s3fs's rm_file is silent about missing keys
            raise NotFound(f"{key}: not found in {self.uri}")
        self.fs.rm_file(self._path(key))


def _transient(exc: BaseException) -> bool:
    """Errors worth another try: network trouble, timeouts, throttling, 5xx."""
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("timeout", "timed out", "throttl", "slow down", "503", "500",
                                   "internal error", "connection", "temporarily"))


class Retrying:
    """Wraps a Storage: transient failures are retried with jittered exponential backoff;
    permanent ones are raised once, as StorageError naming the object."""

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
            except StorageError:
                raise
            except Exception as exc:  # noqa: BLE001 - classified right below
                if not _transient(exc) or attempt == self.attempts - 1:
                    raise StorageError(f"{key}: {what} failed in {self.uri}: {exc}") from exc
                self._sleep(self.base_delay * 2**attempt * (0.5 + random.random()))
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


def open_storage(uri: str, endpoint_url: str | None = None, retry: bool = True) -> Storage:
    """The storage for a bucket URI (see the module docstring for the forms accepted)."""
    if not uri:
        raise StorageError("--bucket is empty: give a folder path or a URI such as s3://bucket")
    endpoint_url = endpoint_url or os.environ.get("VRL_ENDPOINT_URL") or None
    if "://" not in uri:
        inner: Storage = LocalStorage(uri)
    elif uri.startswith("file://"):
        inner = LocalStorage(uri[len("file://"):])
    elif uri.startswith("s3://") and os.environ.get("VRL_S3_BACKEND", "") != "fsspec":
        from volunteer_rl.storage.s3 import (
            S3Storage,  # boto3: conditional writes, ETag polls, multipart
        )

        inner = S3Storage(uri, endpoint_url=endpoint_url)
    elif uri.split("://", 1)[0] in ("s3", "gs", "gcs", "memory", "az", "abfs"):
        inner = FsspecStorage(uri, endpoint_url=endpoint_url)
    else:
        raise StorageError(f"--bucket {uri}: unsupported scheme (use a folder, file://, s3://, gs:// or memory://)")
    return Retrying(inner) if retry else inner
