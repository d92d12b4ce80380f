"""A hostile S3-compatible endpoint (or a man in the middle on plain http) answering a capped
read with far more than it asked for: the Range ignored, the body 64 MiB of zeros, with an
honest Content-Length or none at all. The read must end with TooLarge after about the cap,
whatever the server sends: the server counts what it got to send before the reader hung up.
Both S3 backends: boto3 (storage/s3.py) and s3fs (VRL_S3_BACKEND=fsspec).
"""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers.vrlproc import FAKE_AWS_CREDENTIALS
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import TooLarge

MiB = 1 << 20
TOTAL = 64 * MiB
CAP = 1 * MiB
CHUNK = 64 << 10


class Flood(BaseHTTPRequestHandler):
    """Any GET: `status` (200) with TOTAL zero bytes, made as they are sent (the server holds one chunk)."""

    with_length = True
    status = 200
    sent: list[int] = []
    begun: list[str] = []
    done = threading.Event()

    def do_GET(self):
        self.begun.append(self.path)
        n = 0
        try:
            self.send_response(self.status)
            self.send_header("ETag", '"flood"')
            self.send_header("Content-Type", "application/octet-stream")
            if self.with_length:
                self.send_header("Content-Length", str(TOTAL))
            self.end_headers()
            zeros = bytes(CHUNK)
            while n < TOTAL:
                self.wfile.write(zeros)
                n += CHUNK
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the reader hung up: what we want
        finally:
            self.sent.append(n)
            self.done.set()
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def flood():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Flood)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Flood.sent, Flood.done = [], threading.Event()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("backend", ["boto3", "fsspec"])
@pytest.mark.parametrize("with_length", [True, False], ids=["content-length", "no-length"])
def test_a_capped_s3_read_stops_at_the_cap_whatever_the_server_sends(flood, monkeypatch, backend,
                                                                     with_length):
    for k, v in FAKE_AWS_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VRL_S3_BACKEND", backend if backend == "fsspec" else "")
    monkeypatch.setattr(Flood, "with_length", with_length)
    s = open_storage("s3://bucket/run", endpoint_url=f"http://127.0.0.1:{flood.server_port}")
    with pytest.raises(TooLarge, match=r"^manifest\.json: larger than the 1048576-byte limit$"):
        s.read("manifest.json", max_bytes=CAP)
    assert Flood.done.wait(60), "the server never saw the reader hang up"
    # What the reader took is the cap and one chunk; the rest of what the server got out is
    # what the kernel's socket buffers held when the connection dropped (a few MiB on
    # loopback). Read whole, all 64 MiB went out.
    assert Flood.sent[0] < TOTAL // 2, f"{Flood.sent[0]} of {TOTAL} bytes sent"


@pytest.mark.parametrize("with_length", [True, False], ids=["content-length", "no-length"])
def test_an_error_answer_is_read_only_up_to_its_bound_on_every_try(flood, monkeypatch, with_length):
    """A manifest poll answered 500 with a 64 MiB body, on every try: botocore read each such
    body whole (a GiB across the tries of one poll). Each try now reads at most
    ERROR_BODY_BYTES of it and hangs up, and the poll ends in one StorageError line."""
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.manifest import MAX_MANIFEST_BYTES
    from volunteer_rl.storage.base import StorageError
    from volunteer_rl.storage.retry import Retrying
    from volunteer_rl.storage.s3 import BOTO_ATTEMPTS, S3Storage

    for k, v in FAKE_AWS_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(Flood, "with_length", with_length)
    monkeypatch.setattr(Flood, "status", 500)
    monkeypatch.setattr(Flood, "begun", [])
    s = Retrying(S3Storage("s3://bucket/run", endpoint_url=f"http://127.0.0.1:{flood.server_port}"),
                 attempts=2, sleep=lambda seconds: None, log=lambda line: None)
    with pytest.raises(StorageError) as e:
        s.read_if_changed(layout.MANIFEST, None, max_bytes=MAX_MANIFEST_BYTES)
    assert str(e.value).startswith("manifest.json: ") and "\n" not in str(e.value)
    deadline = time.monotonic() + 60
    while len(Flood.sent) < len(Flood.begun) and time.monotonic() < deadline:
        time.sleep(0.05)  # the server notices each hang-up when its next write fails
    assert len(Flood.sent) == len(Flood.begun) >= 2 * BOTO_ATTEMPTS, Flood.sent  # botocore's tries, twice
    # What each try took is the bound; the rest of what went out is what the kernel's socket
    # buffers held when the connection dropped. Read whole, each try sent all 64 MiB.
    assert max(Flood.sent) < TOTAL // 2, f"{Flood.sent} bytes sent of {TOTAL} per try"
