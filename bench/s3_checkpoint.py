"""Publish and fetch a checkpoint-sized object through S3Storage, next to plain boto3.

    python -m bench.s3_checkpoint [--mb 256] [--repeat 2] [--stream-mbps 50]

Starts moto's S3 server (infra/s3_server.py) in its own process on 127.0.0.1, so server and
client do not share one GIL, then measures two links to it:

- `loopback`: straight to the server. One TCP stream moves GB/s here, so this shows what
  the parallel path costs the server (moto copies the whole object for each ranged GET and
  again when it completes a multipart upload).
- `capped`: through bench/link.py, which caps every connection at --stream-mbps like one
  stream over the internet. This is the case the parallel path is built for.

For each link and repeat, on an emptied bucket:

- S3Storage.create of `checkpoints/v000001/model.safetensors` (multipart, parallel parts,
  If-None-Match on Complete) and S3Storage.read of it (parallel ranged GETs), sha256-checked;
- one plain boto3 put_object and one get_object of the same bytes on the same client.

Prints MB/s of each and, for the best round, the ratio S3Storage / plain for upload and
download.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from volunteer_rl import s3
from volunteer_rl.s3 import S3Storage

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "vrl-bench"
KEY = "checkpoints/v000001/model.safetensors"
MB = 1_000_000


def start(args: list[str], what: str) -> tuple[subprocess.Popen, str]:
    """A child process that prints its URL first; returns it and the URL."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = proc.stdout.readline().strip()
    if not url.startswith("http"):
        proc.kill()
        raise SystemExit(f"{what} did not start")
    return proc, url


def reset_bucket(store: S3Storage, endpoint: str) -> None:
    """Forget every object (moto keeps them in memory), then make the bucket again."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    opener.open(urllib.request.Request(f"{endpoint}/moto-api/reset", data=b"", method="POST")).read()
    store.client.create_bucket(Bucket=BUCKET)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def one_round(store: S3Storage, data: bytes, digest: str) -> dict[str, float]:
    """Seconds for each of the four transfers of `data`."""
    client, plain_key = store.client, f"{store.root}/plain/model.safetensors"
    up, _ = timed(lambda: store.create(KEY, data))
    down, back = timed(lambda: store.read(KEY))
    if hashlib.sha256(back).hexdigest() != digest:
        raise SystemExit(f"{KEY}: sha256 mismatch after the round trip")
    del back
    plain_up, _ = timed(lambda: client.put_object(Bucket=BUCKET, Key=plain_key, Body=data))
    plain_down, back = timed(
        lambda: client.get_object(Bucket=BUCKET, Key=plain_key)["Body"].read())
    if hashlib.sha256(back).hexdigest() != digest:
        raise SystemExit("plain get_object: sha256 mismatch after the round trip")
    return {"up": up, "down": down, "plain_up": plain_up, "plain_down": plain_down}


def report(link: str, size: int, rounds: list[dict[str, float]]) -> None:
    """MB/s of every round, then the best of each and the ratios."""
    rate = lambda seconds: size / MB / seconds  # noqa: E731
    for n, r in enumerate(rounds, 1):
        print(f"{link} round {n}: " + ", ".join(f"{k} {rate(v):6.1f} MB/s" for k, v in r.items()))
    best = {k: rate(min(r[k] for r in rounds)) for k in rounds[0]}
    print(f"{link}   upload: S3Storage.create {best['up']:7.1f} MB/s, put_object "
          f"{best['plain_up']:7.1f} MB/s, ratio {best['up'] / best['plain_up']:.2f}")
    print(f"{link} download: S3Storage.read   {best['down']:7.1f} MB/s, get_object "
          f"{best['plain_down']:7.1f} MB/s, ratio {best['down'] / best['plain_down']:.2f}",
          flush=True)


def measure(link: str, url: str, server: str, data: bytes, digest: str, repeat: int) -> None:
    """`repeat` rounds through `url` (the server itself, or the relay in front of it)."""
    store = S3Storage(f"s3://{BUCKET}/bench", endpoint_url=url)
    rounds = []
    for _ in range(repeat):
        reset_bucket(store, server)
        rounds.append(one_round(store, data, digest))
    report(link, len(data), rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="object size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds per link (default 2)")
    parser.add_argument("--stream-mbps", type=float, default=50.0,
                        help="cap per connection on the capped link, MB/s (default 50)")
    args = parser.parse_args(argv)

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "testing"  # moto accepts any key; never send real ones to it
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    data = os.urandom(args.mb * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    server, endpoint = start([str(ROOT / "infra" / "s3_server.py")], "the moto server")
    relay, relayed = start(["-m", "bench.link", "--to", endpoint,
                            "--mbps", str(args.stream_mbps)], "the capped link")
    try:
        print(f"moto server {endpoint} (own process); {len(data) / MB:.0f} MB object; "
              f"parts of {s3.MIN_PART // 2**20}-{s3.PART_SIZE // 2**20} MiB from "
              f"{s3.MULTIPART_THRESHOLD // 2**20} MiB on, {s3.CONCURRENCY} at a time; "
              f"capped link {args.stream_mbps:g} MB/s per connection", flush=True)
        measure("loopback", endpoint, endpoint, data, digest, args.repeat)
        measure("capped  ", relayed, endpoint, data, digest, args.repeat)
    finally:
        for proc in (relay, server):
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
