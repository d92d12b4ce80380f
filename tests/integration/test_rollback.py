"""Rollback and freeze: a reader never goes back to a manifest behind the newest it accepted.

Every manifests/vN.json in a bucket is a validly signed manifest, and so is every manifest of
another run signed with the same key; anyone able to write manifest.json could put one back
and hold volunteers on a dead version. Unit tests of the ordering rule and the on-disk mark
first (hostile values included), then real `vrl volunteer` and `vrl eval` processes on a
copy of the session's template bucket (v0..v2, signed), ~30 s on 2 cores.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest

from helpers.grants import deal
from helpers.vrlproc import Proc, one_line_error, run_vrl, wait_for
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    TaskRef,
    Dataset,
    FileEntry,
    Manifest,
    ManifestError,
    Sampling,
    read_manifest,
    write_manifest,
)
from volunteer_rl.protocol.signing import (
    MARK_FILE,
    Ed25519PrivateKey,
    HighWater,
    KeyFileError,
    Rollback,
    Seen,
    SignatureError,
    Trust,
    behind,
    parse_private_key,
    public_key_text,
    reader_trust,
    sign,
)
from volunteer_rl.storage import open_storage

KEY = Ed25519PrivateKey.generate()
PUB = public_key_text(KEY)
T0 = 1_795_306_223.2  # some signed publish time


def manifest(version=3, run_id="run-a", created_at=T0 + 3) -> Manifest:
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id=run_id, version=version, checkpoint=layout.checkpoint_prefix(version),
                    files={"config.json": FileEntry("ab" * 32, 1000)},
                    dataset=Dataset("train", "datasets/train-abc.csv", "cd" * 32, 10, 1),
                    sampling=Sampling(8, 1.0, 32), max_staleness=2, created_at=created_at)


def put(s, m: Manifest | bytes, key=KEY) -> None:
    """manifest.json as someone with write access to the bucket would leave it."""
    s.write(layout.MANIFEST, m if isinstance(m, bytes) else m.to_signed_json(key))


def reader(s, work: Path, logs: list | None = None, **kw) -> Trust:
    return reader_trust(s.uri, None, work, PUB, kw.pop("allow_unsigned", False),
                        (logs if logs is not None else []).append)


# --- the ordering rule -------------------------------------------------------------------------

MARK = Seen("run-a", 5, T0 + 5)


@pytest.mark.parametrize("m, refused", [
    (Seen("run-a", 4, T0 + 99), True),          # a lower version, however late it claims to be
    (Seen("run-a", 0, T0), True),
    (Seen("run-a", 5, T0 + 5), False),          # the manifest it has, read again
    (Seen("run-a", 6, T0 - 99), False),         # within a run the version rules, not the clock
    (Seen("run-a", 10**30, T0), False),         # huge, but the run's own key signed it
    (Seen("run-b", 0, T0 + 6), False),          # a new run on a reset bucket: signed later
    (Seen("run-b", 99, T0 + 5), True),          # another run signed at the same instant
    (Seen("run-b", 10**30, T0 + 4), True),      # an older run, whatever its version
    (Seen("run-b", 0, -1e300), True),
    (Seen("run-b", 0, math.nan), True),         # only unsigned manifests carry these: never newer
    (Seen("run-b", 0, math.inf), True),
    (Seen("run-b", 0, 1e300), False),           # far future: only comparable to signed times
])
def test_the_ordering_rule(m, refused):
    assert behind(m, MARK) is refused


def test_the_rule_never_asks_the_readers_clock(monkeypatch):
    """A volunteer's laptop clock may be anything: the rule compares signed times only."""
    monkeypatch.setattr(time, "time", lambda: 0.0)
    assert not behind(Seen("run-b", 0, T0 + 6), MARK)
    monkeypatch.setattr(time, "time", lambda: 1e12)
    assert behind(Seen("run-b", 0, T0 + 4), MARK)


# --- the mark on disk --------------------------------------------------------------------------

