"""A local S3 server for tests and demos: moto's standalone server on 127.0.0.1.

Importable (tests load it by path, it is not part of the installed package)::

    server, endpoint_url = start_s3_server()
    ...                      # boto3 / s3fs / vrl with endpoint_url
    reset(endpoint_url)      # forget every bucket, object and IAM entity
    server.stop()

or run as a script, which prints the endpoint URL and serves until Ctrl-C::

    python infra/s3_server.py [--port 5000]

moto keeps its state in module globals, and the server runs in a thread of the calling
process: every server started in one process shares one state, and switching IAM
enforcement on (enable_iam_auth) also affects moto's in-process mocks in that process.
Switch it off again (disable_iam_auth) when done.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import urllib.request

DEFAULT_HOST = "127.0.0.1"


def start_s3_server(host: str = DEFAULT_HOST, port: int = 0):
    """Start moto's S3 server in a background thread; return (server, endpoint_url).

    port=0 lets the OS pick a free port (no race between picking and binding). Stop the
    server with server.stop().
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    bound_host, bound_port = server.get_host_and_port()
    return server, f"http://{bound_host}:{bound_port}"


def _post(endpoint_url: str, path: str, body: bytes = b"", content_type: str | None = None) -> bytes:
    request = urllib.request.Request(endpoint_url.rstrip("/") + path, data=body, method="POST")
    if content_type:
        request.add_header("Content-Type", content_type)
    # A direct connection: an HTTP(S)_PROXY from the environment must not see loopback calls.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=10) as response:
        return response.read()


def reset(endpoint_url: str) -> None:
    """Forget all state of the server (buckets, objects, IAM users and policies)."""
    _post(endpoint_url, "/moto-api/reset")


def set_auth(endpoint_url: str, initial_no_auth_action_count: float) -> None:
    """Enforce IAM after that many more unauthenticated requests (inf: never enforce).

    Once enforced, only access keys of IAM users created on the server work, and each
    request is checked against that user's policies.
    """
    # moto wants the count as a plain-text body; a form-encoded body gives HTTP 500.
    _post(endpoint_url, "/moto-api/reset-auth", str(initial_no_auth_action_count).encode(), "text/plain")


def enable_iam_auth(endpoint_url: str) -> None:
    """Enforce IAM from the next request on. Create an admin user and its key first."""
    set_auth(endpoint_url, 0)


def disable_iam_auth(endpoint_url: str) -> None:
    """Back to moto's default: any credentials work, no policy is checked."""
    set_auth(endpoint_url, float("inf"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a local S3 (moto) until Ctrl-C.")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    args = parser.parse_args(argv)

    server, endpoint_url = start_s3_server(args.host, args.port)
    print(endpoint_url, flush=True)
    print(
        f"# export VRL_ENDPOINT_URL={endpoint_url} AWS_ACCESS_KEY_ID=testing "
        "AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1",
        file=sys.stderr,
        flush=True,
    )
    # Stop on Ctrl-C and on `kill`; handlers are set explicitly because a shell that starts
    # the script in the background makes it ignore SIGINT.
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
