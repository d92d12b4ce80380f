"""Ed25519 signatures on manifest.json: who may tell volunteers which weights to load.

Anyone with write access to the bucket's manifest could otherwise point every volunteer at
weights of their choosing. The trainer signs each manifest with a private key that never
leaves its host; volunteers check the signature against a public key they were given (or
pinned the first time they saw the bucket) before they use any sha256 the manifest names.

What is signed: the manifest's JSON object without its top-level `signature` field, in the
canonical form of `canonical_bytes` (sorted keys, no spaces, ASCII-only, no NaN), after the
domain tag `vrl-manifest-v1\\n`, so a signature over a manifest can never be replayed as a
signature over anything else. Verification parses the bytes read once and checks the very
object the reader goes on to use, so there is no second parse that could disagree.

Keys travel as short text: `ed25519:<base64 of the 32-byte public key>`.

A signature says who wrote a manifest, not that it is the newest: every `manifests/vN.json`
of the bucket is a validly signed manifest that anyone able to write `manifest.json` could put
back. So readers also keep a high-water mark per bucket (`HighWater`) and refuse anything
behind it (`behind`: the rule is there).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from volunteer_rl.errors import VrlError
from volunteer_rl.protocol import jsonbounds
from volunteer_rl.protocol.printable import printable

ALG = "ed25519"
KEY_PREFIX = "ed25519:"
DOMAIN = b"vrl-manifest-v1\n"
SIGNATURE_FIELD = "signature"
TRUST_KEY_ENV = "VRL_TRUST_KEY"


class SignatureError(VrlError):
    """A manifest is unsigned, its signature does not verify, it is signed by a key the
    reader does not trust, or it is validly signed but older than one the reader already
    accepted (Rollback). The message is one line naming the object."""


class Unsigned(SignatureError):
    """The manifest carries no signature (written by a trainer from before signing)."""


class ForeignKey(SignatureError):
    """The signature is valid but made by another key than the trusted one: another trainer
    (or someone else) wrote this manifest."""


class Rollback(SignatureError):
    """Validly signed by the trusted key, but behind the newest manifest this reader already
    accepted from the bucket: an old manifest (or one of an older run) put back. Unlike the
    other refusals it is never fatal to a volunteer: the bucket's trainer is the right one,
    the bucket is just not showing us its newest version."""


class KeyFileError(VrlError, ValueError):
    """A key file or key text cannot be used (the message names the file or the flag)."""


# ---------------------------------------------------------------------------------------------
# Key text and files.

def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """`ed25519:<base64>`: the form operators copy to volunteers and manifests carry."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def parse_public_key(text: str, where: str = "public key") -> Ed25519PublicKey:
    """The key of an `ed25519:<base64>` text; KeyFileError naming `where` if it is not one.
    The message never quotes the text: it may be a private key given by mistake."""
    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        what = ("is a private key: give its public half (`vrl public-key`, or the .pub file "
                "beside it) and keep the private one secret") if "PRIVATE KEY" in text else \
            f"is not an {KEY_PREFIX}<base64> public key"
        raise KeyFileError(f"{where}: {what}")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(f"{where}: the text after {KEY_PREFIX} is not valid base64") from None
    if len(raw) != 32:
        raise KeyFileError(f"{where}: an ed25519 public key has 32 bytes, this one {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def normalize_public_key(text: str, where: str = "public key") -> str:
    """The canonical text of a public key, so two spellings of one key compare equal."""
    return public_key_text(parse_public_key(text, where))


def resolve_trust_key(value: str | None) -> str | None:
    """The key a `--trust-key` value names: the text itself, or a file holding it (such as
    the trainer's `signing-key.pem.pub`). None stays None (trust on first use)."""
    if not value:
        return None
    if value.strip().startswith(KEY_PREFIX) or "PRIVATE KEY" in value:
        return normalize_public_key(value, "--trust-key")  # refuses a private key unquoted
    path = Path(value).expanduser()
    if not path.is_file():
        raise KeyFileError(f"--trust-key {value}: neither an {KEY_PREFIX}<base64> key nor a file")
    return normalize_public_key(path.read_text(errors="replace"), str(path))


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def parse_private_key(data: bytes, where: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise KeyFileError(f"{where}: not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{where}: holds a {type(key).__name__}, not an Ed25519 key")
    return key


def _write_private(path: Path, data: bytes) -> None:
    """Create `path` with mode 0600, never replacing an existing file: the bytes go to a
    private temp file that is hard-linked into place (atomic, fails if the name is taken)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def key_path(signing_key: str | None, work_dir: str | os.PathLike) -> Path:
    """The trainer's private key file: `--signing-key`, else <work_dir>/signing-key.pem."""
    return Path(signing_key or Path(work_dir) / "signing-key.pem").expanduser().resolve()


def load_or_create_key(path: str | os.PathLike) -> tuple[Ed25519PrivateKey, bool]:
    """The trainer's private key at `path`, made on first use. Returns (key, created).

    Next to it goes `<path>.pub` with the public key text, the file to hand to volunteers.
    """
    path = Path(path).expanduser()
    created = False
    try:
        if not path.exists():
            try:
                _write_private(path, private_key_pem(Ed25519PrivateKey.generate()))
                created = True
            except FileExistsError:
                pass  # another process made it first: use theirs
        key = parse_private_key(path.read_bytes(), str(path))
        pub = path.with_name(path.name + ".pub")
        text = public_key_text(key) + "\n"
        if not pub.exists() or pub.read_text(errors="replace") != text:
            pub.write_text(text)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read or create the signing key ({exc.strerror or exc})") from None
    return key, created


# ---------------------------------------------------------------------------------------------
# Signing and verifying a JSON object.

def canonical_bytes(obj: dict) -> bytes:
    """The bytes a signature covers: the object without `signature`, canonical JSON, tagged."""
    body = {k: v for k, v in obj.items() if k != SIGNATURE_FIELD}
    return DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                               allow_nan=False).encode()


def sign(obj: dict, key: Ed25519PrivateKey) -> dict:
    """`obj` with its `signature` field: {alg, public_key, value (base64)}."""
    value = key.sign(canonical_bytes(obj))
    return {**obj, SIGNATURE_FIELD: {"alg": ALG, "public_key": public_key_text(key),
                                     "value": base64.b64encode(value).decode()}}


def signer(obj: dict, where: str) -> str:
    """The public key that validly signed `obj`. SignatureError if it carries no signature or
    one that does not verify under the key it names."""
    sig = obj.get(SIGNATURE_FIELD)
    if sig is None:
        raise Unsigned(f"{where}: unsigned (written by a trainer without signing); pass "
                       "--allow-unsigned to accept unsigned manifests")
    try:
        if sig["alg"] != ALG:
            raise SignatureError(f"{where}: signature algorithm {sig['alg']!r} is not {ALG}")
        public = parse_public_key(str(sig["public_key"]), f"{where}: signature.public_key")
        value = base64.b64decode(str(sig["value"]), validate=True)
        public.verify(value, canonical_bytes(obj))
    except SignatureError:
        raise
    except KeyFileError as exc:
        raise SignatureError(str(exc)) from None
    except (InvalidSignature, binascii.Error, ValueError, KeyError, TypeError):
        raise SignatureError(f"{where}: signature does not verify (the manifest was changed "
                             "after it was signed)") from None
    return public_key_text(public)


# ---------------------------------------------------------------------------------------------
# Whom a reader trusts.


MAX_STATE_FILE_BYTES = 4 << 20
"""A pin or mark file holds a line per bucket: a few hundred bytes each."""
STATE_FILE_NESTING = 4
"""A mark file nests 2 deep ({bucket: {run_id, version, created_at}})."""


def _read_state_file(path: Path, what: str) -> object:
    """The JSON of one of the volunteer's local trust files (None if there is none yet);
    KeyFileError naming the file if it cannot be read or parsed, or is bigger or deeper than
    a trust file gets (whoever else can write the work dir must not crash the volunteer)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_STATE_FILE_BYTES + 1)
        if len(data) > MAX_STATE_FILE_BYTES:
            raise jsonbounds.JsonError(f"larger than {MAX_STATE_FILE_BYTES} bytes")
        return jsonbounds.loads(data, STATE_FILE_NESTING)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: unreadable {what} file ({printable(exc, 200)}); "
                           "fix or delete it") from None


class Trust:
    """The signer a reader accepts for one bucket.

    `key` is the trusted public key: given by the operator (`--trust-key`), read from the pin
    file, or None for trust on first use: the first validly signed manifest sets it, and
    `on_pin(key)` is called once so the caller can record it. `origin` says where the key came
    from and `hint` what to do if it is wrong, for error messages. Unsigned manifests pass
    only with `allow_unsigned` (a manifest that does carry a signature is always checked).
    """

    def __init__(self, key: str | None = None, allow_unsigned: bool = False,
                 on_pin: Callable[[str], None] | None = None, origin: str = "--trust-key",
                 hint: str = "", mark: HighWater | None = None):
        self.key = normalize_public_key(key, origin) if key else None
        self.allow_unsigned = allow_unsigned
        self.on_pin = on_pin
        self.origin = origin
        self.hint = hint
        self.mark = mark
        """The reader's high-water mark for this bucket: the current manifest it reads must
        not be behind it (manifest.py checks; reader_trust gives volunteers and `vrl eval`
        one, the trainer and `vrl gc` read without)."""

    def check(self, obj: dict, where: str) -> str | None:
        """The signer of `obj` if this reader trusts it (None: unsigned and allowed).

        Raises ForeignKey if it is validly signed by another key, SignatureError otherwise."""
        if obj.get(SIGNATURE_FIELD) is None and self.allow_unsigned:
            return None
        key = signer(obj, where)
        if self.key is None:
            self.key = key
            if self.on_pin is not None:
                self.on_pin(key)
        elif key != self.key:
            raise ForeignKey(f"{where}: signed by {key}, not by the trusted key {self.key} "
                             f"({self.origin}){self.hint}")
        return key


class PinFile:
    """Keys pinned on first use, one per bucket: a JSON object {bucket: key} in a local file.

    Read when a reader starts; written (temp file + rename) when a bucket is first seen."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()

    def load(self) -> dict[str, str]:
        data = _read_state_file(self.path, "pin")
        if data is None:
            return {}
        if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
            raise KeyFileError(f"{self.path}: not a JSON object of bucket: key; fix or delete it")
        return data

    def get(self, bucket: str) -> str | None:
        return self.load().get(bucket)

    def pin(self, bucket: str, key: str) -> None:
        pins = {**self.load(), bucket: key}
        tmp = self.path.parent / f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.path)
        except OSError as exc:
            raise KeyFileError(f"{self.path}: cannot pin the key of {bucket} ({exc})") from None
        finally:
            tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# No going back: the newest manifest a reader accepted from a bucket.
