"""The reader's last check when it rebuilds a version from a keyframe and the patches after
it: the result's pieces must be the manifest's. Neither the keyframe of an older version nor
a patch is hashed as a whole against this version, so a keyframe object that is not what its
manifest named (bit rot, an overwrite, a hostile bucket) is caught here or nowhere (issue 26,
point 9). The bucket and chain are test_weights_chain's: random bytes published by the
trainer's WeightsChain."""
import re

import numpy as np
import pytest
from test_weights_chain import MIB, evolve, held, publish_bytes

from volunteer_rl.model.chain import build_weights
from volunteer_rl.model.hashing import CheckpointError
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import KEYFRAME_FILE
from volunteer_rl.storage import open_storage
from volunteer_rl.trainer.publish import WeightsChain


def test_a_keyframe_that_rebuilds_other_bytes_than_the_pieces_say_is_refused(tmp_path):
    storage = open_storage(str(tmp_path / "bucket"))
    chain = WeightsChain(keyframe_every=8, patch_max_fraction=0.5, piece_bytes=MIB)
    rng = np.random.default_rng(7)
    files = [rng.integers(0, 256, 3 * MIB + 4096, dtype=np.uint8)]
    files += [evolve(files[0], 0.01, rng)]
    files += [evolve(files[1], 0.01, rng)]
    ms = [publish_bytes(storage, chain, v, memoryview(f)) for v, f in enumerate(files)]
    assert ms[2].weights.keyframe.version == 0 and [p.version for p in ms[2].weights.patches] == [1, 2]
    # Keyframe v0's object loses one bit, at a byte neither patch rewrites: same size, and
    # every patch still applies (they name their base by the manifest's root, not by hashing).
    at = int(np.flatnonzero(files[0] == files[2])[MIB + 5])
    path = tmp_path / "bucket" / layout.checkpoint_key(0, KEYFRAME_FILE)
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    message = (f"^{re.escape(layout.checkpoint_key(2, KEYFRAME_FILE))}: sha256 of piece {at // MIB} "
               r"does not match manifest.json \(rebuilt from keyframe v0\)$")
    with pytest.raises(CheckpointError, match=message):
        build_weights(storage, ms[2])
    # A reader holding v1 patches forward without the keyframe: unaffected.
    got = build_weights(storage, ms[2], held(ms[1], files[1]))
    assert got.how == "patches" and bytes(got.buf) == files[2].tobytes()
    # A reader whose held bytes are not what they claim falls back to the keyframe, and is
    # refused there too, rather than handed the corrupt rebuild.
    logs = []
    with pytest.raises(CheckpointError, match=message):
        build_weights(storage, ms[2], held(ms[1], files[0]), logs.append)
    assert len(logs) == 1 and "(patched from v1)" in logs[0]
    assert logs[0].endswith("fetching keyframe v0 instead")
