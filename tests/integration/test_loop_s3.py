"""The loop on S3 over HTTP: one `vrl trainer` and two `vrl volunteer` processes against
moto's S3 server on 127.0.0.1, through whichever S3 backend open_storage() picks.

One run (module fixture: 25-45 s on a busy 2-core machine, from the template's warm-started
model); the tests read what it left in the bucket with plain boto3, and each process's log.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import boto3
import moto.server  # noqa: F401  (a hard test dependency: a broken install fails here)
import pytest
from botocore.config import Config  # noqa: E402

from helpers.chain_checks import root_of  # noqa: E402
from helpers.vrlproc import FAKE_AWS_CREDENTIALS, Proc, load_infra, wait_for  # noqa: E402
from volunteer_rl.protocol import layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "vrl-loop"
PREFIX = "run"
STEPS = 8
MAX_STALENESS = 2  # the trainer's default
CREDENTIALS = FAKE_AWS_CREDENTIALS


class Bucket:
    """Read-only view of the run's objects, with plain boto3 (not the code under test)."""

    def __init__(self, endpoint: str):
        self.client = boto3.client("s3", endpoint_url=endpoint,
                                   config=Config(s3={"addressing_style": "path"}))

    def keys(self, prefix: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=f"{PREFIX}/{prefix}")
        return sorted(o["Key"][len(PREFIX) + 1:] for p in pages for o in p.get("Contents", []))

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")["Body"].read()

    def versions(self) -> list[int]:
        names = [k.rsplit("/", 1)[1].removesuffix(".json") for k in self.keys(layout.MANIFESTS + "/")]
        return sorted(v for v in map(layout.parse_version_dir, names) if v is not None)

    def metrics(self) -> list[dict]:
        rows = []
        for key in self.keys(layout.METRICS + "/"):
            rows += [json.loads(line) for line in self.read(key).decode().splitlines()]
        return rows


@pytest.fixture(scope="module")
def run(tmp_path_factory, template):
    root = tmp_path_factory.mktemp("s3loop")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in CREDENTIALS.items():  # the subprocesses inherit os.environ
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        server, endpoint = load_infra("s3_server").start_s3_server()
        try:
            bucket = Bucket(endpoint)
            bucket.client.create_bucket(Bucket=BUCKET)
            yield _run_loop(root, endpoint, bucket, template)
        finally:
            server.stop()


def _run_loop(root: Path, endpoint: str, bucket: Bucket, template) -> dict:
    """Trainer and two volunteers until the trainer stops; then each volunteer is stopped
    with SIGTERM once it has loaded the final version. v0 is the template's warm-started
    model (conftest): no warm start of its own to wait for; the evaluations of v0 and the
    last version use its 10 held-out rows, not the default 500 (no test here reads them)."""
    uri = f"s3://{BUCKET}/{PREFIX}"
    common = ["--bucket", uri, "--endpoint-url", endpoint, "--threads", "1"]
    trainer = Proc(["trainer", *common, "--model", str(template.model(root / "model")),
                    "--max-steps", str(STEPS), "--groups-per-step", "8", "--publish-every", "2",
                    "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
                    "--work-dir", str(root / "tw")], root / "trainer.log", root)
    vols = [Proc(["volunteer", *common, "--id", f"vol-{i}", "--seed", str(i),
                  "--shard-groups", "8", "--shard-seconds", "3", "--log-shards",
                  "--work-dir", str(root / f"vw{i}")], root / f"vol-{i}.log", root)
            for i in (1, 2)]
    try:
        assert trainer.wait(600) == 0, trainer.text()[-3000:]
        final = bucket.versions()[-1]
        for v in vols:
            wait_for(lambda: f"now on v{final} " in v.text() or v.p.poll() is not None, 90,
                     f"{v.log.name} on v{final}")
            assert f"now on v{final} " in v.text(), v.text()[-3000:]
        codes = [v.terminate() for v in vols]
    finally:
        for p in [trainer, *vols]:
            p.kill()
    return {"bucket": bucket, "final": final, "codes": codes, "trainer": trainer.text(),
            "vols": {f"vol-{i}": v.text() for i, v in zip((1, 2), vols)}}


def test_versions_are_published_and_the_manifest_names_the_last(run):
    versions = run["bucket"].versions()
    assert len(versions) >= 3 and versions == list(range(len(versions))), versions
    manifest = json.loads(run["bucket"].read(layout.MANIFEST))
    assert manifest["version"] == versions[-1] == run["final"]
    assert manifest["checkpoint"] == layout.checkpoint_prefix(manifest["version"])


def test_every_file_the_manifest_names_has_its_sha256(run):
    """Every file the manifest names is there with its size and sha256; the weights file with
    the root of its pieces (it is a keyframe: the loop publishes fp32, all keyframes)."""

    manifest = json.loads(run["bucket"].read(layout.MANIFEST))
    named = {f"{manifest['checkpoint']}/{name}": entry for name, entry in manifest["files"].items()}
    named[manifest["dataset"]["key"]] = manifest["dataset"]
    weights = f"{manifest['checkpoint']}/model.safetensors"
    assert weights in named
    for key, entry in named.items():
        data = run["bucket"].read(key)
        assert len(data) == entry["size"], key
        if key == weights:
            assert root_of(data, manifest["weights"]["piece_bytes"]) == entry["root"], key
        else:
            assert hashlib.sha256(data).hexdigest() == entry["sha256"], key


def test_each_volunteer_worked_on_several_versions_and_stopped_cleanly(run):
    for vid, log in run["vols"].items():
        in_bucket = {layout.parse_shard_key(k)[0] for k in run["bucket"].keys(layout.ROLLOUTS + "/")
                     if layout.parse_shard_key(k) and layout.parse_shard_key(k)[1] == vid}
        logged = {layout.parse_shard_key(k)[0] for k in re.findall(r"uploaded (\S+):", log)}
        assert len(logged) >= 2 and logged <= in_bucket, (vid, logged, in_bucket)
        assert f"now on v{run['final']} " in log, vid
    assert run["codes"] == [0, 0]


def test_only_groups_within_the_staleness_window_are_trained_on(run):
    steps = [m for m in run["bucket"].metrics() if m["kind"] == "step"]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert m["rollout/sources"], m["step"]
        for key in m["rollout/sources"]:
            version, vid, _ = layout.parse_shard_key(key)
            assert 0 <= m["version"] - version <= MAX_STALENESS, (key, m["version"])
            assert vid in run["vols"]
