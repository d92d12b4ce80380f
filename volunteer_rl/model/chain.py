"""A version's weights file from the keyframe/patch chain, in memory (docs/PROTOCOL.md).

A manifest's `weights` names its keyframe (a version published whole, whose weights file is
its own object) and the patches that lead from it to this version. A reader that holds an
older version of the same run patches it forward in place when that downloads fewer bytes
than the keyframe and its patches (`plan_fetch`); either way the file is checked piece by
piece against the manifest before it is returned (`fetch_weights`, `build_weights`). A
keyframe comes from the bucket into one buffer, its pieces hashed as they land, and is copied
into the model only after every hash matched. `keyframe_weights` makes the `weights` of a
version published whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from volunteer_rl.model.hashing import CheckpointError, PieceHasher, byte_buffer, piece_hashes
from volunteer_rl.model.vetting import WEIGHTS_FILE, check_checkpoint, read_verified
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    PIECE_BYTES,
    FileEntry,
    Keyframe,
    Link,
    Manifest,
    Weights,
    WeightsEntry,
    pieces_root,
)
from volunteer_rl.storage.base import ShortObject, Storage, StorageError, TooLarge

if TYPE_CHECKING:
    from volunteer_rl.model.policy import Policy


def keyframe_weights(version: int, buf, piece_bytes: int = PIECE_BYTES
                     ) -> tuple[WeightsEntry, Weights]:
    """files["model.safetensors"] and `weights` of version `version` published whole, its
    weights file the bytes `buf`: the pieces hashed, the root made of them."""
    size = len(memoryview(buf).cast("B"))
    pieces = piece_hashes(buf, piece_bytes)
    entry = WeightsEntry(pieces_root(piece_bytes, size, pieces), size)
    return entry, Weights(piece_bytes, tuple(pieces), Keyframe(version, entry.root, entry.size))


@dataclass
class Held:
    """A weights file a reader holds in memory, verified: the bytes whose root is `root`
    (manifest.pieces_root), version `version` of run `run_id`. `fetch_weights` may patch it
    into a newer version in place, so after a fetch that failed its content is garbage and
    it is no longer held."""

    run_id: str
    version: int
    root: str
    buf: memoryview


@dataclass(frozen=True)
class Fetched:
    """What fetch_weights did: the verified buffer, how (`held`: already there, `patches`: the
    held version patched forward, `keyframe`: the keyframe and the patches after it) and the
    bytes it downloaded."""

    buf: memoryview
    how: str
    bytes: int
    links: int


def plan_fetch(m: Manifest, held: Held | None) -> tuple[str, list[Keyframe | Link]]:
    """("held" | "patches" | "keyframe", the links to download, in order): the fewer bytes of
    patching the held version forward (when the manifest lists every patch after it) and of
    the keyframe with the patches after it. Pure: no I/O."""
    w, whole = m.weights, m.files[WEIGHTS_FILE]
    same_run = held is not None and held.run_id == m.run_id
    if same_run and held.root == whole.root:
        return "held", []
    from_keyframe = [w.keyframe, *(p for p in w.patches if p.version > w.keyframe.version)]
    if same_run and w.patches and w.patches[0].version - 1 <= held.version < m.weights_version:
        from_held = [p for p in w.patches if p.version > held.version]
        if sum(p.size for p in from_held) < sum(p.size for p in from_keyframe):
            return "patches", from_held
    return "keyframe", from_keyframe


def _read_link(storage: Storage, key: str, link: Link) -> memoryview:
    return read_verified(storage, key, FileEntry(link.sha256, link.size))


def _read_whole(storage: Storage, key: str, buf: memoryview,
                on_chunk: Callable[[int, memoryview], None]) -> None:
    """Fill `buf` with the object; CheckpointError if it is not exactly that long."""
    try:
        storage.read_into(key, buf, on_chunk)
    except (TooLarge, ShortObject):
        raise CheckpointError(f"{key}: size does not match manifest.json") from None


def _check_pieces(m: Manifest, hashes: list[str], how: str = "") -> None:
    """CheckpointError naming the first piece whose sha256 is not the manifest's; `how` says
    how the file was made if it was not read whole."""
    if hashes != list(m.weights.pieces):
        bad = next((i for i, (a, b) in enumerate(zip(hashes, m.weights.pieces)) if a != b), len(hashes))
        raise CheckpointError(f"{layout.checkpoint_key(m.weights_version, WEIGHTS_FILE)}: sha256 of piece "
                              f"{bad} does not match manifest.json" + (f" ({how})" if how else ""))


def _patch_forward(storage: Storage, m: Manifest, buf: memoryview, base: str,
                   links: list[Link]) -> int:
    """Apply `links` (patches, in order) to `buf`, the file whose root is `base`, in place;
    the bytes downloaded."""
    from volunteer_rl.protocol.patch import PatchError, apply_patch

    got = 0
    for link in links:
        key = Weights.patch_key(link.version)
        patch = _read_link(storage, key, link)
        got += link.size
        try:
            info = apply_patch(buf, patch, key, base)
        except PatchError as exc:
            raise CheckpointError(str(exc)) from None
        base = info.target
    return got


def fetch_weights(storage: Storage, manifest: Manifest, held: Held | None = None,
                  log: Callable[[str], None] | None = None,
                  reuse: memoryview | None = None) -> Fetched:
    """The manifest's weights file, verified, in memory only: what a volunteer swapping
    weights needs, with no copy on disk (see weights.load_weights).

    The checkpoint is checked first as a model's (check_checkpoint, require_model): no buffer
    is allocated for weights of another size than its config.json describes. Then the
    cheaper of the ways plan_fetch weighs: the held version patched forward in place, or the
    keyframe read into the held buffer or `reuse` (reused when of the right size: a fresh
    multi-GB buffer costs a page fault per 4 KiB page) and patched forward. Either way the result is
    checked piece by piece against the manifest before it is returned. A patch path that
    fails (a patch missing, corrupt, or made for another base than the held bytes) is logged
    in one line and the keyframe path runs instead; if that fails too, CheckpointError, or
    the StorageError of the object that could not be read (NotFound: retention removed it,
    and the reader should read the manifest again)."""
    check_checkpoint(storage, manifest, require_model=True)
    return build_weights(storage, manifest, held, log, reuse)


def build_weights(storage: Storage, manifest: Manifest, held: Held | None = None,
                  log: Callable[[str], None] | None = None,
                  reuse: memoryview | None = None) -> Fetched:
    """fetch_weights after its check of the checkpoint: the weights file from the held
    version or the keyframe, checked by pieces."""
    w, whole = manifest.weights, manifest.files[WEIGHTS_FILE]
    if w is None:
        raise CheckpointError(f"{layout.MANIFEST}: v{manifest.version} names no weights pieces")
    how, links = plan_fetch(manifest, held)
    if how == "held":
        return Fetched(held.buf, how, 0, 0)
    if how == "patches":
        try:
            got = _patch_forward(storage, manifest, held.buf, held.root, links)
            _check_pieces(manifest, piece_hashes(held.buf, w.piece_bytes),
                          f"patched from v{held.version}")
            return Fetched(held.buf, how, got, len(links))
        except (CheckpointError, StorageError) as exc:
            if log is not None:
                log(f"warning: {exc}; fetching keyframe v{w.keyframe.version} instead")
            how, links = plan_fetch(manifest, None)
    buf = byte_buffer(whole.size, held.buf if held is not None else reuse)
    key = w.keyframe_key()
    if w.keyframe.version == manifest.weights_version:  # the file itself: hashed as it lands
        hasher = PieceHasher(buf, w.piece_bytes)
        try:
            _read_whole(storage, key, buf, hasher.add)
        finally:
            hashes = hasher.hashes()
        _check_pieces(manifest, hashes)
        return Fetched(buf, how, whole.size, 1)
    _read_whole(storage, key, buf, lambda offset, piece: None)
    got = whole.size + _patch_forward(storage, manifest, buf, w.keyframe.root, links[1:])
    _check_pieces(manifest, piece_hashes(buf, w.piece_bytes),
                  f"rebuilt from keyframe v{w.keyframe.version}")
    return Fetched(buf, how, got, len(links))


def swap_weights(storage: Storage, m: Manifest, policy: Policy, held: Held | None = None,
                 log: Callable[[str], None] | None = None,
                 reuse: memoryview | None = None) -> Fetched:
    """Fetch the manifest's weights (verified, in memory: chain.fetch_weights, which
    patches the held version forward when that is cheaper) and copy them into the live model.

    Returns what was fetched; its buffer holds version m's weights file until the next fetch,
    so hand it back as `held` (the volunteer keeps one such buffer, the size of the weights
    file, for as long as it runs). fetch_weights checks the checkpoint first
    (CheckpointRefused: weights of another size than config.json describes)."""
    from volunteer_rl.model.weights import load_weights  # torch: only where weights are loaded

    fetched = fetch_weights(storage, m, held, log, reuse)
    load_weights(policy, fetched.buf)
    return fetched


def fetched_text(f: Fetched, m: Manifest) -> str:
    """How a version's weights came, for the log line."""
    if f.how == "held":
        return "weights unchanged"
    mb = f"{f.bytes / 1e6:.1f} MB"
    if f.how == "patches":
        return f"{f.links} patch{'es' * (f.links != 1)}, {mb}"
    after = f" + {f.links - 1} patch{'es' * (f.links != 2)}" if f.links > 1 else ""
    return f"keyframe v{m.weights.keyframe.version}{after}, {mb}"


