"""The storage contract: what every backend must do, as plain check functions.

Each check takes `make`, a factory that returns a fresh, empty store of the backend under
test, and makes one store with it; the checks of refusals also take `deny`, which gives a
context manager inside which the backend refuses to read that store's objects (what a bucket
policy or EACCES does). tests/integration/test_storage_contract.py runs every check on every
backend; the test files of each backend keep only what is that backend's own.

Also here: moto's S3 server for the S3 tests (moto_s3, empty_bucket), and FailFirst, a store
that fails with Transient before it lets calls through.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, ContextManager, Iterator

import pytest

from helpers.recording_storage import RecordingStorage
from helpers.vrlproc import FAKE_AWS_CREDENTIALS, load_infra
from volunteer_rl.storage.base import (
    AlreadyExists,
    Forbidden,
    NotFound,
    PreconditionFailed,
    ShortObject,
    Storage,
    TooLarge,
    Transient,
    is_missing,
)
from volunteer_rl.storage.retry import Retrying

Make = Callable[[], Storage]
Deny = Callable[[Storage], ContextManager[None]]

LISTED = ["r/a.txt", "r/b.txt", "r/b/c", "r/b/d/e", "r/b0", "r/c/x"]
"""Keys whose sorted order is not a naive folder walk's: "r/b.txt" sorts before "r/b/c"."""

STREAMED = b"".join(bytes([i]) * 1000 for i in range(5))
"""What `_write_in_pieces` writes: five 1000-byte pieces."""


def _write_in_pieces(f) -> None:
    for i in range(5):
        f.write(bytes([i]) * 1000)


def _one_line_naming(exc: BaseException, key: str) -> None:
    assert key in str(exc) and "\n" not in str(exc), str(exc)


# --- reads, writes, deletes ----------------------------------------------------------------

def check_write_read_size_exists_delete(make: Make) -> None:
    """A written object reads back, has its size, exists; a write replaces it; a deleted
    one is gone from reads, `exists` and listings."""
    s = make()
    s.write("a/b/c.txt", b"hello")
    s.write("a/d.txt", b"x")
    assert s.read("a/b/c.txt") == b"hello"
    assert s.size("a/b/c.txt") == 5
    assert s.exists("a/b/c.txt") and not s.exists("a/b/nope")
    assert s.list("a") == ["a/b/c.txt", "a/d.txt"]
    s.write("a/b/c.txt", b"replaced")
    assert s.read("a/b/c.txt") == b"replaced"
    s.delete("a/d.txt")
    assert not s.exists("a/d.txt")
    assert s.list("a") == ["a/b/c.txt"]
    with pytest.raises(NotFound, match="a/d.txt"):
        s.read("a/d.txt")
    s.delete("a/b/c.txt")
    assert not s.exists("a/b/c.txt")


def check_delete_many_removes_a_batch_and_skips_missing_keys(make: Make) -> None:
    """`delete_many` removes every named object, in batches past S3's 1,000 keys per request,
    counts an object already gone as deleted, and leaves every other object alone."""
    s = make()
    keys = [f"d/v/{i:04d}" for i in range(1003)]
    for key in keys:
        s.write(key, b"x")
    s.write("d/keep", b"k")
    s.write("d/v0/other", b"k")
    assert s.delete_many(keys[:1] + ["d/missing", "nothing/at/all"]) == []
    assert s.list("d/v", limit=2) == [keys[1], keys[2]]
    assert s.delete_many(keys[1:]) == []
    assert s.list("d") == ["d/keep", "d/v0/other"]
    assert s.delete_many([]) == [] and s.delete_many(keys[:5]) == []
    assert s.read("d/keep") == b"k"