#
# What orders manifests is in the signed bytes already. `run_id` is made fresh (a clock and 24
# random bits) when a trainer starts on a bucket that has no manifest, and every resume keeps
# it: it is the random id of the bucket's current history, it survives copying the bucket, and
# unlike the bucket's URI it does not depend on how each machine names the bucket (a folder
# mounted at two paths, s3:// with and without --endpoint-url). Within a run `version` orders
# manifests (a version number is never reused). Between runs `created_at`, the trainer's clock
# at publish, does: runs on one bucket follow one another (a run starts only where there is no
# manifest.json, and the manifest is a compare-and-swap), so every manifest of an earlier run
# was signed before the first one of a later run.

@dataclass(frozen=True)
class Seen:
    """A manifest's place in its bucket's history: all a high-water mark keeps of it."""

    run_id: str
    version: int
    created_at: float

    def __str__(self) -> str:
        return f"v{self.version} of {self.run_id}"

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "version": self.version, "created_at": self.created_at}

    @staticmethod
    def from_json(obj, where: str) -> "Seen":
        """The mark of a decoded JSON entry; KeyFileError naming `where` if it is not one."""
        ok = (isinstance(obj, dict) and isinstance(obj.get("run_id"), str) and obj["run_id"]
              and type(obj.get("version")) is int and obj["version"] >= 0
              and type(obj.get("created_at")) in (int, float) and math.isfinite(obj["created_at"]))
        if not ok:
            raise KeyFileError(f"{where}: not a mark of run_id, version (an integer >= 0) and "
                               "created_at (a finite number); fix or delete it")
        return Seen(obj["run_id"], obj["version"], float(obj["created_at"]))


