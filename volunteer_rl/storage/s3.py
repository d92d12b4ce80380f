"""The S3 backend: boto3 against `s3://bucket/prefix`, with real conditional writes.

Why not s3fs: the protocol needs create-only writes (checkpoints, shards), compare-and-swap
on `manifest.json`, and a cheap "has the manifest changed?" poll. S3 does all three
atomically with `If-None-Match: *`, `If-Match: <etag>` and a conditional GET that answers
304 without a body, so thousands of idle volunteers polling the manifest cost almost nothing.

Large objects (checkpoints) adapt to the link. A read is one GET that streams from the
socket straight into the caller's buffer; if after PROBE_BYTES the rest would take one stream
longer than SPLIT_SECONDS, the rest is split into parallel ranged GETs into their own slices.
(Against AWS itself botocore validates response checksums and wraps the body of objects
uploaded with one; such reads take one copy more, which the internet link hides.)

An upload is one PUT or a multipart upload with parts sent in parallel, whichever has
been faster on this link so far (UploadChoice). Over the internet, where one TCP stream is
the limit, that means parallel transfers; on a LAN or to a server on the same host, one
stream, which is faster there. A multipart object only becomes visible when
CompleteMultipartUpload succeeds, and that request carries the same condition as a single
PUT would, so readers never see a partial or a replaced written-once object. A failed upload
is aborted; give the bucket a lifecycle rule that aborts incomplete uploads after a day to
catch the ones a killed process leaves behind.

Works with AWS and with S3-compatible stores (MinIO, R2, moto) through `endpoint_url`.
boto3 is imported only when a storage object is made: `vrl --help` stays instant.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO, Callable, Iterator, Sequence

from volunteer_rl.storage.base import (
    DELETE_BATCH,
    AlreadyExists,
    Forbidden,
    NotFound,
    PreconditionFailed,
    ShortObject,
    StorageError,
    TooLarge,
    Transient,
    classify_errors,
    is_transient_os_error,
)

MiB = 1024 * 1024
MULTIPART_THRESHOLD = 64 * MiB
"""Objects this big or bigger are uploaded as multipart."""
PART_SIZE = 64 * MiB
"""Bytes per uploaded part and per ranged GET. Large on purpose: S3 servers that copy the
whole object for each ranged GET (moto) make small parts quadratic; S3 allows 10,000 parts."""
CONCURRENCY = 4
"""Parts uploaded or downloaded at the same time."""
MIN_PART = 8 * MiB
"""Smallest part worth its own request (S3's own floor is 5 MiB)."""
MAX_SINGLE_PUT = 5 * 1024 * MiB
"""S3's limit for one PUT: bigger objects must go up as multipart."""
STREAM_CHUNK = 1 * MiB
"""Bytes taken from the socket at a time while a read probes its stream's rate."""
PROBE_BYTES = 8 * MiB
"""A read measures its one stream's rate over this many bytes before it may split."""
REST_CHUNK = 16 * MiB
"""Bytes per socket read after the probe (read_into hands each piece on as it lands)."""
SPLIT_SECONDS = 1.0
"""A read splits the rest of its object into parallel ranged GETs only when one stream, at
the rate it has shown, would need longer than this for it. On a fast link (a LAN, a server
on the same host) one stream finishes first, and servers that re-read the whole object for
each ranged GET (moto) are spared the extra reads; over the internet, where one TCP stream
is the limit, a big object splits after PROBE_BYTES."""
RETRY_EVERY = 10
"""Once both upload methods have been measured, every this many big uploads use the one that
is not the current best, so the choice follows a link that changes."""

CONNECT_TIMEOUT = 10
READ_TIMEOUT = 120


def _parse_uri(uri: str) -> tuple[str, str]:
    """('bucket', 'some/prefix') for 's3://bucket/some/prefix/'."""
    scheme, _, rest = uri.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme != "s3" or not bucket:
        raise StorageError(f"{uri}: not an s3://bucket[/prefix] URI")
    return bucket, prefix.strip("/")


def _status(exc) -> int:
    """HTTP status of a botocore ClientError (0 if unknown)."""
    return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)


