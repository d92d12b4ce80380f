import json

import pytest

from volunteer_rl.model.chain import keyframe_weights
from volunteer_rl.model.checkpoint import fetch_checkpoint, publish_checkpoint
from volunteer_rl.model.hashing import CheckpointError
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    TaskRef,
    Dataset,
    Manifest,
    ManifestError,
    Sampling,
    read_manifest,
    write_manifest,
)
from volunteer_rl.protocol.signing import Ed25519PrivateKey, Trust, public_key_text, sign
from volunteer_rl.storage import open_storage

KEY = Ed25519PrivateKey.generate()
TRUST = Trust(public_key_text(KEY))


def make_manifest(version=3, files=None, weights=None):
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="run-x", version=version, checkpoint=layout.checkpoint_prefix(version),
                    files=files or {}, dataset=Dataset("train", "datasets/train-abc.csv", "ab" * 32, 10, 1),
                    sampling=Sampling(8, 1.0, 32), max_staleness=2, weights=weights)


def test_round_trip_and_history(tmp_path):
    s = open_storage(str(tmp_path))
    assert read_manifest(s, trust=TRUST) is None
    m = make_manifest()
    etag = write_manifest(s, m, None, KEY)
    assert read_manifest(s, trust=TRUST) == m
    assert read_manifest(s, version=3, trust=TRUST) == m
    assert read_manifest(s, version=2, trust=TRUST) is None
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert raw["schema_version"] == layout.SCHEMA_VERSION
    # A second trainer that never saw this manifest cannot advance the bucket.
    from volunteer_rl.storage.base import PreconditionFailed
    m4 = make_manifest(4)
    with pytest.raises(PreconditionFailed):
        write_manifest(s, m4, None, KEY)
    write_manifest(s, m4, etag, KEY)
    assert read_manifest(s, trust=TRUST).version == 4
    assert raw["sampling"] == {"k": 8, "temperature": 1.0, "max_new_tokens": 32}


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "malformed"),
    (b"[]", "malformed"),
    (b'{"schema_version": 99}', "schema_version 99 is not 10, the one this build speaks; upgrade"),
    (b'{"schema_version": 9}', "schema_version 9 is not 10, the one this build speaks; the trainer "
                               "runs an older"),
    (b'{"schema_version": 10, "run_id": "x"}', "malformed"),
    (b"[" * 100_000, "malformed (nested deeper than 8)"),
    (b'{"a": ' * 100_000, "malformed (nested deeper than 8)"),
    (b'{"schema_version": 6, "x": [' + b"[]" * 50_000 + b"[[[[[[[[[]]]]]]]]]]}", "nested deeper"),
    (b'{"schema_version": NaN}', "malformed (NaN is not JSON)"),
    (b'{"schema_version": 1e999}', "malformed (1e999 is not a finite number)"),
    (b'{"schema_version": ' + b"9" * 4000 + b"}", "malformed (an integer of 4000 digits)"),
    (b'{"schema_version": "\xff"}', "malformed ('utf-8' codec can't decode"),
    (b'\xff\xfe{\x00}\x00', "malformed"),
])
def test_malformed_manifest_is_one_line_naming_the_object(tmp_path, body, needle):
    s = open_storage(str(tmp_path))
    s.write("manifest.json", body)
    with pytest.raises(ManifestError) as e:
        read_manifest(s, trust=Trust(allow_unsigned=True))  # the field checks, not the signature
    msg = str(e.value)
    assert msg.startswith("manifest.json") and needle in msg and "\n" not in msg


def test_deep_manifests_are_refused_by_every_reader(tmp_path):
    """The current manifest (read and polled), a version's kept copy and `vrl status`'s
    unverified read: nesting 100,000 deep is one ManifestError naming the object, not a
    RecursionError out of the parser, before any signature is looked at."""
    from volunteer_rl.observe.status import read_manifest_unverified
    from volunteer_rl.protocol.manifest import poll_manifest

    s = open_storage(str(tmp_path))
    deep = b'{"schema_version": 4, "signature": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    s.write("manifest.json", deep)
    s.write(layout.manifest_history_key(3), deep)
    for read in (lambda: read_manifest(s, trust=TRUST),
                 lambda: poll_manifest(s, None, trust=TRUST),
                 lambda: read_manifest_unverified(s)):
        with pytest.raises(ManifestError, match=r"^manifest\.json: malformed \(nested deeper than 8\)$"):
            read()
    with pytest.raises(ManifestError, match=r"^manifests/v000003\.json: malformed \(nested deeper"):
        read_manifest(s, version=3, trust=TRUST)


def test_manifest_must_point_at_its_own_version(tmp_path):
    s = open_storage(str(tmp_path))
    data = json.loads(make_manifest().to_json())
    data["checkpoint"] = "checkpoints/v000001"
    s.write("manifest.json", json.dumps(sign(data, KEY)).encode())  # signed, still refused
    with pytest.raises(ManifestError, match="does not match version"):
        read_manifest(s, trust=TRUST)


