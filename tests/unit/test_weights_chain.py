"""Keyframes and patches end to end on a folder bucket, with weights files made of random
bytes: the trainer's WeightsChain decides and lists, a reader rebuilds every version bit for
bit from a keyframe or from any version it holds, the cheaper way, and a missing or corrupt
patch is refused in one line and costs nothing held."""
import json
import os
import threading

import numpy as np
import pytest

from volunteer_rl.model.chain import Held, build_weights, plan_fetch
from volunteer_rl.model.hashing import CheckpointError, PieceSink, piece_hashes, sha256_bytes
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import (
    TaskRef,
    KEYFRAME_FILE,
    Dataset,
    Link,
    Manifest,
    ManifestError,
    Sampling,
    Weights,
    WeightsEntry,
    pieces_root,
)
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import NotFound
from volunteer_rl.trainer.publish import WeightsChain

MIB = 1 << 20
SIZE = 3 * MIB + 4096  # 4 pieces of 1 MiB, the last short
DATASET = Dataset("train", "datasets/train-0.csv", "0" * 64, 1, 1)


def manifest_of(version: int, root: str, weights: Weights | None) -> Manifest:
    m = Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id="run", version=version, checkpoint=layout.checkpoint_prefix(version),
                 files={KEYFRAME_FILE: WeightsEntry(root, SIZE)}, dataset=DATASET, sampling=Sampling(),
                 max_staleness=2, weights=weights)
    return Manifest.from_raw(json.loads(m.to_json()))  # what a reader parses, checks included


def publish_bytes(storage, chain: WeightsChain, version: int, buf: memoryview) -> Manifest:
    """What trainer.publish does with the weights file, without a model around it."""
    pieces = piece_hashes(buf, MIB)
    root = pieces_root(MIB, len(buf), pieces)
    patch, keyframe = chain.plan(version, buf, root, word=2)
    if keyframe:
        storage.create(layout.checkpoint_key(version, KEYFRAME_FILE), bytes(buf))
    link = None
    if patch is not None:
        storage.create(Weights.patch_key(version), patch)
        link = Link(version, sha256_bytes(patch), len(patch))
    w = chain.weights(version, WeightsEntry(root, len(buf)), pieces, link, keyframe)
    m = manifest_of(version, root, w)
    chain.commit(version, w, root, buf)
    return m


def evolve(buf: np.ndarray, share: float, rng) -> np.ndarray:
    """The next version: `share` of the bf16 words rewritten."""
    out = buf.copy()
    words = out.view(np.uint16)
    where = rng.choice(len(words), size=int(len(words) * share), replace=False)
    words[where] = rng.integers(0, 1 << 16, size=len(where), dtype=np.uint16)
    return out


@pytest.fixture
def run(tmp_path):
    """25 versions, 1 % of the words changed each, a keyframe every 8, and version 13
    rewritten wholesale (its patch is too big: a keyframe out of turn)."""
    storage = open_storage(str(tmp_path / "bucket"))
    chain = WeightsChain(keyframe_every=8, patch_max_fraction=0.5, piece_bytes=MIB)
    rng = np.random.default_rng(0)
    files = [rng.integers(0, 256, SIZE, dtype=np.uint8)]
    for v in range(1, 25):
        files.append(evolve(files[-1], 0.6 if v == 13 else 0.01, rng))
    manifests = [publish_bytes(storage, chain, v, memoryview(f)) for v, f in enumerate(files)]
    return storage, files, manifests


def held(m: Manifest, data: np.ndarray) -> Held:
    return Held(m.run_id, m.version, m.files[KEYFRAME_FILE].root, memoryview(data.copy()))


def test_the_chain_is_keyframes_on_cadence_and_out_of_turn(run):
    _, _, ms = run
    keyframes = sorted({m.weights.keyframe.version for m in ms})
    assert keyframes == [0, 8, 13, 21]  # 13: its patch was over half the file
    m12, m13, m20, m24 = ms[12], ms[13], ms[20], ms[24]
    assert [p.version for p in m12.weights.patches] == list(range(5, 13))  # 8 back, past keyframe 8
    assert m13.weights.patches == ()  # no patch for 13: a reader behind it takes the keyframe
    assert [p.version for p in m20.weights.patches] == list(range(14, 21))
    assert m24.weights.keyframe.version == 21 and [p.version for p in m24.weights.patches] == list(range(17, 25))
    for m in ms[1:]:
        for p in m.weights.patches:
            assert p.size < 0.05 * SIZE  # 1 % of the words: positions and values, compressed


