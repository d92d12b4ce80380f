"""Checkpoint sync: the trainer's publish and the volunteer's fetch of a Qwen3-0.6B-shaped
checkpoint, against a raw copy of the same bytes to the same place.

    python -m bench.checkpoint_sync [--quick] [--json PATH]

The model is a `transformers` Qwen3ForCausalLM with Qwen3-0.6B's shape (hidden 1024, 28
layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072, vocab 151,936, tied
embeddings: 596 M parameters, 2.38 GB fp32 / 1.19 GB bf16), built on the meta device and
filled with random normals: nothing is downloaded. The tokenizer is the project's own (the
checkpoint's weights are >99.9 % of its bytes). `--quick` uses a much smaller Qwen3 shape.

For each weights dtype (`fp32`, and `bf16` as `vrl trainer --weights-dtype bf16` publishes)
and each bucket (a local folder, and moto's S3 server over HTTP on 127.0.0.1 in its own
process, as bench/s3_checkpoint.py starts it):

- **publish, vrl**: `trainer.publish`, the code the trainer runs, for a keyframe: the weights
  file made in memory from the live model (in the buffer of the version before, as a trainer
  that has published before makes it), uploaded while its 64 MiB pieces are hashed on every
  core (their root names the file), config and tokenizer staged and uploaded, every
  file's size checked, the signed manifest written. (A patch version's publish, which also
  diffs and compresses, is timed by bench/catch_up.py.)
- **publish, raw**: the same weights file's bytes copied to the same bucket. Folder:
  `shutil.copyfile` and then `os.fsync` of the copy. The fsync is there because the folder
  backend fsyncs every object before the manifest may point at it (a crash must not leave a
  committed checkpoint that is only in the page cache); a copy without it measures the page
  cache, and the note gives that figure too. S3: one plain `put_object` of the file, against
  the third publish of one trainer: its storage chooses between a multipart upload and one
  PUT by what was faster on this link so far (`storage.s3_transfer.UploadChoice`: multipart on the
  first big upload, the right guess for the internet; one PUT on the second), so the third
  is what a running trainer does. The note gives all three.
  Before every folder round, untimed, the bucket is left holding the last version only (the
  ones before deleted, as retention does, and the last raw copy), so both sides write into
  disk blocks just freed (see `tidy` in folder_round for why that matters on this VM).
- **fetch, vrl**: `chain.fetch_weights`, what a volunteer that takes the keyframe runs:
  the object read into memory while its 64 MiB pieces are hashed on every core as they land,
  and every piece compared with the manifest. A volunteer reuses its read buffer from one
  version to the next, so the buffer is page-faulted once before the timed rounds.
- **fetch and load, vrl** (folder, no goal): `model.chain.swap_weights`, the same and then
  every tensor copied into the live fp32 model (bf16 upcast on the way), against the same
  raw copy: all a volunteer's `_switch` does when only the weights changed.
- **fetch, raw**: the same object copied to a local file: `shutil.copyfile` (folder), one plain
  `get_object` streamed to a file (S3). No verify, no load.
- Folder fetches are measured twice: with a warm page cache (the file just written, as on a
  machine that serves its own bucket) and a cold one (the bucket's file evicted with
  `posix_fadvise(DONTNEED)` before each round, both sides: the bytes come from the disk).

Why plain put_object / get_object and not boto3's upload_file / download_file: on this server
the managed transfer is the weaker baseline (moto reads the whole object for every ranged
GET, so download_file's 8 MB parts are quadratic: 24-58 MB/s in FIELD-NOTES), and a single
PUT / GET is the fastest plain transfer moto offers. Over loopback a single stream is not
limited the way an internet connection is; bench/s3_checkpoint.py measures that case.

Figures: seconds (best of 3 rounds, vrl and raw in turns), MB/s (10^6 bytes of the weights file per second),
ratio = raw seconds / vrl seconds (> 1: vrl faster). Goal from the issue: >= 0.8.
Also bytes per version (every file of the checkpoint) for fp32 and bf16.

Memory: moto holds several copies of a big object while it takes or serves it (the request
body, the stored value, the concatenated parts of a multipart upload, the whole object again
for every ranged GET): the fp32 S3 round reached 8.6 GB in the server, 13.7 GB with the
bench's model and buffer, over this machine's ~10 GB budget. So at full size S3 is measured
with the bf16 checkpoint (1.19 GB) only, and the fp32 S3 cells are skipped (printed as such);
`--quick` runs every cell.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Row, cli

ROOT = Path(__file__).resolve().parents[1]
MB = 1_000_000
GOAL = 0.8
BUCKET = "vrl-bench"
S3_MAX_BYTES = 1_500_000_000
"""Largest weights file sent through moto (see the memory note above)."""


def qwen3(quick: bool):
    """A randomly initialised Qwen3ForCausalLM of Qwen3-0.6B's shape (or a small one)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=32768, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64) if quick else \
        dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    config = Qwen3Config(**shape, tie_word_embeddings=True, max_position_embeddings=40960)
    with torch.device("meta"):  # no init pass on 0.6 B parameters; filled below
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        for name, b in model.named_buffers():  # rotary inv_freq: to_empty left it unset
            if name.endswith("inv_freq"):
                module = model.get_submodule(name.rsplit(".", 1)[0])
                b.copy_(module.compute_default_rope_parameters(module.config)[0])
    model.tie_weights()
    return model.eval()