def test_max_shard_groups_is_bounded_and_defaults_for_older_trainers(tmp_path):
    from volunteer_rl.protocol.shards import MAX_GROUPS_PER_SHARD
    data = json.loads(make_manifest().to_json())
    assert data["max_shard_groups"] == MAX_GROUPS_PER_SHARD  # signed with the rest
    del data["max_shard_groups"]                             # an older trainer's manifest
    assert Manifest.from_raw(data).max_shard_groups == MAX_GROUPS_PER_SHARD
    data["max_shard_groups"] = 64
    assert Manifest.from_raw(data).max_shard_groups == 64
    for bad in (0, -1, MAX_GROUPS_PER_SHARD + 1, 10 ** 30, "64", True, 64.0, None):
        data["max_shard_groups"] = bad
        with pytest.raises(ManifestError, match="max_shard_groups"):
            Manifest.from_raw(data)


def test_unsafe_file_names_in_manifest_refused(tmp_path):
    s = open_storage(str(tmp_path))
    data = json.loads(make_manifest().to_json())
    data["files"] = {"../../etc/passwd": {"sha256": "0" * 64, "size": 1}}
    s.write("manifest.json", json.dumps(sign(data, KEY)).encode())
    with pytest.raises(ManifestError, match="unsafe"):
        read_manifest(s, trust=TRUST)


def test_publish_then_fetch_verifies_sha(tmp_path):
    s = open_storage(str(tmp_path / "bucket"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w" * 1000)
    (src / "config.json").write_text("{}")
    files = publish_checkpoint(s, 3, src)
    assert set(files) == {"model.safetensors", "config.json"} and files["config.json"].size == 2
    entry, weights = keyframe_weights(3, b"w" * 1000)
    assert files["model.safetensors"] == entry  # listed by its root, as the trainer lists it
    m = make_manifest(3, files, weights)
    out = fetch_checkpoint(s, m, tmp_path / "dest")
    assert (out / "model.safetensors").read_bytes() == b"w" * 1000
    from volunteer_rl.storage.base import AlreadyExists
    with pytest.raises(AlreadyExists):  # written once: a version folder is never refilled
        publish_checkpoint(s, 3, src)
    # Someone swaps the bytes behind the manifest's back: fetch refuses, naming the object.
    (tmp_path / "bucket/checkpoints/v000003/model.safetensors").write_bytes(b"x" * 1000)
    with pytest.raises(CheckpointError, match="checkpoints/v000003/model.safetensors"):
        fetch_checkpoint(s, m, tmp_path / "dest2")
    assert not (tmp_path / "dest2" / "model.safetensors").exists()


def lora_raw() -> dict:
    """A valid LoRA manifest (schema 10) as JSON: v3, adapter on v0's weights."""
    from volunteer_rl.protocol.manifest import AdapterRef, FileEntry

    entry, weights = keyframe_weights(0, b"\0" * 64)
    files = {"model.safetensors": entry, "adapter.safetensors": FileEntry("cd" * 32, 100)}
    m = make_manifest(3, files, weights)
    m = Manifest(**{**m.__dict__, "adapter": AdapterRef(0, 2, 32.0, "all-linear")})
    return json.loads(Manifest.from_raw(json.loads(m.to_json())).to_json())


@pytest.mark.parametrize("change, needle", [
    (lambda r: r["adapter"].update(rank=0), "rank 0 must be integers, the rank in 1..1024"),
    (lambda r: r["adapter"].update(rank=1025), "the rank in 1..1024"),
    (lambda r: r["adapter"].update(rank="2"), "must be integers"),
    (lambda r: r["adapter"].update(base=True), "must be integers"),
    (lambda r: r["adapter"].update(alpha=0), "alpha 0 is not a number in (0, 1e+06]"),
    (lambda r: r["adapter"].update(alpha=1e7), "is not a number in"),
    (lambda r: r["adapter"].update(alpha="32"), "is not a number in"),
    (lambda r: r["adapter"].update(targets="../x\n"), "targets is not 1-200 of"),
    (lambda r: r["adapter"].update(targets=""), "targets is not 1-200 of"),
    (lambda r: r["adapter"].update(extra=1), "adapter must be null or an object of base, rank"),
    (lambda r: r["adapter"].update(base=3), "adapter: base v3 must be before v3"),
    (lambda r: r["adapter"].update(base=-1), "adapter: base v-1 must be before v3"),
    (lambda r: r["files"].pop("adapter.safetensors"), "files must list adapter.safetensors exactly"),
    (lambda r: r.update(adapter=None), "files must list adapter.safetensors exactly"),
    (lambda r: r.pop("adapter"), "malformed (KeyError"),
    (lambda r: r["adapter"].update(base=1), "patches must reach back to v1"),  # v1 is no base
])
def test_a_lora_manifests_adapter_is_bounded_and_consistent(change, needle):
    raw = lora_raw()
    m = Manifest.from_raw(dict(raw))
    assert m.adapter.base == 0 and m.weights_version == 0
    change(raw)
    with pytest.raises(ManifestError) as e:
        Manifest.from_raw(raw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
