"""Signed manifests without a model: keys, signatures, trust decisions, pinning."""
from __future__ import annotations

import dataclasses
import json
import stat

import pytest

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    TaskRef,
    Dataset,
    FileEntry,
    Manifest,
    Sampling,
    read_manifest,
    write_manifest,
)
from volunteer_rl.protocol.signing import (
    DOMAIN,
    Ed25519PrivateKey,
    ForeignKey,
    KeyFileError,
    MARK_FILE,
    PIN_FILE,
    PinFile,
    SignatureError,
    Trust,
    Unsigned,
    canonical_bytes,
    load_or_create_key,
    public_key_text,
    reader_trust,
    resolve_trust_key,
    sign,
    signer,
)
from volunteer_rl.storage import open_storage

KEY = Ed25519PrivateKey.generate()
PUB = public_key_text(KEY)
OTHER = Ed25519PrivateKey.generate()


def manifest(version=3) -> Manifest:
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="run-x", version=version, checkpoint=layout.checkpoint_prefix(version),
                    files={"config.json": FileEntry("ab" * 32, 1000)},
                    dataset=Dataset("train", "datasets/train-abc.csv", "cd" * 32, 10, 1),
                    sampling=Sampling(8, 1.0, 32), max_staleness=2)


def bucket_with(tmp_path, m: Manifest, key=KEY):
    s = open_storage(str(tmp_path / "bucket"))
    write_manifest(s, m, None, key)
    return s


# --- signatures --------------------------------------------------------------------------------

def test_round_trip_names_the_signer_and_survives_reformatting():
    doc = sign(json.loads(manifest().to_json()), KEY)
    assert doc["signature"]["alg"] == "ed25519" and doc["signature"]["public_key"] == PUB
    assert signer(doc, "manifest.json") == PUB
    # Key order and whitespace are not part of what is signed: the canonical form is.
    reformatted = json.loads(json.dumps(doc, indent=4, sort_keys=False))
    assert signer(reformatted, "manifest.json") == PUB
    assert canonical_bytes(doc).startswith(DOMAIN) and b" " not in canonical_bytes(doc)


@pytest.mark.parametrize("edit", [
    lambda d: d["files"]["config.json"].update(sha256="ef" * 32),
    lambda d: d.update(version=4, checkpoint="checkpoints/v000004"),
    lambda d: d["sampling"].update(temperature=0.5),
    lambda d: d.update(extra="field"),                       # additions are covered too
    lambda d: d["signature"].update(public_key=public_key_text(OTHER)),  # claims another signer
    lambda d: d["signature"].update(public_key="ed25519:AAAA"),
    lambda d: d["signature"].update(value="not base64!"),
    lambda d: d["signature"].update(alg="rsa"),
])
def test_any_change_after_signing_fails(edit):
    doc = sign(json.loads(manifest().to_json()), KEY)
    edit(doc)
    with pytest.raises(SignatureError) as e:
        Trust(PUB).check(doc, "manifest.json")
    assert str(e.value).startswith("manifest.json: ") and "\n" not in str(e.value)


def test_tampered_bytes_in_the_bucket_are_refused_before_use(tmp_path):
    s = bucket_with(tmp_path, manifest())
    path = tmp_path / "bucket" / "manifest.json"
    path.write_text(path.read_text().replace("ab" * 32, "ef" * 32))  # point at other weights
    with pytest.raises(SignatureError, match=r"^manifest.json: signature does not verify"):
        read_manifest(s, trust=Trust(PUB))


def test_wrong_key_is_refused_naming_both_keys(tmp_path):
    s = bucket_with(tmp_path, manifest())
    with pytest.raises(ForeignKey) as e:
        read_manifest(s, trust=Trust(public_key_text(OTHER)))
    msg = str(e.value)
    assert msg.startswith("manifest.json: signed by " + PUB) and public_key_text(OTHER) in msg
    # Someone who re-signs a manifest with a key of their own is a foreign signer too.
    assert read_manifest(s, trust=Trust(PUB)).files == manifest().files
    s2 = bucket_with(tmp_path / "b2", manifest(), key=OTHER)
    with pytest.raises(ForeignKey):
        read_manifest(s2, trust=Trust(PUB))


