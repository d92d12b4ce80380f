
"""What is each backend's own (the folder's atomic writes and walks), open_storage, and how
failures are classified; the contract every backend keeps is in
tests/integration/test_storage_contract.py."""
import errno
import os
import subprocess
import sys
from unittest import mock

import pytest

from volunteer_rl.storage import local, open_storage
from volunteer_rl.storage.base import (
    Forbidden,
    NotFound,
    ShortObject,
    StorageError,
    TooLarge,
    Transient,
    is_missing,
    is_transient_os_error,
)
from volunteer_rl.storage.fsspec import FsspecStorage
from volunteer_rl.storage.local import LocalStorage
from volunteer_rl.storage.retry import Retrying


def test_local_write_is_atomic_and_hides_temp_files(tmp_path):
    s = LocalStorage(tmp_path)
    s.write("k.bin", b"old")
    # A temp file of an interrupted writer must never be listed or read as an object.
    (tmp_path / ".k.bin.tmp-1234").write_bytes(b"half")
    s.write("k.bin", b"new")
    assert s.read("k.bin") == b"new"
    assert s.list("") == ["k.bin"]


def test_key_cannot_escape_folder(tmp_path):
    s = LocalStorage(tmp_path / "b")
    with pytest.raises(StorageError, match="escapes"):
        s.write("../outside", b"x")


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


def test_permanent_errors_are_not_retried():
    """An exception no backend classified (a bare PermissionError here) is not retried: it is
    raised once, as a StorageError naming the object."""
    inner = Flaky(10, PermissionError("access denied"))
    r = Retrying(inner, attempts=5, sleep=lambda s: None)
    with pytest.raises(StorageError, match="access denied") as caught:
        r.read("manifest.json")
    assert inner.calls == 1
    assert str(caught.value).startswith("manifest.json: read failed in flaky://")


def test_is_missing_means_not_found_or_forbidden():
    assert is_missing(NotFound("k: not found"))
    assert is_missing(Forbidden("k: access denied (read)"))  # 403: missing, to a non-lister
    for exc in (Transient("k: read failed: timed out"), TooLarge("k: larger than the limit"),
                ShortObject("k: 1 bytes"), StorageError("k: read failed"),
                PermissionError("access denied")):
        assert not is_missing(exc), exc


def test_which_os_errors_are_transient():
    for exc in (TimeoutError("timed out"), ConnectionResetError("reset by peer"),
                ConnectionRefusedError("refused"),
                OSError(errno.EAGAIN, "Resource temporarily unavailable"),
                OSError(errno.EBUSY, "Please reduce your request rate."),  # s3fs: 503, SlowDown
                OSError(errno.EREMOTEIO, "We encountered an internal error")):  # s3fs: 500
        assert is_transient_os_error(exc), exc
    for exc in (FileNotFoundError("k"), PermissionError("k"), OSError(errno.ENOSPC, "full"),
                OSError(errno.EINVAL, "Invalid range"), ValueError("k")):
        assert not is_transient_os_error(exc), exc


@pytest.mark.parametrize("error, kind", [
    (OSError(errno.EACCES, "Permission denied"), Forbidden),
    (OSError(errno.ETIMEDOUT, "Connection timed out"), Transient),  # a share that stopped answering
    (OSError(errno.EAGAIN, "Resource temporarily unavailable"), Transient),
])
def test_local_os_errors_become_forbidden_or_transient(tmp_path, monkeypatch, error, kind):
    s = LocalStorage(tmp_path)
    s.write("k", b"1")
    monkeypatch.setattr(local, "open", mock.Mock(side_effect=error), raising=False)
    with pytest.raises(kind, match=f"^k: .* in {tmp_path}") as caught:
        s.read("k")
    assert caught.value.__cause__ is error and "\n" not in str(caught.value)


def test_an_unclassified_local_failure_is_reported_once(tmp_path, monkeypatch):
    s, opened = LocalStorage(tmp_path), []

    def disk_full(tmp):
        opened.append(tmp)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(LocalStorage, "_open_new", staticmethod(disk_full))
    with pytest.raises(OSError) as caught:
        s.write("k", b"1")
    assert not isinstance(caught.value, StorageError)
    with pytest.raises(StorageError, match="k: write failed in .*No space left on device"):
        Retrying(s, sleep=lambda t: None).write("k", b"1")
    assert len(opened) == 2


