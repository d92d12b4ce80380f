"""The S3 backend: boto3 against `s3://bucket/prefix`, with real conditional writes.

Why not s3fs: the protocol needs create-only writes (checkpoints, shards), compare-and-swap
on `manifest.json`, and a cheap "has the manifest changed?" poll. S3 does all three
atomically with `If-None-Match: *`, `If-Match: <etag>` and a conditional GET that answers
304 without a body, so thousands of idle volunteers polling the manifest cost almost nothing.

Large objects (checkpoints) adapt to the link: reads that split into parallel ranged GETs
when one stream is slow, uploads as one PUT or parallel parts (s3_transfer.py). What S3's
answers mean, and which are worth another try, is s3_errors.py.

Works with AWS and with S3-compatible stores (MinIO, R2, moto) through `endpoint_url`.
boto3 is imported only when a storage object is made: `vrl --help` stays instant.
"""

from __future__ import annotations

import contextlib
import time
from typing import BinaryIO, Callable, Iterator, Sequence

from volunteer_rl.storage import s3_transfer
from volunteer_rl.storage.base import (
    DELETE_BATCH,
    AlreadyExists,
    Forbidden,
    NotFound,
    PreconditionFailed,
    ShortObject,
    StorageError,
    TooLarge,
    classify_errors,
)
from volunteer_rl.storage.s3_errors import (
    bound_error_bodies,
    error_code,
    http_status,
    is_conflict,
    is_transient,
    was_retried,
)

CONNECT_TIMEOUT = 5  # each of botocore's tries; an unreachable host costs this per try
READ_TIMEOUT = 120
BOTO_ATTEMPTS = 3
"""botocore's own tries per request (its waits are silent and not cut short by a signal);
Retrying (retry.py) makes the further tries, each one said and interruptible."""


