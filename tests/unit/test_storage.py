
import os

import pytest

from helpers.storage_contract import check_bounded_listing_and_one_level
from volunteer_rl.storage.base import (
    LocalStorage,
    NotFound,
    Retrying,
    StorageError,
    TooLarge,
    open_storage,
)


def test_local_write_read_list_delete(tmp_path):
    s = open_storage(str(tmp_path / "b"))
    s.write("a/b/c.txt", b"hello")
    s.write("a/d.txt", b"x")
    assert s.read("a/b/c.txt") == b"hello"
    assert s.size("a/b/c.txt") == 5
    assert s.list("a") == ["a/b/c.txt", "a/d.txt"]
    assert s.list("nothing/here") == []
    s.delete("a/d.txt")
    assert not s.exists("a/d.txt")
    with pytest.raises(NotFound, match="a/d.txt"):
        s.read("a/d.txt")


def test_local_write_is_atomic_and_hides_temp_files(tmp_path):
    s = LocalStorage(tmp_path)
    s.write("k.bin", b"old")
    # A temp file of an interrupted writer must never be listed or read as an object.
    (tmp_path / ".k.bin.tmp-1234").write_bytes(b"half")
    s.write("k.bin", b"new")
    assert s.read("k.bin") == b"new"
    assert s.list("") == ["k.bin"]


def test_read_cap(tmp_path):
    s = open_storage(str(tmp_path))
    s.write("big", b"x" * 100)
    assert s.read("big", max_bytes=100) == b"x" * 100
    with pytest.raises(TooLarge, match="big"):
        s.read("big", max_bytes=99)


def test_key_cannot_escape_folder(tmp_path):
    s = LocalStorage(tmp_path / "b")
    with pytest.raises(StorageError, match="escapes"):
        s.write("../outside", b"x")


def test_memory_backend_round_trip():
    s = open_storage("memory://vrl-test-bucket/pre")
    s.write("x/y.json", b"{}")
    assert s.read("x/y.json") == b"{}"
    assert s.list("x") == ["x/y.json"]
    with pytest.raises(TooLarge):
        s.read("x/y.json", max_bytes=1)
    s.delete("x/y.json")
    with pytest.raises(NotFound):
        s.read("x/y.json")


def test_file_uri_and_bad_scheme(tmp_path):
    s = open_storage(f"file://{tmp_path}")
    s.write("k", b"1")
    assert (tmp_path / "k").read_bytes() == b"1"
    with pytest.raises(StorageError, match="unsupported scheme"):
        open_storage("ftp://x")


class Flaky:
    uri = "flaky://"

    def __init__(self, failures, exc):
        self.failures, self.exc, self.calls = failures, exc, 0

    def read(self, key, max_bytes=None):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc
        return b"ok"


def test_retry_recovers_from_transient_errors():
    inner = Flaky(2, ConnectionError("connection reset"))
    r = Retrying(inner, attempts=3, sleep=lambda s: None)
    assert r.read("k") == b"ok"
    assert inner.calls == 3


def test_retry_gives_up_with_the_object_name():
    inner = Flaky(10, TimeoutError("read timed out"))
    r = Retrying(inner, attempts=3, sleep=lambda s: None)
    with pytest.raises(StorageError, match="rollouts/x: read failed"):
        r.read("rollouts/x")
    assert inner.calls == 3