def _code(exc) -> str:
    """S3 error code of a botocore ClientError ('NoSuchKey', 'PreconditionFailed', ...)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def _retried(exc) -> bool:
    """True if botocore retried the request that failed: an earlier attempt may have landed."""
    return exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0) > 0


RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                         "TooManyRequests", "RequestTimeout", "InternalError",
                         "ServiceUnavailable"})
"""S3 error codes of answers worth another try whatever their HTTP status."""


def is_transient(exc: BaseException) -> bool:
    """Is this a fault worth another try? A ClientError with a 5xx or 429 status or one of
    RETRY_CODES; botocore's and urllib3's connection errors and timeouts (not a failed TLS
    handshake, which a retry repeats); a body cut short; a socket's own timeout or reset.
    botocore has spent its own retries on these before they reach us; Retrying spaces out a
    few more. Also the rule for s3:// through s3fs (storage/fsspec.py)."""
    import http.client

    from botocore import exceptions as boto
    from urllib3 import exceptions as urllib3

    if isinstance(exc, boto.ClientError):
        status = _status(exc)
        return status >= 500 or status == 429 or _code(exc) in RETRY_CODES
    if isinstance(exc, boto.SSLError):
        return False
    return is_transient_os_error(exc) or isinstance(exc, (
        boto.ConnectionError, boto.HTTPClientError, boto.IncompleteReadError,
        urllib3.ProtocolError, urllib3.TimeoutError, http.client.IncompleteRead))


def _is_conflict(exc) -> bool:
    """A condition did not hold: 412, or 409 when another conditional write was in flight."""
    return _status(exc) == 412 or _code(exc) == "ConditionalRequestConflict"


def _part_ranges(start: int, end: int, part_size: int) -> list[tuple[int, int]]:
    """[(first, last), ...] inclusive byte ranges covering [start, end) in part_size steps."""
    return [(p, min(p + part_size, end) - 1) for p in range(start, end, part_size)]