def check_missing_objects_are_not_found(make: Make) -> None:
    """Every way of touching a missing object raises NotFound, one line naming the key, and
    is_missing says so; `exists` says False."""
    s = make()
    calls = {
        "read": lambda: s.read("x/missing"),
        "size": lambda: s.size("x/missing"),
        "read_into": lambda: s.read_into("x/missing", memoryview(bytearray(1))),
        "read_if_changed": lambda: s.read_if_changed("x/missing", None),
        "delete": lambda: s.delete("x/missing"),
    }
    for name, call in calls.items():
        with pytest.raises(NotFound, match="x/missing") as caught:
            call()
        _one_line_naming(caught.value, "x/missing")
        assert is_missing(caught.value), name
    assert not s.exists("x/missing")


# --- conditional writes --------------------------------------------------------------------

def check_create_is_write_once(make: Make) -> None:
    """A second create of a key, plain or streamed, raises AlreadyExists and leaves the first
    object as it was."""
    s = make()
    s.create("ck/a", b"first")
    with pytest.raises(AlreadyExists, match="ck/a"):
        s.create("ck/a", b"second")
    assert s.read("ck/a") == b"first"
    assert s.list("ck") == ["ck/a"]
    s.create_from("ck/w.bin", _write_in_pieces)
    assert s.read("ck/w.bin") == STREAMED
    with pytest.raises(AlreadyExists, match="ck/w.bin"):
        s.create_from("ck/w.bin", lambda f: f.write(b"other"))
    with pytest.raises(AlreadyExists, match="ck/w.bin"):
        s.create("ck/w.bin", b"other")
    assert s.read("ck/w.bin") == STREAMED
    assert s.list("ck") == ["ck/a", "ck/w.bin"]


def check_compare_and_swap(make: Make) -> None:
    """write_if_match replaces only the version its etag names (None: only a missing key);
    a stale etag, or an etag of an object since deleted, raises PreconditionFailed."""
    s = make()
    e1 = s.write_if_match("manifest.json", b"v1", None)      # None: must not exist yet
    with pytest.raises(PreconditionFailed, match="manifest.json"):
        s.write_if_match("manifest.json", b"v1-again", None)
    assert s.read("manifest.json") == b"v1"
    e2 = s.write_if_match("manifest.json", b"v2", e1)
    assert e2 != e1
    with pytest.raises(PreconditionFailed):                 # a second trainer with the old etag
        s.write_if_match("manifest.json", b"v2-other", e1)
    assert s.read("manifest.json") == b"v2"
    with pytest.raises(PreconditionFailed):                 # the object is gone
        s.write_if_match("gone.json", b"x", e1)
    assert not s.exists("gone.json")


def check_read_if_changed(make: Make) -> None:
    """read_if_changed answers (None, etag) while the object is the version `etag` names, and
    (data, new etag) once it changed, the etag being the one write_if_match returned; the
    byte cap holds; a missing object is NotFound."""
    s = make()
    e1 = s.write_if_match("manifest.json", b"v1", None)
    data, etag = s.read_if_changed("manifest.json", None)
    assert data == b"v1" and etag == e1
    assert s.read_if_changed("manifest.json", etag) == (None, etag)   # unchanged: no body
    e2 = s.write_if_match("manifest.json", b"v2", e1)
    assert s.read_if_changed("manifest.json", etag) == (b"v2", e2)
    with pytest.raises(NotFound, match="missing"):
        s.read_if_changed("missing", None)
    s.write("big.json", b"x" * 100)
    with pytest.raises(TooLarge, match="big.json"):
        s.read_if_changed("big.json", None, max_bytes=10)


# --- capped and streamed reads -------------------------------------------------------------

def check_capped_reads(make: Make) -> None:
    """`read` returns at most max_bytes (TooLarge past it), empty objects included."""
    s = make()
    s.write("big", b"x" * 100)
    assert s.read("big", max_bytes=100) == b"x" * 100
    with pytest.raises(TooLarge, match="big"):
        s.read("big", max_bytes=99)
    s.write("empty", b"")
    assert s.read("empty") == b"" and s.size("empty") == 0
    assert s.read("empty", max_bytes=0) == b""


