"""Retention planning (pure), deleting through Storage, and the trainer's incremental passes."""
import pytest

from helpers.recording_storage import RecordingStorage
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Dataset, Manifest, Sampling, TaskRef
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import Forbidden, NotFound, StorageError, is_missing
from volunteer_rl.storage.local import LocalStorage
from volunteer_rl.storage.retry import Retrying
from volunteer_rl.trainer.retention import TrainerRetention, collect, execute
from volunteer_rl.trainer.retention_plan import (
    BELOW_RANGE,
    UNCOMMITTED,
    chain_floor,
    kept_from,
    plan,
)
from volunteer_rl.trainer.retention_report import summary_lines, version_ranges


def ckpt(v, name="model.safetensors"):
    return layout.checkpoint_key(v, name)


def shard(v, vid="vol-1", n=0):
    return layout.shard_key(v, vid, f"0000000000001-{n:06d}-00000000")


def bucket_keys(versions, committed=None):
    """Checkpoint files, shards, manifest copies and metrics of `versions`."""
    committed = set(versions) if committed is None else committed
    keys = [layout.MANIFEST]
    for v in versions:
        keys += [ckpt(v), ckpt(v, "config.json"), shard(v), shard(v, "vol-2"),
                 layout.metrics_key(v)]
        if v in committed:
            keys.append(layout.manifest_history_key(v))
    return keys


def deleted_versions(p, prefix):
    return {layout.split_versioned_key(k)[1] for k in p.keys if k.startswith(prefix + "/")}


# --- planning ---------------------------------------------------------------------------------

def test_keeps_the_newest_n_and_removes_older_checkpoints_and_rollouts():
    p = plan(bucket_keys(range(21)), current=20, max_staleness=2, keep_versions=10,
             committed=set(range(21)))
    assert p.kept_from == 11
    assert deleted_versions(p, layout.CHECKPOINTS) == set(range(11))
    assert deleted_versions(p, layout.ROLLOUTS) == set(range(11))
    assert {r.reason for r in p.removals} == {BELOW_RANGE}
    assert len(p.keys) == 11 * 4  # two checkpoint files and two shards per old version


def test_never_deletes_the_manifest_version_nor_the_staleness_window():
    for current in range(30):
        for staleness in range(6):
            for keep in (1, 2, 5):
                p = plan(bucket_keys(range(current + 3)), current, staleness, keep,
                         committed=set(range(current + 1)))
                gone = deleted_versions(p, layout.CHECKPOINTS) | deleted_versions(p, layout.ROLLOUTS)
                assert not gone & set(range(max(0, current - staleness), current + 3)), (current, staleness, keep)
                assert current not in gone


def test_staleness_window_wider_than_keep_versions_wins():
    assert kept_from(20, max_staleness=8, keep_versions=3) == 12
    assert kept_from(20, max_staleness=1, keep_versions=3) == 18
    assert kept_from(2, max_staleness=1, keep_versions=10) == 0


def test_keeps_versions_above_the_manifest_a_publish_may_be_in_flight():
    keys = bucket_keys(range(10), committed=set(range(8)))  # v8, v9: uploaded, not committed
    p = plan(keys, current=7, max_staleness=1, keep_versions=2, committed=set(range(8)))
    assert deleted_versions(p, layout.CHECKPOINTS) == set(range(6))


def test_manifest_history_metrics_and_unknown_prefixes_stay():
    keys = bucket_keys(range(12)) + [
        "ledger/v000001.jsonl", "quarantine/v000001/vol-1/x.json", "denylist.json",
        "datasets/train-abc.csv", "volunteers/alice.json", "checkpoints/README",
        "rollouts/notaversion/x.jsonl.gz"]
    p = plan(keys, current=11, max_staleness=2, keep_versions=3, committed=set(range(12)))
    assert all(k.startswith((layout.CHECKPOINTS + "/v", layout.ROLLOUTS + "/v")) for k in p.keys)
    assert len(p.keys) == 9 * 4
    # A new prefix is removed only once it is named.
    p = plan(keys, current=11, max_staleness=2, keep_versions=3,
             prefixes=(layout.CHECKPOINTS, layout.ROLLOUTS, "ledger"))
    assert "ledger/v000001.jsonl" in p.keys and "quarantine/v000001/vol-1/x.json" not in p.keys