def test_a_busy_file_system_is_transient_and_retried(monkeypatch):
    s = FsspecStorage("memory://busy/pre")
    s.write("k", b"data")
    real, calls = s.fs.cat_file, []

    def busy(*args, **kwargs):
        calls.append(args)
        if len(calls) <= 2:
            raise OSError(errno.EBUSY, "Please reduce your request rate.")
        return real(*args, **kwargs)
    monkeypatch.setattr(s.fs, "cat_file", busy)
    with pytest.raises(Transient, match="k: read failed in memory://busy/pre: .*request rate"):
        s.read("k")
    assert Retrying(s, sleep=lambda t: None).read("k") == b"data" and len(calls) == 3


def test_a_folder_bucket_loads_no_remote_backend(tmp_path):
    code = ("import sys; from volunteer_rl.storage import open_storage; "
            f"open_storage({str(tmp_path)!r}).write('k', b'1'); "
            "loaded = {'fsspec', 's3fs', 'boto3', 'botocore'} & set(sys.modules); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_failed_local_streamed_create_leaves_nothing(tmp_path):
    s = LocalStorage(tmp_path)

    def write(f):
        f.write(b"half")
        raise RuntimeError("serializer died")
    with pytest.raises(RuntimeError):
        s.create_from("w.bin", write)
    assert not s.exists("w.bin") and list(tmp_path.iterdir()) == []


def test_a_big_local_write_goes_to_the_disk_as_it_is_written(tmp_path, monkeypatch):
    """The folder backend starts the disk writing every WRITEBACK_BYTES of a big object
    (sync_file_range) instead of leaving it all to the final fsync: the ranges handed over
    follow each other from byte 0, only bytes already flushed, and the object is exact."""
    real = local._START_WRITEBACK
    if sys.platform.startswith("linux"):
        assert real is not None  # glibc and musl both have it
    started = []

    def record(fd, offset, length, flags):
        assert os.fstat(fd).st_size >= offset + length  # flushed before it is handed over
        started.append((offset, length))
        return real(fd, offset, length, flags) if real is not None else 0
    monkeypatch.setattr(local, "_START_WRITEBACK", record)
    pieces = [os.urandom(n) for n in (5 << 20, 1, 20 << 20, 3, 17 << 20, 100)]

    def write(f):
        for p in pieces:
            f.write(p)
    LocalStorage(tmp_path).create_from("big.bin", write)
    assert (tmp_path / "big.bin").read_bytes() == b"".join(pieces)
    assert started and started[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(started, started[1:]))
    assert all(n >= local.WRITEBACK_BYTES for _, n in started)


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


def _within(seconds: float, call):
    """call() on a thread: its result or exception, or "hung" if it has not returned in
    `seconds` (a safety net so a blocking read fails the test instead of hanging it)."""
    import threading

    out: list = ["hung"]

    def run():
        try:
            out[0] = call()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            out[0] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return out[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_local_a_fifo_is_no_object(tmp_path):
    """A FIFO where an object should be used to block the reader forever (open() waits for a
    writer, past SIGINT). Every read is NotFound at once; listings and exists() skip it."""
    s = LocalStorage(tmp_path)
    s.write("checkpoints/v000002/model.patch.ok", b"x")
    fifo = tmp_path / "checkpoints" / "v000002" / "model.patch"
    os.mkfifo(fifo)
    try:
        for call in (lambda: s.read("checkpoints/v000002/model.patch"),
                     lambda: s.read("checkpoints/v000002/model.patch", max_bytes=10),
                     lambda: s.read_into("checkpoints/v000002/model.patch", memoryview(bytearray(4))),
                     lambda: s.read_if_changed("checkpoints/v000002/model.patch", None, 10),
                     lambda: s.size("checkpoints/v000002/model.patch")):
            got = _within(10, call)
            assert isinstance(got, NotFound) and "model.patch: " in str(got), got
        assert s.list("checkpoints/") == ["checkpoints/v000002/model.patch.ok"]
        assert s.list_level("checkpoints/v000002/") == ["checkpoints/v000002/model.patch.ok"]
        assert not s.exists("checkpoints/v000002/model.patch")
    finally:  # release a reader the old code left blocked in open()
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting: nothing to release
            pass


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_local_a_device_or_folder_is_no_object(tmp_path):
    """/dev/zero never ends (a read without a cap used to fill the memory) and a folder
    holds no bytes: NotFound, never read."""
    s = LocalStorage("/dev")
    for call in (lambda: s.read("zero", max_bytes=16), lambda: s.size("zero"),
                 lambda: s.read_into("zero", memoryview(bytearray(16)))):
        with pytest.raises(NotFound, match="^zero: is not a regular file in /dev$"):
            call()
    (tmp_path / "d").mkdir()
    with pytest.raises(NotFound, match="^d: is a folder in "):
        LocalStorage(tmp_path).read("d", max_bytes=16)