def policy_for(model):
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.policy import Policy
    from volunteer_rl.model.tiny import build_tokenizer
    from volunteer_rl.task.dataset import load_csv

    problems = load_csv(PACKAGE_DATA / "train.csv")[:2000]
    tokenizer = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems])
    return Policy(model, tokenizer, "plain", torch.device("cpu"))


def best(fn, rounds: int) -> float:
    times = []
    for n in range(rounds):
        start = time.perf_counter()
        fn(n)
        times.append(time.perf_counter() - start)
    return min(times)


def best_of_pairs(vrl, raw, rounds: int, tidy=lambda: None) -> tuple[float, float]:
    """Best seconds of `vrl` and of `raw`, run in turns (vrl, raw, vrl, raw, ...): whatever
    the machine does meanwhile (writeback of earlier files, reclaiming page cache for the
    next big write) falls on both sides alike, not on whichever ran first. `tidy` runs,
    untimed, before each."""
    times: tuple[list[float], list[float]] = ([], [])
    for n in range(rounds):
        for fn, out in ((vrl, times[0]), (raw, times[1])):
            tidy()
            start = time.perf_counter()
            fn(n)
            out.append(time.perf_counter() - start)
    return min(times[0]), min(times[1])


class Publisher:
    """trainer.publish on one bucket, one version after another. With `keyframe_every`, one
    WeightsChain throughout, as `vrl trainer --keyframe-every` runs it; without, every version
    a keyframe (a fresh chain each time), its file made in the buffer of the version before,
    as a trainer that has published before makes it. With `lora_rank` (a policy wrapped by
    model.lora.add_adapters), as `vrl trainer --lora-rank` publishes: the first version whole
    (the base), every later one its adapter only."""

    def __init__(self, uri: str, endpoint: str | None, policy, dtype: str, work: Path,
                 keyframe_every: int | None = None, lora_rank: int = 0):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
        from volunteer_rl.storage import open_storage
        from volunteer_rl.task.calculator_task import CalculatorTask
        from volunteer_rl.trainer.publish import WeightsChain, upload_dataset

        # The trainer's config as it runs (k and max_new_tokens the task's), for the manifest.
        self.cfg = TrainerConfig(bucket=uri, endpoint_url=endpoint, work_dir=str(work),
                                 weights_dtype=dtype).with_task_defaults(CalculatorTask())
        if keyframe_every is not None:
            self.cfg.keyframe_every = keyframe_every
        self.cfg.lora_rank = lora_rank
        self.base = None  # a LoRA run's published base (trainer.publish.LoraBase), after v1
        self.storage = open_storage(uri, endpoint)
        self.policy, self.key, self.etag, self.version = policy, Ed25519PrivateKey.generate(), None, 0
        self.dataset = upload_dataset(self.storage, PACKAGE_DATA / "train.csv")
        self.manifest = None
        self.chain = WeightsChain(self.cfg.keyframe_every, self.cfg.patch_max_fraction) \
            if keyframe_every is not None else None
        self.spare = None

    def publish(self) -> None:
        from volunteer_rl.task.registry import info
        from volunteer_rl.trainer.publish import LoraBase, WeightsChain, publish

        chain = self.chain
        if chain is None:  # a keyframe: a chain with no last version, the last file's buffer reused
            chain = WeightsChain(self.cfg.keyframe_every, self.cfg.patch_max_fraction)
            chain.spare = self.spare
        self.version += 1
        self.manifest, self.etag = publish(self.storage, self.policy, self.version, self.cfg,
                                           "bench", self.dataset, self.etag, self.key, chain,
                                           task=info("calculator").ref, base=self.base)
        if self.cfg.lora_rank:  # the base, streamed: no file is held after it
            self.base = self.base or LoraBase.of(self.manifest)
        else:
            self.spare = chain.last[2]