def test_manifest_and_history_cannot_be_named_for_deletion():
    for prefixes in ((layout.MANIFESTS,), (layout.CHECKPOINTS, layout.MANIFEST)):
        with pytest.raises(ValueError, match="never deletes"):
            plan([], 5, 1, 2, prefixes=prefixes)
    with pytest.raises(ValueError, match="--keep-versions"):
        plan([], 5, 1, 0)


def test_crash_debris_of_uncommitted_versions_is_removed_below_the_window_only():
    committed = set(range(20)) - {14, 16, 19}
    keys = bucket_keys(range(21), committed=committed)
    p = plan(keys, current=20, max_staleness=3, keep_versions=10, committed=committed)
    debris = [r for r in p.removals if r.reason == UNCOMMITTED]
    # v14 and v16: never committed, inside the kept range, below the window: checkpoint only.
    # v19: uncommitted but inside the window (manifest.json may name it while its copy is missing).
    assert [(r.prefix, r.versions) for r in debris] == [(layout.CHECKPOINTS, (14, 16))]
    assert shard(14) not in p.keys
    # Without the list of committed versions nothing is taken for debris.
    p = plan(keys, current=20, max_staleness=3, keep_versions=10, committed=None)
    assert {r.reason for r in p.removals} == {BELOW_RANGE}


def test_version_parsing_of_keys():
    assert layout.split_versioned_key("checkpoints/v000042/model.safetensors") == ("checkpoints", 42)
    assert layout.split_versioned_key("manifests/v000042.json") == ("manifests", 42)
    assert layout.split_versioned_key("ledger/v1234567.jsonl") == ("ledger", 1234567)
    for other in ["manifest.json", "checkpoints/v42/x", "checkpoints/v000042.json/x",
                  "rollouts/latest/x", "datasets/train-abc.csv", "v000001"]:
        assert layout.split_versioned_key(other) is None, other


def test_summary_names_the_kept_range_and_each_prefix():
    keys = bucket_keys(range(12), committed=set(range(12)) - {5})
    p = plan(keys, current=11, max_staleness=1, keep_versions=8, committed=set(range(12)) - {5})
    storage = open_storage("memory://retention-summary")
    for k in p.keys:
        storage.write(k, b"x" * 100)
    lines = summary_lines(p, execute(storage, p, dry_run=True), dry_run=True)
    assert lines[0].startswith("kept: v4-v11 ")
    assert lines[1] == ("checkpoints/: would remove 10 objects, 1.0 kB "
                        "(8 below the kept range: v0-v3; 2 never committed: v5)")
    assert lines[2] == "rollouts/: would remove 8 objects, 800 B (8 below the kept range: v0-v3)"
    assert version_ranges([0, 1, 2, 5, 7, 8]) == "v0-v2, v5, v7-v8"


# --- deleting --------------------------------------------------------------------------------

def manifest(version, max_staleness=1):
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="run-x", version=version, checkpoint=layout.checkpoint_prefix(version),
                    files={}, dataset=Dataset("train", "datasets/train-abc.csv", "ab" * 32, 10, 1),
                    sampling=Sampling(2, 1.0, 8), max_staleness=max_staleness)


UNSIGNED = Trust(allow_unsigned=True)  # these manifests are written by hand, not signed


def set_current(storage, version):
    """manifest.json as the trainer leaves it (its manifests/ copy is written by `fill`)."""
    storage.write(layout.MANIFEST, manifest(version).to_json())


def fill(storage, versions, committed=None):
    for key in bucket_keys(versions, committed):
        parsed = layout.split_versioned_key(key)
        if parsed is not None and parsed[0] == layout.MANIFESTS:
            storage.write(key, manifest(parsed[1]).to_json())
        elif key != layout.MANIFEST:
            storage.write(key, b"12345")


def with_chain(version: int, keyframe: int, first_patch: int | None) -> Manifest:
    """A manifest whose weights come from keyframe `keyframe` and patches from `first_patch`."""
    from volunteer_rl.protocol.manifest import Keyframe, Link, Weights, WeightsEntry, pieces_root

    sha = "ab" * 32
    root = pieces_root(1 << 20, 5, (sha,))
    patches = () if first_patch is None else tuple(Link(v, sha, 1) for v in range(first_patch, version + 1))
    m = manifest(version)
    return Manifest(**{**m.__dict__, "files": {"model.safetensors": WeightsEntry(root, 5)},
                       "weights": Weights(1 << 20, (sha,), Keyframe(keyframe, root, 5), patches)})


