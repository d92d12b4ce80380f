"""The folder backend: a bucket that is a folder on a local or network file system.

The embedded default (no server): a plain path or `file://` URI. Atomic writes are a temp
file renamed into place, create-only writes a hard link that fails if the name is taken,
compare-and-swap an advisory lock beside the object.
"""

from __future__ import annotations

import itertools
import os
import stat
import uuid
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Sequence

from volunteer_rl.faults import crash_point
from volunteer_rl.storage.base import (
    AlreadyExists,
    NotFound,
    PreconditionFailed,
    ShortObject,
    StorageError,
    TooLarge,
    check_cap,
    classify_errors,
    delete_each,
)

READ_CHUNK = 16 << 20
"""Bytes per piece of a streamed local read: big enough for few syscalls, small enough that
hashing one piece overlaps reading the next."""
WRITEBACK_BYTES = 16 << 20
"""A big object's bytes are handed to the disk this many at a time while it is written (see
_EarlyWriteback)."""


def _sync_file_range():
    """Linux's sync_file_range from the C library, or None where there is none (macOS)."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_START_WRITEBACK = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class _EarlyWriteback:
    """A temp file being written whose pages start going to the disk every WRITEBACK_BYTES
    (sync_file_range: started, not waited for), so the fsync that ends the write waits for
    the last few pages, not the whole object: a 1.19 GB weights file written while it is
    made then fsynced took 0.5-0.9 s more than the making on this project's 2-core VM;
    started early, 0.1-0.25 s more.
    Only a hint: where the call is missing or fails, the fsync does it all, as before."""

    def __init__(self, f: BinaryIO):
        self.f, self.started = f, 0

    def write(self, data) -> int:
        n = self.f.write(data)
        if _START_WRITEBACK is not None and self.f.tell() - self.started >= WRITEBACK_BYTES:
            self.f.flush()
            end = self.f.tell()
            _START_WRITEBACK(self.f.fileno(), self.started, end - self.started, _SYNC_FILE_RANGE_WRITE)
            self.started = end
        return n

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def _fill_from(key: str, src: BinaryIO, buf: memoryview,
               on_chunk: Callable[[int, memoryview], None] | None, piece: int = READ_CHUNK) -> None:
    """Read exactly len(buf) bytes of `src` into `buf`, `piece` bytes at a time; TooLarge if
    more follow, ShortObject if fewer come."""
    done = 0
    while done < len(buf):
        n = src.readinto(buf[done:done + piece])
        if not n:
            raise ShortObject(f"{key}: {done} bytes, shorter than the expected {len(buf)}")
        if on_chunk is not None:
            on_chunk(done, buf[done:done + n])
        done += n
    if src.read(1):
        raise TooLarge(f"{key}: larger than the {len(buf)}-byte limit")


class LocalStorage:
    """A folder on a local or network file system (NFS and SMB shares work the same way).

    An OSError becomes the storage error it means (base.classify_errors): EACCES is
    Forbidden, a timeout or a busy share Transient."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents and path != self.root:
            raise StorageError(f"{key}: key escapes the bucket folder")
        return path

    def _object(self, key: str, mode: int) -> None:
        """NotFound unless `mode` is a regular file's: only a regular file is an object."""
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise NotFound(f"{key}: is {what} in {self.uri}")

    def _open(self, key: str, buffering: int = -1) -> BinaryIO:
        """The object's file, open for reading. Only a regular file is an object: a folder,
        FIFO, device or socket at the key is NotFound, decided on the opened file (fstat), so
        nothing can be swapped in after the check. O_NONBLOCK keeps the open itself from
        waiting for a FIFO's writer; a read from a FIFO or /dev/zero would block or never end."""
        fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self._object(key, os.fstat(fd).st_mode)
            os.set_blocking(fd, True)
            return open(fd, "rb", buffering=buffering)
        except BaseException:
            os.close(fd)
            raise

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        try:
            with classify_errors(key, "read", self.uri), self._open(key) as f:
                data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None
        return check_cap(key, data, max_bytes)

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
                  on_chunk: Callable[[int, memoryview], None] | None = None,
                  piece: int | None = None) -> None:
        """Fill `buf` with the object, which must be exactly len(buf) bytes long."""
        try:
            with classify_errors(key, "read", self.uri), self._open(key, buffering=0) as f:
                _fill_from(key, f, buf, on_chunk, piece or READ_CHUNK)
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None

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
                write(_EarlyWriteback(f))
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
        with classify_errors(key, "write", self.uri):
            self._put(key, data, create_only=False)

    def create(self, key: str, data: bytes) -> None:
        with classify_errors(key, "create", self.uri):
            self._put(key, data, create_only=True)

    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """Create-only, with `write` filling the temp file directly (no copy in memory)."""
        with classify_errors(key, "create", self.uri):
            self._put_from(key, write, create_only=True)

    def _etag(self, key: str) -> str | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"

    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]:
        with classify_errors(key, "read", self.uri):
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
        with classify_errors(key, "write", self.uri):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.parent / f".{path.name}.lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if self._etag(key) != etag:
                    raise PreconditionFailed(f"{key}: changed since it was read (another writer?)")
                self.write(key, data)
                return self._etag(key)

    def exists(self, key: str) -> bool:
        with classify_errors(key, "exists", self.uri):
            return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            with classify_errors(key, "size", self.uri):
                st = self._path(key).stat()
        except FileNotFoundError:
            raise NotFound(f"{key}: not found in {self.uri}") from None
        self._object(key, st.st_mode)
        return st.st_size

    def list(self, prefix: str, limit: int | None = None) -> list[str]:
        """All keys under `prefix` (recursive), sorted; temp and hidden files excluded.

        With `limit`, the first `limit` of them, and the walk stops there: a folder of a
        million objects past them is never entered. A folder that is entered has its names
        read whole (one `scandir`, sorted), but no key is built past the limit."""
        base = self._path(prefix)
        with classify_errors(prefix, "list", self.uri):
            if not base.is_dir():
                return []
            return list(itertools.islice(self._walk(base), limit))

    def list_level(self, prefix: str) -> list[str]:
        """The objects directly in `prefix` and its sub-folders (as keys ending in '/'),
        sorted; one `scandir`, whatever the sub-folders hold. A folder left holding only a
        hidden temp file is named too, and lists empty."""
        base = self._path(prefix)
        with classify_errors(prefix, "list", self.uri):
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
        other entries, so walking them in this order yields every key in sorted order. Only
        regular files are keys (a FIFO or device is not an object). As with os.walk,
        symlinked folders are not entered, and a folder that cannot be read (a concurrent
        delete prunes empty ones) is empty."""
        entries: list[tuple[str, str | None]] = []
        try:
            with os.scandir(folder) as it:
                for e in it:
                    if e.name.startswith("."):
                        continue
                    if e.is_file():  # a FIFO, device or socket is no object
                        entries.append((rel + e.name, None))
                    elif e.is_dir() and not e.is_symlink():
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
            with classify_errors(key, "delete", self.uri):
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

    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """`delete` each object (a folder has no batch delete); one already gone is fine."""
        return delete_each(self.delete, keys)
