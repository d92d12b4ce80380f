"""A volunteer catching up 1, 5 and 20 versions over a 50 MB/s link: patches against the keyframe.

    python -m bench.catch_up [--quick] [--json PATH]

The chain is real: a Qwen3ForCausalLM of Qwen3-0.6B's shape (bench.checkpoint_sync.qwen3)
takes supervised AdamW steps at lr 1e-6 on the calculator task (bench.patch_size's steps),
and after each step `trainer.publish` publishes it to a folder bucket as
`vrl trainer --weights-dtype bf16 --keyframe-every 20` does: v1 a keyframe (a trainer's first
version), v2-v20 patches, v21 a keyframe on cadence and a patch as well, and the manifest of
v21 lists the 20 patches v2-v21.

The volunteer's side runs over HTTP: v21's objects (its checkpoint files and the 20 patches)
are copied into moto's S3 server in its own process, reached through bench/link.py's relay
with `--shared`: one link of 50 MB/s each way, shared by every connection (a volunteer's home
line; a per-connection cap would let the parallel ranged GETs of a keyframe multiply it).
A volunteer holding v(21-n), for n = 1, 5, 20 (its buffer rebuilt bit for bit from the folder
bucket), fetches v21 with `model.chain.swap_weights`: `fetch_weights` chooses to patch the held
bytes forward, downloads the n patches, applies them in place, checks every piece hash, and
the weights are copied into the live model. The baseline is the same call by a volunteer
that holds nothing (or holds a version from before the listed patches): it takes v21's
keyframe, the whole bf16 file, as every version was before patches.

Figures: seconds to the new weights in the live model, and the bytes downloaded. The note
also gives the trainer's publish time per patch version (make the file, hash it, diff,
compress, upload the patch). `--quick` uses a much smaller Qwen3 shape. Peak memory at full
size is about 14 GB (the training run: fp32 weights, gradients, two Adam moments, two bf16
files; then moto holding the keyframe).

The same run then measures LoRA on the same model (bench.lora_catch_up, row (d) of issue 42):
a new volunteer's base + adapter against the keyframe above, a volunteer behind against the
patches above, merged against unmerged, and the replay of those honest groups.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, cli
from bench.lora_catch_up import lora_rows

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m bench.catch_up"
MBPS = 50
BEHIND = (1, 5, 20)
KEYFRAME_EVERY = 20
LR = 1e-6
BUCKET = "vrl-bench"


def build_chain(policy, folder: Path, work: Path) -> tuple[list, list[float]]:
    """Publish v1..v(KEYFRAME_EVERY + 1) to `folder`, one AdamW step apart; (the manifests by
    version, index 0 unused; seconds each publish took)."""
    from bench.checkpoint_sync import Publisher
    from bench.patch_size import calculator_steps

    pub = Publisher(str(folder), None, policy, "bf16", work, keyframe_every=KEYFRAME_EVERY)
    manifests, publish_s = [None], []
    steps = calculator_steps(policy, LR)
    for v in range(1, KEYFRAME_EVERY + 2):
        if v > 1:
            loss, step_s = next(steps)
        t0 = time.perf_counter()
        pub.publish()
        publish_s.append(time.perf_counter() - t0)
        m = pub.manifest
        manifests.append(m)
        how = ("keyframe" if m.weights.keyframe.version == v else "") + \
            (" + " if m.weights.keyframe.version == v and m.weights.patches
             and m.weights.patches[-1].version == v else "") + \
            (f"patch {m.weights.patches[-1].size / 1e6:.1f} MB" if m.weights.patches
             and m.weights.patches[-1].version == v else "")
        print(f"v{v}: {how}, published in {publish_s[-1]:.1f} s"
              + (f" (step {step_s:.0f} s, loss {loss:.3f})" if v > 1 else ""), flush=True)
    steps.close()
    policy.model.zero_grad(set_to_none=True)  # the gradients' 4 bytes a parameter, freed
    return manifests, publish_s


def upload_target(folder: Path, m, s3) -> None:
    """Copy what a reader of manifest `m` may fetch into the S3 bucket: its checkpoint's
    files and every patch it lists."""
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.manifest import Weights

    keys = [layout.checkpoint_key(m.version, name) for name in m.files
            if (folder / layout.checkpoint_key(m.version, name)).exists()]
    keys += [Weights.patch_key(p.version) for p in m.weights.patches]
    for key in keys:
        s3.create(key, (folder / key).read_bytes())


def results(quick: bool = False) -> list[Row]:
    from bench.checkpoint_sync import policy_for, qwen3
    from bench.s3_checkpoint import start
    from volunteer_rl.model.chain import Held, build_weights
    from volunteer_rl.storage import open_storage
    from volunteer_rl.model.chain import swap_weights

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "testing"  # moto accepts any key; never send real ones to it
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    policy = policy_for(qwen3(quick))
    n = sum(p.numel() for p in policy.model.parameters())
    print(f"Qwen3-shaped model, {n / 1e6:.0f} M parameters", flush=True)
    target = KEYFRAME_EVERY + 1
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="vrl-catchup-") as tmp:
        folder = Path(tmp) / "bucket"
        manifests, publish_s = build_chain(policy, folder, Path(tmp) / "work")
        m = manifests[target]
        local = open_storage(str(folder))
        server, endpoint = start([str(ROOT / "infra" / "s3_server.py")], "the moto server")
        relay = None
        try:
            from volunteer_rl.storage.s3 import S3Storage

            direct = S3Storage(f"s3://{BUCKET}/run", endpoint_url=endpoint)
            direct.client.create_bucket(Bucket=BUCKET)
            upload_target(folder, m, direct)
            relay, link = start(["-m", "bench.link", "--to", endpoint, "--mbps", str(MBPS),
                                 "--shared"], "the link relay")
            remote = open_storage(f"s3://{BUCKET}/run", link)

            def catch_up(held: Held | None, reuse=None):
                t0 = time.perf_counter()
                got = swap_weights(remote, m, policy, held, print, reuse)
                return time.perf_counter() - t0, got

            key_s, key = catch_up(None)
            if key.how != "keyframe" or key.links != 1:
                raise SystemExit(f"a volunteer holding nothing fetched {key.how} ({key.links} links)")
            print(f"keyframe: {key.bytes / 1e6:.0f} MB in {key_s:.1f} s "
                  f"({key.bytes / 1e6 / key_s:.1f} MB/s)", flush=True)
            buf = key.buf
            full = {"keyframe_s": key_s, "keyframe_bytes": key.bytes, "behind": {}}
            for behind in BEHIND:
                mine = manifests[target - behind]
                held_buf = build_weights(local, mine, reuse=buf).buf  # v(target-behind), verified
                held = Held(mine.run_id, mine.version, mine.files["model.safetensors"].root,
                            held_buf)
                sec, got = catch_up(held)
                if got.how != "patches" or got.links != behind:
                    raise SystemExit(f"{behind} behind: fetched {got.how} ({got.links} links)")
                print(f"{behind} behind: {got.links} patches, {got.bytes / 1e6:.1f} MB in "
                      f"{sec:.1f} s", flush=True)
                full["behind"][behind] = (sec, got.bytes)
                rows.append(Row(
                    f"volunteer catching up {behind} version{'s' * (behind > 1)}, "
                    f"{MBPS} MB/s link", "seconds to the new weights (patches vs keyframe)",
                    sec, key_s, key_s / sec, "-", None, COMMAND + (" --quick" if quick else ""),
                    f"{got.bytes:,} bytes in {behind} patch{'es' * (behind > 1)} vs the "
                    f"{key.bytes:,}-byte bf16 keyframe ({key.bytes / got.bytes:.1f}x fewer); "
                    f"both verified by pieces and loaded into the live model; moto over HTTP "
                    f"through one {MBPS} MB/s link shared by every connection; "
                    f"{'small Qwen3' if quick else 'Qwen3-0.6B shape'}, "
                    f"AdamW lr {LR:g}; the trainer published each patch version in "
                    f"{statistics.median_high(publish_s[1:-1]):.1f} s (median)"))
            del key, buf, held_buf, held, got
            rows += lora_rows(policy, Path(tmp), f"s3://{BUCKET}", endpoint, link, quick, full)
        finally:
            for proc in (relay, server):
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
        shutil.rmtree(folder, ignore_errors=True)
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