def test_the_folders_the_kept_versions_are_rebuilt_from_stay(tmp_path):
    """Kept range v5-v7 (keep 3); v5's keyframe is v2, so v2-v4 stay under checkpoints/ (their
    rollouts go); a manifest copy that cannot be read keeps every checkpoint."""
    s = open_storage(str(tmp_path))
    fill(s, range(8))
    s.write(layout.manifest_history_key(5), with_chain(5, 2, 3).to_json())
    s.write(layout.MANIFEST, with_chain(7, 6, 3).to_json())
    p, out = collect(s, keep_versions=3, trust=UNSIGNED)
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {2, 3, 4, 5, 6, 7}
    assert {layout.split_versioned_key(k)[1] for k in s.list("rollouts")} == {5, 6, 7}
    # the current manifest lists patches from v1 on: v1's folder stays too
    fill(s, range(8))
    s.write(layout.manifest_history_key(5), with_chain(5, 2, 3).to_json())
    s.write(layout.MANIFEST, with_chain(7, 6, 1).to_json())
    collect(s, keep_versions=3, trust=UNSIGNED)
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {1, 2, 3, 4, 5, 6, 7}
    # v5's copy unreadable: nothing under checkpoints/ goes
    fill(s, range(8))
    s.write(layout.manifest_history_key(5), b"not a manifest")
    collect(s, keep_versions=3, trust=UNSIGNED)
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == set(range(8))
    assert chain_floor(with_chain(7, 6, None), with_chain(5, 2, 3), 5) == 2
    assert chain_floor(with_chain(7, 6, None), None, 5) == 0


def lora(version: int, base: int, keyframe: int | None = None) -> Manifest:
    """A LoRA version's manifest: the weights of `base` (a keyframe, or `keyframe` and
    patches up to the base), and its own adapter."""
    from dataclasses import replace

    from volunteer_rl.protocol.manifest import ADAPTER_FILE, AdapterRef, FileEntry

    m = with_chain(version, base if keyframe is None else keyframe,
                   None if keyframe is None else keyframe + 1)
    weights = replace(m.weights, patches=tuple(p for p in m.weights.patches if p.version <= base))
    return replace(m, weights=weights, files={**m.files, ADAPTER_FILE: FileEntry("cd" * 32, 7)},
                   adapter=AdapterRef(base, 1, 32.0, "all-linear"))


def test_a_lora_runs_base_stays_and_the_adapters_below_the_kept_range_go(tmp_path):
    """Kept range v7-v9 (keep 3) of a LoRA run on base v2: v2's folder stays (volunteers fetch
    the base from it), the adapter folders v0-v1 and v3-v6 go; a base rebuilt from keyframe v1
    and a patch keeps v1 and v2. Both `vrl gc` and the trainer's passes."""
    s = open_storage(str(tmp_path))
    fill(s, range(10))
    s.write(layout.manifest_history_key(7), lora(7, 2).to_json())
    s.write(layout.MANIFEST, lora(9, 2).to_json())
    collect(s, keep_versions=3, trust=UNSIGNED)
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {2, 7, 8, 9}
    assert {layout.split_versioned_key(k)[1] for k in s.list("rollouts")} == {7, 8, 9}
    fill(s, range(10))
    s.write(layout.manifest_history_key(7), lora(7, 2, keyframe=1).to_json())
    s.write(layout.MANIFEST, lora(9, 2, keyframe=1).to_json())
    collect(s, keep_versions=3, trust=UNSIGNED)
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {1, 2, 7, 8, 9}
    fill(s, range(10))
    r = TrainerRetention(s, keep_versions=3, every=1, log=lambda line: None)
    r.run_pass(lora(9, 2))
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {2, 7, 8, 9}


