"""What the live patch tests share: the manifests a run published, and the check that every
version rebuilds bit for bit."""
from __future__ import annotations

import hashlib

from volunteer_rl.model.chain import Held, build_weights
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import KEYFRAME_FILE, Manifest, pieces_root
from volunteer_rl.storage import open_storage


def published_manifests(bucket, last: int):
    """(the folder bucket's storage, the kept manifest of every version 0..last)."""
    storage = open_storage(str(bucket))
    return storage, [Manifest.from_json(storage.read(layout.manifest_history_key(v)))
                     for v in range(last + 1)]


def root_of(buf, piece_bytes: int) -> str:
    """The root of a weights file (manifest.pieces_root), its pieces hashed here with hashlib,
    not with the code that checks them in a reader."""
    view = memoryview(buf).cast("B")
    return pieces_root(piece_bytes, len(view), [hashlib.sha256(view[i:i + piece_bytes]).hexdigest()
                                                for i in range(0, len(view), piece_bytes)])


def assert_rebuilds_bit_for_bit(storage, manifests) -> None:
    """Each manifest's weights, rebuilt from the bucket with nothing held (its keyframe and
    the patches after it), have the root the trainer computed from its own bytes; and
    patched forward from the version before, as a volunteer that follows does, they are the
    same bytes. A version with a patch of its own is reached by that one patch, at most half
    the file."""
    held = None
    for m in manifests:
        whole = m.files[KEYFRAME_FILE]
        cold = build_weights(storage, m)
        assert root_of(cold.buf, m.weights.piece_bytes) == whole.root, m.version
        assert len(cold.buf) == whole.size, m.version
        if held is not None:
            warm = build_weights(storage, m, held)
            has_patch = any(p.version == m.version for p in m.weights.patches)
            assert warm.how == ("patches" if has_patch else "keyframe"), m.version
            if has_patch:
                assert warm.links == 1 and warm.bytes <= whole.size / 2, m.version
            assert bytes(warm.buf) == bytes(cold.buf), m.version
        held = Held(m.run_id, m.version, whole.root, memoryview(bytearray(cold.buf)))
