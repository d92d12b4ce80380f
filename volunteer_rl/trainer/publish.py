"""Publishing a version, in the order that keeps the bucket consistent: the dataset and
checkpoint files first (content-addressed or write-once), then the signed manifest that
commits them, written last with a compare-and-swap. A crash anywhere before that write leaves
the previous version standing; the files it left are overwritten or collected later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import VrlError
from volunteer_rl.faults import crash_point
from volunteer_rl.model.checkpoint import clear_folder, publish_checkpoint, upload_buffer
from volunteer_rl.model.hashing import (
    CheckpointError,
    Filling,
    PieceSink,
    byte_buffer,
    piece_hashes,
    sha256_bytes,
)
from volunteer_rl.model.lora import adapter_file, adapter_tensors
from volunteer_rl.model.policy import Policy
from volunteer_rl.model.vetting import WEIGHTS_FILE
from volunteer_rl.model.weights import (
    WEIGHTS_DTYPES,
    fill_weights,
    save_policy,
    weights_size,
    write_weights,
)
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    ADAPTER_FILE,
    MAX_POOL,
    AdapterRef,
    PIECE_BYTES,
    Dataset,
    Keyframe,
    Link,
    Manifest,
    Quota,
    Sampling,
    TaskRef,
    Weights,
    WeightsEntry,
    pieces_root,
    write_manifest,
)
from volunteer_rl.protocol.patch import count_changed, make_patch
from volunteer_rl.protocol.shards import SHARD_GROUPS_LIMIT
from volunteer_rl.protocol.signing import Trust, load_or_create_key, public_key_text
from volunteer_rl.storage.base import AlreadyExists, PreconditionFailed, Storage
from volunteer_rl.trainer.preflight import (
    POINT_AT_KEY,
    TrainerError,
    refuse_new_key,
    signing_key_path,
)


def sampling_of(cfg: TrainerConfig) -> Sampling:
    """The manifest's sampling settings, from the trainer's: what each version's groups are
    sampled with (a resumed run must keep them, trainer.startup)."""
    return Sampling(cfg.k, cfg.temperature, cfg.max_new_tokens)


def signing_key(cfg: TrainerConfig, storage: Storage, log: Callable[[str], None],
                path: Path | None = None) -> tuple[Ed25519PrivateKey, Trust]:
    """The key that signs this trainer's manifests (at `path`, else preflight's), and the
    Trust that accepts the bucket's manifest only if that key signed it. The key is made on
    the first run only (preflight.refuse_new_key: never for a bucket another key signs)."""
    path = path or signing_key_path(cfg)
    if not path.exists():
        refuse_new_key(storage, path, cfg.allow_unsigned)
    key, created = load_or_create_key(path)
    log(f"{'created' if created else 'loaded'} manifest signing key {path}; public key "
        f"{public_key_text(key)} (give volunteers --trust-key with it, or {path.name}.pub)")
    trust = Trust(public_key_text(key), cfg.allow_unsigned, origin=f"this trainer's key {path}",
                  hint=POINT_AT_KEY)
    return key, trust


def upload_dataset(storage: Storage, path: Path) -> Dataset:
    data = path.read_bytes()
    sha = sha256_bytes(data)
    key = layout.dataset_key(path.stem, sha)
    try:
        storage.create(key, data)
    except AlreadyExists:
        pass  # content-addressed: an existing object of this name holds these very bytes
    rows = max(0, data.count(b"\n") - 1)
    return Dataset(name=path.stem, key=key, sha256=sha, size=len(data), rows=rows)


class WeightsChain:
    """The trainer's side of keyframes and patches: the weights file it last published (in
    memory: one more copy of the weights in the published dtype, or on disk once `spill`ed),
    the keyframe, and the run of patches the manifest lists.

    Each version's weights file is made in memory; it is a patch when the last version
    published is the one before it (same file size) and the patch is at most
    `patch_max_fraction` of the file, and also a keyframe when the last keyframe is
    `keyframe_every` versions back or the patch was refused. The manifest lists the patches of
    the last `keyframe_every` versions that have one, consecutive, so a volunteer that
    holds any of those versions patches forward whatever the keyframe is. A trainer that
    starts (or resumes) holds no last version: its first version is a keyframe.

    `spill_to` (a file path; the writer rank of a sharded trainer, trainer.writer): the last file
    is kept on disk between publishes instead of in memory (`spill`), and no spare, so the
    process holds one weights file only while it publishes one: the next file is compared
    with the spilled one piece by piece, and read back whole only to make a patch that may
    pay."""

    def __init__(self, keyframe_every: int, patch_max_fraction: float, piece_bytes: int = PIECE_BYTES,
                 spill_to: Path | None = None):
        self.keyframe_every, self.patch_max_fraction = keyframe_every, patch_max_fraction
        self.piece_bytes = piece_bytes
        self.spill_to = spill_to
        self.last: tuple[int, str, memoryview | None] | None = None  # version, root, the file
        """The file is None once spilled (to `spill_to`)."""
        self.last_size = 0
        self.spare: memoryview | None = None
        """The file published before the last: the next version's file is made in it (a fresh
        multi-GB buffer costs a page fault per 4 KiB page, several times the making)."""
        self.keyframe: Keyframe | None = None
        self.patches: list[Link] = []

    def _follows(self, version: int, size: int) -> bool:
        """Whether the last version published is the one before `version`, of the same size:
        the file a patch for `version` is made against."""
        return self.last is not None and self.last[0] == version - 1 and self.last_size == size

    def due(self, version: int, size: int) -> bool:
        """Whether `version`, a file of `size` bytes, is a keyframe whatever its patch: there
        is no last version to patch from, or the last keyframe is `keyframe_every` back."""
        return (not self._follows(version, size) or self.keyframe is None
                or version - self.keyframe.version >= self.keyframe_every)

    def plan(self, version: int, buf: memoryview, root: str, word: int
             ) -> tuple[bytes | None, bool]:
        """(patch or None, whether this version is a keyframe too) for `buf`, whose root is
        `root`. Changes nothing: `commit` does, once the version is published."""
        patch = None
        if self._follows(version, len(buf)):
            limit = self.patch_max_fraction * len(buf)
            # Skip making a patch that cannot pay: zstd never got the changed bf16 values below
            # half their raw size here. fp32 weights change in every word at every step, so
            # at the default --patch-max-fraction 0.5 this skips them (every word changed, at
            # half its bytes, is the limit) and an fp32 run publishes keyframes. A bigger
            # fraction lets them be tried: one step of lr 1e-6 to 1e-4 on weights of std 0.02
            # gave patches of 0.19-0.24 of the file, 1e-3 0.41 (protocol.patch.make_patch on
            # 4 M words, 2026-11-27); the demo's tiny model at lr 3e-4 gave 0.71, one version
            # to the next (so its keyframes are right).
            held = self.last[2]
            try:
                changed = (count_changed(held, buf, word) if held is not None
                           else _changed_on_disk(self.spill_to, buf, word))
                if held is None and changed * word * 0.5 < limit:
                    import numpy as np  # read back for the patch only: make_patch wants it whole
                    held = memoryview(np.fromfile(self.spill_to, dtype=np.uint8))
            except OSError:  # the spilled file is gone or cut short: no base, a keyframe
                changed = len(buf)
            if changed * word * 0.5 < limit:
                made = make_patch(held, buf, word, self.last[1], root,
                                  threads=-1 if len(buf) > (64 << 20) else 0)
                if len(made) <= limit:
                    patch = made
        return patch, patch is None or self.due(version, len(buf))

    def weights(self, version: int, whole: WeightsEntry, pieces: list[str],
                patch: Link | None, keyframe: bool) -> Weights:
        """The manifest's `weights` for this version, published with `patch` (its Link) and
        as a keyframe or not."""
        key = Keyframe(version, whole.root, whole.size) if keyframe else self.keyframe
        patches = ([*self.patches, patch] if patch is not None else [])[-self.keyframe_every:]
        return Weights(self.piece_bytes, tuple(pieces), key, tuple(patches))

    def commit(self, version: int, weights: Weights, root: str, buf: memoryview) -> None:
        """Version `version` is published with `weights`: it is now the last one."""
        if self.last is not None and self.last[2] is not None and self.last[2] is not buf \
                and self.spill_to is None:
            self.spare = self.last[2]
        self.last, self.last_size = (version, root, buf), len(buf)
        self.keyframe, self.patches = weights.keyframe, list(weights.patches)

    def drop_file(self) -> None:
        """Hold no weights file any more (a LoRA run after its base is published: its
        versions are adapters, never patches)."""
        self.last, self.spare, self.last_size = None, None, 0

    def spill(self) -> None:
        """Move the last file from memory to `spill_to` (written whole, then renamed): a
        patch base that costs no memory. Nothing without `spill_to` or once spilled."""
        if self.spill_to is None or self.last is None or self.last[2] is None:
            return
        tmp = self.spill_to.with_name(self.spill_to.name + ".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(self.last[2])
        os.replace(tmp, self.spill_to)
        self.last = (self.last[0], self.last[1], None)


SPILL_CHUNK = 64 << 20
"""Bytes of a spilled file compared at a time (a multiple of every word size)."""


def _changed_on_disk(path: Path, buf: memoryview, word: int) -> int:
    """count_changed between the file at `path` and `buf`, reading SPILL_CHUNK bytes at a
    time (read, not mapped: the file's pages stay out of this process's memory)."""
    import numpy as np

    chunk = np.empty(SPILL_CHUNK, dtype=np.uint8)
    changed, at = 0, 0
    with open(path, "rb", buffering=0) as f:
        while at < len(buf):
            n = f.readinto(memoryview(chunk)[:min(SPILL_CHUNK, len(buf) - at)])
            if not n:
                raise OSError(f"{path}: shorter than the file it was spilled from")
            changed += count_changed(chunk[:n], buf[at:at + n], word)
            at += n
    return changed


@dataclass(frozen=True)
class LoraBase:
    """The published weights a LoRA run's adapters apply to: their version, files entry and
    the manifest's `weights` that fetch them (keyframe and patches)."""

    version: int
    whole: WeightsEntry
    weights: Weights

    @staticmethod
    def of(m: Manifest) -> "LoraBase":
        """The base of the weights `m` names: a LoRA version's base, or `m` itself."""
        return LoraBase(m.weights_version, m.files[WEIGHTS_FILE], m.weights)