def test_history_copy_carries_the_same_signature(tmp_path):
    s = bucket_with(tmp_path, manifest(5))
    root = tmp_path / "bucket"
    assert (root / "manifest.json").read_bytes() == (root / "manifests/v000005.json").read_bytes()
    assert read_manifest(s, 5, trust=Trust(PUB)).version == 5
    with pytest.raises(ForeignKey, match="manifests/v000005.json: signed by"):
        read_manifest(s, 5, trust=Trust(public_key_text(OTHER)))


def test_unsigned_needs_allow_unsigned_and_a_signature_is_checked_anyway(tmp_path):
    s = open_storage(str(tmp_path))
    s.write("manifest.json", manifest().to_json())               # an older trainer's manifest
    with pytest.raises(Unsigned, match="manifest.json: unsigned .*--allow-unsigned"):
        read_manifest(s, trust=Trust(PUB))
    assert read_manifest(s, trust=Trust(PUB, allow_unsigned=True)).version == 3
    s.write("manifest.json", manifest().to_signed_json(OTHER))
    with pytest.raises(ForeignKey):
        read_manifest(s, trust=Trust(PUB, allow_unsigned=True))


def test_a_full_fetch_leaves_only_the_files_the_signed_manifest_names(tmp_path):
    from volunteer_rl.model.chain import keyframe_weights
    from volunteer_rl.model.checkpoint import fetch_checkpoint, publish_checkpoint

    s = open_storage(str(tmp_path / "bucket"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w" * 100)
    files = publish_checkpoint(s, 3, src)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "generation_config.json").write_text("{}")  # left by another version or bucket
    fetch_checkpoint(s, dataclasses.replace(manifest(3), files=files,
                                            weights=keyframe_weights(3, b"w" * 100)[1]), dest)
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]


# --- keys --------------------------------------------------------------------------------------

def test_trainer_key_is_created_once_private_and_with_a_public_file(tmp_path):
    path = tmp_path / "tw" / "signing-key.pem"
    key, created = load_or_create_key(path)
    assert created and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert b"PRIVATE KEY" in path.read_bytes()
    again, created = load_or_create_key(path)
    assert not created and public_key_text(again) == public_key_text(key)
    pub = tmp_path / "tw" / "signing-key.pem.pub"
    assert pub.read_text().strip() == public_key_text(key)
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_bad_key_file_is_a_clear_error(tmp_path):
    path = tmp_path / "k.pem"
    path.write_text("not a key")
    with pytest.raises(KeyFileError, match=f"{path}: not an unencrypted PEM private key"):
        load_or_create_key(path)


def test_trust_key_from_text_or_file(tmp_path):
    assert resolve_trust_key(PUB) == PUB and resolve_trust_key(None) is None
    f = tmp_path / "trainer.pub"
    f.write_text(PUB + "\n")
    assert resolve_trust_key(str(f)) == PUB
    for bad in ("ed25519:AAAA", "ed25519:***", str(tmp_path / "missing")):
        with pytest.raises(KeyFileError, match="--trust-key"):
            resolve_trust_key(bad)


def test_trainer_refuses_a_signing_key_inside_a_folder_bucket(tmp_path):
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.trainer.preflight import TrainerError, signing_key_path
    from volunteer_rl.trainer.publish import signing_key

    bucket = str((tmp_path / "bucket").resolve())
    cfg = TrainerConfig(bucket=bucket, signing_key=str(tmp_path / "bucket" / "keys" / "k.pem"))
    with pytest.raises(TrainerError, match="inside the bucket folder"):
        signing_key_path(cfg)
    assert not (tmp_path / "bucket").exists()
    cfg.signing_key = str(tmp_path / "k.pem")
    key, _ = signing_key(cfg, open_storage("memory://no-run-yet"), print)
    assert public_key_text(key)


# --- trust on first use ------------------------------------------------------------------------