def check_streamed_create_and_read_into(make: Make) -> None:
    """create_from writes what its writer hands over; read_into fills a buffer of exactly
    the object's size, telling on_chunk of every piece from offset 0 (with `piece`, of
    pieces of at most that many bytes, in order: what a bandwidth cap paces); a smaller
    buffer is TooLarge, a larger one ShortObject, a missing object NotFound."""
    s = make()
    s.create_from("ck/w.bin", _write_in_pieces)
    buf, seen = bytearray(len(STREAMED)), []
    s.read_into("ck/w.bin", memoryview(buf), lambda off, piece: seen.append((off, len(piece))))
    assert bytes(buf) == STREAMED and sum(n for _, n in seen) == len(STREAMED) and seen[0][0] == 0
    buf, seen = bytearray(len(STREAMED)), []
    s.read_into("ck/w.bin", memoryview(buf), lambda off, piece: seen.append((off, len(piece))),
                piece=700)
    assert bytes(buf) == STREAMED and max(n for _, n in seen) <= 700
    assert [off for off, _ in seen] == [sum(n for _, n in seen[:i]) for i in range(len(seen))]
    assert sum(n for _, n in seen) == len(STREAMED)
    with pytest.raises(TooLarge, match="ck/w.bin"):
        s.read_into("ck/w.bin", memoryview(bytearray(len(STREAMED) - 1)))
    with pytest.raises(ShortObject, match="ck/w.bin"):
        s.read_into("ck/w.bin", memoryview(bytearray(len(STREAMED) + 1)))
    with pytest.raises(NotFound):
        s.read_into("ck/none", memoryview(bytearray(1)))


# --- listings ------------------------------------------------------------------------------

def check_listing_is_recursive_relative_sorted_under_the_prefix(make: Make) -> None:
    """`list(prefix)` names every key under `prefix/`, at any depth, relative to the bucket,
    sorted; "r" does not list "rr/..."; "" lists everything."""
    s = make()
    for key in ("r/v000001/vol/b.gz", "r/v000001/vol/a.gz", "r/v000002/x.gz", "rr/other", "top"):
        s.write(key, b"1")
    assert s.list("r") == ["r/v000001/vol/a.gz", "r/v000001/vol/b.gz", "r/v000002/x.gz"]
    assert s.list("r/v000001") == ["r/v000001/vol/a.gz", "r/v000001/vol/b.gz"]
    assert s.list("nothing/here") == []
    assert s.list("") == sorted(["r/v000001/vol/b.gz", "r/v000001/vol/a.gz",
                                 "r/v000002/x.gz", "rr/other", "top"])


def check_bounded_listing_and_one_level(make: Make) -> None:
    """`list` with and without a limit returns the first keys in sorted order; `list_level`
    names a prefix's objects and folders one level down."""
    store = make()
    for key in reversed(LISTED + ["rr/other", "top"]):
        store.write(key, b"1")
    assert store.list("r") == LISTED
    for limit in range(len(LISTED) + 2):
        assert store.list("r", limit=limit) == LISTED[:limit]
    assert store.list("nothing", limit=3) == []
    assert store.list_level("r") == ["r/a.txt", "r/b.txt", "r/b/", "r/b0", "r/c/"]
    assert store.list_level("r/b") == ["r/b/c", "r/b/d/"]
    assert store.list_level("") == ["r/", "rr/", "top"]
    assert store.list_level("nothing/here") == [] and store.list_level("top") == []


# --- refusals and retries ------------------------------------------------------------------

