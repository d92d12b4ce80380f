"""protocol.patch: a patch rewrites its base into its target bit for bit, and a patch that is
malformed, for another base or out of bounds is refused before one byte of the buffer moves."""
import hashlib
import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from volunteer_rl.protocol import patch as patch_module
from volunteer_rl.protocol.patch import (
    HEADER,
    MAGIC,
    PatchError,
    apply_patch,
    make_patch,
    read_header,
)


def sha(b) -> str:
    return hashlib.sha256(b).hexdigest()


def patch_of(base: bytes, target: bytes, word: int) -> bytes:
    """A patch naming its files by their sha256 (the trainer names them by their roots)."""
    return make_patch(base, target, word, sha(base), sha(target))


def changed_copy(base: bytes, word: int, share: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = bytearray(base)
    words = len(base) // word
    for i in rng.choice(words, size=int(words * share), replace=False) if words else []:
        out[i * word:(i + 1) * word] = rng.bytes(word)
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3000), word=st.sampled_from([1, 2, 4, 8]),
       share=st.floats(0, 1), seed=st.integers(0, 2**32 - 1), tail_changes=st.booleans())
def test_apply_gives_the_target_exactly(size, word, share, seed, tail_changes):
    base = np.random.default_rng(seed + 1).bytes(size)
    target = bytearray(changed_copy(base, word, share, seed))
    if tail_changes and size % word:
        target[-1] ^= 0xFF  # the bytes after the last whole word travel in the header
    target = bytes(target)
    patch = patch_of(base, target, word)
    buf = bytearray(base)
    info = apply_patch(buf, patch, base=sha(base))
    assert bytes(buf) == target
    assert info.target == sha(target) and info.base == sha(base)
    assert info.changed == sum(base[i * word:(i + 1) * word] != target[i * word:(i + 1) * word]
                               for i in range(size // word))


def test_a_one_step_change_costs_less_than_its_new_value():
    """A bf16 weight that moved by one step differs from the old bit pattern by 1: 1 % of the
    words of 4 MB moved by +-1 cost well under the 2 bytes a new value would."""
    rng = np.random.default_rng(2)
    base = rng.bytes(4 << 20)
    words = np.frombuffer(base, dtype="<u2").copy()
    where = rng.choice(len(words), size=len(words) // 100, replace=False)
    words[where] += rng.choice(np.array([1, 0xFFFF], dtype="<u2"), size=len(where))  # +-1, wrapping
    target = words.tobytes()
    patch = patch_of(base, target, 2)
    assert read_header(patch).changed == len(where)
    assert len(patch) < len(where) * 1.5, len(patch)  # gaps ~1 byte, deltas ~2 bits each
    buf = bytearray(base)
    apply_patch(buf, patch, base=sha(base))
    assert bytes(buf) == target


def test_a_sparse_change_costs_what_changed():
    """1 % of the bf16 words of 4 MB rewritten at random: the patch is about that 1 %
    (positions and deltas), not the 4 MB."""
    base = np.random.default_rng(0).bytes(4 << 20)
    target = changed_copy(base, 2, 0.01, 1)
    patch = patch_of(base, target, 2)
    changed = read_header(patch).changed
    assert 0.009 * (2 << 20) < changed <= 0.01 * (2 << 20)
    assert len(patch) < changed * 2 * 2.5, len(patch)  # values 2 bytes, gaps ~1.5 bytes each
    assert len(patch_of(base, base, 2)) < HEADER.size + 100  # nothing changed: a header


def refused(buf: bytearray, patch, match: str, **kw) -> None:
    before = bytes(buf)
    with pytest.raises(PatchError, match=match):
        apply_patch(buf, patch, "checkpoints/v000002/weights.vrlpatch", **kw)
    assert bytes(buf) == before  # nothing written


def forged(word: int, size: int, changed: int, gaps, deltas, body: bytes | None = None) -> bytes:
    header = HEADER.pack(MAGIC, 2, word, size, b"\0" * 32, b"\0" * 32, changed, b"\0" * 8)
    if body is None:
        g = np.asarray(gaps, dtype="<u8")
        v = np.asarray(deltas, dtype=f"<u{word}")
        body = zstandard.ZstdCompressor().compress(
            g.view(np.uint8).reshape(len(g), 8).T.tobytes() + v.tobytes())
    return header + body


def test_malformed_patches_are_refused_and_the_buffer_is_left_alone():
    base = bytes(range(256)) * 4
    target = changed_copy(base, 2, 0.1, 3)
    good = patch_of(base, target, 2)
    buf = bytearray(base)
    name = "weights.vrlpatch"
    refused(buf, good[:50], "shorter than a patch header")
    refused(buf, b"NOTPATCH" + good[8:], "not a vrl weights patch")
    refused(buf, good[:8] + struct.pack("<I", 1) + good[12:], "patch format 1, this build reads 2")
    refused(buf, good[:12] + struct.pack("<I", 3) + good[16:], "word width 3")
    refused(bytearray(base[:-2]), good, "patches a file of 1024 bytes")
    refused(buf, good, "made for another base", base=sha(b"other"))
    refused(buf, good[:HEADER.size] + b"garbage", "not a zstd frame")
    refused(buf, good[:-5], "bytes, the header announces|not a zstd frame")
    # header n over the file's words
    refused(buf, forged(2, 1024, 513, [0], [1]), "513 changed words in a file of 512")
    # a body longer or shorter than n announces
    refused(buf, forged(2, 1024, 2, [0, 1, 1], [1, 2, 3]), "holds more than 20 bytes")
    refused(buf, forged(2, 1024, 2, [0], [1]), "the header announces 20")
    # positions: past the end, repeated, wrapping around 2**64
    refused(buf, forged(2, 1024, 1, [512], [7]), "outside the file or out of order")
    refused(buf, forged(2, 1024, 2, [5, 0], [7, 8]), "outside the file or out of order")
    refused(buf, forged(2, 1024, 2, [300, 300], [7, 8]), "outside the file or out of order")
    refused(buf, forged(2, 1024, 3, [10, 2**63, 2**63], [1, 2, 3]), "outside the file or out of order")
    # and the untouched buffer still takes the good patch
    apply_patch(buf, good, name, base=sha(base))
    assert bytes(buf) == target


def test_make_patch_refuses_what_it_cannot_express():
    with pytest.raises(ValueError, match="32 bytes"):
        make_patch(b"ab", b"ab", 1, "ab" * 16, "ab" * 20)
    with pytest.raises(ValueError, match="equal sizes"):
        patch_of(b"ab", b"abc", 1)
    with pytest.raises(ValueError, match="word 3"):
        patch_of(b"ab", b"ab", 3)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_apply_is_exact_and_checks_across_chunk_edges(monkeypatch, chunk):
    """apply_patch works through the positions `CHUNK` at a time: the same result and the
    same refusals when a chunk edge falls anywhere, a bad position in a later chunk included
    (checked before the first chunk is written)."""
    monkeypatch.setattr(patch_module, "CHUNK", chunk)
    base = np.random.default_rng(5).bytes(4001)
    for word, share in ((1, 0.3), (2, 1.0), (4, 0.05), (8, 0.5)):
        target = changed_copy(base, word, share, word)
        buf = bytearray(base)
        apply_patch(buf, patch_of(base, target, word), base=sha(base))
        assert bytes(buf) == target
    buf = bytearray(base[:1024])
    gaps = [0] + [1] * 199
    refused(buf, forged(2, 1024, 200, gaps[:150] + [0] + gaps[151:], list(range(200))),
            "outside the file or out of order")
    refused(buf, forged(2, 1024, 200, gaps[:199] + [400], list(range(200))),
            "outside the file or out of order")
    refused(buf, forged(2, 1024, 3, [10, 2**63, 2**63], [1, 2, 3]), "outside the file or out of order")


@pytest.mark.parametrize("word", [1, 2, 4])
def test_applying_a_patch_holds_chunks_not_its_body(word):
    """Worst case: every word of an 8 MiB file changed, so the decompressed body is 3 to 9
    times the file (n * (8 + word) bytes). apply_patch streams it: beyond the file it holds
    a few CHUNK-long buffers, whatever n is (it used to hold the whole body, and before that
    ~35 bytes per changed word on top: 272 MiB for one 8 MiB file)."""
    import tracemalloc

    size = 8 << 20
    base = np.random.default_rng(1).bytes(size)
    target = (np.frombuffer(base, dtype=f"<u{word}") + 1).tobytes()  # every word changed
    patch = patch_of(base, target, word)
    buf = bytearray(base)
    body = size // word * (8 + word)
    tracemalloc.start()
    try:
        apply_patch(buf, patch, base=sha(base))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bytes(buf) == target
    bound = 4 << 20  # the skip buffer (SKIP_BYTES, 1 MiB), ~32 bytes per word of a CHUNK, slack
    assert peak <= bound < body // 4, f"{peak / 2**20:.1f} MiB for a body of {body / 2**20:.1f} MiB"


def test_a_frame_asking_for_a_bigger_window_than_max_window_is_refused():
    """Each stream of an apply holds one zstd window: a frame may not ask for more than
    MAX_WINDOW (zstd's default limit is 128 MiB); the frames make_patch writes stay under it."""
    base = np.random.default_rng(3).bytes(1 << 20)
    target = changed_copy(base, 2, 0.5, 4)
    good = patch_of(base, target, 2)
    frame = zstandard.get_frame_parameters(good[HEADER.size:])
    assert frame.window_size <= patch_module.MAX_WINDOW
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=24,
                                                            write_content_size=False)
    body = zstandard.ZstdDecompressor().decompress(good[HEADER.size:])
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()  # size unknown
    wide = stream.compress(body) + stream.flush()
    assert zstandard.get_frame_parameters(wide).window_size > patch_module.MAX_WINDOW
    refused(bytearray(base), good[:HEADER.size] + wide, "not a zstd frame")
