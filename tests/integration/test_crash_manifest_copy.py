"""`kill -9` between a version's manifest.json and its manifests/ copy, then a restart.

The trainer is killed (VRL_CRASH_AT=manifest_copy, volunteer_rl/faults.py) right after it
committed v3's manifest.json, before the write-once copy manifests/v000003.json. The trainer
restarted on the same bucket repairs the copy: it must hold manifest.json's bytes, signature
included (docs/PROTOCOL.md), so that readers who verify it (`vrl eval --version 3`, `vrl gc`,
a later trainer's window recovery, all through read_manifest) accept it.
"""
from __future__ import annotations

from conftest import PICKED, TEMPLATE_VERSION

from helpers.bucket_objects import FolderBucket, as_dicts, gz_lines, key
from helpers.vrlproc import Proc
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import read_manifest
from volunteer_rl.protocol.signing import Trust, parse_private_key, public_key_text
from volunteer_rl.storage import open_storage


def trainer(bucket, root, name: str, template, env: dict, *extra: str) -> Proc:
    return Proc(["trainer", "--bucket", str(bucket), "--groups-per-step", "4",
                 "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
                 "--dashboard-every", "0", "--threads", "1", "--poll-seconds", "0.05",
                 *PICKED, "--work-dir", str(root / "work"), "--signing-key", str(template.key), *extra],
                root / f"{name}.log", root, env)


def test_a_crash_before_the_manifest_copy_is_repaired_with_the_signed_bytes(template, tmp_path):
    bucket = template.copy(tmp_path / "bucket")
    FolderBucket(bucket).put(key("vol-0", "s"), gz_lines(as_dicts(template.groups("vol-0")[:4], "vol-0")))
    version = TEMPLATE_VERSION + 1
    copy = bucket / layout.manifest_history_key(version)

    crashed = trainer(bucket, tmp_path, "crash", template, {"VRL_CRASH_AT": "manifest_copy"})
    assert crashed.wait(300) == -9 and "crash point manifest_copy" in crashed.text(), crashed.text()[-2000:]
    manifest = bucket / layout.MANIFEST
    assert f'"version": {version},' in manifest.read_text() and not copy.exists()

    # The restart resumes v3 and, with nothing more to train, stops after a second of RL.
    restarted = trainer(bucket, tmp_path, "restart", template, {}, "--max-seconds", "1")
    assert restarted.wait(300) == 0, restarted.text()[-2000:]
    assert f"resuming {template.run_id} at v{version}" in restarted.text()
    assert copy.read_bytes() == manifest.read_bytes()
    trust = Trust(public_key_text(parse_private_key(template.key.read_bytes(), str(template.key))))
    assert read_manifest(open_storage(str(bucket)), version, trust=trust).version == version
