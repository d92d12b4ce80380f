"""Readers facing objects built to crash them: real `vrl` processes on a folder bucket.

A manifest.json nested 100,000 deep used to raise RecursionError out of the parser, before
any signature check: a volunteer died with a traceback, and so did `vrl status`. Now it is a
refused manifest like any other: one line, and a volunteer keeps what it holds.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from helpers.grants import deal
from helpers.vrlproc import Proc, one_line_error, run_vrl, wait_for
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.signing import parse_private_key, public_key_text

DEEP = b'{"schema_version": 4, "run_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
REFUSED = "manifest.json: malformed (nested deeper than 8)"


def put_deep_manifest(bucket) -> None:
    tmp = bucket / ".manifest.json.deep"
    tmp.write_bytes(DEEP)
    os.replace(tmp, bucket / layout.MANIFEST)  # as a PUT would: whole at once


def test_deep_manifest_on_a_fresh_volunteer_and_status_is_one_line(tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    put_deep_manifest(bucket)
    # No model yet: it says so once and keeps waiting for a valid manifest, as for any
    # malformed one (test_loop_local), instead of dying in the parser.
    r = run_vrl(["volunteer", "--bucket", str(bucket), "--id", "v", "--max-seconds", "3",
                 "--poll-seconds", "0.2", "--work-dir", str(tmp_path / "vw")], cwd=tmp_path)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.count(REFUSED) == 1 and "Traceback" not in r.stdout + r.stderr, r
    for cmd in (["status"], ["status", "--json"]):
        err = one_line_error(run_vrl([*cmd, "--bucket", str(bucket)], cwd=tmp_path))
        assert err == f"error: {REFUSED}"


def test_deep_manifest_leaves_a_running_volunteer_on_its_version(template, tmp_path):
    bucket = template.copy(tmp_path / "bucket")
    key = public_key_text(parse_private_key(template.key.read_bytes(), str(template.key)))
    deal(bucket, template.key, template.run_id, "vol", 2, tmp_path / "vw", blocks=8)  # no trainer runs: dealt
    vol = Proc(["volunteer", "--bucket", str(bucket), "--id", "vol", "--trust-key", key,
                "--threads", "1", "--poll-seconds", "0.2", "--prompts-per-batch", "4",
                "--shard-groups", "4", "--heartbeat-seconds", "1", "--device", "cpu", "--log-shards",
                "--work-dir", str(tmp_path / "vw")], tmp_path / "vol.log", tmp_path)
    try:
        wait_for(lambda: "now on v2 " in vol.text() and "uploaded" in vol.text(), 120, "v2 in use")
        put_deep_manifest(bucket)
        mark = len(vol.text())
        wait_for(lambda: REFUSED in vol.text()[mark:], 60, "the refusal")
        refused_at = time.time()
        # still at work on v2: it uploads again after the refusal, and says so in a heartbeat.
        # It may have sampled all 64 numbers dealt before it saw the refusal (it samples them
        # in seconds): more numbers, above those, give it work whatever the timing. It reads
        # its grant object on every turn of its loop, manifest or none.
        at = len(vol.text())
        deal(bucket, template.key, template.run_id, "vol", 2, None, blocks=4, first_block=8)
        wait_for(lambda: "uploaded rollouts/v000002/" in vol.text()[at:], 60,
                 "an upload after the refusal")
        heartbeat = bucket / layout.heartbeat_key("vol")
        wait_for(lambda: json.loads(heartbeat.read_text())["updated_at"] > refused_at, 60,
                 "a heartbeat written after the refusal")
        beat = json.loads(heartbeat.read_text())
        code = vol.terminate()
    finally:
        vol.kill()
    log = vol.text()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert log[mark:].count(REFUSED) == 1 and "now on" not in log[mark:], log[mark:]
    assert beat["version"] == 2, beat


def test_a_deep_denylist_is_one_line(tmp_path):
    """denylist.json, read by the trainer, `vrl status` and `vrl volunteers list`, with the
    same bounds: one DenylistError line, not a RecursionError."""
    from volunteer_rl.protocol.fleet import DenylistError, read_denylist
    from volunteer_rl.storage import open_storage

    s = open_storage(str(tmp_path))
    s.write(layout.DENYLIST, b'{"volunteers": ' + b"[" * 100_000)
    with pytest.raises(DenylistError, match=r"^denylist\.json: malformed \(nested deeper than 8\)$"):
        read_denylist(s)