def test_every_version_rebuilds_bit_for_bit_from_nothing_and_from_what_is_held(run):
    storage, files, ms = run
    for m in ms:
        got = build_weights(storage, m)
        assert got.how == "keyframe" and bytes(got.buf) == files[m.version].tobytes()
        assert got.links == 1 + m.version - m.weights.keyframe.version
    for h in range(24):
        for t in range(h + 1, 25):
            how, links = plan_fetch(ms[t], held(ms[h], files[h]))
            got = build_weights(storage, ms[t], held(ms[h], files[h]))
            assert bytes(got.buf) == files[t].tobytes()
            assert got.how == how and got.links == len(links)
            if how == "patches":  # the cheaper way: fewer bytes than the keyframe's
                assert got.bytes < SIZE and got.links == t - h
    # a reader on 20 takes 4 patches to 24, not keyframe 21 and 3 patches
    assert plan_fetch(ms[24], held(ms[20], files[20]))[0] == "patches"
    # a reader on 12 cannot patch across 13 (a keyframe with no patch)
    assert plan_fetch(ms[15], held(ms[12], files[12]))[0] == "keyframe"
    assert plan_fetch(ms[9], held(ms[9], files[9]))[0] == "held"


def test_a_corrupt_or_missing_patch_is_one_line_and_the_keyframe_path_follows(run, tmp_path):
    storage, files, ms = run
    root = tmp_path / "bucket"
    # patch 8 is listed for readers behind keyframe 8; corrupt it: a reader on 6 going to 10
    # fails on it, says so in one line, and takes keyframe 8 + patches 9, 10
    path = root / Weights.patch_key(8)
    good = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    logs = []
    got = build_weights(storage, ms[10], held(ms[6], files[6]), logs.append)
    assert got.how == "keyframe" and bytes(got.buf) == files[10].tobytes()
    assert len(logs) == 1 and "\n" not in logs[0]
    assert logs[0].startswith(f"warning: {Weights.patch_key(8)}: sha256 or size does not match")
    assert logs[0].endswith("fetching keyframe v8 instead")
    path.write_bytes(good)
    # a patch the keyframe path needs is missing: NotFound (the volunteer reads the manifest
    # again, as for any object retention removed), one line naming it
    (root / Weights.patch_key(10)).unlink()
    with pytest.raises(NotFound) as e:
        build_weights(storage, ms[10], None)
    assert str(e.value).startswith(Weights.patch_key(10)) and "\n" not in str(e.value)
    # a corrupt one: CheckpointError naming it
    (root / Weights.patch_key(10)).write_bytes(good)  # patch 8's bytes under 10's name
    with pytest.raises(CheckpointError, match=f"^{Weights.patch_key(10)}: sha256 or size"):
        build_weights(storage, ms[10], None)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_where_a_patch_should_be_is_one_line_and_the_keyframe_path_follows(run, tmp_path):
    """A FIFO in a folder bucket used to block the reader in open() forever, past SIGINT:
    now it is no object (NotFound), and the keyframe path runs. On a thread with a timeout,
    so a reader that blocks fails the test instead of hanging it."""
    storage, files, ms = run
    fifo = tmp_path / "bucket" / Weights.patch_key(8)
    fifo.unlink()
    os.mkfifo(fifo)
    logs, out = [], []
    t = threading.Thread(target=lambda: out.append(
        build_weights(storage, ms[10], held(ms[6], files[6]), logs.append)), daemon=True)
    t.start()
    t.join(60)
    try:
        assert not t.is_alive(), "the read blocked on the FIFO"
    finally:  # release a reader blocked in open()
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    got = out[0]
    assert got.how == "keyframe" and bytes(got.buf) == files[10].tobytes()
    assert logs == [f"warning: {Weights.patch_key(8)}: is not a regular file in {storage.uri}; "
                    "fetching keyframe v8 instead"]


def test_held_bytes_that_are_not_what_they_claim_fall_back_to_the_keyframe(run):
    storage, files, ms = run
    wrong = held(ms[17], files[16])  # says 17, holds 16: the patches apply, the pieces differ
    logs = []
    got = build_weights(storage, ms[19], wrong, logs.append)
    assert got.how == "keyframe" and bytes(got.buf) == files[19].tobytes()
    assert "piece" in logs[0] and "does not match manifest.json" in logs[0]
    other_run = Held("another-run", 17, ms[17].files[KEYFRAME_FILE].root, memoryview(files[17].copy()))
    assert plan_fetch(ms[19], other_run)[0] == "keyframe"


