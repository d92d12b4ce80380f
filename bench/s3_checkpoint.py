"""Publish and fetch a checkpoint-sized object through S3Storage, next to plain boto3.

    python -m bench.s3_checkpoint [--mb 256] [--repeat 2]

Starts moto's S3 server (infra/s3_server.py) in its own process on 127.0.0.1, so server and
client do not share one GIL, then for each repeat on an emptied bucket:

- S3Storage.create of `checkpoints/v000001/model.safetensors` (multipart, parallel parts,
  If-None-Match on Complete) and S3Storage.read of it (parallel ranged GETs), sha256-checked;
- one plain boto3 put_object and one get_object of the same bytes on the same client.

Prints MB/s of each and the ratio S3Storage / plain for upload and download. The figures
are those of moto on loopback (it copies the whole object for each ranged GET), not of AWS.
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


def start_server() -> tuple[subprocess.Popen, str]:
    """moto in a child process; returns it and the endpoint URL it prints first."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "infra" / "s3_server.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    endpoint = proc.stdout.readline().strip()
    if not endpoint.startswith("http"):
        proc.kill()
        raise SystemExit("the moto server did not start")
    return proc, endpoint


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


def report(size: int, rounds: list[dict[str, float]]) -> None:
    """MB/s of every round, then the best of each and the ratios."""
    rate = lambda seconds: size / MB / seconds  # noqa: E731
    for n, r in enumerate(rounds, 1):
        print(f"round {n}: " + ", ".join(f"{k} {rate(v):6.1f} MB/s" for k, v in r.items()))
    best = {k: rate(min(r[k] for r in rounds)) for k in rounds[0]}
    print(f"best   upload: S3Storage.create {best['up']:.1f} MB/s, put_object "
          f"{best['plain_up']:.1f} MB/s, ratio {best['up'] / best['plain_up']:.2f}")
    print(f"best download: S3Storage.read {best['down']:.1f} MB/s, get_object "
          f"{best['plain_down']:.1f} MB/s, ratio {best['down'] / best['plain_down']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="object size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds (default 2)")
    args = parser.parse_args(argv)

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "testing"  # moto accepts any key; never send real ones to it
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    data = os.urandom(args.mb * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    server, endpoint = start_server()
    try:
        store = S3Storage(f"s3://{BUCKET}/bench", endpoint_url=endpoint)
        print(f"moto server {endpoint} (own process); {len(data) / MB:.0f} MB object; "
              f"part {s3.PART_SIZE // 2**20} MiB, threshold {s3.MULTIPART_THRESHOLD // 2**20} MiB, "
              f"concurrency {s3.CONCURRENCY}", flush=True)
        rounds = []
        for _ in range(args.repeat):
            reset_bucket(store, endpoint)
            rounds.append(one_round(store, data, digest))
        report(len(data), rounds)
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
