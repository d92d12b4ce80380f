"""Issue 28, Done-when (b): the trainer as two gloo ranks under a real torchrun (FSDP2 over
the template's tiny model, bf16 weights published from fp32 masters), two real `vrl volunteer` processes, a folder bucket. The writer
rank publishes what a single process would; the volunteers rebuild every version they move to
from its keyframe or patches and check it against the signed manifest's hashes (a wrong bit
and they refuse it), and the test rebuilds every version, cold and warm."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers.bucket_objects import published_versions
from helpers.chain_checks import assert_rebuilds_bit_for_bit, published_manifests
from helpers.vrlproc import Proc, stop_on_version

STEPS = 12
GROUPS = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory, template):
    root = tmp_path_factory.mktemp("ranks-loop")
    bucket = root / "bucket"
    bucket.mkdir()
    trainer = Proc(["trainer", "--bucket", str(bucket), "--model", str(template.model(root / "model")),
                    "--max-steps", str(STEPS), "--groups-per-step", str(GROUPS),
                    "--publish-every", "2", "--eval-every", "0", "--lr", "5e-4",
                    "--eval-dataset", str(template.eval_csv), "--keyframe-every", "3",
                    "--weights-dtype", "bf16",
                    "--threads", "1", "--work-dir", str(root / "tw")],
                   root / "trainer.log", root, env={"OMP_NUM_THREADS": "1"}, ranks=2)
    vols = [Proc(["volunteer", "--bucket", str(bucket), "--id", f"vol-{i}", "--threads", "1",
                  "--seed", str(i), "--shard-groups", "16", "--shard-seconds", "3",
                  "--work-dir", str(root / "vw")], root / f"vol-{i}.log", root) for i in (1, 2)]
    try:
        assert trainer.wait(600) == 0, trainer.text()[-4000:]
        final = published_versions(bucket)[-1]
        codes = stop_on_version(vols, final, 120)
    finally:
        for p in [trainer, *vols]:
            p.kill()
    return {"root": root, "bucket": bucket, "trainer": trainer.text(), "codes": codes,
            "vols": {f"vol-{i}": v.text() for i, v in zip((1, 2), vols)}}


def steps(bucket: Path) -> list[dict]:
    rows = []
    for f in sorted((bucket / "metrics").glob("v*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return [m for m in rows if m["kind"] == "step"]


def test_the_writer_publishes_every_version_once_and_trains_every_step(run):
    versions = published_versions(run["bucket"])
    assert versions == list(range(STEPS // 2 + 1))
    ms = steps(run["bucket"])
    assert [m["step"] for m in ms] == list(range(1, STEPS + 1))
    assert all(m["rollout/groups"] == GROUPS for m in ms)
    # both ranks were there: torchrun ran two, and each saved its optimizer shards (DCP)
    final = versions[-1]
    shards = sorted(p.name for p in (run["root"] / "tw" / "state" / f"v{final:06d}" / "optimizer").iterdir())
    assert all(p.startswith("shard-") and p.endswith(".safetensors") for p in shards), shards
    assert {p.split("-")[1] for p in shards} == {"00001", "00002"}, shards  # ranks 0 and 1 (DCP counts from 1)
    assert len(shards) == 2  # a small model: one file each (state.FILE_BYTES)
    assert run["trainer"].count("trainer stopped at v") == 2, run["trainer"][-3000:]


def test_volunteers_rebuild_every_version_bit_for_bit(run):
    final = published_versions(run["bucket"])[-1]
    for vid, log in run["vols"].items():
        switched = [int(v) for v in re.findall(r"now on v(\d+) ", log)]
        assert switched[-1] == final and switched == sorted(set(switched)), (vid, switched)
        assert "refus" not in log.lower(), log[-3000:]
    assert run["codes"] == [0, 0]


def test_every_version_rebuilds_bit_for_bit_from_its_chain(run):
    """Each version's weights, rebuilt cold from its keyframe and patches and warm from the
    version before (as a following volunteer does), have the root the writer computed from
    its gathered weights; some versions are patches."""
    final = published_versions(run["bucket"])[-1]
    storage, manifests = published_manifests(run["bucket"], final)
    assert any(m.weights.patches for m in manifests), "keyframes every 3 versions, patches between"
    assert_rebuilds_bit_for_bit(storage, manifests)