def test_collect_deletes_and_dry_run_does_not(tmp_path):
    s = open_storage(str(tmp_path))
    fill(s, range(8))
    s.write("ledger/v000001.jsonl", b"{}")
    set_current(s, 7)
    before = s.list("")
    _, out = collect(s, keep_versions=3, dry_run=True, trust=UNSIGNED)
    assert s.list("") == before and out.objects == 5 * 4 and out.bytes == 5 * 4 * 5
    _, out = collect(s, keep_versions=3, trust=UNSIGNED)
    assert out.objects == 20 and not out.failed
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints") + s.list("rollouts")} == {5, 6, 7}
    assert s.exists("ledger/v000001.jsonl") and s.exists(layout.manifest_history_key(0))
    assert s.exists(layout.metrics_key(0)) and s.exists(layout.MANIFEST)
    # No empty version folders are left behind on a folder bucket.
    assert not (tmp_path / "checkpoints" / "v000000").exists()
    assert not (tmp_path / "rollouts" / "v000000").exists()
    # A second pass finds nothing left to do.
    assert collect(s, keep_versions=3, trust=UNSIGNED)[1].objects == 0


def test_collect_refuses_a_bucket_without_manifest(tmp_path):
    from volunteer_rl.protocol.manifest import ManifestError

    s = open_storage(str(tmp_path))
    fill(s, range(3))
    with pytest.raises(ManifestError, match="manifest.json: not found"):
        collect(s, keep_versions=1, trust=UNSIGNED)
    assert len(s.list("checkpoints")) == 6


class DenyDelete:
    """A folder bucket whose delete fails for some keys, as a bucket policy would."""

    def __init__(self, root, deny):
        self.inner, self.deny, self.uri = LocalStorage(root), deny, str(root)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete(self, key):
        if any(d in key for d in self.deny):
            raise Forbidden(f"{key}: access denied (delete)")
        self.inner.delete(key)

    def delete_many(self, keys):  # as S3's DeleteObjects: per-key errors, the rest deleted
        failed = [(k, f"{k}: access denied (delete)") for k in keys if any(d in k for d in self.deny)]
        self.inner.delete_many([k for k in keys if not any(d in k for d in self.deny)])
        return failed


def test_failed_deletes_are_reported_and_the_rest_goes_on(tmp_path):
    s = Retrying(DenyDelete(tmp_path, deny=["vol-2"]), sleep=lambda s: None)
    fill(s, range(6))
    set_current(s, 5)
    _, out = collect(s, keep_versions=2, trust=UNSIGNED)
    assert len(out.failed) == 4 and all("vol-2" in k for k, _ in out.failed)
    assert all(m.startswith(k) and "\n" not in m for k, m in out.failed)
    assert out.objects == 4 * 3  # both checkpoint files and vol-1's shard of v0-v3
    assert sorted(k for k in s.list("rollouts") if "vol-1" in k) == [shard(4), shard(5)]


def test_objects_already_gone_are_not_failures(tmp_path):
    s = open_storage(str(tmp_path))
    fill(s, range(4))
    p = plan(s.list("checkpoints"), 3, 0, 1)
    s.delete(ckpt(0))  # lifecycle expiry or another gc got there first
    out = execute(s, p)
    assert not out.failed and out.objects == 5


def test_is_missing():
    assert is_missing(NotFound("k: not found"))
    assert is_missing(Forbidden("k: access denied (read)"))  # S3 403, also through Retrying
    assert not is_missing(StorageError("k: read failed: timeout"))


# --- the trainer's passes ---------------------------------------------------------------------

def listed(s: RecordingStorage) -> list[str]:
    return [prefix for _, prefix, _, _ in s.lists]


def test_trainer_passes_walk_only_the_versions_that_fell_out(tmp_path):
    s = RecordingStorage(open_storage(str(tmp_path)))
    logs = []
    r = TrainerRetention(s, keep_versions=3, every=2, log=logs.append)
    fill(s, range(11), committed=set(range(11)) - {2})
    out = r.run_pass(manifest(10))  # first pass: where to start, then v0-v7 of each prefix
    assert listed(s)[:2] == ["checkpoints", "manifests"] and "rollouts" not in listed(s)
    assert out.objects == 8 * 4 and not out.failed
    assert r.next == {"rollouts": 8, "checkpoints": 8} and r.debris == []
    assert logs == ["retention: removed 32 objects; kept v8-v10"]
    assert s.calls["delete"] == 0 and s.calls["size"] == 0  # batches, no HEAD per object
    s.lists.clear()
    fill(s, range(11, 13))
    out = r.run_pass(manifest(12))
    assert sorted(listed(s)) == ["checkpoints/v000008", "checkpoints/v000009",
                                "rollouts/v000008", "rollouts/v000009"]
    assert out.objects == 8 and r.next == {"rollouts": 10, "checkpoints": 10}
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {10, 11, 12}


