"""manifest.json: the commit point of the bucket.

The trainer writes it only after every object of a version is uploaded and verified, so a
reader that follows the manifest never meets a half-published checkpoint. Readers go the
opposite way: manifest first, then the files it names, each checked against its sha256
(the weights file: against its pieces' sha256s, which make its root).
The manifest is signed by the trainer's key (see signing.py) and readers check the signature
on the bytes they read, against the key they trust, before any sha256 in it is used; a reader
with a high-water mark (volunteers, `vrl eval`) then refuses a current manifest that is behind
the newest it accepted from the bucket (signing.behind), so an old one put back cannot pin it
to a dead version. Schema: docs/PROTOCOL.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import time
from dataclasses import asdict, dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from volunteer_rl.config import LORA_TARGETS, MAX_LORA_ALPHA, MAX_LORA_RANK
from volunteer_rl.errors import VrlError
from volunteer_rl.faults import crash_point
from volunteer_rl.protocol import jsonbounds, layout
from volunteer_rl.protocol.printable import printable
from volunteer_rl.protocol.shards import MAX_GROUPS_PER_SHARD
from volunteer_rl.protocol.signing import Seen, Trust, sign
from volunteer_rl.storage.base import NotFound, Storage, StorageError

MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KB; anything near this is not ours
MAX_MANIFEST_NESTING = 8
"""A manifest nests 4 deep (weights, patches, a patch); deeper is not ours, and is refused
before the parser recurses into it (jsonbounds)."""
OLD_MANIFEST_SECONDS = 15 * 60
"""`vrl status` flags a manifest.json whose `created_at` is older than this: the trainer has
stopped publishing, or an old manifest was put back. A trainer publishes every few seconds to
a few minutes; one that publishes less often than this is flagged too (it is a hint)."""


class ManifestError(VrlError):
    """manifest.json is missing, unreadable or does not match the schema."""


@dataclass(frozen=True)
class FileEntry:
    """A checkpoint file other than the weights: its sha256 and size."""

    sha256: str
    size: int


@dataclass(frozen=True)
class WeightsEntry:
    """files["model.safetensors"]: the weights file, named by `root`, the root of its pieces'
    sha256s (pieces_root), and not by a sha256 of the whole file: a reader checks the pieces
    on all its cores anyway, and the trainer, which makes a multi-GB file at every version,
    hashes it once (by pieces, on every core) instead of twice."""

    root: str
    size: int


KEYFRAME_FILE = "model.safetensors"
"""A keyframe: the whole weights file of its version, in that version's checkpoint folder."""
PATCH_FILE = "weights.vrlpatch"
"""A patch (protocol.patch) that turns the weights file of version N-1 into version N's, in
version N's checkpoint folder."""
ADAPTER_FILE = "adapter.safetensors"
"""A LoRA version's adapter (model.lora; schema 10), in that version's checkpoint folder: the
version is the weights the manifest's `weights` names (its `adapter.base`) plus this."""
MAX_PATCHES = 256
"""Most patches one manifest may list; the trainer's --keyframe-every stays below it."""
MAX_POOL = 4096
"""Most rows a manifest's `prompt_pool` may hold (a pool of 4,096 is about 30 KB of JSON)."""
MAX_QUOTA_GROUPS = 1 << 20
"""Most groups a manifest's `quota` may ask of one volunteer for one version."""
QUOTA_WAIT_RANGE = (0.1, 3600.0)
"""Seconds a manifest's `quota.wait_seconds` may say: from a tenth of a second to an hour."""
PIECE_BYTES = 64 << 20
"""Bytes per hashed piece of the weights file the trainer publishes (the last is shorter)."""
_PIECE_RANGE = (1 << 20, 1 << 30)
_HEX64 = re.compile(r"[0-9a-f]{64}")
ROOT_DOMAIN = b"vrl-weights-root-v1\0"


