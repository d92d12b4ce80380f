"""The storage interface every backend implements, and the errors every backend raises.

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
- Failures come as the StorageError subclasses below, classified by the backend where it
  still knows what happened (an HTTP status, an S3 error code, an OSError type): Retrying
  retries Transient ones and nothing else, and callers tell a missing object (is_missing)
  from the rest by type.

Big objects (checkpoints) have two streaming forms, so a 2.4 GB file is never held twice:
`create_from(key, write)` calls `write(f)` with a file-like sink that goes straight to the
object (a temp file renamed into place, or a multipart upload), and `read_into(key, buf)`
fills a caller's buffer, telling `on_chunk(offset, piece)` about each piece in order (for
hashing while the rest arrives; a retried read starts again at offset 0). With `piece`, the
backend reads in pieces of at most that many bytes, one stream, and tells `on_chunk` about
each (pace.Paced, whose sleeps between them hold a cap); fsspec's stores, which read the
object whole, only hand it on in such pieces.
"""

from __future__ import annotations

import contextlib
import errno
from typing import BinaryIO, Callable, Iterator, Protocol, Sequence

from volunteer_rl.errors import VrlError


class StorageError(VrlError):
    """A storage operation failed; the message is one line and names the object."""


class NotFound(StorageError):
    """The object does not exist."""


class Forbidden(StorageError):
    """The bucket refused the operation (HTTP 403, access denied, EACCES)."""


class Transient(StorageError):
    """A fault worth another try: a 5xx answer, throttling, a timeout, a refused, reset or
    dropped connection, a busy resource. Retrying retries these and only these."""


class TooLarge(StorageError):
    """The object is larger than the caller's byte cap."""


class ShortObject(StorageError):
    """The object has fewer bytes than the caller was told to expect (`read_into`)."""


class AlreadyExists(StorageError):
    """A create-only write found the key taken: written-once objects are never replaced."""


class PreconditionFailed(StorageError):
    """A compare-and-swap lost: the object changed since the caller read it."""


def is_missing(exc: BaseException) -> bool:
    """Does a storage error mean the object is not there (any more)?

    NotFound, or Forbidden: a reader without list permission (volunteers on S3 and MinIO)
    gets 403, not 404, for a key that does not exist, so to such a reader a refusal is what
    a missing object looks like."""
    return isinstance(exc, (NotFound, Forbidden))


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
    # Delete several objects in as few requests as the backend allows (S3: one per 1,000
    # keys); an object already gone is no failure. Returns (key, one-line error) of each
    # object the bucket refused to delete; a failure of the whole request raises.
    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, str]]: ...
    # Conditional operations. `etag` is an opaque version token of one object.
    def create(self, key: str, data: bytes) -> None: ...
    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None: ...
    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None,
                  piece: int | None = None) -> None: ...
    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]: ...
    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str: ...


def check_cap(key: str, data: bytes, max_bytes: int | None) -> bytes:
    """`data`, or TooLarge if it has more than `max_bytes` bytes."""
    if max_bytes is not None and len(data) > max_bytes:
        raise TooLarge(f"{key}: larger than the {max_bytes}-byte limit")
    return data


TRANSIENT_ERRNOS = frozenset(
    n for n in (errno.EAGAIN, errno.EBUSY, getattr(errno, "EREMOTEIO", None)) if n is not None)
"""errno values of an OSError worth another try besides the ConnectionError and TimeoutError
types: try again, busy (s3fs's answer to 503 and SlowDown), remote I/O error (s3fs's 500)."""


def is_transient_os_error(exc: BaseException) -> bool:
    """An OSError worth another try: a timeout, a refused, reset or aborted connection, or one
    of TRANSIENT_ERRNOS."""
    return isinstance(exc, (ConnectionError, TimeoutError)) or (
        isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)


@contextlib.contextmanager
def classify_errors(key: str, what: str, where: str,
                    transient: Callable[[BaseException], bool] = is_transient_os_error,
                    ) -> Iterator[None]:
    """Raise a refused operation (PermissionError) as Forbidden and a fault worth another try
    (what the backend's `transient` rule says is one) as Transient, both one line naming
    `key`; storage errors and anything else pass unchanged. Missing objects are left to the
    caller, which knows whether a FileNotFoundError means the object or its bucket."""
    try:
        yield
    except StorageError:
        raise
    except PermissionError as exc:
        raise Forbidden(f"{key}: access denied ({what}) in {where}: {one_line(exc)}") from exc
    except Exception as exc:
        if transient(exc):
            raise Transient(f"{key}: {what} failed in {where}: {one_line(exc)}") from exc
        raise


DELETE_BATCH = 1000
"""Keys one `delete_many` request takes at most (S3's DeleteObjects limit); callers that want a
failed request to cost only its own keys hand over batches of this size."""


def delete_each(delete: Callable[[str], None], keys: Sequence[str]) -> list[tuple[str, str]]:
    """`delete_many` for a backend without a batch request: `delete` each key, an object
    already gone (NotFound) skipped; (key, one-line error) of each the bucket refused."""
    failed = []
    for key in keys:
        try:
            delete(key)
        except NotFound:
            continue
        except StorageError as exc:
            failed.append((key, one_line(exc)))
    return failed


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a server's answer can span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