def test_crash_debris_is_found_by_the_first_pass(tmp_path):
    """v5's checkpoint folder never got its manifests/ copy: below the window it goes, though
    it is in the kept range; v6's (in the window) stays."""
    s = open_storage(str(tmp_path))
    fill(s, range(9), committed=set(range(9)) - {5, 7})
    r = TrainerRetention(s, keep_versions=6, every=1)
    out = r.run_pass(manifest(8))
    assert out.removed[("checkpoints", UNCOMMITTED)].objects == 2 and r.debris == []
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {3, 4, 6, 7, 8}


def test_crash_debris_left_by_a_pass_out_of_budget_goes_in_the_next(tmp_path, monkeypatch):
    import volunteer_rl.trainer.retention as retention

    monkeypatch.setattr(retention, "MAX_LISTINGS_PER_PASS", 3)  # the start's two, one more
    s = open_storage(str(tmp_path))
    fill(s, range(9), committed=set(range(9)) - {4, 5})
    r = TrainerRetention(s, keep_versions=6, every=1)
    r.run_pass(manifest(8))
    assert r.debris == [5]
    r.run_pass(manifest(8))
    assert r.debris == [] and s.list(layout.checkpoint_prefix(5)) == []
    assert s.list(layout.checkpoint_prefix(4)) == [] and s.list(layout.checkpoint_prefix(6))


def junk(root, version, n, vid="vol-9"):
    """`n` objects a volunteer wrote under its own folder of `version` (of a folder bucket at
    `root`, written as plain files: quicker than one fsync each)."""
    folder = root / layout.rollout_volunteer_prefix(version, vid)
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"junk-{i:06d}").write_bytes(b"j")


def test_a_pass_is_bounded_whatever_volunteers_wrote_and_the_next_ones_finish(tmp_path, monkeypatch):
    """A volunteer's 1,200 objects in each of two old versions: each pass makes at most its
    listings and deletes (in batches), and a few passes later everything expired is gone."""
    import volunteer_rl.trainer.retention as retention

    monkeypatch.setattr(retention, "LIST_LIMIT", 100)  # the same bounds, at a test's scale
    monkeypatch.setattr(retention, "MAX_DELETES_PER_PASS", 500)
    monkeypatch.setattr(retention, "MAX_LISTINGS_PER_PASS", 20)
    s = RecordingStorage(open_storage(str(tmp_path)))
    fill(s, range(8))
    junk(tmp_path, 1, 1200)
    junk(tmp_path, 3, 1200)
    logs = []
    r = TrainerRetention(s, keep_versions=2, every=1, log=logs.append)
    passes = 0
    while s.list("rollouts/v000003", limit=1) or s.list("checkpoints/v000005", limit=1):
        s.calls.clear()
        s.lists.clear()
        out = r.run_pass(manifest(7))
        passes += 1
        assert s.calls["list"] + s.calls["list_level"] <= 20
        assert all(limit is not None and limit <= 100 for name, prefix, limit, _ in s.lists
                   if name == "list" and prefix.startswith("rollouts"))
        assert out.objects <= 500 and s.calls["delete_many"] <= s.calls["list"]
        assert s.calls["delete"] == 0 and s.calls["size"] == 0
        assert passes < 10, logs
    assert passes == 5  # 2,400 junk objects and the run's 24 at 500 a pass
    assert {layout.split_versioned_key(k)[1] for k in s.list("rollouts")} == {6, 7}
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {6, 7}
    assert logs[0].endswith("; more next pass") and not logs[-1].endswith("more next pass")


def test_retention_log_lines_escape_the_keys_volunteers_chose(tmp_path):
    """A key with ESC, BEL and a newline that cannot be deleted is logged escaped."""
    evil = f"{layout.rollout_volunteer_prefix(0, 'vol-2')}/\x1b]0;owned\x07\nfake line"
    s = Retrying(DenyDelete(tmp_path, deny=["owned"]), sleep=lambda s: None)
    fill(s, range(4))
    s.write(evil, b"x")
    logs = []
    TrainerRetention(s, keep_versions=2, every=1, log=logs.append).run_pass(manifest(3))
    named = [line for line in logs if "owned" in line]
    assert named and all(ch.isprintable() for line in logs for ch in line), logs
    assert "vol-2/\\x1b]0;owned\\x07\\x0afake line: access denied" in named[0]