def test_mark_moves_up_survives_a_restart_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "vw" / MARK_FILE
    hw = HighWater(path, "bucket-1")
    assert hw.seen is None and not path.exists()
    hw.admit(Seen("run-a", 3, T0 + 3), "manifest.json")
    hw.admit(Seen("run-a", 5, T0 + 5), "manifest.json")
    with pytest.raises(Rollback) as e:
        hw.admit(Seen("run-a", 4, T0 + 4), "manifest.json")
    assert str(e.value) == ("manifest.json: v4 of run-a is older than v5, already accepted from "
                            "this bucket (an old manifest put back?)")
    assert json.loads(path.read_text()) == {"bucket-1": {"run_id": "run-a", "version": 5,
                                                         "created_at": T0 + 5}}
    assert sorted(p.name for p in path.parent.iterdir()) == [MARK_FILE]
    again = HighWater(path, "bucket-1")                               # a restart
    assert again.seen == Seen("run-a", 5, T0 + 5)
    with pytest.raises(Rollback):
        again.admit(Seen("run-a", 4, T0 + 4), "manifest.json")
    assert HighWater(path, "bucket-2").seen is None                   # marks are per bucket


def test_refusing_an_older_run_names_both_runs_and_the_way_out(tmp_path):
    hw = HighWater(tmp_path / MARK_FILE, "s3://b/run at http://127.0.0.1:9000")
    hw.admit(Seen("run-b", 7, T0 + 100), "manifest.json")
    with pytest.raises(Rollback) as e:
        hw.admit(Seen("run-a", 42, T0 + 50), "manifest.json")
    msg = str(e.value)
    assert msg.startswith("manifest.json: v42 of run-a, signed 2026-11-22 00:11:13 UTC, is not "
                          "newer than v7 of run-b, signed 2026-11-22 00:12:03 UTC and already "
                          "accepted from this bucket") and "\n" not in msg
    assert msg.endswith(f"delete 's3://b/run at http://127.0.0.1:9000' from {tmp_path / MARK_FILE})")
    hw.admit(Seen("run-c", 0, T0 + 101), "manifest.json")             # a later run takes over
    assert hw.seen == Seen("run-c", 0, T0 + 101)
    with pytest.raises(Rollback):                                     # and b is behind it now
        hw.admit(Seen("run-b", 8, T0 + 100.5), "manifest.json")


def test_a_future_mark_holds_and_times_no_calendar_holds_still_make_one_line(tmp_path):
    hw = HighWater(tmp_path / MARK_FILE, "b")
    hw.admit(Seen("run-future", 1, 1e300), "manifest.json")  # a trainer whose clock was wrong
    assert HighWater(tmp_path / MARK_FILE, "b").seen.created_at == 1e300
    with pytest.raises(Rollback) as e:
        hw.admit(Seen("run-now", 0, T0), "manifest.json")
    assert "signed 1e+300" in str(e.value) and "\n" not in str(e.value)
    hw.admit(Seen("run-future", 2, 1.0), "manifest.json")    # its own run still moves on by version


def test_unsigned_manifests_are_checked_but_never_move_the_mark(tmp_path):
    hw = HighWater(tmp_path / MARK_FILE, "b")
    hw.admit(Seen("run-a", 5, T0), "manifest.json")
    hw.admit(Seen("run-a", 10**18, T0), "manifest.json", record=False)
    assert hw.seen.version == 5 and json.loads((tmp_path / MARK_FILE).read_text())["b"]["version"] == 5
    with pytest.raises(Rollback):
        hw.admit(Seen("run-a", 4, T0), "manifest.json", record=False)
    hw.admit(Seen("run-a", 6, T0), "manifest.json")           # the real run goes on
    assert hw.seen.version == 6