def publish(storage: Storage, policy: Policy, version: int, cfg: TrainerConfig, run_id: str,
            dataset: Dataset, etag: str | None, key: Ed25519PrivateKey, chain: WeightsChain,
            before_commit: Callable[[], None] = lambda: None,
            prompt_pool: tuple[int, ...] = (), quota: Quota | None = None,
            source: torch.nn.Module | None = None, *,
            task: TaskRef, base: LoraBase | None = None) -> tuple[Manifest, str]:
    """Write the checkpoint, verify it, run `before_commit` (ledger, trainer state), then
    commit it all with the signed manifest: in that order, so a crash anywhere before the
    manifest leaves the previous version standing, complete.

    The weights file is made in memory, hashed by pieces (its root names it), and uploaded as a
    keyframe (checkpoints/vN/model.safetensors), a patch against the last version
    (checkpoints/vN/weights.vrlpatch), or both, as `chain` decides.

    `etag` is the manifest this trainer last saw, `key` signs the manifest, `prompt_pool`
    is the version's prompt pool (empty: the dataset's first MAX_POOL rows), `quota` what
    each volunteer should sample of it (trainer.balance; None: no quota); returns the new
    manifest and its etag. `source`: the model whose tensors make the weights file, when it
    is not `policy.model` (a sharded model: the writer rank gathers each tensor while the
    other ranks take part, model.weights.gather_along; `policy` then gives the config and
    tokenizer). `task` names the task volunteers sample for (the manifest's `task`). `base`:
    a LoRA run's published base; the version is then its adapter (checkpoints/vN/
    adapter.safetensors, in the weights dtype) and the manifest names the base's weights and
    the adapter (`adapter`), and no weights file is made; the base itself (a LoRA run's
    version published with no `base`) is streamed (_stream_base)."""
    dtype = WEIGHTS_DTYPES[cfg.weights_dtype]
    if base is None:
        make = _stream_base if cfg.lora_rank else _publish_weights
        whole, weights, commit = make(storage, policy, version, dtype, chain, source)
    staging = Path(cfg.work_dir) / f"staging-{layout.version_dir(version)}"
    clear_folder(staging)
    try:
        save_policy(policy, staging, dtype, weights=False)
        if base is not None:  # a LoRA version: its adapter goes up with the small files
            tensors = adapter_tensors(policy.model)
            (staging / ADAPTER_FILE).write_bytes(adapter_file(tensors, dtype))
        files = publish_checkpoint(storage, version, staging)
    finally:
        clear_folder(staging)
    adapter = None
    if base is None:
        files[WEIGHTS_FILE] = whole  # a patch version lists the file its chain rebuilds
    else:
        files[WEIGHTS_FILE], weights = base.whole, base.weights
        adapter = AdapterRef(base.version, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    manifest = Manifest(
        run_id=run_id, version=version, checkpoint=layout.checkpoint_prefix(version), files=files,
        dataset=dataset, sampling=sampling_of(cfg),
        max_staleness=cfg.max_staleness, task=task, prompt_format=policy.prompt_format,
        weights_dtype=str(dtype).removeprefix("torch."), max_shard_groups=SHARD_GROUPS_LIMIT,
        prompt_pool=tuple(prompt_pool) or tuple(range(min(dataset.rows, MAX_POOL))),
        quota=quota, weights=weights, adapter=adapter)
    before_commit()
    crash_point("before_manifest")
    try:
        new_etag = write_manifest(storage, manifest, etag, key)
    except PreconditionFailed:
        raise TrainerError(f"{layout.MANIFEST}: changed by another writer while v{version} was "
                           "being published; is a second trainer running on this bucket?") from None
    if base is None:
        commit()
    return manifest, new_etag


def _publish_weights(storage: Storage, policy: Policy, version: int, dtype: torch.dtype,
                     chain: WeightsChain, source: torch.nn.Module | None
                     ) -> tuple[WeightsEntry, Weights, Callable[[], None]]:
    """The weights file of `version` made in memory, hashed by pieces and uploaded as a
    keyframe, a patch or both (as `chain` decides): its files entry, the manifest's `weights`,
    and what tells `chain` once the manifest is written."""
    source = policy.model if source is None else source
    buf = byte_buffer(weights_size(source, dtype), chain.spare)
    weights_key = layout.checkpoint_key(version, WEIGHTS_FILE)
    filling = Filling()
    with ThreadPoolExecutor(2) as pool:
        # Everything that reads the file follows its making, piece by piece: a keyframe that
        # is due whatever the patch goes up (mostly the disk's or the link's time) and the
        # pieces hash on every core. The making (a cast per tensor) runs here; a failure stops
        # every follower. The file is hashed once: its name is the root of its pieces.
        upload = pool.submit(upload_buffer, storage, weights_key, buf, filling.wait) \
            if chain.due(version, len(buf)) else None
        pieces_f = pool.submit(piece_hashes, buf, chain.piece_bytes, 0, filling.wait)
        try:
            fill_weights(source, dtype, buf, filling.made)
        except BaseException as exc:
            filling.fail(exc)
            raise
        pieces = pieces_f.result()
        root = pieces_root(chain.piece_bytes, len(buf), pieces)
        patch, keyframe = chain.plan(version, buf, root, dtype.itemsize)
        if keyframe and upload is None:  # the patch was refused: a keyframe after all
            upload = pool.submit(upload_buffer, storage, weights_key, buf)
        if upload is not None:
            upload.result()
            crash_point("checkpoint_upload")
    whole = WeightsEntry(root, len(buf))
    patch_link = None
    if patch is not None:
        patch_key = Weights.patch_key(version)
        upload_buffer(storage, patch_key, patch)
        patch_link = Link(version, sha256_bytes(patch), len(patch))
    weights = chain.weights(version, whole, pieces, patch_link, keyframe)
    return whole, weights, lambda: chain.commit(version, weights, root, buf)


def _stream_base(storage: Storage, policy: Policy, version: int, dtype: torch.dtype,
                 chain: WeightsChain, source: torch.nn.Module | None
                 ) -> tuple[WeightsEntry, Weights, Callable[[], None]]:
    """A LoRA run's base, as _publish_weights returns it, but written from the model straight
    into the upload and hashed by pieces on the way: never held whole in memory. Its buffer
    would serve no patch (no version after it is one), and made in memory it was the LoRA
    trainer's peak, its fp32 model and the whole file at once. A keyframe with no patches;
    `chain` is left holding no file."""
    source = policy.model if source is None else source
    key, size = layout.checkpoint_key(version, WEIGHTS_FILE), weights_size(source, dtype)
    pieces: list[str] = []

    def write(sink) -> None:  # a retried upload calls it again, on a fresh sink
        hashed = PieceSink(sink, chain.piece_bytes)
        write_weights(source, hashed, dtype)
        pieces[:] = hashed.finish()

    storage.create_from(key, write)
    if storage.size(key) != size:
        raise CheckpointError(f"{key}: size after upload differs from {size} bytes")
    crash_point("checkpoint_upload")
    root = pieces_root(chain.piece_bytes, size, pieces)
    weights = Weights(chain.piece_bytes, tuple(pieces), Keyframe(version, root, size), ())
    return WeightsEntry(root, size), weights, chain.drop_file


def published_or_started(storage: Storage) -> list[int]:
    """Every version with a checkpoint file or a kept manifest, complete or not. Read once at
    start-up, so it may walk the whole history."""
    versions = []
    for prefix in (layout.CHECKPOINTS, layout.MANIFESTS):
        for key in storage.list(prefix):
            parsed = layout.split_versioned_key(key)
            if parsed is not None:
                versions.append(parsed[1])
    return versions


# ---------------------------------------------------------------------------------------------
# One optimizer step.
