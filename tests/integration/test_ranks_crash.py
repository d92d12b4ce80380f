"""Issue 28, Done-when (c): `kill -9` of one trainer rank mid-step, torchrun restarting every
rank, and exactly-once across the restart.

The trainer runs as two gloo ranks under a real torchrun with --max-restarts 1. Six shards
of four real groups each (conftest.template) wait in the bucket; a step takes four groups and
each is published. Rank 1 (a follower) SIGKILLs itself inside its third optimizer step
(VRL_CRASH_AT=optimizer_step:3@1, faults.py: once, in torchrun's first start only). torchrun
stops rank 0, starts both again, and they resume from the last committed version: the
writer's weights and ledger from the bucket, AdamW's moments from the shards every rank saved
into the version's state folder (torch.distributed.checkpoint).
The committed ledgers then show each of the 24 groups trained exactly once."""
from __future__ import annotations

from conftest import PICKED

from helpers.bucket_objects import assert_manifest_complete, honest_shards, trained_lines
from helpers.vrlproc import Proc, wait_for

SHARDS = 6
KILLED = "crash point optimizer_step: SIGKILL"


def test_a_rank_killed_mid_step_restarts_and_nothing_is_trained_twice_or_lost(template, tmp_path):
    bucket = template.copy(tmp_path / "bucket")
    keys = honest_shards(template, bucket, SHARDS)
    expected = {(k, line) for k in keys for line in range(4)}
    proc = Proc(["trainer", *PICKED, "--bucket", str(bucket), "--groups-per-step", "4",
                 "--max-staleness", "50", "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
                 "--threads", "1", "--poll-seconds", "0.05", "--work-dir", str(tmp_path / "work"),
                 "--signing-key", str(template.key)], tmp_path / "trainer.log", tmp_path,
                {"VRL_CRASH_AT": "optimizer_step:3@1", "OMP_NUM_THREADS": "1"}, ranks=2, restarts=1)
    try:
        wait_for(lambda: KILLED in proc.text(), 300, "rank 1 killing itself")
        wait_for(lambda: set(trained_lines(bucket)) == expected, 300, "every group trained")
    finally:
        proc.terminate(120)
    text = proc.text()
    counts = trained_lines(bucket)
    assert set(counts) == expected and set(counts.values()) == {1}, counts
    version = assert_manifest_complete(bucket, tmp_path)
    after = text.split(KILLED, 1)[1]
    # the writer, in a collective with the dead rank, says so in one line: no traceback of ours
    assert "rank 0 of 2 lost the other ranks while training: " in after, after[:4000]
    assert "[rank0]: Traceback" not in after, after[:4000]
    assert after.count("resuming run-") == 1, text[-4000:]  # the writer, from the bucket
    assert "fresh optimizer moments" not in after, text[-4000:]  # the moments were saved
    assert version >= 2 + 24 // 4, text[-4000:]  # every step published, on top of v2