@pytest.mark.parametrize("text", [
    "", "not json", "[]", '{"b": []}', '{"b": {}}',
    '{"b": {"run_id": "r", "version": -1, "created_at": 1}}',
    '{"b": {"run_id": "r", "version": 1.5, "created_at": 1}}',
    '{"b": {"run_id": "r", "version": 2.0, "created_at": 1}}',
    '{"b": {"run_id": "r", "version": "3", "created_at": 1}}',
    '{"b": {"run_id": "r", "version": true, "created_at": 1}}',
    '{"b": {"run_id": "r", "version": 1, "created_at": NaN}}',
    '{"b": {"run_id": "r", "version": 1, "created_at": Infinity}}',
    '{"b": {"run_id": "r", "version": 1, "created_at": 1e400}}',
    '{"b": {"run_id": "r", "version": 1, "created_at": "1"}}',
    '{"b": {"run_id": "", "version": 1, "created_at": 1}}',
    '{"b": {"run_id": 7, "version": 1, "created_at": 1}}',
    '{"b": {"run_id": "r", "version": 1' + "0" * 5000 + ', "created_at": 1}}',  # past int parsing's limit
    '{"other": {"run_id": "r", "version": -5, "created_at": 1}}',              # any bad entry
])
def test_a_broken_mark_file_is_one_line_naming_it(tmp_path, text):
    path = tmp_path / MARK_FILE
    path.write_text(text)
    with pytest.raises(KeyFileError) as e:
        HighWater(path, "b")
    msg = str(e.value)
    assert msg.startswith(str(path)) and msg.endswith("fix or delete it") and "\n" not in msg
    # reader_trust (volunteer start, `vrl eval`) says the same: the CLI prints it as one line.
    with pytest.raises(KeyFileError):
        reader_trust("b", None, tmp_path, PUB, False, print)


def test_a_huge_version_in_the_file_is_a_version(tmp_path):
    path = tmp_path / MARK_FILE
    path.write_text(json.dumps({"b": {"run_id": "r", "version": 10**40, "created_at": T0}}))
    hw = HighWater(path, "b")
    with pytest.raises(Rollback):
        hw.admit(Seen("r", 10**40 - 1, T0 + 1), "manifest.json")


def test_readers_sharing_a_work_dir_keep_the_newer_mark(tmp_path):
    path = tmp_path / MARK_FILE
    ahead, lagging = HighWater(path, "b"), HighWater(path, "b")
    ahead.admit(Seen("run-a", 9, T0), "manifest.json")
    lagging.admit(Seen("run-a", 7, T0), "manifest.json")       # its write must not lower the file
    assert json.loads(path.read_text())["b"]["version"] == 9 and lagging.seen.version == 9
    with pytest.raises(Rollback):
        lagging.admit(Seen("run-a", 8, T0), "manifest.json")


def test_a_mark_that_cannot_be_written_is_a_warning_once_and_holds_in_memory(tmp_path):
    path = tmp_path / MARK_FILE
    logs: list[str] = []
    hw = HighWater(path, "b", logs.append)
    path.mkdir()                                               # a directory where the file goes
    hw.admit(Seen("run-a", 3, T0), "manifest.json")
    hw.admit(Seen("run-a", 4, T0), "manifest.json")
    assert len(logs) == 1 and logs[0].startswith("warning: cannot record v3 of run-a as the newest")
    assert "a restart will not remember it" in logs[0]
    with pytest.raises(Rollback):
        hw.admit(Seen("run-a", 3, T0), "manifest.json")


# --- through read_manifest: what volunteers and `vrl eval` read --------------------------------

def test_a_replayed_copy_is_refused_history_is_not_and_a_restart_remembers(tmp_path):
    s = open_storage(str(tmp_path / "bucket"))
    etag = None
    for v in range(4):                                             # v0..v3, each with its copy
        etag = write_manifest(s, manifest(v, created_at=T0 + v), etag, KEY)
    trust = reader(s, tmp_path / "vw")
    assert read_manifest(s, trust=trust).version == 3
    put(s, s.read(layout.manifest_history_key(1)))                 # the signed bytes of v1, put back
    with pytest.raises(Rollback, match=r"^manifest.json: v1 of run-a is older than v3, already"):
        read_manifest(s, trust=trust)
    # History asked for by number is history: readable, and it does not move the mark.
    assert read_manifest(s, 1, trust=trust).version == 1 and trust.mark.seen.version == 3
    with pytest.raises(Rollback):
        read_manifest(s, trust=reader(s, tmp_path / "vw"))         # a restart
    # Another work dir has no mark yet: the price of a mark kept per reader.
    assert read_manifest(s, trust=reader(s, tmp_path / "other")).version == 1


