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
from helpers.grants import assert_none_missing
from helpers.vrlproc import Proc, run_vrl, stop_on_version

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
                    "--weights-dtype", "bf16", "--report-to", "tensorboard",
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



def test_each_rank_names_itself_and_the_writer_alone_says_it_stopped(run):
    """Issue 39: a rank's first line says its rank, the world and the backend, each of its
    lines carries `[rank R]`, and "trainer stopped" comes once, from the writer."""
    lines = run["trainer"].splitlines()
    ours = [line for line in lines if line.startswith("[rank ")]
    for rank, role in ((0, "the writer, it publishes"), (1, "follows rank 0")):
        first = next(line for line in ours if line.startswith(f"[rank {rank}] "))
        assert first == f"[rank {rank}] rank {rank} of 2, backend gloo, device cpu: {role}", ours[:5]
    assert any(line.startswith("[rank 0] step 1 v") for line in ours)
    stopped = [line for line in lines if "trainer stopped" in line]
    assert len(stopped) == 1 and stopped[0].startswith("[rank 0] trainer stopped at v"), stopped


def test_the_writer_alone_reports_every_step_to_tensorboard(run):
    """--report-to tensorboard: one event file (rank 0's), under <work-dir>/runs/<run id>,
    whose scalars are metrics/'s own, step by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (run["root"] / "tw" / "runs").glob("*/events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    ms = steps(run["bucket"])
    got = [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")]
    assert got == [(m["step"], pytest.approx(m["rollout/reward_mean"])) for m in ms]
    assert "train/loss" in acc.Tags()["scalars"]


def test_honest_volunteers_have_no_number_missing(run):
    """Issue 41, point 7, with a trainer of 2 ranks and volunteers waiting at their quotas."""
    assert_none_missing(run["bucket"], {"vol-1", "vol-2"})


def test_fleet_json_and_vrl_status_say_the_trainer_ran_as_2_ranks_and_stopped(run):
    trainer = json.loads((run["bucket"] / "fleet.json").read_text())["trainer"]
    assert trainer["ranks"] == 2 and trainer["stopped_at"] is not None, trainer
    r = run_vrl(["status", "--bucket", str(run["bucket"])], cwd=run["root"])
    assert r.returncode == 0 and "2 ranks" in r.stdout and "stopped" in r.stdout, r.stdout


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