def _split(start: int, end: int) -> list[tuple[int, int]]:
    """Ranges of [start, end) for parallel transfer: CONCURRENCY parts of equal size when that
    is between MIN_PART and PART_SIZE, so every connection carries the same share."""
    share = -(-(end - start) // CONCURRENCY)
    return _part_ranges(start, end, max(MIN_PART, min(PART_SIZE, share)))


def expected_etag(data: bytes, multipart: bool | None = None) -> str:
    """The ETag S3 gives `data` when this module uploads it (no SSE-KMS / SSE-C).

    A single PUT gets the MD5 of the body; a multipart upload the MD5 of the parts' MD5s
    followed by '-<parts>'. `multipart` None: multipart from MULTIPART_THRESHOLD on.
    Used to recognise our own object after a retried conditional write.
    """
    if multipart is None:
        multipart = len(data) >= MULTIPART_THRESHOLD
    if not multipart:
        return f'"{hashlib.md5(data).hexdigest()}"'
    ranges = _split(0, len(data))
    digests = b"".join(hashlib.md5(data[a:b + 1]).digest() for a, b in ranges)
    return f'"{hashlib.md5(digests).hexdigest()}-{len(ranges)}"'


def _socket_reader(body) -> Callable[[memoryview], int]:
    """A readinto(view) -> n for the body of a boto3 GET that puts bytes from the socket
    straight into `view`.

    botocore's StreamingBody reads through urllib3, which copies every sized read through
    its own buffer; the http.client response underneath reads into the caller's buffer.
    That is used only for a plain StreamingBody whose body is not content-encoded and not
    yet touched; anything else (a checksum-validating body, an unknown wrapper) goes
    through body.read() and one copy. Whoever calls it reads exactly Content-Length bytes
    and checks them (sha256 in the manifest), which is what StreamingBody would check.
    """
    from botocore.response import StreamingBody

    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    headers = getattr(raw, "headers", None) or {}
    if (type(body) is StreamingBody and hasattr(fp, "readinto")
            and not headers.get("content-encoding")
            and getattr(raw, "_fp_bytes_read", None) == 0):
        return fp.readinto

    def readinto(view: memoryview) -> int:
        chunk = body.read(len(view))
        view[:len(chunk)] = chunk
        return len(chunk)
    return readinto


def _read_capped(key: str, body, cap: int) -> bytes:
    """All of a GET's body, taken STREAM_CHUNK at a time and given up (TooLarge) as soon as
    more than `cap` bytes have come, whatever the Range asked and Content-Length said: a
    server that ignores the Range, or a man in the middle on plain http, costs the cap and
    what is in flight when the connection drops, not what it sends. Closes the body."""
    data = bytearray()
    try:
        while chunk := body.read(min(STREAM_CHUNK, cap + 1 - len(data))):
            data += chunk
            if len(data) > cap:
                raise TooLarge(f"{key}: larger than the {cap}-byte limit")
    finally:
        body.close()  # drops the connection: the rest of an oversized body is never read
    return bytes(data)


def _fill(key: str, readinto: Callable[[memoryview], int], view: memoryview,
          got: int, stop: int) -> int:
    """Read view[got:stop] from a stream; returns stop. Transient if it ends early
    (the connection dropped: the read is worth another try)."""
    while got < stop:
        n = readinto(view[got:stop])
        if not n:
            raise Transient(f"{key}: connection closed after {got} of {len(view)} bytes")
        got += n
    return got


class UploadChoice:
    """Single PUT or parallel multipart, for each big upload: whichever has been faster.

    Which one wins depends on the link and the server, not on the object: over the internet
    one TCP stream is the limit and parallel parts win by the number of streams; on a fast
    link to a server that copies parts once more when it completes the upload (moto, some
    self-hosted stores) one PUT wins. So each method is tried once (multipart first, the
    right guess for the internet), its MB/s remembered (the best seen, slowly forgotten),
    and from then on the faster one is used, with the other retried every RETRY_EVERY
    uploads. Objects over S3's single-PUT limit always go multipart. Pure logic, no I/O.
    """

    METHODS = ("multipart", "single")

    def __init__(self, fixed: str | None = None):
        """`fixed`: always use this method (tests, or a user who knows their link)."""
        self.fixed = fixed
        self.rate: dict[str, float] = {}
        self.uploads = 0
        self.last: str | None = None  # the method of the latest big upload

    def pick(self, size: int) -> str:
        if size > MAX_SINGLE_PUT:
            return "multipart"
        if self.fixed:
            return self.fixed
        untried = [m for m in self.METHODS if m not in self.rate]
        if untried:
            return untried[0]
        best = max(self.METHODS, key=self.rate.__getitem__)
        if self.uploads % RETRY_EVERY == RETRY_EVERY - 1:
            return next(m for m in self.METHODS if m != best)
        return best

    def record(self, method: str, size: int, seconds: float) -> None:
        rate = size / max(seconds, 1e-6)
        old = self.rate.get(method)
        self.rate[method] = rate if old is None else max(rate, 0.7 * old + 0.3 * rate)
        self.uploads += 1
        self.last = method


class S3Storage:
    """A Storage on `s3://bucket/prefix`; keys are relative to the prefix."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.bucket, self.root = _parse_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.root}" if self.root else f"s3://{self.bucket}"
        self.endpoint_url = endpoint_url
        self.client = self._make_client(endpoint_url)
        self.upload_choice = UploadChoice()

    # --- setup -------------------------------------------------------------------------

    @staticmethod
    def _make_client(endpoint_url: str | None):
        """A boto3 S3 client from the standard credential chain.

        Retries: botocore's adaptive mode retries 5xx, throttling, timeouts and dropped
        connections itself, with client-side rate limiting when the server throttles.
        With an endpoint (MinIO, R2, a test server) requests are path-style, and checksums
        are only sent where S3 requires them: several S3-compatible stores reject the
        CRC trailers that botocore adds by default since 1.36.
        """
        import boto3
        from botocore.config import Config

        options = dict(
            retries={"mode": "adaptive", "max_attempts": 8},
            connect_timeout=CONNECT_TIMEOUT,
            read_timeout=READ_TIMEOUT,
            max_pool_connections=max(10, 2 * CONCURRENCY),
            tcp_keepalive=True,
        )
        if endpoint_url:
            options.update(s3={"addressing_style": "path"},
                           request_checksum_calculation="when_required",
                           response_checksum_validation="when_required")
        return boto3.client("s3", endpoint_url=endpoint_url or None, config=Config(**options))

    def _key(self, key: str) -> str:
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
                status, code = _status(exc), _code(exc)
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
        params = dict(Bucket=self.bucket, Key=self._key(key), **conditions)
        if last is not None:
            params["Range"] = f"bytes=0-{last}"
        response = self.client.get_object(**params)
        response["Data"] = _read_capped(key, response["Body"], cap)
        return response

    def _open(self, key: str, conditions: dict) -> dict | None:
        """GET the whole object, body not yet read; None on 304 Not Modified."""
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key), **conditions)
        except ClientError as exc:
            if _status(exc) == 304:
                return None
            raise

    def _probe(self, key: str, readinto, view: memoryview) -> tuple[int, bool]:
        """Read the first PROBE_BYTES of an open GET into `view`: (bytes read, split the rest?).

        The rate is measured from the first chunk on, so the server's time to first byte
        does not count; the rest is split when one stream at that rate would need longer
        than SPLIT_SECONDS for it."""
        total = len(view)
        first = _fill(key, readinto, view, 0, min(total, STREAM_CHUNK))
        t_first = time.perf_counter()
        got = _fill(key, readinto, view, first, min(total, PROBE_BYTES))
        left, measured = total - got, got - first
        elapsed = time.perf_counter() - t_first
        split = left >= 2 * MIN_PART and measured > 0 and left * elapsed / measured > SPLIT_SECONDS
        return got, split

    @staticmethod
    def _read_stream(key: str, readinto, buf: memoryview, got: int,
                     on_chunk: Callable[[int, memoryview], None] | None) -> None:
        """buf[got:] from the rest of the one open stream: in one go, or in REST_CHUNK pieces
        handed to `on_chunk` as each lands."""
        total = len(buf)
        step = REST_CHUNK if on_chunk is not None else total
        while got < total:
            end = _fill(key, readinto, buf, got, min(total, got + step))
            if on_chunk is not None:
                on_chunk(got, buf[got:end])
            got = end

    def _split_rest(self, key: str, readinto, buf: memoryview, got: int, etag: str,
                    on_chunk: Callable[[int, memoryview], None] | None) -> None:
        """buf[got:] with the open stream taking the next share and parallel ranged GETs
        pinned to `etag` the others (If-Match: a replaced object fails the read instead of
        mixing two versions), each into its own slice; `on_chunk` sees pieces in order."""
        total = len(buf)
        share = max(MIN_PART, min(PART_SIZE, -(-(total - got) // CONCURRENCY)))
        cut = min(total, got + share)
        ranges = _part_ranges(cut, total, share)
        with ThreadPoolExecutor(max(1, min(CONCURRENCY - 1, len(ranges)))) as pool:
            parts = [(r, pool.submit(self._get_into, key, etag, buf, r)) for r in ranges]
            try:
                self._read_stream(key, readinto, buf[:cut], got, on_chunk)
                for (first, last), future in parts:
                    future.result()
                    if on_chunk is not None:
                        on_chunk(first, buf[first:last + 1])
            finally:
                for _, future in parts:
                    future.cancel()

    def _stream_into(self, key: str, body, buf: memoryview, etag: str,
                     on_chunk: Callable[[int, memoryview], None] | None = None) -> None:
        """Fill `buf` (the whole object) from the open GET `body`: probe the stream's rate,
        then read the rest on it, or split the rest if one stream is too slow (_probe).
        Bytes go from the socket straight into `buf` (_socket_reader): no copy on the way.
        `on_chunk(offset, piece)` sees the pieces in order as soon as each has landed."""
        try:
            readinto = _socket_reader(body)
            got, split = self._probe(key, readinto, buf)
            if on_chunk is not None:
                on_chunk(0, buf[:got])
            if split:
                self._split_rest(key, readinto, buf, got, etag, on_chunk)
            else:
                self._read_stream(key, readinto, buf, got, on_chunk)
        finally:
            body.close()

    def _read_whole(self, key: str, body, total: int, etag: str) -> bytearray:
        """The whole object, read straight into one buffer that is then handed over as it is:
        as few copies as a plain `get_object()["Body"].read()`, which is one."""
        buf = bytearray(total)
        self._stream_into(key, body, memoryview(buf), etag)
        return buf

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
                if _status(exc) == 304:
                    return None
                if last is None or _code(exc) != "InvalidRange":
                    raise
        raise AssertionError("unreachable")

    def _read(self, key: str, max_bytes: int | None,
              if_none_match: str | None = None) -> tuple[bytes | None, str]:
        """(data, etag) of the object, or (None, etag) if its ETag is still `if_none_match`.

        Under a small cap (manifests, shards: anything a volunteer may have written) one
        ranged GET that cannot bring more than the cap. Otherwise (checkpoint files, whose
        size the manifest states) one GET whose Content-Length is checked before the body
        is read, streamed and split if it is slow (_stream).
        """
        conditions = {"IfNoneMatch": if_none_match} if if_none_match else {}
        with self._errors(key, "read"):
            if max_bytes is not None and max_bytes < MULTIPART_THRESHOLD:
                response = self._get_capped(key, max_bytes, conditions)
                if response is None:
                    return None, if_none_match
                return response["Data"], response["ETag"]
            opened = self._open_sized(key, max_bytes, conditions)
            if opened is None:
                return None, if_none_match
            body, etag, total = opened
            return self._read_whole(key, body, total, etag), etag

    def read_into(self, key: str, buf: memoryview,
                  on_chunk: Callable[[int, memoryview], None] | None = None) -> None:
        """Fill `buf` with the object, which must be exactly len(buf) bytes, with no copy
        held twice: one streamed GET that splits into parallel ranged GETs if it is slow
        (_stream_into). `on_chunk` sees the pieces in order, each as soon as it and every
        piece before it have landed, so hashing overlaps the download."""
        size = len(buf)
        with self._errors(key, "read"):
            body, etag, total = self._open_sized(key, size, {})
            if total < size:
                body.close()
                raise ShortObject(f"{key}: {total} bytes, shorter than the expected {size}")
            self._stream_into(key, body, buf, etag, on_chunk)

    def _get_into(self, key: str, etag: str, buf: memoryview, byte_range: tuple[int, int]) -> None:
        """One ranged GET (If-Match `etag`) streamed into buf[first:last + 1]."""
        from botocore.exceptions import ClientError

        first, last = byte_range
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                              IfMatch=etag, Range=f"bytes={first}-{last}")
        except ClientError as exc:
            if _status(exc) == 412:
                raise StorageError(f"{key}: replaced while being read from {self.uri}") from None
            raise
        size = last + 1 - first
        if response["ContentLength"] != size:
            response["Body"].close()
            raise StorageError(f"{key}: ranged GET of bytes {first}-{last} returned "
                               f"{response['ContentLength']} bytes")
        try:
            _fill(key, _socket_reader(response["Body"]), buf[first:last + 1], 0, size)
        finally:
            response["Body"].close()

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
            response = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
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
        big = len(data) >= MULTIPART_THRESHOLD
        method = self.upload_choice.pick(len(data)) if big else "single"
        start = time.perf_counter()
        if method == "multipart":
            etag = self._put_multipart(key, data, conditions)
        else:
            etag = self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                          **conditions)["ETag"]
        if big:
            self.upload_choice.record(method, len(data), time.perf_counter() - start)
        return etag

    def _put_multipart(self, key: str, data: bytes, conditions: dict) -> str:
        """A multipart upload with parts sent in parallel; `conditions` go on the Complete
        request, the moment the object becomes visible. Aborted on any failure."""
        full = self._key(key)
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
        try:
            ranges = _split(0, len(data))
            send = lambda n: self._upload_part(full, upload_id, n + 1, data, ranges[n])  # noqa: E731
            with ThreadPoolExecutor(min(CONCURRENCY, len(ranges))) as pool:
                parts = list(pool.map(send, range(len(ranges))))
            response = self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, **conditions)
        except BaseException:
            self._abort(full, upload_id)
            raise
        return response["ETag"]

    def _upload_part(self, full: str, upload_id: str, number: int, data: bytes,
                     byte_range: tuple[int, int]) -> dict:
        """Upload one part; its {PartNumber, ETag} for CompleteMultipartUpload."""
        first, last = byte_range
        response = self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                           PartNumber=number, Body=data[first:last + 1])
        return {"PartNumber": number, "ETag": response["ETag"]}

    def _abort(self, full: str, upload_id: str) -> None:
        """Drop an unfinished multipart upload; a failure here must not hide the real one."""
        with contextlib.suppress(Exception):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)

    def _is_ours(self, key: str, data: bytes) -> str | None:
        """The object's ETag if it holds exactly `data` as we would have uploaded it, else None.

        botocore retries a request whose answer was lost; if the first attempt had landed,
        the retry of a conditional write fails its own condition. This tells that case apart
        from a real conflict.
        """
        try:
            with self._errors(key, "check"):
                etag = self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ETag"]
        except NotFound:
            return None
        ours = (etag == expected_etag(data, multipart=False)
                or (len(data) >= MULTIPART_THRESHOLD and etag == expected_etag(data, multipart=True)))
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
                if not _is_conflict(exc):
                    raise
                if not (_retried(exc) and self._is_ours(key, data)):
                    raise AlreadyExists(f"{key}: already exists in {self.uri}") from None

    def create_from(self, key: str, write: Callable[[BinaryIO], None]) -> None:
        """Create-only, streamed: `write(sink)` fills PART_SIZE parts that go up while it
        writes the next ones (at most CONCURRENCY in flight, so memory stays bounded); a
        stream shorter than MULTIPART_THRESHOLD goes as one PUT, and so does every stream
        while upload_choice finds one PUT faster on this link (then the whole object is
        held in memory first). If-None-Match: * on the request that makes the object
        visible, as in `create`."""
        from botocore.exceptions import ClientError

        method = self.upload_choice.pick(MULTIPART_THRESHOLD)  # the size is not known yet
        sink = _PartSink(self, self._key(key), single=method == "single")
        start = time.perf_counter()
        with self._errors(key, "create"):
            try:
                write(sink)
                sink.finish({"IfNoneMatch": "*"})
                if sink.size >= MULTIPART_THRESHOLD:
                    self.upload_choice.record(method, sink.size, time.perf_counter() - start)
            except ClientError as exc:
                sink.abort()
                if not _is_conflict(exc):
                    raise
                if not (_retried(exc) and self._etag_of(key) == sink.expected_etag()):
                    raise AlreadyExists(f"{key}: already exists in {self.uri}") from None
            except BaseException:
                sink.abort()
                raise

    def _etag_of(self, key: str) -> str | None:
        try:
            with self._errors(key, "check"):
                return self.client.head_object(Bucket=self.bucket, Key=self._key(key))["ETag"]
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
                gone = etag is not None and _code(exc) in ("NoSuchKey", "404")
                if not (_is_conflict(exc) or gone):
                    raise
                mine = _retried(exc) and self._is_ours(key, data)
                if mine:
                    return mine
                raise PreconditionFailed(
                    f"{key}: changed since it was read (another writer?) in {self.uri}") from None

    def delete(self, key: str) -> None:
        """Delete the object; NotFound if there is none (S3 itself would answer 204 anyway)."""
        self.size(key)
        with self._errors(key, "delete"):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_many(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        """DeleteObjects, DELETE_BATCH keys per request; S3 reports a missing key as deleted.
        Returns the keys S3 refused (its per-key errors), each with a one-line reason."""
        failed = []
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start:start + DELETE_BATCH]
            with self._errors(batch[0], "delete"):
                response = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True})
            for error in response.get("Errors", []):
                if error.get("Code") == "NoSuchKey":
                    continue
                key = self._relative(error.get("Key", ""))
                why = " ".join(f"{error.get('Code', '?')} {error.get('Message', '')}".split())
                failed.append((key, f"{key}: delete refused in {self.uri}: {why}"))
        return failed


class _PartSink:
    """The file-like `S3Storage.create_from` hands to its writer: bytes accumulate into a
    PART_SIZE buffer; each full buffer becomes one part of a multipart upload, uploaded by a
    pool while the writer goes on."""

    def __init__(self, store: S3Storage, full_key: str, single: bool = False):
        """`single`: keep everything and send it as one PUT in `finish`."""
        self.store, self.full_key, self.single = store, full_key, single
        self.size = 0
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.pending: list[Future] = []
        self.part_etags: list[str] = []
        self.small: bytes | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        self.size += n
        if self.single:
            self.buffer += view
            if len(self.buffer) <= MAX_SINGLE_PUT:
                return n
            self.single = False  # too big for one PUT after all: go on as multipart
            view, self.buffer = memoryview(self.buffer), bytearray()
        while len(view):
            take = PART_SIZE - len(self.buffer)
            self.buffer += view[:take]
            view = view[take:]
            if len(self.buffer) == PART_SIZE:
                self._send()
        return n

    def flush(self) -> None:
        pass

    def _send(self) -> None:
        store = self.store
        if self.upload_id is None:
            self.upload_id = store.client.create_multipart_upload(
                Bucket=store.bucket, Key=self.full_key)["UploadId"]
            self.pool = ThreadPoolExecutor(CONCURRENCY)
        number, body = len(self.pending) + 1, bytes(self.buffer)
        self.buffer = bytearray()
        in_flight = [f for f in self.pending if not f.done()]
        if len(in_flight) >= CONCURRENCY:
            in_flight[0].result()  # back-pressure: memory holds at most CONCURRENCY parts
        self.pending.append(self.pool.submit(
            lambda: store.client.upload_part(Bucket=store.bucket, Key=self.full_key,
                                             UploadId=self.upload_id, PartNumber=number,
                                             Body=body)["ETag"]))

    def finish(self, conditions: dict) -> None:
        store = self.store
        if self.upload_id is None:  # small, or one PUT chosen: everything is in the buffer
            self.small = self.buffer
            store.client.put_object(Bucket=store.bucket, Key=self.full_key, Body=self.small,
                                    **conditions)
            return
        if self.buffer:
            self._send()
        self.part_etags = [f.result() for f in self.pending]
        self.pool.shutdown()
        parts = [{"PartNumber": n, "ETag": e} for n, e in enumerate(self.part_etags, 1)]
        store.client.complete_multipart_upload(
            Bucket=store.bucket, Key=self.full_key, UploadId=self.upload_id,
            MultipartUpload={"Parts": parts}, **conditions)
        self.upload_id = None

    def expected_etag(self) -> str:
        """The ETag S3 gives what this sink uploaded (see `expected_etag`)."""
        if self.small is not None:
            return f'"{hashlib.md5(self.small).hexdigest()}"'
        digests = b"".join(bytes.fromhex(e.strip('"')) for e in self.part_etags)
        return f'"{hashlib.md5(digests).hexdigest()}-{len(self.part_etags)}"'

    def abort(self) -> None:
        if self.pool is not None:
            for f in self.pending:
                f.cancel()
            self.pool.shutdown(wait=True)
        if self.upload_id is not None:
            self.store._abort(self.full_key, self.upload_id)
            self.upload_id = None
