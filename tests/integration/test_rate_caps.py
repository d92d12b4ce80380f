"""Issue 43's bandwidth caps, for real: a published version of several MB fetched through
`--max-download-rate`'s wrapper (storage/pace.py) from a folder bucket and from S3 (moto's
server on 127.0.0.1) stays within 10 % of the cap and still has every piece verified (a
corrupted piece is refused under the cap too); an upload of a few MB keeps to
`--max-upload-rate`; and a real `vrl volunteer` given both flags says so, takes at least
the capped time to load its version, and uploads a shard.

Rates are measured as bytes over wall time of the whole call, on an otherwise idle link
(localhost): with a cap the link is far faster than, the rate achieved is the cap's.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from conftest import TEMPLATE_VERSION
from helpers import storage_contract as contract
from helpers.grants import deal, wait_for_ask
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.model.chain import fetch_weights, keyframe_weights
from volunteer_rl.model.checkpoint import publish_checkpoint
from volunteer_rl.model.hashing import CheckpointError
from volunteer_rl.model.policy import Policy
from volunteer_rl.model.tiny import build_tokenizer
from volunteer_rl.model.weights import save_policy
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Manifest, Sampling, TaskRef, read_manifest
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.pace import paced
from volunteer_rl.task.calculator_generate import generate_problems

BUCKET = "vrl-rate-test"
CAP = 1_500_000
"""The cap of the measured transfers, bytes per second: a 6 MB weights file takes 4 s."""
WEIGHTS = "model.safetensors"
PIECE = 1 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random Llama-shaped model of about 6 MB of fp32 weights, saved as the trainer saves a
    version (save_policy)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    problems = generate_problems(200, seed=3)
    tokenizer = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems],
                                vocab_size=300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    policy = Policy(AutoModelForCausalLM.from_config(config).eval(), tokenizer, "plain",
                    torch.device("cpu"))
    folder = save_policy(policy, tmp_path_factory.mktemp("ckpt") / "v0")
    assert (folder / WEIGHTS).stat().st_size > 5_000_000
    return folder


@pytest.fixture(scope="module")
def endpoint():
    with contract.moto_s3() as url:
        yield url


@pytest.fixture(params=["folder", "s3"])
def bucket(request, tmp_path) -> tuple[str, str | None]:
    """(bucket URI, endpoint): an empty folder bucket, or an empty bucket on moto."""
    if request.param == "folder":
        (tmp_path / "bucket").mkdir()
        return str(tmp_path / "bucket"), None
    endpoint = request.getfixturevalue("endpoint")
    contract.empty_bucket(endpoint, BUCKET)
    return f"s3://{BUCKET}/run", endpoint


def publish(uri: str, endpoint: str | None, folder: Path) -> Manifest:
    """Version 0 of `folder` published (unpaced) as the trainer does: its files under
    checkpoints/v000000/, and the manifest that names them, its weights by pieces."""
    from volunteer_rl.trainer.publish import upload_dataset

    storage = open_storage(uri, endpoint)
    files = publish_checkpoint(storage, 0, folder)
    # Pieces of 1 MiB, not the trainer's 64 MiB: a corrupted piece is one of six
    files[WEIGHTS], weights = keyframe_weights(0, (folder / WEIGHTS).read_bytes(), PIECE)
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="run-rate",
                    version=0, checkpoint=layout.checkpoint_prefix(0), files=files,
                    dataset=upload_dataset(storage, PACKAGE_DATA / "eval.csv"),
                    sampling=Sampling(2, 1.0, 8), max_staleness=2, weights=weights)


def timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def test_a_capped_fetch_keeps_within_ten_percent_of_the_cap_and_checks_every_piece(
        bucket, checkpoint):
    uri, endpoint = bucket
    m = publish(uri, endpoint, checkpoint)
    size = m.files[WEIGHTS].size
    capped = paced(open_storage(uri, endpoint), download=CAP)  # as the volunteer wraps it

    fetched, seconds = timed(lambda: fetch_weights(capped, m))
    assert bytes(fetched.buf) == (checkpoint / WEIGHTS).read_bytes() and fetched.bytes == size
    rate = size / seconds  # config.json and the tokenizer's files came too: under 1 %
    print(f"{uri.split(':')[0] if endpoint else 'folder'}: {size} bytes in {seconds:.2f} s, "
          f"{rate / 1e6:.3f} MB/s under a cap of {CAP / 1e6} MB/s")
    assert 0.9 * CAP <= rate <= 1.1 * CAP, rate

    # One byte of one piece changed in the bucket: the capped fetch still refuses the file.
    data = bytearray((checkpoint / WEIGHTS).read_bytes())
    at = m.weights.piece_bytes + 1000  # in piece 1
    data[at] ^= 0xFF
    key = layout.checkpoint_key(0, WEIGHTS)
    if endpoint is None:
        (Path(uri) / key).write_bytes(data)
    else:
        import boto3
        from botocore.config import Config

        boto3.client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"})
                     ).put_object(Bucket=BUCKET, Key=f"run/{key}", Body=bytes(data))
    faster = paced(open_storage(uri, endpoint), download=4 * CAP)
    with pytest.raises(CheckpointError, match=r"sha256 of piece 1 does not match manifest"):
        fetch_weights(faster, m)


def test_a_capped_upload_keeps_within_ten_percent_of_the_cap(bucket):
    """A shard's create and a streamed create_from, 4.5 MB each, under --max-upload-rate's
    wrapper: each takes the capped time, and lands whole."""
    uri, endpoint = bucket
    capped = paced(open_storage(uri, endpoint), upload=CAP)
    shard = bytes(range(256)) * 17_578  # 4.5 MB
    key = layout.checkpoint_key(0, "shard.bin")  # any key: the bytes are what counts
    _, seconds = timed(lambda: capped.create(key, shard))
    rate_create = len(shard) / seconds

    def write(f):
        for start in range(0, len(shard), 1 << 20):
            f.write(shard[start:start + (1 << 20)])
    _, seconds = timed(lambda: capped.create_from(key + ".2", write))
    rate_stream = len(shard) / seconds
    print(f"create {rate_create / 1e6:.3f} MB/s, create_from {rate_stream / 1e6:.3f} MB/s "
          f"under a cap of {CAP / 1e6} MB/s")
    plain = open_storage(uri, endpoint)
    assert plain.read(key) == shard and plain.read(key + ".2") == shard
    for rate in (rate_create, rate_stream):
        assert 0.9 * CAP <= rate <= 1.1 * CAP, rate


# --- the flags on a real `vrl volunteer` ---------------------------------------------------------

def test_vrl_volunteer_takes_both_caps_and_still_loads_and_uploads(template, tmp_path):
    bucket = template.copy(tmp_path / "bucket")
    m = read_manifest(open_storage(str(bucket)), trust=Trust(allow_unsigned=False))
    # What loading the version downloads: its checkpoint's files (the weights file is v0's
    # keyframe, v1 and v2 republish it) and the dataset
    fetched = sum(entry.size for entry in m.files.values()) + m.dataset.size
    cap = fetched // 8  # loading the version takes 8 s or more
    cmd = ["volunteer", "--bucket", str(bucket), "--trust-key", f"{template.key}.pub",
           "--threads", "1", "--prompts-per-batch", "4", "--shard-groups", "4",
           "--heartbeat-seconds", "1", "--poll-seconds", "0.2", "--work-dir", str(tmp_path / "vw"),
           "--max-download-rate", str(cap), "--max-upload-rate", "200k"]
    p = Proc(cmd, tmp_path / "volunteer.log", tmp_path)
    try:
        said = wait_for(lambda: re.search(r"^downloads at most (.+?), uploads at most (.+)$",
                                          p.text(), re.M), 120, "the caps line", interval=0.05)
        capped_at = time.perf_counter()
        wait_for(lambda: f"now on v{TEMPLATE_VERSION} " in p.text(), 120, "the version loaded",
                 interval=0.05)
        loaded = time.perf_counter() - capped_at
        vid = re.search(r"^volunteer (\S+) on ", p.text(), re.M).group(1)
        wait_for_ask(bucket, vid, TEMPLATE_VERSION, 120)
        deal(bucket, template.key, template.run_id, vid, TEMPLATE_VERSION, None, blocks=1)
        wait_for(lambda: list((bucket / layout.rollout_volunteer_prefix(TEMPLATE_VERSION, vid))
                              .glob("*.jsonl.gz")), 180, "a shard")
        assert p.terminate() == 0, p.text()[-3000:]
    finally:
        p.kill()
    assert said.groups()[1] == "200 kB/s", said.group(0)
    # The checkpoint's files came through the cap after the line (the dataset and manifest
    # besides): at the cap's pace, less the 0.1 s of burst an idle cap lends.
    print(f"{fetched} bytes of checkpoint and dataset under a cap of {cap} B/s: loaded in "
          f"{loaded:.1f} s")
    assert loaded >= 0.9 * fetched / cap, (loaded, fetched, cap)