def behind(m: Seen, mark: Seen) -> bool:
    """The ordering rule: must a reader whose newest accepted manifest is `mark` refuse `m`?

    The same run: yes if `m` has a lower version (the same version is the manifest it has).
    Another run: yes unless `m` was signed strictly later than `mark`; a new run on a reset
    bucket is, a replayed manifest of an older run is not. Times are only ever compared with
    times the trainer signed, never with the reader's clock, which on a volunteer's laptop may
    be anything."""
    if m.run_id == mark.run_id:
        return m.version < mark.version
    return not (math.isfinite(m.created_at) and m.created_at > mark.created_at)


def _when(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))
    except (OverflowError, OSError, ValueError):  # a time no calendar holds: say it as it is
        return repr(t)


MARK_FILE = "newest-manifests.json"


class HighWater:
    """The newest manifest a reader has accepted from one bucket, in memory and on disk.

    On disk it is one JSON object {bucket: {run_id, version, created_at}} in
    <work_dir>/newest-manifests.json, next to the pinned keys and filed under the same bucket
    names, so a restarted volunteer (or the next `vrl eval`) still refuses what it refused
    before. It is written (temp file, fsync, rename) each time the mark moves: at most once per
    new version the reader sees. A write that fails is a warning, once: the mark in memory
    still holds for this process. Processes sharing a work dir merge their marks (the newer
    stays); two writing at the same instant may lose the newer one until its next write.
    """

    def __init__(self, path: str | os.PathLike, bucket: str, log: Callable[[str], None] = print):
        self.path = Path(path).expanduser()
        self.bucket = bucket
        self.log = log
        self.seen: Seen | None = self._load().get(bucket)
        self._write_error: str | None = None

    def _load(self) -> dict[str, Seen]:
        data = _read_state_file(self.path, "mark")
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise KeyFileError(f"{self.path}: not a JSON object of bucket: mark; fix or delete it")
        return {bucket: Seen.from_json(entry, f"{self.path}: {bucket}") for bucket, entry in data.items()}

    def admit(self, m: Seen, where: str, record: bool = True) -> None:
        """Raise Rollback (one line naming `where` and both manifests) if `m` is behind the
        mark; else move the mark to `m` if `record`. Only signed manifests are recorded: an
        unsigned one (passed by --allow-unsigned) proves nothing, and recording its version
        10**18 would refuse the real run for good."""
        if self.seen is not None and behind(m, self.seen):
            raise Rollback(self._refusal(m, where))
        if not record or not math.isfinite(m.created_at):
            return
        if self.seen is None or (m.run_id, m.version) != (self.seen.run_id, self.seen.version):
            self.seen = m
            self._save()

    def _refusal(self, m: Seen, where: str) -> str:
        mark = self.seen
        if m.run_id == mark.run_id:
            return (f"{where}: v{m.version} of {m.run_id} is older than v{mark.version}, already "
                    "accepted from this bucket (an old manifest put back?)")
        return (f"{where}: {m}, signed {_when(m.created_at)}, is not newer than {mark}, signed "
                f"{_when(mark.created_at)} and already accepted from this bucket (an older run's "
                f"manifest put back? if it is a new run whose trainer's clock is behind, delete "
                f"{self.bucket!r} from {self.path})")

    def _save(self) -> None:
        tmp = self.path.parent / f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            marks = self._load()
            theirs = marks.get(self.bucket)
            if theirs is not None and behind(self.seen, theirs):
                self.seen = theirs  # another reader sharing this work dir got further
                return
            marks[self.bucket] = self.seen
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({b: s.to_json() for b, s in sorted(marks.items())}, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())  # the rename must never publish an empty file
            os.replace(tmp, self.path)
        except (OSError, KeyFileError) as exc:
            why = str(exc) if isinstance(exc, KeyFileError) else f"{self.path}: {exc.strerror or exc}"
            if why != self._write_error:
                self.log(f"warning: cannot record {self.seen} as the newest manifest of "
                         f"{self.bucket} ({why}); a restart will not remember it")
            self._write_error = why
            return
        finally:
            tmp.unlink(missing_ok=True)
        self._write_error = None