def test_runs_are_ordered_by_their_signed_time(tmp_path):
    s = open_storage(str(tmp_path / "bucket"))
    put(s, manifest(40, "run-old", created_at=T0))
    trust = reader(s, tmp_path / "vw")
    assert read_manifest(s, trust=trust).run_id == "run-old"
    put(s, manifest(0, "run-new", created_at=T0 + 60))     # the bucket was reset, a new run began
    assert read_manifest(s, trust=trust).run_id == "run-new"
    put(s, manifest(41, "run-old", created_at=T0 + 1))     # the old run's later manifest, put back
    with pytest.raises(Rollback, match="v41 of run-old, signed .* is not newer than v0 of run-new"):
        read_manifest(s, trust=trust)
    # Another bucket's run with the same key is no different: signed before, refused.
    put(s, manifest(7, "run-elsewhere", created_at=T0 + 30))
    with pytest.raises(Rollback):
        read_manifest(s, trust=trust)


def test_a_rollback_is_a_signature_refusal_after_the_key_check(tmp_path):
    """A foreign key is refused as such before the mark is asked anything."""
    s = open_storage(str(tmp_path / "bucket"))
    put(s, manifest(5))
    trust = reader(s, tmp_path / "vw")
    read_manifest(s, trust=trust)
    put(s, manifest(2), key=Ed25519PrivateKey.generate())
    with pytest.raises(SignatureError) as e:
        read_manifest(s, trust=trust)
    assert not isinstance(e.value, Rollback) and "signed by" in str(e.value)


def test_unsigned_with_allow_unsigned_cannot_raise_the_mark(tmp_path):
    s = open_storage(str(tmp_path / "bucket"))
    put(s, manifest(5))
    trust = reader(s, tmp_path / "vw", allow_unsigned=True)
    read_manifest(s, trust=trust)
    put(s, manifest(10**18).to_json())                      # unsigned: nobody vouches for it
    assert read_manifest(s, trust=trust).version == 10**18
    put(s, manifest(6))                                     # the trainer's next version
    assert read_manifest(s, trust=trust).version == 6 and trust.mark.seen.version == 6
    put(s, manifest(3).to_json())                           # unsigned and behind: refused too
    with pytest.raises(Rollback):
        read_manifest(s, trust=trust)


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(version=-1, checkpoint="checkpoints/v-00001"), "does not match version -1"),
    (lambda d: d.update(version=3.0), "is not an integer"),
    (lambda d: d.update(version="3"), "is not an integer"),
    (lambda d: d.update(version=True), "is not an integer"),
    (lambda d: d.update(created_at="nan"), "created_at nan"),
    (lambda d: d.update(created_at="-inf"), "created_at -inf"),
    (lambda d: d.update(created_at="yesterday"), "malformed"),
])
def test_hostile_signed_values_are_malformed_not_a_crash(tmp_path, edit, needle):
    """Values only the key's holder could sign, still refused as one line (a negative version
    used to escape as a bare ValueError from the checkpoint key)."""
    s = open_storage(str(tmp_path / "bucket"))
    doc = json.loads(manifest(3).to_json())
    edit(doc)
    put(s, json.dumps(sign(doc, KEY)).encode())
    trust = reader(s, tmp_path / "vw")
    with pytest.raises(ManifestError) as e:
        read_manifest(s, trust=trust)
    assert str(e.value).startswith("manifest.json: ") and needle in str(e.value)
    assert trust.mark.seen is None


