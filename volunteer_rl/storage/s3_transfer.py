"""Big objects over S3 at the link's speed: reads that split when one stream is slow, and
uploads as one PUT or parallel parts, whichever has been faster.

Large objects (checkpoints) adapt to the link. A read is one GET that streams from the
socket straight into the caller's buffer; if after PROBE_BYTES the rest would take one stream
longer than SPLIT_SECONDS, the rest is split into parallel ranged GETs into their own slices.
(Against AWS itself botocore validates response checksums and wraps the body of objects
uploaded with one; such reads take one copy more, which the internet link hides.)

An upload is one PUT or a multipart upload with parts sent in parallel, whichever has
been faster on this link so far (`UploadChoice`). Over the internet, where one TCP stream is
the limit, that means parallel transfers; on a LAN or to a server on the same host, one
stream, which is faster there. A multipart object only becomes visible when
CompleteMultipartUpload succeeds, and that request carries the same condition as a single
PUT would, so readers never see a partial or a replaced written-once object. A failed upload
is aborted; give the bucket a lifecycle rule that aborts incomplete uploads after a day to
catch the ones a killed process leaves behind.

The functions here act for an S3Storage (`store`: its client, bucket and URI, and
`store.full_key`); the conditions on its requests and the errors it raises are s3.py's.
botocore is imported only inside functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from volunteer_rl.storage.base import StorageError, Transient
from volunteer_rl.storage.s3_errors import http_status

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


# --- reads -------------------------------------------------------------------------------------

def probe(key: str, readinto, view: memoryview) -> tuple[int, bool]:
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


def read_stream(key: str, readinto, buf: memoryview, got: int,
                on_chunk: Callable[[int, memoryview], None] | None,
                piece: int | None = None) -> None:
    """buf[got:] from the rest of the one open stream: in one go, or in pieces of `piece`
    (else REST_CHUNK) bytes handed to `on_chunk` as each lands."""
    total = len(buf)
    step = piece or (REST_CHUNK if on_chunk is not None else total)
    while got < total:
        end = _fill(key, readinto, buf, got, min(total, got + step))
        if on_chunk is not None:
            on_chunk(got, buf[got:end])
        got = end


def split_rest(store, key: str, readinto, buf: memoryview, got: int, etag: str,
               on_chunk: Callable[[int, memoryview], None] | None) -> None:
    """buf[got:] with the open stream taking the next share and parallel ranged GETs
    pinned to `etag` the others (If-Match: a replaced object fails the read instead of
    mixing two versions), each into its own slice; `on_chunk` sees pieces in order."""
    total = len(buf)
    share = max(MIN_PART, min(PART_SIZE, -(-(total - got) // CONCURRENCY)))
    cut = min(total, got + share)
    ranges = _part_ranges(cut, total, share)
    with ThreadPoolExecutor(max(1, min(CONCURRENCY - 1, len(ranges)))) as pool:
        parts = [(r, pool.submit(get_into, store, key, etag, buf, r)) for r in ranges]
        try:
            read_stream(key, readinto, buf[:cut], got, on_chunk)
            for (first, last), future in parts:
                future.result()
                if on_chunk is not None:
                    on_chunk(first, buf[first:last + 1])
        finally:
            for _, future in parts:
                future.cancel()


def stream_into(store, key: str, body, buf: memoryview, etag: str,
                on_chunk: Callable[[int, memoryview], None] | None = None,
                piece: int | None = None) -> None:
    """Fill `buf` (the whole object) from the open GET `body`: probe the stream's rate,
    then read the rest on it, or split the rest if one stream is too slow (probe).
    Bytes go from the socket straight into `buf` (_socket_reader): no copy on the way.
    `on_chunk(offset, piece)` sees the pieces in order as soon as each has landed.
    With `piece` (a paced read, storage/pace.py), no probe and no split: the one stream in
    pieces of that many bytes, so every byte passes `on_chunk`, whose sleeps hold the cap,
    before the next piece is taken from the socket."""
    try:
        readinto = _socket_reader(body)
        if piece is not None:
            read_stream(key, readinto, buf, 0, on_chunk, piece)
            return
        got, split = probe(key, readinto, buf)
        if on_chunk is not None:
            on_chunk(0, buf[:got])
        if split:
            split_rest(store, key, readinto, buf, got, etag, on_chunk)
        else:
            read_stream(key, readinto, buf, got, on_chunk)
    finally:
        body.close()


def read_whole(store, key: str, body, total: int, etag: str) -> bytearray:
    """The whole object, read straight into one buffer that is then handed over as it is:
    as few copies as a plain `get_object()["Body"].read()`, which is one."""
    buf = bytearray(total)
    stream_into(store, key, body, memoryview(buf), etag)
    return buf


def get_into(store, key: str, etag: str, buf: memoryview, byte_range: tuple[int, int]) -> None:
    """One ranged GET (If-Match `etag`) streamed into buf[first:last + 1]."""
    from botocore.exceptions import ClientError

    first, last = byte_range
    try:
        response = store.client.get_object(Bucket=store.bucket, Key=store.full_key(key),
                                           IfMatch=etag, Range=f"bytes={first}-{last}")
    except ClientError as exc:
        if http_status(exc) == 412:
            raise StorageError(f"{key}: replaced while being read from {store.uri}") from None
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


# --- writes ------------------------------------------------------------------------------------

def put_multipart(store, key: str, data: bytes, conditions: dict) -> str:
    """A multipart upload with parts sent in parallel; `conditions` go on the Complete
    request, the moment the object becomes visible. Aborted on any failure."""
    full = store.full_key(key)
    upload_id = store.client.create_multipart_upload(Bucket=store.bucket, Key=full)["UploadId"]
    try:
        ranges = _split(0, len(data))
        send = lambda n: upload_part(store, full, upload_id, n + 1, data, ranges[n])  # noqa: E731
        with ThreadPoolExecutor(min(CONCURRENCY, len(ranges))) as pool:
            parts = list(pool.map(send, range(len(ranges))))
        response = store.client.complete_multipart_upload(
            Bucket=store.bucket, Key=full, UploadId=upload_id,
            MultipartUpload={"Parts": parts}, **conditions)
    except BaseException:
        abort_upload(store, full, upload_id)
        raise
    return response["ETag"]


def upload_part(store, full: str, upload_id: str, number: int, data: bytes,
                byte_range: tuple[int, int]) -> dict:
    """Upload one part; its {PartNumber, ETag} for CompleteMultipartUpload."""
    first, last = byte_range
    response = store.client.upload_part(Bucket=store.bucket, Key=full, UploadId=upload_id,
                                        PartNumber=number, Body=data[first:last + 1])
    return {"PartNumber": number, "ETag": response["ETag"]}


def abort_upload(store, full: str, upload_id: str) -> None:
    """Drop an unfinished multipart upload; a failure here must not hide the real one."""
    with contextlib.suppress(Exception):
        store.client.abort_multipart_upload(Bucket=store.bucket, Key=full, UploadId=upload_id)


class PartSink:
    """The file-like `S3Storage.create_from` hands to its writer: bytes accumulate into a
    PART_SIZE buffer; each full buffer becomes one part of a multipart upload, uploaded by a
    pool while the writer goes on."""

    def __init__(self, store, full_key: str, single: bool = False):
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
            abort_upload(self.store, self.full_key, self.upload_id)
            self.upload_id = None
