"""Publish and fetch a checkpoint-sized object through S3Storage, next to plain boto3.

    python -m bench.s3_checkpoint [--mb 256] [--repeat 4] [--stream-mbps 50] [--json PATH]

Starts moto's S3 server (infra/s3_server.py) in its own process on 127.0.0.1, so server and
client do not share one GIL, then measures two links to it:

- `loopback`: straight to the server. One TCP stream moves hundreds of MB/s here, and the
  server (one Python process on the same two cores) is the limit: moto copies the whole
  object for each ranged GET and again when it completes a multipart upload.
- `capped`: through bench/link.py, which caps every connection at --stream-mbps like one
  stream over the internet. This is the case parallel transfers are built for.

For each link and repeat, on an emptied bucket:

- S3Storage.create of `checkpoints/v000001/model.safetensors` (If-None-Match: *; one PUT or
  parallel multipart, as its UploadChoice decides);
- S3Storage.read_into of it into one buffer that every round reuses, as a volunteer reuses
  its weights buffer from one version to the next (vetting.read_verified): one streamed
  GET, read from the socket straight into the buffer, that splits into parallel ranged GETs
  if it is slow; sha256-checked after the clock stops;
- S3Storage.read of it, which returns a new buffer each time (a row with no goal: the cost of
  a fresh buffer is page faults, the same for any reader);
- one plain boto3 put_object and one get_object of the same bytes on the same client.

One S3Storage serves all rounds of a link, as one trainer serves all its publishes: its
first two uploads try multipart and then one PUT, later ones use the faster. The printed
ratios S3Storage / plain come from the best of the rounds after those two.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Row, emit_rows
from volunteer_rl.storage import s3_transfer
from volunteer_rl.storage.s3 import S3Storage

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


def one_round(store: S3Storage, data: bytes, digest: str, reuse: memoryview) -> dict[str, float]:
    """Seconds for each of the five transfers of `data`; which upload method S3Storage chose
    and whether its reads split go into the dict as well."""
    client, plain_key = store.client, f"{store.root}/plain/model.safetensors"
    up, _ = timed(lambda: store.create(KEY, data))
    splits = []
    get_into = store._get_into  # only a split read makes ranged GETs
    store._get_into = lambda *a: (splits.append(1), get_into(*a))[1]
    down, _ = timed(lambda: store.read_into(KEY, reuse))
    if hashlib.sha256(reuse).hexdigest() != digest:
        raise SystemExit(f"{KEY}: sha256 mismatch after the round trip (read_into)")
    fresh, back = timed(lambda: store.read(KEY))
    store._get_into = get_into
    if hashlib.sha256(back).hexdigest() != digest:
        raise SystemExit(f"{KEY}: sha256 mismatch after the round trip (read)")
    del back
    plain_up, _ = timed(lambda: client.put_object(Bucket=BUCKET, Key=plain_key, Body=data))
    plain_down, back = timed(
        lambda: client.get_object(Bucket=BUCKET, Key=plain_key)["Body"].read())
    if hashlib.sha256(back).hexdigest() != digest:
        raise SystemExit("plain get_object: sha256 mismatch after the round trip")
    return {"up": up, "down": down, "fresh": fresh, "plain_up": plain_up, "plain_down": plain_down,
            "method": store.upload_choice.last, "split": bool(splits)}


EXPLORE_ROUNDS = 2
"""S3Storage's first two big uploads on a link try multipart, then one PUT (UploadChoice);
the figures compare the rounds after that, when it uses what it found faster."""


def report(link: str, size: int, rounds: list[dict]) -> dict[str, float]:
    """Print MB/s of every round; return the best MB/s of each transfer over the settled rounds."""
    rate = lambda seconds: size / MB / seconds  # noqa: E731
    for n, r in enumerate(rounds, 1):
        print(f"{link} round {n}: " + ", ".join(f"{k} {rate(r[k]):6.1f} MB/s" for k in TRANSFERS)
              + f" (upload as {r['method']}, read {'split' if r['split'] else 'one stream'})")
    settled = rounds[EXPLORE_ROUNDS:] or rounds
    best = {k: rate(min(r[k] for r in settled)) for k in TRANSFERS}
    print(f"{link}   upload: S3Storage.create {best['up']:7.1f} MB/s, put_object "
          f"{best['plain_up']:7.1f} MB/s, ratio {best['up'] / best['plain_up']:.2f}")
    print(f"{link} download: S3Storage.read_into {best['down']:7.1f} MB/s (read, new buffer: "
          f"{best['fresh']:.1f}), get_object {best['plain_down']:7.1f} MB/s, ratio "
          f"{best['down'] / best['plain_down']:.2f}", flush=True)
    return best


TRANSFERS = ("up", "down", "fresh", "plain_up", "plain_down")


def measure(link: str, url: str, server: str, data: bytes, digest: str, repeat: int) -> dict[str, float]:
    """`repeat` rounds through `url` (the server itself, or the relay in front of it)."""
    store = S3Storage(f"s3://{BUCKET}/bench", endpoint_url=url)
    rounds, reuse = [], memoryview(bytearray(len(data)))
    for _ in range(repeat):
        reset_bucket(store, server)
        rounds.append(one_round(store, data, digest, reuse))
    return report(link, len(data), rounds)


def rows(link: str, best: dict[str, float], mb: int, command: str) -> list[Row]:
    note = (f"{mb} MiB object, moto server in its own process; "
            + ("every connection capped at 50 MB/s like one internet stream" if link == "capped"
               else "straight to the server on 127.0.0.1"))
    made = [Row(f"S3 checkpoint {what} ({link})", "MB/s", best[mine], best[plain],
                best[mine] / best[plain], ">= 1 (not slower)", best[mine] >= best[plain] * 0.97,
                command, f"{note}; {how}; baseline one plain boto3 {call}")
            for what, mine, plain, call, how in (
                ("upload", "up", "plain_up", "put_object", "S3Storage.create"),
                ("download", "down", "plain_down", "get_object",
                 "S3Storage.read_into the buffer a volunteer reuses across versions"))]
    made.append(Row(f"S3 read into a new buffer ({link})", "MB/s", best["fresh"],
                    best["plain_down"], best["fresh"] / best["plain_down"], "-", None, command,
                    f"{note}; S3Storage.read, which allocates the whole object each time; "
                    "baseline one plain boto3 get_object"))
    return made


def run(mb: int, repeat: int, stream_mbps: float) -> list[Row]:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "testing"  # moto accepts any key; never send real ones to it
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    data = os.urandom(mb * 1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    server, endpoint = start([str(ROOT / "infra" / "s3_server.py")], "the moto server")
    relay, relayed = start(["-m", "bench.link", "--to", endpoint,
                            "--mbps", str(stream_mbps)], "the capped link")
    command = f"python -m bench.s3_checkpoint --mb {mb} --repeat {repeat}"
    try:
        print(f"moto server {endpoint} (own process); {len(data) / MB:.0f} MB object; "
              f"parts of {s3_transfer.MIN_PART // 2**20}-{s3_transfer.PART_SIZE // 2**20} MiB "
              f"from {s3_transfer.MULTIPART_THRESHOLD // 2**20} MiB on, "
              f"{s3_transfer.CONCURRENCY} at a time; "
              f"capped link {stream_mbps:g} MB/s per connection", flush=True)
        loop = measure("loopback", endpoint, endpoint, data, digest, repeat)
        capped = measure("capped  ", relayed, endpoint, data, digest, repeat)
    finally:
        for proc in (relay, server):
            proc.terminate()
            proc.wait(30)
    return rows("loopback", loop, mb, command) + rows("capped", capped, mb, command)


def results(quick: bool = False) -> list[Row]:
    return run(64 if quick else 256, 3 if quick else 4, 50.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="object size in MiB (default 256)")
    parser.add_argument("--repeat", type=int, default=4,
                        help=f"rounds per link (default 4; the first {EXPLORE_ROUNDS} explore)")
    parser.add_argument("--stream-mbps", type=float, default=50.0,
                        help="cap per connection on the capped link, MB/s (default 50)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args(argv)
    return emit_rows(run(args.mb, args.repeat, args.stream_mbps), args.json)


if __name__ == "__main__":
    sys.exit(main())
