"""A TCP relay whose every connection is capped at a fixed rate: one internet stream, emulated.

    python -m bench.link --to http://127.0.0.1:PORT --mbps 50 [--shared]

prints the relay's own URL (`http://127.0.0.1:<port>`) on its first line and relays until
killed. Point a client at that URL instead of the server's. With `--shared` the rate is the
whole link's, shared by every connection (one volunteer's home line), not each one's.

Why: on loopback a single TCP stream already moves gigabytes per second, so sending parts in
parallel can only add work. Over the internet one stream is limited by its round-trip time
and window (AWS's S3 guidance reckons on the order of 100 MB/s per connection and tells
clients to open several), and that limit is what parallel parts beat. The cap is the
kernel's own per-socket pacing (SO_MAX_PACING_RATE, honoured by TCP on Linux without any
qdisc), set on both sockets of each relayed connection, so uploads and downloads are capped
per connection while the relay itself only copies bytes. A shared cap is a token bucket per
direction in the relay: each chunk waits for its slot on the link, whichever connection it
belongs to, so parallel connections split the rate instead of multiplying it.
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from urllib.parse import urlparse

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's value
CHUNK = 1 << 20
SHARED_CHUNK = 64 << 10  # 1.3 ms of a 50 MB/s link: the shared cap's granularity


class Link:
    """One direction of a link of `rate` bytes per second that every connection shares."""

    def __init__(self, rate: int):
        self.rate, self.lock, self.free_at = rate, threading.Lock(), time.monotonic()

    def send(self, n: int) -> None:
        """Wait until n more bytes have had their time on the link."""
        with self.lock:
            now = time.monotonic()
            self.free_at = max(self.free_at, now) + n / self.rate
            wait = self.free_at - now
        time.sleep(wait)


def _pace(sock: socket.socket, rate: int) -> None:
    """Cap what `sock` sends at `rate` bytes per second."""
    sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, rate)


def _pump(src: socket.socket, dst: socket.socket, link: Link | None = None) -> None:
    """Copy src → dst until src closes, then half-close dst so the peer sees the end; through
    `link` if given (each chunk waits for its time on the shared link)."""
    buf = bytearray(SHARED_CHUNK if link else CHUNK)
    view = memoryview(buf)
    try:
        while (n := src.recv_into(buf)) > 0:
            if link is not None:
                link.send(n)
            dst.sendall(view[:n])
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _relay(client: socket.socket, target: tuple[str, int], rate: int,
           links: tuple[Link, Link] | None) -> None:
    """Relay one connection both ways, each direction paced (on its own, or through the
    shared `links`: down, up)."""
    down, up = links or (None, None)
    with client, socket.create_connection(target) as upstream:
        if links is None:
            _pace(client, rate)    # server → client: downloads
            _pace(upstream, rate)  # client → server: uploads
        back = threading.Thread(target=_pump, args=(upstream, client, down), daemon=True)
        back.start()
        _pump(client, upstream, up)
        back.join()


def serve(target_url: str, rate: int, port: int = 0, shared: bool = False) -> None:
    """Accept on 127.0.0.1 forever; print the relay URL first."""
    target = urlparse(target_url)
    links = (Link(rate), Link(rate)) if shared else None
    listener = socket.create_server(("127.0.0.1", port))
    print(f"http://127.0.0.1:{listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_relay, args=(client, (target.hostname, target.port), rate, links),
                         daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--to", required=True, help="the server's URL, http://host:port")
    parser.add_argument("--mbps", type=float, required=True,
                        help="cap per connection and direction, in MB/s (10^6 bytes)")
    parser.add_argument("--shared", action="store_true",
                        help="the cap is the whole link's, shared by every connection")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free)")
    args = parser.parse_args(argv)
    serve(args.to, int(args.mbps * 1_000_000), args.port, args.shared)
    return 0


if __name__ == "__main__":
    sys.exit(main())