def test_trainer_pass_failures_never_stop_the_trainer(tmp_path):
    logs = []
    s = Retrying(DenyDelete(tmp_path, deny=["checkpoints"]), sleep=lambda s: None)
    fill(s, range(8))
    r = TrainerRetention(s, keep_versions=2, every=1, log=logs.append)
    out = r.run_pass(manifest(7))
    # every checkpoint refused: each named or counted once, and the walk goes on past them
    assert len(out.failed) == 6 * 2 and r.next == {"rollouts": 6, "checkpoints": 6}
    assert out.objects == 6 * 2
    assert logs[0] == "retention: removed 12 objects; kept v6-v7; could not delete 12 objects"
    assert sum("could not delete" in line for line in logs) == 1 + TrainerRetention.MAX_REPORTED
    logs.clear()
    assert not r.run_pass(manifest(7)).failed and logs == []  # not tried again
    with pytest.raises(ValueError):
        TrainerRetention(s, keep_versions=0, every=1)


class Unanswered(DenyDelete):
    """A bucket whose delete requests fail as a whole (an outage), not key by key."""

    def delete_many(self, keys):
        raise StorageError(f"{keys[0]}: delete failed: connection reset")


def test_a_delete_request_that_goes_unanswered_is_tried_again_by_the_next_pass(tmp_path):
    s = Unanswered(tmp_path, deny=[])
    fill(s, range(8))
    r = TrainerRetention(s, keep_versions=2, every=1, log=[].append)
    out = r.run_pass(manifest(7))
    assert out.failed and r.next == {"rollouts": 0, "checkpoints": 0}
    s.delete_many = s.inner.delete_many  # the bucket answers again
    r.run_pass(manifest(7))
    assert r.next == {"rollouts": 6, "checkpoints": 6} and len(s.list("rollouts")) == 4


def test_an_object_that_cannot_be_deleted_is_reported_and_retention_goes_on(tmp_path):
    """On a folder bucket a volunteer leaves, among its shards of v1, a symlink to a file
    outside the bucket: listed as an object, never deletable (the key escapes the bucket).
    The trainer's pass names it once, escaped, counts it, and goes on: the other expired
    versions go, checkpoints included, and later passes do not try it again."""
    s = open_storage(str(tmp_path / "bucket"))
    fill(s, range(8))
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not the bucket's")
    folder = tmp_path / "bucket" / layout.rollout_volunteer_prefix(1, "vol-2")
    (folder / "link\x1b[2J").symlink_to(outside)
    logs = []
    r = TrainerRetention(s, keep_versions=2, every=1, log=logs.append)
    out = r.run_pass(manifest(7))
    assert [k for k, _ in out.failed] == [f"{layout.rollout_volunteer_prefix(1, 'vol-2')}/link\x1b[2J"]
    assert logs[0] == "retention: removed 24 objects; kept v6-v7; could not delete 1 object"
    assert len(logs) == 2 and "link\\x1b[2J: key escapes the bucket folder" in logs[1]
    assert all(ch.isprintable() for line in logs for ch in line)
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {6, 7}
    assert {layout.split_versioned_key(k)[1] for k in s.list("rollouts")} == {1, 6, 7}
    assert outside.read_bytes() == b"not the bucket's"
    logs.clear()
    fill(s, range(8, 10))
    out = r.run_pass(manifest(9))  # the next pass walks v6-v7 only
    assert not out.failed and logs == ["retention: removed 8 objects; kept v8-v9"]


def test_a_folder_of_too_many_refused_objects_is_given_up(tmp_path, monkeypatch):
    import volunteer_rl.trainer.retention as retention

    monkeypatch.setattr(retention, "LIST_LIMIT", 4)
    monkeypatch.setattr(retention, "MAX_REFUSED_PER_FOLDER", 4)
    s = Retrying(DenyDelete(tmp_path, deny=["vol-9"]), sleep=lambda s: None)
    fill(s, range(4))
    junk(tmp_path, 0, 9)
    logs = []
    r = TrainerRetention(s, keep_versions=2, every=1, log=logs.append)
    out = r.run_pass(manifest(3))
    assert len(out.failed) == 6 and r.next == {"rollouts": 2, "checkpoints": 2}
    assert ("warning: retention leaves the rest of rollouts/v000000/: more than 4 objects "
            "there could not be deleted") in logs
    assert {layout.split_versioned_key(k)[1] for k in s.list("checkpoints")} == {2, 3}