def test_first_use_pins_the_key_and_later_readers_hold_to_it(tmp_path):
    s = bucket_with(tmp_path, manifest())
    logs: list[str] = []
    trust = reader_trust(s.uri, None, tmp_path / "vw", None, False, logs.append)
    assert trust.key is None
    read_manifest(s, trust=trust)
    read_manifest(s, trust=trust)
    assert trust.key == PUB and len(logs) == 1 and PUB in logs[0]       # printed once
    assert PinFile(tmp_path / "vw" / "trusted-keys.json").load() == {s.uri: PUB}
    # A later reader (a restart) starts from the pin: another key is refused, with the way out.
    (tmp_path / "bucket" / "manifest.json").write_bytes(manifest().to_signed_json(OTHER))
    later = reader_trust(s.uri, None, tmp_path / "vw", None, False, logs.append)
    assert later.key == PUB
    with pytest.raises(ForeignKey, match="pinned on first use in .*trusted-keys.json.*--trust-key"):
        read_manifest(s, trust=later)
    # The operator's --trust-key overrides the pin (a trainer that really changed its key).
    given = reader_trust(s.uri, None, tmp_path / "vw", public_key_text(OTHER), False, logs.append)
    assert read_manifest(s, trust=given).version == 3


def test_pins_are_per_bucket_and_endpoint(tmp_path, monkeypatch):
    pins = PinFile(tmp_path / "trusted-keys.json")
    pins.pin("s3://b/run", PUB)
    pins.pin("s3://b/run at http://127.0.0.1:9000", public_key_text(OTHER))
    assert reader_trust("s3://b/run", None, tmp_path, None, False, print).key == PUB
    assert reader_trust("s3://b/run", "http://127.0.0.1:9000", tmp_path, None, False,
                        print).key == public_key_text(OTHER)
    assert reader_trust("s3://b/other", None, tmp_path, None, False, print).key is None
    monkeypatch.setenv("VRL_TRUST_KEY", public_key_text(OTHER))
    assert reader_trust("s3://b/run", None, tmp_path, None, False, print).key == public_key_text(OTHER)


def test_unsigned_manifest_pins_nothing(tmp_path):
    s = open_storage(str(tmp_path / "bucket"))
    s.write("manifest.json", manifest().to_json())
    trust = reader_trust(s.uri, None, tmp_path / "vw", None, True, print)
    assert read_manifest(s, trust=trust).version == 3
    assert trust.key is None and not (tmp_path / "vw" / "trusted-keys.json").exists()


# --- the volunteer: fatal before the first accepted manifest, refused and polled after ----------

def test_volunteer_refuses_a_foreign_key_at_start_and_a_key_change_mid_run(tmp_path):
    from volunteer_rl.config import VolunteerConfig
    from volunteer_rl.volunteer.loop import Volunteer

    s = bucket_with(tmp_path, manifest(3))
    cfg = VolunteerConfig(bucket=s.uri, volunteer_id="me", work_dir=str(tmp_path / "vw"),
                          trust_key=public_key_text(OTHER))
    with pytest.raises(ForeignKey):
        Volunteer(cfg, log=lambda m: None).poll()

    logs: list[str] = []
    cfg.trust_key = None                                   # trust on first use
    v = Volunteer(cfg, log=logs.append)
    assert v.poll().version == 3
    # The key changes mid-run: the new manifest is refused, once, and never becomes `latest`.
    (tmp_path / "bucket" / "manifest.json").write_bytes(manifest(4).to_signed_json(OTHER))
    assert v.poll() is None and v.poll() is None
    assert v.latest.version == 3
    warnings = [m for m in logs if m.startswith("warning:")]
    assert len(warnings) == 1 and "signed by" in warnings[0] and "still polling" in warnings[0]
    # The rightful trainer publishes again: followed as usual.
    (tmp_path / "bucket" / "manifest.json").write_bytes(manifest(5).to_signed_json(KEY))
    assert v.poll().version == 5


@pytest.mark.parametrize("name, text, needle", [
    (PIN_FILE, "[" * 100_000, "nested deeper than 4"),
    (MARK_FILE, '{"b": ' * 100_000, "nested deeper than 4"),
    (MARK_FILE, '{"b": {"run_id": "r", "version": 1, "created_at": NaN}}', "NaN is not JSON"),
    (MARK_FILE, " " * (4 << 20) + "{}", "larger than 4194304 bytes"),
])
def test_a_deep_or_huge_trust_file_is_one_line_naming_it(tmp_path, name, text, needle):
    """The volunteer's own pin and mark files are parsed with the same bounds as manifests:
    whoever else can write the work dir gets a one-line refusal, not a RecursionError."""
    (tmp_path / name).write_text(text)
    with pytest.raises(KeyFileError) as e:
        reader_trust("b", None, tmp_path, None, False, print)
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / name)) and needle in msg and "\n" not in msg
