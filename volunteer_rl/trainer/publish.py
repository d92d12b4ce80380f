"""Publishing a version, in the order that keeps the bucket consistent: the dataset and
checkpoint files first (content-addressed or write-once), then the signed manifest that
commits them, written last with a compare-and-swap. A crash anywhere before that write leaves
the previous version standing; the files it left are overwritten or collected later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import VrlError
from volunteer_rl.faults import crash_point
from volunteer_rl.model.checkpoint import (
    WEIGHTS_FILE,
    clear_folder,
    publish_checkpoint,
    sha256_bytes,
)
from volunteer_rl.model.policy import Policy
from volunteer_rl.model.weights import WEIGHTS_DTYPES, save_policy, weights_writer
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    Dataset,
    Manifest,
    Sampling,
    write_manifest,
)
from volunteer_rl.protocol.shards import SHARD_GROUPS_LIMIT
from volunteer_rl.protocol.signing import key_path, load_or_create_key, public_key_text
from volunteer_rl.storage.base import AlreadyExists, PreconditionFailed, Storage


class TrainerError(VrlError):
    """A condition the trainer cannot run under (named object, one line)."""


def signing_key(cfg: TrainerConfig, bucket_uri: str, log: Callable[[str], None]) -> Ed25519PrivateKey:
    """The key that signs this trainer's manifests, made on the first run. It is refused
    inside a folder bucket: whoever can read the bucket could then sign manifests."""
    path = key_path(cfg.signing_key, cfg.work_dir)
    if "://" not in bucket_uri and path.is_relative_to(Path(bucket_uri)):
        raise TrainerError(f"--signing-key {path}: inside the bucket folder {bucket_uri}; keep "
                           "the private key out of the bucket")
    key, created = load_or_create_key(path)
    log(f"{'created' if created else 'loaded'} manifest signing key {path}; public key "
        f"{public_key_text(key)} (give volunteers --trust-key with it, or {path.name}.pub)")
    return key


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


def publish(storage: Storage, policy: Policy, version: int, cfg: TrainerConfig, run_id: str,
            dataset: Dataset, etag: str | None, key: Ed25519PrivateKey,
            before_commit: Callable[[], None] = lambda: None) -> tuple[Manifest, str]:
    """Write the checkpoint, verify it, run `before_commit` (ledger, trainer state), then
    commit it all with the signed manifest: in that order, so a crash anywhere before the
    manifest leaves the previous version standing, complete.

    `etag` is the manifest this trainer last saw, `key` signs the manifest; returns the new
    manifest and its etag."""
    dtype = WEIGHTS_DTYPES[cfg.weights_dtype]
    staging = Path(cfg.work_dir) / f"staging-{layout.version_dir(version)}"
    clear_folder(staging)
    try:
        # The small files are staged; the weights go from the tensors straight into the
        # bucket object, hashed on the way (no staged copy, no second read).
        save_policy(policy, staging, dtype, weights=False)
        files = publish_checkpoint(storage, version, staging,
                                   {WEIGHTS_FILE: weights_writer(policy.model, dtype)})
    finally:
        clear_folder(staging)
    manifest = Manifest(
        run_id=run_id, version=version, checkpoint=layout.checkpoint_prefix(version), files=files,
        dataset=dataset, sampling=Sampling(cfg.k, cfg.temperature, cfg.max_new_tokens),
        max_staleness=cfg.max_staleness, prompt_format=policy.prompt_format,
        weights_dtype=str(dtype).removeprefix("torch."), max_shard_groups=SHARD_GROUPS_LIMIT)
    before_commit()
    crash_point("before_manifest")
    try:
        return manifest, write_manifest(storage, manifest, etag, key)
    except PreconditionFailed:
        raise TrainerError(f"{layout.MANIFEST}: changed by another writer while v{version} was "
                           "being published; is a second trainer running on this bucket?") from None


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
