"""A hostile S3-compatible endpoint (or a man in the middle on plain http) answering a capped
read with far more than it asked for: the Range ignored, the body 64 MiB of zeros, with an
honest Content-Length or none at all. The read must end with TooLarge after about the cap,
whatever the server sends: the server counts what it got to send before the reader hung up.
Both S3 backends: boto3 (storage/s3.py) and s3fs (VRL_S3_BACKEND=fsspec).
"""
from __future__ import annotations

import threading
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
    """Any GET: 200 with TOTAL zero bytes, made as they are sent (the server holds one chunk)."""

    with_length = True
    sent: list[int] = []
    done = threading.Event()

    def do_GET(self):
        n = 0
        try:
            self.send_response(200)
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