def pieces_root(piece_bytes: int, size: int, pieces) -> str:
    """The name of a weights file of `size` bytes whose `piece_bytes` slices have the sha256s
    `pieces` (hex, in order): the sha256 of ROOT_DOMAIN, piece_bytes and size (uint64
    little-endian), and every piece's 32-byte digest. Two files with one root have the same
    size, the same cut and the same pieces, so the same bytes (unless sha256 collides)."""
    h = hashlib.sha256(ROOT_DOMAIN + struct.pack("<QQ", piece_bytes, size))
    for piece in pieces:
        h.update(bytes.fromhex(piece))
    return h.hexdigest()


@dataclass(frozen=True)
class Keyframe:
    """The newest version at or before a manifest's published whole: its weights file's root
    (WeightsEntry.root) and size."""

    version: int
    root: str
    size: int


@dataclass(frozen=True)
class Link:
    """One patch object a reader may fetch to build a version's weights, named by version,
    with its sha256 and size."""

    version: int
    sha256: str
    size: int


@dataclass(frozen=True)
class Weights:
    """How a version's weights file (files["model.safetensors"]: its root and size) is
    fetched and checked.

    `pieces`: the sha256 of every `piece_bytes` slice of the file, so readers hash pieces
    on all cores as they land, and check a file they rebuilt; the file's root is made of
    them (pieces_root). `keyframe`: the newest version
    at or before this one published whole. `patches`: consecutive versions ending at this
    one, each a patch against the version before it, reaching back at least to the one after
    the keyframe; a reader that holds any version from the one before the first patch on
    needs only the patches after it. Empty when this version is a keyframe with no patch."""

    piece_bytes: int
    pieces: tuple[str, ...]
    keyframe: Keyframe
    patches: tuple[Link, ...] = ()

    def keyframe_key(self) -> str:
        return layout.checkpoint_key(self.keyframe.version, KEYFRAME_FILE)

    @staticmethod
    def patch_key(version: int) -> str:
        return layout.checkpoint_key(version, PATCH_FILE)


@dataclass(frozen=True)
class AdapterRef:
    """A LoRA version (schema 10): the weights the manifest's `weights` names are those of
    version `base`, and this version is them plus the adapter file of its own checkpoint
    folder (ADAPTER_FILE, listed in `files` with its sha256 and size): on each adapted layer
    W + (alpha / rank) * B @ A (model.lora)."""

    base: int
    rank: int
    alpha: float
    targets: str
    """What the trainer adapted (`all-linear` or module names, --lora-targets): for people
    and `vrl export`; readers take the layers from the file's tensor names."""


@dataclass(frozen=True)
class Sampling:
    """How volunteers must sample; the behavior logprobs they report are under these settings."""

    k: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 32


@dataclass(frozen=True)
class Quota:
    """How much of a version the trainer wants from each volunteer (schema 7): sample at
    most `groups` groups with it, then wait for the next version; a volunteer that sees no
    newer one for `wait_seconds` samples another `groups` of the same version (the trainer
    may still lack usable groups: without this, a fleet stopped at its quotas would wait for
    a version that never comes). Advice to honest volunteers, not a defence: the trainer's
    caps per volunteer and version bound one that ignores it (docs/THREATS.md)."""

    groups: int
    wait_seconds: float


@dataclass(frozen=True)
class Dataset:
    """The train split volunteers draw prompts from, content-addressed in the bucket."""

    name: str
    key: str
    sha256: str
    size: int
    rows: int


@dataclass(frozen=True)
class TaskRef:
    """The task volunteers sample for (schema 8): its name, and the installed package that
    provides it with that package's version. A volunteer runs it only from its own installed
    packages (task.registry), never from the bucket."""

    name: str
    package: str
    version: str


TASK_NAME = re.compile(r"[A-Za-z0-9_.-]{1,40}")
"""A task's name; its package's name and version are 1-100 printable characters of the
same set plus '+', '!' (PEP 440 versions)."""
_PACKAGE_TEXT = re.compile(r"[A-Za-z0-9_.+!-]{1,100}")