def test_a_huge_signed_version_is_followed_and_remembered(tmp_path):
    s = open_storage(str(tmp_path / "bucket"))
    put(s, manifest(10**30))
    assert read_manifest(s, trust=reader(s, tmp_path / "vw")).version == 10**30
    assert HighWater(tmp_path / "vw" / MARK_FILE, s.uri).seen.version == 10**30


def test_fields_a_newer_trainer_adds_are_signed_and_read_by_this_build(tmp_path):
    """Why no schema bump is needed for signed additions: the signature covers fields a
    reader does not know, and from_raw reads only the ones it knows."""
    s = open_storage(str(tmp_path / "bucket"))
    doc = {**json.loads(manifest(3).to_json()), "bucket_id": "9f2c" * 8, "future": {"x": [1]}}
    put(s, json.dumps(sign(doc, KEY)).encode())
    assert read_manifest(s, trust=reader(s, tmp_path / "vw")) == manifest(3)


# --- the volunteer: refused with one warning, never fatal, keeps what it has --------------------

def test_volunteer_refuses_a_put_back_manifest_keeps_its_version_and_a_restart_too(tmp_path):
    from volunteer_rl.config import VolunteerConfig
    from volunteer_rl.volunteer.loop import Volunteer

    s = open_storage(str(tmp_path / "bucket"))
    put(s, manifest(5))
    cfg = VolunteerConfig(bucket=s.uri, volunteer_id="me", work_dir=str(tmp_path / "vw"), trust_key=PUB)
    logs: list[str] = []
    v = Volunteer(cfg, log=logs.append)
    assert v.poll().version == 5
    v.manifest = v.latest                                  # as if v5 was loaded
    put(s, manifest(3))
    assert v.poll() is None and v.poll() is None and v.latest.version == 5
    warnings = [m for m in logs if m.startswith("warning:")]
    assert warnings == ["warning: manifest.json: v3 of run-a is older than v5, already accepted from "
                        "this bucket (an old manifest put back?); refused (nothing it names is "
                        "loaded); keeping v5, still polling"]
    put(s, manifest(6))
    assert v.poll().version == 6
    # A restart while the old manifest is back: not fatal (unlike a foreign key), just refused.
    put(s, manifest(4))
    logs.clear()
    again = Volunteer(cfg, log=logs.append)
    assert again.poll() is None and again.latest is None
    assert logs == ["warning: manifest.json: v4 of run-a is older than v6, already accepted from "
                    "this bucket (an old manifest put back?); refused (nothing it names is "
                    "loaded), still polling"]


# --- `vrl status`: an old manifest is flagged --------------------------------------------------

@pytest.mark.parametrize("age, old", [(5.0, False), (15 * 60 - 1, False), (15 * 60 + 1, True),
                                      (86400.0 * 400, True), (-3600.0, False)])
def test_status_flags_an_old_manifest(age, old):
    from rich.console import Console

    from volunteer_rl.observe.status import build_status, render, trainer_lines
    from volunteer_rl.protocol.manifest import OLD_MANIFEST_SECONDS

    now = T0 + 10**6
    doc = build_status("/b", manifest(42, created_at=now - age), {}, None, [], [], now)
    t = doc["trainer"]
    assert t["manifest_old"] is old and t["manifest_age_seconds"] == pytest.approx(age)
    assert t["manifest_old_after_seconds"] == OLD_MANIFEST_SECONDS == 900
    json.dumps(doc)
    line = trainer_lines(doc)[1]
    assert ("OLD: over 15 min, is the trainer running?" in line) is old
    console = Console(record=True, width=200)
    console.print(render(doc))
    assert ("OLD: over 15 min" in console.export_text()) is old


# --- live: real `vrl` processes ----------------------------------------------------------------