PIN_FILE = "trusted-keys.json"


def bucket_identity(uri: str, endpoint_url: str | None) -> str:
    """The name a bucket's pinned key is filed under: one s3:// URI on two endpoints is two
    buckets."""
    return f"{uri} at {endpoint_url}" if endpoint_url else uri


def reader_trust(uri: str, endpoint_url: str | None, work_dir: str | os.PathLike,
                 trust_key: str | None, allow_unsigned: bool, log: Callable[[str], None]) -> Trust:
    """The Trust of a volunteer or `vrl eval` for a bucket: the operator's key if given
    (`--trust-key`, else $VRL_TRUST_KEY), else the key pinned for this bucket in
    <work_dir>/trusted-keys.json, else trust on first use (pinned and printed once). Whichever,
    it carries the reader's high-water mark for the bucket (<work_dir>/newest-manifests.json)."""
    given = resolve_trust_key(trust_key or os.environ.get(TRUST_KEY_ENV))
    bucket = bucket_identity(uri, endpoint_url)
    mark = HighWater(Path(work_dir) / MARK_FILE, bucket, log)
    if given:
        return Trust(given, allow_unsigned, mark=mark)
    pins = PinFile(Path(work_dir) / PIN_FILE)
    pinned = pins.get(bucket)
    if pinned:
        return Trust(pinned, allow_unsigned, origin=_pin_origin(pins), hint=PIN_HINT, mark=mark)

    def on_pin(key: str) -> None:
        pins.pin(bucket, key)
        log(f"trusting manifest signing key {key} for {bucket} from now on (first use; "
            f"pinned in {pins.path})")
    return Trust(None, allow_unsigned, on_pin, origin=_pin_origin(pins), hint=PIN_HINT, mark=mark)


def _pin_origin(pins: PinFile) -> str:
    return f"pinned on first use in {pins.path}"


PIN_HINT = "; if the trainer's key really changed, pass --trust-key or delete that pin"