class Held:
    """A real store whose listings, made from any thread but `free`, wait until `release`
    is set; `threads` holds the thread of every listing."""

    def __init__(self, inner, free):
        import threading

        self.inner, self.uri, self.free = inner, inner.uri, free
        self.entered, self.release, self.threads = threading.Event(), threading.Event(), []

    def __getattr__(self, name):
        import threading

        fn = getattr(self.inner, name)
        if name not in ("list", "list_level"):
            return fn

        def held(*args, **kwargs):
            self.threads.append(threading.current_thread())
            if threading.current_thread() is not self.free:
                self.entered.set()
                self.release.wait()
            return fn(*args, **kwargs)
        return held


def test_after_publish_runs_the_pass_on_its_own_thread_one_at_a_time(tmp_path):
    import threading

    s = Held(open_storage(str(tmp_path)), free=threading.main_thread())
    fill(s.inner, range(8))
    logs = []  # (thread, line): only the trainer's thread writes its log
    r = TrainerRetention(s, keep_versions=2, every=1,
                         log=lambda line: logs.append((threading.current_thread(), line)))
    r.after_publish(manifest(6))  # returns while its pass is held in a listing
    assert s.entered.wait(60) and not s.release.is_set()
    r.after_publish(manifest(7))  # due while one runs: not a second thread
    assert threading.main_thread() not in s.threads
    assert sum(t.name == "vrl-retention" for t in threading.enumerate()) == 1
    s.release.set()
    r.close()
    assert {layout.split_versioned_key(k)[1] for k in s.list("rollouts")} == {6, 7}  # v7's pass ran
    assert [line for _, line in logs] == ["retention: removed 20 objects; kept v5-v6",
                                          "retention: removed 4 objects; kept v6-v7"]
    assert {thread for thread, _ in logs} == {threading.main_thread()}


def test_close_on_a_stop_ends_the_pass_at_its_next_request(tmp_path):
    import threading

    stop = threading.Event()
    s = Held(open_storage(str(tmp_path)), free=threading.main_thread())
    fill(s.inner, range(8))
    logs = []
    r = TrainerRetention(s, keep_versions=2, every=1, log=logs.append, stopping=stop.is_set)
    r.after_publish(manifest(7))
    assert s.entered.wait(60)
    stop.set()
    s.release.set()
    r.close()
    assert not r._thread.is_alive() and r.next is not None
    assert len(s.list("rollouts")) == 16 and logs == []  # cut short before any delete
    r.after_publish(manifest(7))  # closed: no pass after close
    assert not r._thread.is_alive()


def test_gc_command_names_each_failed_object_and_exits_1(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import volunteer_rl.storage
    from volunteer_rl_cli.main import app

    s = Retrying(DenyDelete(tmp_path, deny=["vol-2"]), sleep=lambda s: None)
    fill(s, range(6))
    set_current(s, 5)
    monkeypatch.setattr(volunteer_rl.storage, "open_storage", lambda uri, endpoint=None, **kw: s)
    r = CliRunner().invoke(app, ["gc", "--bucket", str(tmp_path), "--keep-versions", "2",
                                 "--allow-unsigned"])
    assert r.exit_code == 1, r.output
    out, err = r.stdout.splitlines(), r.stderr.splitlines()
    assert out[0].startswith("kept: v4-v5 ")
    assert out[1:] == ["checkpoints/: removed 8 objects, 40 B (8 below the kept range: v0-v3)",
                       "rollouts/: removed 4 objects, 20 B (4 below the kept range: v0-v3)"]
    assert [line.split(":")[0] for line in err[:4]] == ["error"] * 4
    assert [line.split()[4].rstrip(":") for line in err[:4]] == [shard(v, "vol-2") for v in range(4)]
    assert err[4] == "error: 4 objects could not be deleted; run vrl gc again to retry"