def test_a_manifest_whose_chain_does_not_hold_together_is_refused(run):
    _, _, ms = run
    m = ms[10]
    raw = json.loads(m.to_json())

    def refused(edit, needle):
        r = json.loads(json.dumps(raw))
        edit(r["weights"])
        with pytest.raises(ManifestError, match=needle):
            Manifest.from_raw(r)
    refused(lambda w: w["patches"].pop(), "consecutive versions ending at v10")
    refused(lambda w: w.update(patches=w["patches"][-1:]), "reach back to v9")  # only 10's
    refused(lambda w: w["keyframe"].update(version=11), "keyframe v11 must be at or before v10")
    refused(lambda w: w["keyframe"].update(size=5), "keyframe v8 must be at or before v10 and of")
    refused(lambda w: w["patches"][0].update(size=SIZE + 1), "size at most")
    refused(lambda w: w["patches"][0].update(version=True), "must be integers")
    refused(lambda w: w["pieces"].pop(), "3 pieces of 1048576 bytes do not cover")
    refused(lambda w: w.update(piece_bytes=4096), "piece_bytes 4096 is not an integer in")
    refused(lambda w: w["pieces"].__setitem__(0, "A" * 64), "is not a sha256 in lowercase hex")
    # a piece swapped: the pieces no longer make the file's root
    refused(lambda w: w["pieces"].__setitem__(0, "b" * 64), "root of the pieces is not")
    refused(lambda w: w.update(patches=[{}] * 300), "at most 256 patches")
    refused(lambda w: w.update(keyframe="v8"), "malformed")
    own = json.loads(ms[8].to_json())  # v8 is its own keyframe: the root must be its file's
    own["weights"]["keyframe"]["root"] = "b" * 64
    with pytest.raises(ManifestError, match="keyframe v8 is this version's, so it must be its"):
        Manifest.from_raw(own)


def test_followers_of_a_file_being_made_get_its_bytes_or_stop_when_the_making_fails(tmp_path):
    """The trainer hashes (by pieces) and uploads the weights file while it is being made
    (Filling): the followers see exactly the finished bytes, and a making that fails stops
    them all with no object left behind, instead of leaving them waiting for ever."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from volunteer_rl.model.checkpoint import upload_buffer
    from volunteer_rl.model.hashing import Filling

    storage = open_storage(str(tmp_path / "bucket"))
    data = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)

    def follow(key: str, fail_at: int | None):
        buf = memoryview(np.zeros(SIZE, dtype=np.uint8))
        filling = Filling()
        with ThreadPoolExecutor(2) as pool:
            up = pool.submit(upload_buffer, storage, key, buf, filling.wait)
            pieces = pool.submit(piece_hashes, buf, MIB, 2, filling.wait)
            start, step = 0, 256 << 10
            while start < SIZE:  # made in slices, as tensors are
                end = min(start + step, SIZE)
                if fail_at is not None and end > fail_at:
                    filling.fail(RuntimeError("cast failed"))
                    break
                buf[start:end] = data[start:end]
                filling.made(end)
                start = end
                threading.Event().wait(0.001)  # let the followers catch up and wait
            return [f.exception() or f.result() for f in (up, pieces)]

    done = follow("ok.bin", None)
    assert done == [None, piece_hashes(data, MIB)]
    assert bytes(storage.read("ok.bin")) == data.tobytes()

    failed = follow("failed.bin", 2 * MIB)
    assert all(isinstance(r, Exception) and "cast failed" in str(r) for r in failed), failed
    assert isinstance(failed[1], CheckpointError)  # the hashing stops with Filling's error
    assert not storage.exists("failed.bin")


@pytest.mark.parametrize("size", [0, 1, 4096, 4096 * 3, 4096 * 3 + 5])
def test_a_file_hashed_by_pieces_while_it_is_written_has_the_pieces_of_the_whole(size, tmp_path):
    """PieceSink (a LoRA base streamed into its upload) gives the pieces piece_hashes gives for
    the same bytes in one buffer, whatever the writes' sizes, and passes every byte on."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    out = tmp_path / "out"
    with open(out, "wb") as f:
        sink = PieceSink(f, 4096)
        at, step = 0, 1
        while at < size:  # writes of 1, 2, 4, ... bytes, across piece boundaries
            sink.write(data[at:at + step])
            at, step = at + step, step * 2 + 1
        pieces = sink.finish()
    assert out.read_bytes() == data and sink.size == size
    assert pieces == piece_hashes(memoryview(data), 4096)