def onto_version(storage: Storage, m: Manifest, policy: "Policy", weights: memoryview,
                 holds: str | None) -> "tuple[Policy, str]":
    """(`policy` on version `m` as a volunteer samples it, the root of the weights file its
    model then holds). `holds`: the root of the file the model holds now (None: not known);
    `weights`: m's weights file, verified (fetch_weights). The plain model takes that file
    unless it holds it already; a LoRA version's adapter is fetched and checked before
    anything changes, and held unmerged beside the base (lora.hold_adapter: the very
    computation the trainer replays). The policy's model is changed in place."""
    from volunteer_rl.model.lora import base_model_of, fetch_adapter, hold_adapter, spec_of, unwrapped
    from volunteer_rl.model.policy import Policy
    from volunteer_rl.model.weights import load_weights

    adapter = None if m.adapter is None else fetch_adapter(storage, m, base_model_of(policy.model))
    root, model = m.files[WEIGHTS_FILE].root, policy.model
    if adapter is None or holds != root:
        model = unwrapped(model)
    if holds != root:
        load_weights(Policy(model, policy.tokenizer, policy.prompt_format, policy.device), weights)
    if adapter is not None:
        model = hold_adapter(model, adapter, spec_of(m))
    return Policy(model, policy.tokenizer, policy.prompt_format, policy.device), root
