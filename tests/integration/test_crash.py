"""`kill -9` at five points of the trainer's loop, and a restart after each.

Six shards of four real groups each (conftest.template) wait in the bucket; a step takes
four groups. The trainer is killed with SIGKILL (VRL_CRASH_AT, volunteer_rl/faults.py)
while ingesting, inside an optimizer step, halfway through a checkpoint upload, between the
checkpoint and the manifest, and while saving its state; each time it is restarted with the
same work dir. After every crash the manifest names a complete, verifiable checkpoint. At
the end the ledger objects of the committed versions show each of the 24 groups trained
exactly once: none twice, none lost.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import PICKED, TEMPLATE_VERSION

from helpers.bucket_objects import assert_manifest_complete, committed, honest_shards, trained_lines
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.storage import open_storage

CRASHES = [("ingest", 1), ("optimizer_step", 2), ("checkpoint_upload", 3),
           ("before_manifest", 2), ("state_save", 2)]
SHARDS = 6


def trainer(bucket: Path, root: Path, name: str, eval_csv: Path, crash: str | None,
            key: Path, extra: tuple[str, ...] = ()) -> Proc:
    env = {"VRL_CRASH_AT": crash} if crash else {}
    return Proc(["trainer", *PICKED, *extra, "--bucket", str(bucket), "--groups-per-step", "4",
                 "--max-staleness", "50", "--eval-every", "0", "--eval-dataset", str(eval_csv),
                 "--threads", "1", "--poll-seconds", "0.05", "--work-dir", str(root / "work"),
                 "--signing-key", str(key)],
                root / f"{name}.log", root, env)


LORA = ("--lora-rank", "2")
"""The LoRA case: the template's v2, published whole, becomes the base, and every version the
trainer publishes after it is an adapter; each restart restores the adapters and their AdamW
moments from the state saved with the version it resumes (no "fresh optimizer" at the end)."""


@pytest.mark.parametrize("extra", [(), LORA], ids=["full", "lora"])
def test_sigkill_anywhere_loses_nothing_and_trains_nothing_twice(template, tmp_path, extra):
    bucket = template.copy(tmp_path / "bucket")
    keys = honest_shards(template, bucket, SHARDS)
    expected = {(k, line) for k in keys for line in range(4)}
    versions = [TEMPLATE_VERSION]
    for point, nth in CRASHES:
        proc = trainer(bucket, tmp_path, point, template.eval_csv, f"{point}:{nth}", template.key,
                       extra)
        code = proc.wait(180)
        assert code == -9 and f"crash point {point}: SIGKILL" in proc.text(), proc.text()[-2000:]
        versions.append(assert_manifest_complete(bucket, tmp_path))
        assert set(trained_lines(bucket)) <= expected
        assert max(trained_lines(bucket).values(), default=1) == 1, point
    assert versions == sorted(versions) and versions[-1] > TEMPLATE_VERSION
    final = trainer(bucket, tmp_path, "final", template.eval_csv, None, template.key, extra)
    try:
        wait_for(lambda: set(trained_lines(bucket)) == expected, 180, "every group trained")
    finally:
        final.kill()
    counts = trained_lines(bucket)
    assert set(counts) == expected and set(counts.values()) == {1}
    assert_manifest_complete(bucket, tmp_path)
    # the crashes left debris that no committed manifest points at, and it was skipped over
    debris = {layout.parse_version_dir(p.stem) for p in (bucket / "ledger").glob("v*.jsonl")}
    assert debris - set(committed(bucket)), "expected a ledger of an uncommitted version"
    for name in [p for p, _ in CRASHES[1:]] + ["final"]:
        assert "resuming" in (tmp_path / f"{name}.log").read_text()
    assert "fresh optimizer" not in (tmp_path / "final.log").read_text()
    m = Manifest.from_json((bucket / layout.MANIFEST).read_bytes())
    assert (m.adapter is not None) == bool(extra)  # adapters on v2's weights, or whole versions
    if extra:
        assert m.adapter.base == TEMPLATE_VERSION and m.weights_version == TEMPLATE_VERSION


def test_a_volunteer_killed_mid_upload_leaves_nothing_visible(template, tmp_path):
    """SIGKILL after the shard's bytes are in the temp file, before the rename: readers see
    no shard, and no partial one."""
    bucket = template.copy(tmp_path / "bucket")
    proc = Proc(["volunteer", "--bucket", str(bucket), "--id", "doomed", "--threads", "1",
                 "--trust-key", f"{template.key}.pub",
                 "--shard-groups", "4", "--prompts-per-batch", "4", "--seed", "1",
                 "--heartbeat-seconds", "0",  # the first local write must be the shard's
                 "--work-dir", str(tmp_path / "vw")], tmp_path / "vol.log", tmp_path,
                {"VRL_CRASH_AT": "local_write:1"})
    assert proc.wait(120) == -9 and "crash point local_write" in proc.text(), proc.text()[-2000:]
    folder = bucket / "rollouts" / layout.version_dir(TEMPLATE_VERSION) / "doomed"
    assert [p.name for p in folder.iterdir()][0].startswith(".")  # the cut-short temp file
    assert open_storage(str(bucket)).list("rollouts") == []