def check_refused_reads_are_forbidden(make: Make, deny: Deny) -> None:
    """A read the bucket refuses raises Forbidden, one line naming the key, for an object
    that exists and for one that does not (to a reader that may not list, S3 answers 403
    for both); is_missing counts it as missing. Refusal over, the object reads again."""
    s = make()
    s.write("manifest.json", b"{}")
    with deny(s):
        for key in ("manifest.json", "never/written"):
            for call in (lambda: s.read(key), lambda: s.read(key, max_bytes=10),
                         lambda: s.read_into(key, memoryview(bytearray(2))),
                         lambda: s.read_if_changed(key, None)):
                with pytest.raises(Forbidden, match="access denied") as caught:
                    call()
                _one_line_naming(caught.value, key)
                assert is_missing(caught.value)
    assert s.read("manifest.json") == b"{}"


class FailFirst:
    """A real store whose first `failures` calls raise Transient (one line naming the key, as
    a backend's would), then go through; `calls` counts the calls by method."""

    def __init__(self, inner: Storage, failures: int):
        self.inner, self.uri, self.failures, self.calls = inner, inner.uri, failures, Counter()

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def failing(key, *args, **kwargs):
            self.calls[name] += 1
            if sum(self.calls.values()) <= self.failures:
                raise Transient(f"{key}: {name} failed in {self.uri}: connection reset (injected)")
            return fn(key, *args, **kwargs)
        return failing


def check_retrying_retries_transient_failures_only(make: Make, deny: Deny) -> None:
    """Retrying tries a Transient failure again until it succeeds, gives up after its
    attempts with the object named, and raises every other storage error at once."""
    s = make()
    s.write("rollouts/x", b"data")
    sleeps: list[float] = []
    flaky = FailFirst(s, failures=2)
    assert Retrying(flaky, attempts=3, sleep=sleeps.append).read("rollouts/x") == b"data"
    assert flaky.calls["read"] == 3 and len(sleeps) == 2

    down = FailFirst(s, failures=10)
    with pytest.raises(Transient, match="rollouts/x: read failed") as caught:
        Retrying(down, attempts=3, sleep=sleeps.append).read("rollouts/x")
    assert "gave up after 3 tries" in str(caught.value)
    _one_line_naming(caught.value, "rollouts/x")
    assert down.calls["read"] == 3

    recorded = RecordingStorage(s)
    retrying = Retrying(recorded, attempts=5, sleep=sleeps.append)
    with pytest.raises(NotFound, match="rollouts/none"):
        retrying.read("rollouts/none")
    with pytest.raises(TooLarge, match="rollouts/x"):
        retrying.read("rollouts/x", max_bytes=1)
    with deny(s), pytest.raises(Forbidden, match="access denied"):
        retrying.read("rollouts/x")
    with pytest.raises(AlreadyExists, match="rollouts/x"):
        retrying.create("rollouts/x", b"other")
    assert recorded.calls["read"] == 3 and recorded.calls["create"] == 1
    assert len(sleeps) == 4  # only the Transient failures above were slept on


# --- moto's S3 server ----------------------------------------------------------------------

s3_server = load_infra("s3_server")


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3 server over HTTP on 127.0.0.1, with fake credentials in the environment
    while it runs; yields its endpoint URL."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in FAKE_AWS_CREDENTIALS.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        server, url = s3_server.start_s3_server()
        try:
            yield url
        finally:
            server.stop()


def empty_bucket(endpoint: str, bucket: str):
    """A plain boto3 client on a fresh, empty `bucket` (the server's state is reset first)."""
    import boto3
    from botocore.config import Config

    s3_server.reset(endpoint)
    client = boto3.client("s3", endpoint_url=endpoint,
                          config=Config(s3={"addressing_style": "path"}))
    client.create_bucket(Bucket=bucket)
    return client


@contextlib.contextmanager
def iam_denies_everything(endpoint: str) -> Iterator[None]:
    """moto enforces IAM, with no IAM user whose keys the stores hold: every request is
    refused with 403, as a bucket policy refuses a reader."""
    s3_server.enable_iam_auth(endpoint)
    try:
        yield
    finally:
        s3_server.disable_iam_auth(endpoint)
