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
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import uuid
from pathlib import Path
from typing import Callable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALG = "ed25519"
KEY_PREFIX = "ed25519:"
DOMAIN = b"vrl-manifest-v1\n"
SIGNATURE_FIELD = "signature"
TRUST_KEY_ENV = "VRL_TRUST_KEY"


class SignatureError(Exception):
    """A manifest is unsigned, its signature does not verify, or it is signed by a key the
    reader does not trust. The message is one line naming the object."""


class Unsigned(SignatureError):
    """The manifest carries no signature (written by a trainer from before signing)."""


class ForeignKey(SignatureError):
    """The signature is valid but made by another key than the trusted one: another trainer
    (or someone else) wrote this manifest."""


class KeyFileError(ValueError):
    """A key file or key text cannot be used (the message names the file or the flag)."""


# ---------------------------------------------------------------------------------------------
# Key text and files.

def public_key_text(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """`ed25519:<base64>`: the form operators copy to volunteers and manifests carry."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def parse_public_key(text: str, where: str = "public key") -> Ed25519PublicKey:
    """The key of an `ed25519:<base64>` text; KeyFileError naming `where` if it is not one."""
    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        raise KeyFileError(f"{where}: {text[:60]!r} is not an {KEY_PREFIX}<base64> public key")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(f"{where}: {text[:60]!r} is not valid base64") from None
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
    if value.strip().startswith(KEY_PREFIX):
        return normalize_public_key(value, "--trust-key")
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
                 hint: str = ""):
        self.key = normalize_public_key(key, origin) if key else None
        self.allow_unsigned = allow_unsigned
        self.on_pin = on_pin
        self.origin = origin
        self.hint = hint

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
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise KeyFileError(f"{self.path}: unreadable pin file ({exc}); fix or delete it") from None
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


PIN_FILE = "trusted-keys.json"


def bucket_identity(uri: str, endpoint_url: str | None) -> str:
    """The name a bucket's pinned key is filed under: one s3:// URI on two endpoints is two
    buckets."""
    return f"{uri} at {endpoint_url}" if endpoint_url else uri


def reader_trust(uri: str, endpoint_url: str | None, work_dir: str | os.PathLike,
                 trust_key: str | None, allow_unsigned: bool, log: Callable[[str], None]) -> Trust:
    """The Trust of a volunteer or `vrl eval` for a bucket: the operator's key if given
    (`--trust-key`, else $VRL_TRUST_KEY), else the key pinned for this bucket in
    <work_dir>/trusted-keys.json, else trust on first use (pinned and printed once)."""
    given = resolve_trust_key(trust_key or os.environ.get(TRUST_KEY_ENV))
    if given:
        return Trust(given, allow_unsigned)
    bucket = bucket_identity(uri, endpoint_url)
    pins = PinFile(Path(work_dir) / PIN_FILE)
    pinned = pins.get(bucket)
    if pinned:
        return Trust(pinned, allow_unsigned, origin=_pin_origin(pins), hint=PIN_HINT)

    def on_pin(key: str) -> None:
        pins.pin(bucket, key)
        log(f"trusting manifest signing key {key} for {bucket} from now on (first use; "
            f"pinned in {pins.path})")
    return Trust(None, allow_unsigned, on_pin, origin=_pin_origin(pins), hint=PIN_HINT)


def _pin_origin(pins: PinFile) -> str:
    return f"pinned on first use in {pins.path}"


PIN_HINT = "; if the trainer's key really changed, pass --trust-key or delete that pin"