def test_permanent_errors_are_not_retried():
    inner = Flaky(10, PermissionError("access denied"))
    r = Retrying(inner, attempts=5, sleep=lambda s: None)
    with pytest.raises(StorageError, match="access denied"):
        r.read("manifest.json")
    assert inner.calls == 1


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_create_is_write_once(tmp_path, kind):
    from volunteer_rl.storage.base import AlreadyExists
    s = open_storage(str(tmp_path) if kind == "local" else f"memory://create-{tmp_path.name}")
    s.create("ck/a", b"first")
    with pytest.raises(AlreadyExists, match="ck/a"):
        s.create("ck/a", b"second")
    assert s.read("ck/a") == b"first"
    assert s.list("ck") == ["ck/a"]


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_compare_and_swap_and_conditional_read(tmp_path, kind):
    from volunteer_rl.storage.base import PreconditionFailed
    s = open_storage(str(tmp_path) if kind == "local" else f"memory://cas-{tmp_path.name}")
    e1 = s.write_if_match("manifest.json", b"v1", None)      # None: must not exist yet
    with pytest.raises(PreconditionFailed):
        s.write_if_match("manifest.json", b"v1-again", None)
    data, etag = s.read_if_changed("manifest.json", None)
    assert data == b"v1" and etag == e1
    assert s.read_if_changed("manifest.json", etag) == (None, etag)   # unchanged: no body
    e2 = s.write_if_match("manifest.json", b"v2", e1)
    with pytest.raises(PreconditionFailed):                 # a second trainer with the old etag
        s.write_if_match("manifest.json", b"v2-other", e1)
    assert s.read_if_changed("manifest.json", etag) == (b"v2", e2)
    with pytest.raises(NotFound):
        s.read_if_changed("missing", None)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_streamed_create_and_read_into(tmp_path, kind):
    from volunteer_rl.storage.base import AlreadyExists, ShortObject

    s = open_storage(str(tmp_path / "b") if kind == "local" else "memory://streamed")
    s.create_from("ck/w.bin", lambda f: [f.write(bytes([i]) * 1000) for i in range(5)])
    data = b"".join(bytes([i]) * 1000 for i in range(5))
    assert s.read("ck/w.bin") == data
    with pytest.raises(AlreadyExists):
        s.create_from("ck/w.bin", lambda f: f.write(b"other"))
    assert s.read("ck/w.bin") == data
    buf, seen = bytearray(len(data)), []
    s.read_into("ck/w.bin", memoryview(buf), lambda off, piece: seen.append((off, len(piece))))
    assert bytes(buf) == data and sum(n for _, n in seen) == len(data) and seen[0][0] == 0
    with pytest.raises(TooLarge):
        s.read_into("ck/w.bin", memoryview(bytearray(len(data) - 1)))
    with pytest.raises(ShortObject):
        s.read_into("ck/w.bin", memoryview(bytearray(len(data) + 1)))
    with pytest.raises(NotFound):
        s.read_into("ck/none", memoryview(bytearray(1)))


def test_a_failed_local_streamed_create_leaves_nothing(tmp_path):
    s = LocalStorage(tmp_path)

    def write(f):
        f.write(b"half")
        raise RuntimeError("serializer died")
    with pytest.raises(RuntimeError):
        s.create_from("w.bin", write)
    assert not s.exists("w.bin") and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_bounded_listing_and_one_level(tmp_path, kind):
    check_bounded_listing_and_one_level(
        open_storage(str(tmp_path / "b") if kind == "local" else f"memory://lvl-{tmp_path.name}"))


def test_local_bounded_listing_stops_walking(tmp_path, monkeypatch):
    s = LocalStorage(tmp_path)
    for i in range(20):
        s.write(f"f/{i:02d}/k", b"1")
    (tmp_path / "f" / "00" / ".k.tmp-1").write_bytes(b"half")  # hidden: neither listed nor counted
    (tmp_path / "f" / ".hidden").mkdir()
    (tmp_path / "f" / ".hidden" / "k").write_bytes(b"1")
    read = []
    real = LocalStorage._entries
    monkeypatch.setattr(LocalStorage, "_entries",
                        staticmethod(lambda folder, rel: read.append(rel) or real(folder, rel)))
    assert s.list("f", limit=3) == ["f/00/k", "f/01/k", "f/02/k"]
    assert read == ["f/", "f/00/", "f/01/", "f/02/"]  # the 17 other folders are never opened
    assert s.list_level("f") == [f"f/{i:02d}/" for i in range(20)]


def test_local_listing_of_a_deep_folder_does_not_recurse(tmp_path):
    deep = "/".join(["d"] * 1200)  # deeper than Python's recursion limit
    path = str(tmp_path)
    for _ in range(1200):  # one level at a time: os.makedirs recurses too
        path += "/d"
        os.mkdir(path)
    with open(f"{path}/k", "wb") as f:
        f.write(b"1")
    try:
        s = LocalStorage(tmp_path)
        assert s.list("d") == [f"{deep}/k"] and s.list("d", limit=1) == [f"{deep}/k"]
    finally:  # pytest's own clean-up of old temp folders recurses: it died on this tree once
        os.remove(f"{path}/k")
        for _ in range(1200):
            os.rmdir(path)
            path = os.path.dirname(path)