def _parse_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'some/prefix') for 's3://bucket/some/prefix/'."""
    scheme, _, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme != "s3" or not bucket:
        raise StorageError(f"{uri}: not an s3://bucket[/prefix] URI")
    return bucket, prefix.strip("/")


def _read_capped(key: str, body, cap: int) -> bytes:
    """All of a GET's body, taken STREAM_CHUNK at a time and given up (TooLarge) as soon as
    more than `cap` bytes have come, whatever the Range asked and Content-Length said: a
    server that ignores the Range, or a man in the middle on plain http, costs the cap and
    what is in flight when the connection drops, not what it sends. Closes the body."""
    data = bytearray()
    try:
        while chunk := body.read(min(s3_transfer.STREAM_CHUNK, cap + 1 - len(data))):
            data += chunk
            if len(data) > cap:
                raise TooLarge(f"{key}: larger than the {cap}-byte limit")
    finally:
        body.close()  # drops the connection: the rest of an oversized body is never read
    return bytes(data)


class S3Storage:
    """A Storage on `s3://bucket/prefix`; keys are relative to the prefix."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.bucket, self.root = _parse_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.root}" if self.root else f"s3://{self.bucket}"
        self.endpoint_url = endpoint_url
        self.client = self._make_client(endpoint_url)
        self.upload_choice = s3_transfer.UploadChoice()

    # --- setup -------------------------------------------------------------------------

    @staticmethod
    def _make_client(endpoint_url: str | None):
        """A boto3 S3 client from the standard credential chain.

        Retries: botocore's adaptive mode retries 5xx, throttling, timeouts and dropped
        connections itself, with client-side rate limiting when the server throttles.
        With an endpoint (MinIO, R2, a test server) requests are path-style, and checksums
        are only sent where S3 requires them: several S3-compatible stores reject the
        CRC trailers that botocore adds by default since 1.36.
        An answer with an error status is read only up to s3_errors.ERROR_BODY_BYTES.
        """
        import boto3
        from botocore.config import Config

        options = dict(
            retries={"mode": "adaptive", "max_attempts": BOTO_ATTEMPTS},
            connect_timeout=CONNECT_TIMEOUT,
            read_timeout=READ_TIMEOUT,
            max_pool_connections=max(10, 2 * s3_transfer.CONCURRENCY),
            tcp_keepalive=True,
        )
        if endpoint_url:
            options.update(s3={"addressing_style": "path"},
                           request_checksum_calculation="when_required",
                           response_checksum_validation="when_required")
        client = boto3.client("s3", endpoint_url=endpoint_url or None, config=Config(**options))
        bound_error_bodies(client)
        return client

    def full_key(self, key: str) -> str:
        """The full object key of a relative key."""
        return f"{self.root}/{key}" if self.root else key

    @contextlib.contextmanager
    def _errors(self, key: str, what: str) -> Iterator[None]:
        """Translate S3's answers into the Storage exceptions every backend raises.

        404 → NotFound, 403 → Forbidden, a missing bucket → StorageError, a fault worth
        another try (is_transient) → Transient (base.classify_errors). Anything else
        propagates, and Retrying reports it once as a StorageError.
        """
        from botocore.exceptions import ClientError

        with classify_errors(key, what, self.uri, transient=is_transient):
            try:
                yield
            except ClientError as exc:
                status, code = http_status(exc), error_code(exc)
                if code == "NoSuchBucket":
                    raise StorageError(
                        f"{key}: bucket {self.bucket} does not exist ({self.uri})") from None
                if status == 404 or code in ("NoSuchKey", "NotFound"):
                    raise NotFound(f"{key}: not found in {self.uri}") from None
                if status == 403 or code == "AccessDenied":
                    raise Forbidden(
                        f"{key}: access denied ({what}) in bucket {self.bucket}; check the "
                        "credentials and the bucket policy") from None
                raise

    # --- reads -------------------------------------------------------------------------

    def _get(self, key: str, last: int | None, cap: int, **conditions) -> dict:
        """One GET of bytes 0..last (None: all); returns the boto3 response with the body
        already read into 'Data', TooLarge if more than `cap` bytes came (_read_capped)."""
        params = dict(Bucket=self.bucket, Key=self.full_key(key), **conditions)
        if last is not None:
            params["Range"] = f"bytes=0-{last}"
        response = self.client.get_object(**params)
        response["Data"] = _read_capped(key, response["Body"], cap)
        return response

    def _open(self, key: str, conditions: dict) -> dict | None:
        """GET the whole object, body not yet read; None on 304 Not Modified."""
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.full_key(key), **conditions)
        except ClientError as exc:
            if http_status(exc) == 304:
                return None
            raise

    def _open_sized(self, key: str, max_bytes: int | None, conditions: dict):
        """(body, etag, size) of a GET of the whole object, its body not yet read, or None
        on 304. Content-Length is checked against max_bytes before any of the body is read,
        so an oversized object costs at most what is in flight when the connection drops."""
        response = self._open(key, conditions)
        if response is None:
            return None
        body, etag, total = response["Body"], response["ETag"], response.get("ContentLength")
        if total is None or (max_bytes is not None and total > max_bytes):
            body.close()
            if total is None:
                raise StorageError(f"{key}: the server gave no Content-Length")
            raise TooLarge(f"{key}: larger than the {max_bytes}-byte limit")
        return body, etag, total

    def _get_capped(self, key: str, max_bytes: int, conditions: dict) -> dict | None:
        """One ranged GET of at most max_bytes + 1 bytes, so an oversized object costs at
        most the cap on the wire; None on 304; TooLarge if more than max_bytes come, whatever
        the server sends. An empty object answers any Range with 416, so that case falls back
        to a plain GET, under the same cap."""
        from botocore.exceptions import ClientError

        for last in (max_bytes, None):
            try:
                return self._get(key, last, max_bytes, **conditions)
            except ClientError as exc:
                if http_status(exc) == 304:
                    return None
                if last is None or error_code(exc) != "InvalidRange":
                    raise
        raise AssertionError("unreachable")

    def _read(self, key: str, max_bytes: int | None,
              if_none_match: str | None = None) -> tuple[bytes | None, str]:
        """(data, etag) of the object, or (None, etag) if its ETag is still `if_none_match`.

        Under a small cap (manifests, shards: anything a volunteer may have written) one
        ranged GET that cannot bring more than the cap. Otherwise (checkpoint files, whose
        size the manifest states) one GET whose Content-Length is checked before the body
        is read, streamed and split if it is slow (s3_transfer.stream_into).
        """
        conditions = {"IfNoneMatch": if_none_match} if if_none_match else {}
        with self._errors(key, "read"):
            if max_bytes is not None and max_bytes < s3_transfer.MULTIPART_THRESHOLD:
                response = self._get_capped(key, max_bytes, conditions)
                if response is None:
                    return None, if_none_match
                return response["Data"], response["ETag"]
            opened = self._open_sized(key, max_bytes, conditions)
            if opened is None:
                return None, if_none_match
            body, etag, total = opened
            return s3_transfer.read_whole(self, key, body, total, etag), etag

    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None,
                  piece: int | None = None) -> None:
        """Fill `buf` with the object, which must be exactly len(buf) bytes, with no copy
        held twice: one streamed GET that splits into parallel ranged GETs if it is slow
        (s3_transfer.stream_into). `on_chunk` sees the pieces in order, each as soon as it
        and every piece before it have landed, so hashing overlaps the download. With
        `piece`, one stream read `piece` bytes at a time, never split (a paced read)."""
        size = len(buf)
        with self._errors(key, "read"):
            body, etag, total = self._open_sized(key, size, {})
            if total < size:
                body.close()
                raise ShortObject(f"{key}: {total} bytes, shorter than the expected {size}")
            s3_transfer.stream_into(self, key, body, buf, etag, on_chunk, piece)

    def read(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes; TooLarge if it has more than max_bytes. A big object comes
        back as the bytearray it was read into (bytes-like like the rest), which saves a
        copy of the whole object."""
        return self._read(key, max_bytes)[0]

    def read_if_changed(self, key: str, etag: str | None,
                        max_bytes: int | None = None) -> tuple[bytes | None, str]:
        """(None, etag) if the object is still the version `etag` names (a 304, no body),
        else (data, new_etag). The manifest poll of every volunteer."""
        return self._read(key, max_bytes, if_none_match=etag)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def size(self, key: str) -> int:
        with self._errors(key, "size"):
            response = self.client.head_object(Bucket=self.bucket, Key=self.full_key(key))
        return int(response["ContentLength"])

    def _prefix(self, prefix: str) -> str:
        """The full key prefix of a relative prefix, with the '/' that keeps "r" from
        listing "rr/..."; '' for the URI's root in a bucket without prefix."""
        full = "/".join(part for part in (self.root, prefix.strip("/")) if part)
        return f"{full}/" if full else ""

    def _relative(self, full: str) -> str:
        """A listed key relative to the URI prefix."""
        return full[len(self.root) + 1:] if self.root else full

    def list(self, prefix: str, limit: int | None = None) -> list[str]:
        """All keys under `prefix/` (recursive), relative to the URI prefix, sorted.

        With `limit`, the first `limit` keys: S3 lists in key order, so paging stops there,
        in pages sized to need no more than one extra key (1,025 keys: two pages of 513)."""
        config: dict = {}
        if limit is not None:
            if limit <= 0:
                return []
            pages_needed = -(-limit // 1000)
            config = {"PaginationConfig": {"PageSize": -(-limit // pages_needed)}}
        keys: list[str] = []
        with self._errors(prefix, "list"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._prefix(prefix), **config)
            for page in pages:
                keys += [self._relative(obj["Key"]) for obj in page.get("Contents", [])]
                if limit is not None and len(keys) >= limit:
                    break
        return sorted(keys)[:limit]

    def list_level(self, prefix: str) -> list[str]:
        """The objects directly under `prefix/` and its folders (keys ending in '/'),
        sorted: LIST with Delimiter='/', so a folder costs one entry whatever it holds."""
        out: list[str] = []
        with self._errors(prefix, "list"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._prefix(prefix), Delimiter="/")
            for page in pages:
                out += [self._relative(obj["Key"]) for obj in page.get("Contents", [])]
                out += [self._relative(p["Prefix"]) for p in page.get("CommonPrefixes", [])]
        return sorted(out)

    # --- writes ------------------------------------------------------------------------

    def _put(self, key: str, data: bytes, conditions: dict) -> str:
        """Upload `data` under `conditions`; the new ETag. Objects from MULTIPART_THRESHOLD
        on go as one PUT or as parallel parts, whichever upload_choice has found faster."""
        big = len(data) >= s3_transfer.MULTIPART_THRESHOLD
        method = self.upload_choice.pick(len(data)) if big else "single"
        start = time.perf_counter()
        if method == "multipart":
            etag = s3_transfer.put_multipart(self, key, data, conditions)
        else:
            etag = self.client.put_object(Bucket=self.bucket, Key=self.full_key(key), Body=data,
                                          **conditions)["ETag"]
        if big:
            self.upload_choice.record(method, len(data), time.perf_counter() - start)
        return etag

    def _is_ours(self, key: str, data: bytes) -> str | None:
        """The object's ETag if it holds exactly `data` as we would have uploaded it, else None.

        botocore retries a request whose answer was lost; if the first attempt had landed,
        the retry of a conditional write fails its own condition. This tells that case apart
        from a real conflict.
        """
        try:
            with self._errors(key, "check"):
                etag = self.client.head_object(Bucket=self.bucket, Key=self.full_key(key))["ETag"]
        except NotFound:
            return None
        ours = (etag == s3_transfer.expected_etag(data, multipart=False)
                or (len(data) >= s3_transfer.MULTIPART_THRESHOLD
                    and etag == s3_transfer.expected_etag(data, multipart=True)))
        return etag if ours else None

    def write(self, key: str, data: bytes) -> None:
        """Create or replace the object; readers see the old or the whole new one."""
        with self._errors(key, "write"):
            self._put(key, data, {})

    def create(self, key: str, data: bytes) -> None:
        """Write a new object; AlreadyExists (and the old content kept) if the key is taken."""
        from botocore.exceptions import ClientError

        with self._errors(key, "create"):
            try:
                self._put(key, data, {"IfNoneMatch": "*"})
            except ClientError as exc:
                if not is_conflict(exc):
                    raise
                if not (was_retried(exc) and self._is_ours(key, data)):
                    raise AlreadyExists(f"{key}: already exists in {self.uri}") from None

    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """Create-only, streamed: `write(sink)` fills PART_SIZE parts that go up while it
        writes the next ones (at most CONCURRENCY in flight, so memory stays bounded); a
        stream shorter than MULTIPART_THRESHOLD goes as one PUT, and so does every stream
        while upload_choice finds one PUT faster on this link (then the whole object is
        held in memory first). If-None-Match: * on the request that makes the object
        visible, as in `create`."""
        from botocore.exceptions import ClientError

        # the stream's size is not known yet: pick as for the smallest big object
        method = self.upload_choice.pick(s3_transfer.MULTIPART_THRESHOLD)
        sink = s3_transfer.PartSink(self, self.full_key(key), single=method == "single")
        start = time.perf_counter()
        with self._errors(key, "create"):
            try:
                write(sink)
                sink.finish({"IfNoneMatch": "*"})
                if sink.size >= s3_transfer.MULTIPART_THRESHOLD:
                    self.upload_choice.record(method, sink.size, time.perf_counter() - start)
            except ClientError as exc:
                sink.abort()
                if not is_conflict(exc):
                    raise
                if not (was_retried(exc) and self._etag_of(key) == sink.expected_etag()):
                    raise AlreadyExists(f"{key}: already exists in {self.uri}") from None
            except BaseException:
                sink.abort()
                raise

    def _etag_of(self, key: str) -> str | None:
        try:
            with self._errors(key, "check"):
                return self.client.head_object(Bucket=self.bucket, Key=self.full_key(key))["ETag"]
        except NotFound:
            return None

    def write_if_match(self, key: str, data: bytes, etag: str | None) -> str:
        """Replace `key` only if its ETag is still `etag` (None: it must not exist yet).

        PreconditionFailed if another writer got there first; returns the new ETag.
        """
        from botocore.exceptions import ClientError

        conditions = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        with self._errors(key, "write"):
            try:
                return self._put(key, data, conditions)
            except ClientError as exc:
                # If-Match on a key that no longer exists answers 404 NoSuchKey.
                gone = etag is not None and error_code(exc) in ("NoSuchKey", "404")
                if not (is_conflict(exc) or gone):
                    raise
                mine = was_retried(exc) and self._is_ours(key, data)
                if mine:
                    return mine
                raise PreconditionFailed(
                    f"{key}: changed since it was read (another writer?) in {self.uri}") from None

    def delete(self, key: str) -> None:
        """Delete the object; NotFound if there is none (S3 itself would answer 204 anyway)."""
        self.size(key)
        with self._errors(key, "delete"):
            self.client.delete_object(Bucket=self.bucket, Key=self.full_key(key))

    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """DeleteObjects, DELETE_BATCH keys per request; S3 reports a missing key as deleted.
        Returns the keys S3 refused (its per-key errors), each with a one-line reason."""
        failed = []
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start:start + DELETE_BATCH]
            with self._errors(batch[0], "delete"):
                response = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self.full_key(k)} for k in batch], "Quiet": True})
            for error in response.get("Errors", []):
                if error.get("Code") == "NoSuchKey":
                    continue
                key = self._relative(error.get("Key", ""))
                why = " ".join(f"{error.get('Code', '?')} {error.get('Message', '')}".split())
                failed.append((key, f"{key}: delete refused in {self.uri}: {why}"))
        return failed