@pytest.fixture(scope="module")
def live(template, tmp_path_factory):
    """A volunteer follows a copy of the template bucket to v2 and `vrl eval` reads v2; then
    manifest.json is replaced by manifests/v000001.json, the signed bytes of v1."""
    root = tmp_path_factory.mktemp("rollback")
    bucket = template.copy(root / "bucket")
    key = public_key_text(parse_private_key(template.key.read_bytes(), str(template.key)))
    current = json.loads((bucket / layout.MANIFEST).read_text())
    assert current["version"] == 2
    deal(bucket, template.key, template.run_id, "vol", 2, root / "vw", blocks=4)  # no trainer runs: dealt
    eval_cmd = ["eval", "--bucket", str(bucket), "--trust-key", key, "--work-dir", str(root / "ew"),
                "--dataset", str(template.eval_csv), "--samples", "1", "--device", "cpu"]
    volunteer = ["volunteer", "--bucket", str(bucket), "--id", "vol", "--trust-key", key,
                 "--threads", "1", "--poll-seconds", "0.2", "--prompts-per-batch", "4",
                 "--shard-groups", "4", "--heartbeat-seconds", "1", "--device", "cpu",
                 "--work-dir", str(root / "vw")]
    vol = Proc(volunteer, root / "vol.log", root)
    try:
        before = run_vrl(eval_cmd, cwd=root)                   # runs while the volunteer loads
        wait_for(lambda: "now on v2 " in vol.text() and "uploaded" in vol.text(), 120, "v2 in use")
        replaced_at = time.time()
        tmp = bucket / ".manifest.json.replay"
        tmp.write_bytes((bucket / layout.manifest_history_key(1)).read_bytes())
        os.replace(tmp, bucket / layout.MANIFEST)              # as a PUT would: whole at once
        mark = len(vol.text())
        wait_for(lambda: "warning: manifest.json: v1 " in vol.text()[mark:], 60, "the refusal")
        heartbeat = bucket / layout.heartbeat_key("vol")
        wait_for(lambda: json.loads(heartbeat.read_text())["updated_at"] > replaced_at + 1.5, 30,
                 "a heartbeat written after the refusal")
        beat = json.loads(heartbeat.read_text())  # before the restart below writes its own
        after = run_vrl(eval_cmd, cwd=root)
        vol_code = vol.terminate()
    finally:
        vol.kill()
    restarted = run_vrl([*volunteer, "--max-seconds", "5"], cwd=root)
    return {"run_id": current["run_id"], "before": before, "after": after, "log": vol.text(),
            "since": vol.text()[mark:], "heartbeat": beat,
            "vol_code": vol_code, "restarted": restarted}


def test_live_volunteer_refuses_the_older_copy_and_keeps_v2(live):
    refusal = (f"warning: manifest.json: v1 of {live['run_id']} is older than v2, already accepted "
               "from this bucket (an old manifest put back?); refused (nothing it names is "
               "loaded); keeping v2, still polling")
    assert live["since"].count(refusal) == 1, live["since"]
    assert live["log"].count("warning:") == 1                      # once, not once per poll
    assert "now on v1 " not in live["since"] and "now on" not in live["since"]
    assert live["heartbeat"]["version"] == 2 and live["heartbeat"]["run_id"] == live["run_id"]
    assert live["vol_code"] == 0                                   # it never exited on its own


def test_live_eval_refuses_the_older_copy_after_it_saw_v2(live):
    assert live["before"].returncode == 0 and "v2: greedy" in live["before"].stdout, live["before"]
    err = one_line_error(live["after"])
    assert err == (f"error: manifest.json: v1 of {live['run_id']} is older than v2, already "
                   "accepted from this bucket (an old manifest put back?)")


def test_live_a_restarted_volunteer_remembers_and_waits_instead_of_exiting(live):
    r = live["restarted"]
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"refusing manifests behind v2 of {live['run_id']}, the newest seen from this bucket" in r.stdout
    assert f"warning: manifest.json: v1 of {live['run_id']} is older than v2" in r.stdout
    assert "now on" not in r.stdout and "uploaded" not in r.stdout