@dataclass(frozen=True)
class Manifest:
    run_id: str
    version: int
    checkpoint: str  # key prefix of the checkpoint folder, e.g. checkpoints/v000042
    files: dict[str, FileEntry | WeightsEntry]
    """Every file of the checkpoint; model.safetensors (KEYFRAME_FILE) as a WeightsEntry."""
    dataset: Dataset
    sampling: Sampling
    max_staleness: int
    task: TaskRef
    """The task (schema 8; a string, the task's name alone, before)."""
    prompt_format: str = "plain"
    weights_dtype: str = "float32"
    """dtype of the checkpoint's floating-point weights ("float32" or "bfloat16"). Absent in
    manifests of older trainers, which always published float32."""
    max_shard_groups: int = MAX_GROUPS_PER_SHARD
    """Most groups one shard may hold (1..MAX_GROUPS_PER_SHARD). Absent in manifests of
    older trainers, which took up to MAX_GROUPS_PER_SHARD."""
    prompt_pool: tuple[int, ...] = (0,)
    """Dataset rows this version's groups are sampled for (schema 6): group number n of a
    volunteer is sampled for pool_prompt(prompt_pool, run_id, version, volunteer, n). The
    trainer fills it from its curriculum (task.curriculum); 1..MAX_POOL rows of the dataset."""
    quota: Quota | None = None
    """Groups each volunteer should sample with this version before it waits for the next
    (schema 7); None: no quota, sample until the next version (the trainer has not measured
    its fleet yet, or runs with --quota-headroom 0)."""
    weights: Weights | None = None
    """Pieces and chain of the weights file (schema 3 on). None only for a checkpoint without
    weights, which no reader loads (tests of the protocol's other parts)."""
    adapter: AdapterRef | None = None
    """A LoRA version's adapter (schema 10; null for a version published as whole weights):
    `weights` then names the weights of version `adapter.base`, the frozen base."""
    schema_version: int = layout.SCHEMA_VERSION
    created_at: float = field(default_factory=time.time)
    """The trainer's clock when it published this version. Signed like every field; readers
    order the manifests of different runs on one bucket by it (signing.behind)."""

    @property
    def weights_version(self) -> int:
        """The version whose weights `weights` names: this one, or a LoRA version's base."""
        return self.version if self.adapter is None else self.adapter.base

    def to_json(self) -> bytes:
        """Unsigned JSON (what a signature covers is the same object; see to_signed_json)."""
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    def to_signed_json(self, key: Ed25519PrivateKey) -> bytes:
        """The manifest as the bucket holds it: the same object plus its `signature` field."""
        return json.dumps(sign(asdict(self), key), indent=1, sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> "Manifest":
        """Parse without checking any signature (read_manifest and poll_manifest check it)."""
        return Manifest.from_raw(decode(data))

    @staticmethod
    def from_raw(raw: dict) -> "Manifest":
        """The manifest of a decoded JSON object; ManifestError if a field is wrong."""
        try:
            files = {name: WeightsEntry(str(e["root"]), int(e["size"])) if name == KEYFRAME_FILE
                     else FileEntry(str(e["sha256"]), int(e["size"]))
                     for name, e in raw["files"].items()}
            for name in files:
                if not layout.is_safe_name(name):
                    raise ManifestError(f"{layout.MANIFEST}: unsafe file name {name!r}")
            if type(raw["version"]) is not int:  # 3.7 or "3" is no version, nor is true
                raise ValueError(f"version {raw['version']!r} is not an integer")
            m = Manifest(
                run_id=str(raw["run_id"]), version=raw["version"],
                checkpoint=str(raw["checkpoint"]), files=files,
                dataset=Dataset(**raw["dataset"]), sampling=Sampling(**raw["sampling"]),
                max_staleness=int(raw["max_staleness"]), task=_task(raw["task"]),
                prompt_format=str(raw["prompt_format"]),
                weights_dtype=str(raw.get("weights_dtype", "float32")),
                max_shard_groups=raw.get("max_shard_groups", MAX_GROUPS_PER_SHARD),
                prompt_pool=_pool(raw["prompt_pool"]), quota=_quota(raw["quota"]),
                weights=_weights(raw.get("weights")), adapter=_adapter(raw["adapter"]),
                schema_version=int(raw["schema_version"]), created_at=float(raw["created_at"]))
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{layout.MANIFEST}: malformed ({type(exc).__name__}: {exc})") from None
        if m.version < 0 or m.checkpoint != layout.checkpoint_prefix(m.version):
            raise ManifestError(f"{layout.MANIFEST}: checkpoint {m.checkpoint!r} does not match version {m.version}")
        if type(m.max_shard_groups) is not int or not 1 <= m.max_shard_groups <= MAX_GROUPS_PER_SHARD:
            raise ManifestError(f"{layout.MANIFEST}: max_shard_groups {m.max_shard_groups!r} is not "
                                f"an integer in 1..{MAX_GROUPS_PER_SHARD}")
        if not math.isfinite(m.created_at):  # "nan" as a string survives signing and float()
            raise ManifestError(f"{layout.MANIFEST}: malformed (created_at {m.created_at!r})")
        if type(m.dataset.rows) is not int or not 1 <= len(m.prompt_pool) <= MAX_POOL or not all(
                0 <= r < m.dataset.rows for r in m.prompt_pool):
            raise ManifestError(f"{layout.MANIFEST}: prompt_pool must hold 1..{MAX_POOL} rows "
                                f"of the dataset's {m.dataset.rows}")
        if (m.weights is None) != (KEYFRAME_FILE not in m.files):
            raise ManifestError(f"{layout.MANIFEST}: weights: files must list {KEYFRAME_FILE} "
                                "exactly when the manifest has weights")
        if (m.adapter is None) == (ADAPTER_FILE in m.files) or (
                m.adapter is not None and m.weights is None):
            raise ManifestError(f"{layout.MANIFEST}: adapter: files must list {ADAPTER_FILE} "
                                "exactly when the manifest has an adapter, and weights with it")
        if m.adapter is not None and not 0 <= m.adapter.base < m.version:
            raise ManifestError(f"{layout.MANIFEST}: adapter: base v{m.adapter.base} must be "
                                f"before v{m.version}")
        if m.weights is not None:
            _check_weights(m)
        return m


def _task(raw) -> TaskRef:
    """The `task` object: name, package and version, each a short string of safe characters
    (they are printed in a volunteer's one-line refusal and name a package to install)."""
    if not isinstance(raw, dict) or set(raw) != {"name", "package", "version"}:
        raise ValueError("task must be an object of name, package and version")
    ref = TaskRef(**raw)
    if not all(isinstance(v, str) for v in (ref.name, ref.package, ref.version)) \
            or not TASK_NAME.fullmatch(ref.name) or not _PACKAGE_TEXT.fullmatch(ref.package) \
            or not _PACKAGE_TEXT.fullmatch(ref.version):
        raise ValueError("task: name, package or version is not a short string of "
                         "[A-Za-z0-9_.+!-]")
    return ref


def _pool(raw) -> tuple[int, ...]:
    """The `prompt_pool` list, each entry an integer (bounds: Manifest.from_raw)."""
    if not isinstance(raw, list) or len(raw) > MAX_POOL or not all(type(r) is int for r in raw):
        raise ValueError(f"prompt_pool must be a list of at most {MAX_POOL} integers")
    return tuple(raw)


def _quota(raw) -> Quota | None:
    """The `quota` object (required since schema 7, null for none), its numbers in bounds."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"groups", "wait_seconds"}:
        raise ValueError("quota must be null or an object of groups and wait_seconds")
    groups, wait = raw["groups"], raw["wait_seconds"]
    lo, hi = QUOTA_WAIT_RANGE
    if type(groups) is not int or not 1 <= groups <= MAX_QUOTA_GROUPS:
        raise ValueError(f"quota.groups {groups!r:.20} is not an integer in 1..{MAX_QUOTA_GROUPS}")
    if type(wait) not in (int, float) or not lo <= wait <= hi:  # NaN fails the range too
        raise ValueError(f"quota.wait_seconds {wait!r:.20} is not a number in {lo}..{hi:g}")
    return Quota(groups, float(wait))


def _adapter(raw) -> AdapterRef | None:
    """The `adapter` object (required since schema 10, null for none), its numbers in bounds."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"base", "rank", "alpha", "targets"}:
        raise ValueError("adapter must be null or an object of base, rank, alpha and targets")
    base, rank, alpha, targets = raw["base"], raw["rank"], raw["alpha"], raw["targets"]
    if type(base) is not int or type(rank) is not int or not 1 <= rank <= MAX_LORA_RANK:
        raise ValueError(f"adapter: base {base!r:.20} and rank {rank!r:.20} must be integers, "
                         f"the rank in 1..{MAX_LORA_RANK}")
    if type(alpha) not in (int, float) or not 0 < alpha <= MAX_LORA_ALPHA:  # NaN fails too
        raise ValueError(f"adapter: alpha {alpha!r:.20} is not a number in (0, {MAX_LORA_ALPHA:g}]")
    if not isinstance(targets, str) or not LORA_TARGETS.fullmatch(targets):
        raise ValueError("adapter: targets is not 1-200 of [A-Za-z0-9_.,-]")
    return AdapterRef(base, rank, float(alpha), targets)


def _link(raw) -> Link:
    return Link(version=raw["version"], sha256=raw["sha256"], size=raw["size"])


def _keyframe(raw) -> Keyframe:
    return Keyframe(version=raw["version"], root=raw["root"], size=raw["size"])


def _weights(raw) -> Weights | None:
    """The `weights` object's fields, typed (checked against the manifest in _check_weights)."""
    if raw is None:
        return None
    if not isinstance(raw["pieces"], list) or not isinstance(raw["patches"], list) \
            or len(raw["patches"]) > MAX_PATCHES:
        raise ValueError(f"weights: pieces and patches must be lists, at most {MAX_PATCHES} patches")
    return Weights(piece_bytes=raw["piece_bytes"], pieces=tuple(raw["pieces"]),
                   keyframe=_keyframe(raw["keyframe"]), patches=tuple(map(_link, raw["patches"])))


def _check_weights(m: Manifest) -> None:
    """The pieces cover the weights file exactly and make its root; the keyframe is at or
    before this version and of the file's size; the patches are consecutive, end at this
    version and reach the keyframe; every number is an integer in bounds and every hash a
    sha256."""
    w, whole = m.weights, m.files[KEYFRAME_FILE]
    version = m.weights_version

    def bad(why: str) -> ManifestError:
        return ManifestError(f"{layout.MANIFEST}: weights: {why}")
    if type(w.piece_bytes) is not int or not _PIECE_RANGE[0] <= w.piece_bytes <= _PIECE_RANGE[1]:
        raise bad(f"piece_bytes {w.piece_bytes!r:.40} is not an integer in {_PIECE_RANGE[0]}..{_PIECE_RANGE[1]}")
    if whole.size < 0 or len(w.pieces) != -(-whole.size // w.piece_bytes):
        raise bad(f"{len(w.pieces)} pieces of {w.piece_bytes} bytes do not cover {whole.size} bytes")
    for sha in (*w.pieces, whole.root, w.keyframe.root, *(p.sha256 for p in w.patches)):
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            raise bad(f"{sha!r:.80} is not a sha256 in lowercase hex")
    if pieces_root(w.piece_bytes, whole.size, w.pieces) != whole.root:
        raise bad(f"the root of the pieces is not {KEYFRAME_FILE}'s root")
    for link in (w.keyframe, *w.patches):
        if type(link.version) is not int or type(link.size) is not int or not 0 <= link.size <= whole.size:
            raise bad(f"v{link.version!r:.20}: version and size must be integers, the size at most "
                      f"the weights file's {whole.size}")
    k = w.keyframe
    if not 0 <= k.version <= version or k.size != whole.size:
        raise bad(f"keyframe v{k.version} must be at or before v{version} and of {whole.size} bytes")
    if k.version == version and k.root != whole.root:
        raise bad(f"keyframe v{k.version} is this version's, so it must be its weights file")
    versions = [p.version for p in w.patches]
    if versions and (versions != list(range(versions[0], version + 1)) or versions[0] < 1):
        raise bad(f"patches must be of consecutive versions ending at v{version}")
    if k.version < version and (not versions or versions[0] > k.version + 1):
        raise bad(f"patches must reach back to v{k.version + 1}, the version after the keyframe")


def decode(data: bytes) -> dict:
    """The JSON object of a manifest's bytes, checked for the schema version only."""
    try:
        raw = jsonbounds.loads(data, MAX_MANIFEST_NESTING)
    except jsonbounds.JsonError as exc:
        raise ManifestError(f"{layout.MANIFEST}: malformed ({printable(exc, 120)})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{layout.MANIFEST}: malformed (not a JSON object)")
    found = raw.get("schema_version")
    if found != layout.SCHEMA_VERSION:
        newer = isinstance(found, int) and not isinstance(found, bool) and found > layout.SCHEMA_VERSION
        raise ManifestError(
            f"{layout.MANIFEST}: schema_version {printable(repr(found), 20)} is not "
            f"{layout.SCHEMA_VERSION}, the one this build speaks; "
            + ("upgrade volunteer_rl" if newer else "the trainer runs an older volunteer_rl"))
    return raw


def _parse(key: str, data: bytes, version: int | None, trust: Trust) -> Manifest:
    """Decode, check the signature of that very object, read its fields, and (the current
    manifest only) check it against the reader's high-water mark."""
    try:
        raw = decode(data)
    except ManifestError as exc:
        raise ManifestError(str(exc).replace(layout.MANIFEST, key, 1)) from None
    signed_by = trust.check(raw, key)
    try:
        m = Manifest.from_raw(raw)
    except ManifestError as exc:
        raise ManifestError(str(exc).replace(layout.MANIFEST, key, 1)) from None
    if version is not None and m.version != version:
        raise ManifestError(f"{key}: holds version {m.version}")
    if version is None and trust.mark is not None:
        # manifests/vK.json is history a reader asks for by number (`vrl eval --version K`):
        # it neither has to beat the mark nor moves it.
        trust.mark.admit(Seen(m.run_id, m.version, m.created_at), key, record=signed_by is not None)
    return m


def read_manifest(storage: Storage, version: int | None = None, *, trust: Trust) -> Manifest | None:
    """The current manifest (or the kept copy of `version`'s), None if there is none yet.

    Raises ManifestError (one line, naming the object) if it exists but is not valid, and
    SignatureError if `trust` does not accept its signature (Rollback if it is the current
    manifest and behind `trust.mark`).
    """
    key = layout.MANIFEST if version is None else layout.manifest_history_key(version)
    try:
        data = storage.read(key, max_bytes=MAX_MANIFEST_BYTES)
    except NotFound:
        return None
    except StorageError as exc:
        raise ManifestError(str(exc)) from None
    return _parse(key, data, version, trust)


def poll_manifest(storage: Storage, etag: str | None, *,
                  trust: Trust) -> tuple[Manifest | None, str | None]:
    """(manifest, etag) if manifest.json changed since `etag`, (None, etag) if it did not or
    does not exist yet. On S3 an unchanged manifest costs a bodiless 304, so thousands of
    idle volunteers polling cost almost nothing."""
    try:
        data, new_etag = storage.read_if_changed(layout.MANIFEST, etag, MAX_MANIFEST_BYTES)
    except NotFound:
        return None, None
    except StorageError as exc:
        raise ManifestError(str(exc)) from None
    if data is None:
        return None, etag
    return _parse(layout.MANIFEST, data, None, trust), new_etag


def write_manifest(storage: Storage, manifest: Manifest, etag: str | None,
                   key: Ed25519PrivateKey) -> str:
    """Commit a version: manifest.json, signed with `key`, as a compare-and-swap against `etag`
    (the manifest this trainer last wrote or read; None on an empty bucket), so two trainers
    can never both advance one bucket; then the version's write-once copy under manifests/
    (the same bytes, signature included), which only a committed version gets. Returns the
    new etag."""
    data = manifest.to_signed_json(key)
    new_etag = storage.write_if_match(layout.MANIFEST, data, etag)
    crash_point("manifest_copy")  # tests: the crash a resume repairs (trainer.startup.repair_history)
    storage.create(layout.manifest_history_key(manifest.version), data)
    return new_etag