def evict(path: Path) -> None:
    """Drop the file's pages from the page cache (written back first, so they are clean and
    the kernel lets them go): the next read comes from the disk. No root needed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rows_for(backend: str, dtype: str, size: int, times: dict[str, float], extra: str,
             quick: bool) -> list[Row]:
    """Publish and fetch rows of one backend and dtype from measured seconds."""
    cmd = "python -m bench.checkpoint_sync" + (" --quick" if quick else "")
    out = []
    for way, cache in (("publish", ""), ("fetch", ""), ("fetch", "_cold"), ("swap", "")):
        if way + cache not in times:
            continue
        vrl, raw = times[way + cache], times[f"raw_{way}{cache}"]
        page = ("" if backend != "folder" or way == "publish" else
                ", cold page cache" if cache else ", warm page cache")
        note = (f"weights {size / MB:.0f} MB: vrl {size / MB / vrl:.0f} MB/s, raw "
                f"{size / MB / raw:.0f} MB/s; " + (extra if way == "publish" else "")
                + ("vrl = fetch_weights: read, every piece's sha256 checked; " if way == "fetch"
                   else "vrl = swap_weights: fetch_weights, then every tensor copied into the "
                        "live fp32 model; " if way == "swap" else "")
                + ("raw = copyfile + fsync" if (backend == "folder" and way == "publish") else
                   "raw = copyfile" if backend == "folder" else
                   "raw = one put_object" if way == "publish" else "raw = one get_object to a file")
                + ("; the bucket's file evicted from the page cache (posix_fadvise) before "
                   "each round" if cache else ""))
        name = "checkpoint fetch and load" if way == "swap" else f"checkpoint {way}"
        goal = "-" if way == "swap" else f">= {GOAL}"
        out.append(Row(name, f"{backend} {dtype}{page}: seconds", vrl, raw, raw / vrl,
                       goal, None if way == "swap" else raw / vrl >= GOAL, cmd, note))
    return out


def folder_round(policy, dtype: str, tmp: Path, rounds: int, quick: bool):
    """Folder bucket: publish and fetch, vrl and raw; returns rows, bytes per version, the
    published weights file (the raw S3 transfers send the same bytes) and the volunteer's
    read buffer (the S3 fetch reuses it, as a volunteer would)."""
    from volunteer_rl.model.chain import fetch_weights
    from volunteer_rl.model.chain import swap_weights

    bucket = tmp / f"bucket-{dtype}"
    pub = Publisher(str(bucket), None, policy, dtype, tmp / f"work-{dtype}")
    pub.publish()  # the first publish also pays the page faults of a fresh buffer: not timed
    weights = bucket / pub.manifest.checkpoint / "model.safetensors"
    size = weights.stat().st_size
    (bucket / "raw").mkdir()
    copy_only = []

    def tidy() -> None:
        """Both sides write into a bucket that holds the last version only: the versions
        before it deleted, as retention does, and the last raw copy. On this VM a write to
        disk blocks never written before ran at about a third of the speed of a rewrite of
        freed ones (a thin-provisioned virtual disk); when vrl kept every version and raw
        deleted its copy, that alone made the publish 3.1 s against 0.8 s."""
        drop_before(pub.storage, pub.version)
        (bucket / "raw" / "p.safetensors").unlink(missing_ok=True)

    def raw_publish(n: int) -> None:  # the last version's file: the same bytes, kept by tidy
        src, dest = bucket / pub.manifest.checkpoint / "model.safetensors", bucket / "raw" / "p.safetensors"
        start = time.perf_counter()
        shutil.copyfile(src, dest)
        copy_only.append(time.perf_counter() - start)
        fsync_path(dest)

    times = dict(zip(("publish", "raw_publish"),
                     best_of_pairs(lambda n: pub.publish(), raw_publish, rounds, tidy)))
    weights = bucket / pub.manifest.checkpoint / "model.safetensors"
    tidy()  # only the last version is read from here on
    held: list = [None]  # the buffer a volunteer keeps from one swap to the next

    def fetch(n: int) -> None:  # held as the reuse buffer only: the whole file is read
        held[0] = fetch_weights(pub.storage, pub.manifest, reuse=held[0]).buf

    def swap(n: int) -> None:  # the same, and the weights copied into the live model
        held[0] = swap_weights(pub.storage, pub.manifest, policy, reuse=held[0]).buf

    def raw_fetch(n: int) -> None:
        shutil.copyfile(weights, tmp / f"fetched-{dtype}")

    def cold(fn):  # the same, with the bucket's file out of the page cache first
        def run(n: int) -> None:
            evict(weights)
            fn(n)
        return run

    swap(-1)  # the volunteer's buffer, page-faulted once as a running volunteer's is
    times["fetch"], times["raw_fetch"] = best_of_pairs(fetch, raw_fetch, rounds)
    times["swap"], raw = best_of_pairs(swap, raw_fetch, rounds)
    times["raw_swap"] = min(raw, times["raw_fetch"])  # the fastest raw copy of all six
    times["fetch_cold"], times["raw_fetch_cold"] = best_of_pairs(cold(fetch), cold(raw_fetch), rounds)
    (tmp / f"fetched-{dtype}").unlink()
    shutil.rmtree(bucket / "raw")
    extra = f"copyfile alone {min(copy_only):.2f} s, ratio {min(copy_only) / times['publish']:.2f}; "
    total = sum(e.size for e in pub.manifest.files.values())
    sizes = {"weights": size, "total": total}
    return rows_for("folder", dtype, size, times, extra, quick), sizes, weights, held[0]


def s3_round(policy, dtype: str, weights: Path, held, endpoint: str, tmp: Path,
             quick: bool) -> list[Row]:
    """S3 (moto over HTTP): one round of each transfer on an emptied bucket."""
    from bench.s3_checkpoint import reset_bucket
    from volunteer_rl.model.chain import fetch_weights
    from volunteer_rl.storage.s3 import S3Storage

    plain = S3Storage(f"s3://{BUCKET}/raw", endpoint_url=endpoint)
    reset_bucket(plain, endpoint)
    pub = Publisher(f"s3://{BUCKET}/run", endpoint, policy, dtype, tmp / f"work-s3-{dtype}")
    size = weights.stat().st_size
    # A running trainer's S3Storage has learned which upload is faster on its link
    # (UploadChoice: multipart on the first big upload, one PUT on the second, then the
    # faster). Three publishes, each one's objects of the version before deleted after it
    # (moto holds them in memory); the row is the third, the note gives all three.
    seconds, methods = [], []
    for _ in range(3):
        seconds.append(best(lambda n: pub.publish(), 1))
        methods.append(pub.storage.inner.upload_choice.last)  # inside the Retrying wrapper
        drop_before(pub.storage, pub.version)
    times = {"publish": seconds[-1]}
    extra = ("publishes in turn " + ", ".join(f"{t:.1f} s ({m})" for t, m in zip(seconds, methods))
             + ": the row is the third; ")

    def raw_publish(n: int) -> None:
        with open(weights, "rb") as f:
            plain.client.put_object(Bucket=BUCKET, Key="raw/model.safetensors", Body=f)

    times["raw_publish"] = best(raw_publish, 1)

    def raw_fetch(n: int) -> None:
        body = plain.client.get_object(Bucket=BUCKET, Key="raw/model.safetensors")["Body"]
        with open(tmp / "fetched-s3", "wb") as f:
            shutil.copyfileobj(body, f, 16 << 20)

    times["raw_fetch"] = best(raw_fetch, 1)
    (tmp / "fetched-s3").unlink()
    times["fetch"] = best(lambda n: fetch_weights(pub.storage, pub.manifest, reuse=held), 1)
    reset_bucket(plain, endpoint)  # moto keeps objects in memory and temp files: free them
    return rows_for("s3", dtype, size, times, extra, quick)


def drop_before(storage, version: int) -> None:
    """Delete the checkpoint objects of every version before `version`."""
    from volunteer_rl.protocol import layout

    for key in storage.list(layout.CHECKPOINTS):
        parsed = layout.split_versioned_key(key)
        if parsed is not None and parsed[1] < version:
            storage.delete(key)


def results(quick: bool = False) -> list[Row]:
    from bench.s3_checkpoint import start

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "testing"  # moto accepts any key; never send real ones to it
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    t0 = time.perf_counter()
    policy = policy_for(qwen3(quick))
    n = sum(p.numel() for p in policy.model.parameters())
    print(f"Qwen3-shaped model, {n / 1e6:.1f} M parameters, built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    rows, sizes = [], {}
    server, endpoint = start([str(ROOT / "infra" / "s3_server.py")], "the moto server")
    try:
        with tempfile.TemporaryDirectory(prefix="vrl-sync-") as tmp:
            for dtype in ("fp32", "bf16"):
                folder_rows, sizes[dtype], weights, held = folder_round(
                    policy, dtype, Path(tmp), 3, quick)
                rows += folder_rows
                if weights.stat().st_size <= S3_MAX_BYTES:
                    rows += s3_round(policy, dtype, weights, held, endpoint, Path(tmp), quick)
                else:
                    print(f"s3 {dtype}: skipped at {weights.stat().st_size / MB:.0f} MB (moto "
                          "would need more memory than this machine's budget; see the "
                          "module docstring)", flush=True)
                del held
    finally:
        server.terminate()
        server.wait(30)
    fp32, bf16 = sizes["fp32"]["total"], sizes["bf16"]["total"]
    rows.append(Row("checkpoint bytes per version", "bytes, bf16 (vrl) vs fp32 (baseline)",
                    bf16, fp32, fp32 / bf16, "-", None,
                    "python -m bench.checkpoint_sync" + (" --quick" if quick else ""),
                    f"every file of a version; weights alone {sizes['bf16']['weights']:,} vs "
                    f"{sizes['fp32']['weights']:,} bytes"))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
