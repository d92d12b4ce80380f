"""Weight patches: one weights file rewritten into the next version's, bit for bit, by storing
the words that changed and nothing else.

A patch is made from two weights files of the same size (two versions of one model,
serialized the same way: safetensors written by `model.weights.write_weights`, whose header
depends on the tensors' names, shapes and dtype only). Both are read as arrays of `word`-byte
words, where `word` is the published dtype's width (2 for bf16, 4 for fp32), so a weight is
one word and a weight that did not change costs nothing. RL steps at small learning rates
leave most bf16 weights exactly as they were (PULSE measures ~99 %), so a patch is the
changed words' positions and, for each, the difference of its bit pattern: new word minus
old word as unsigned integers, modulo 2^(8 word). That is integer arithmetic on the bits,
not a float difference, so applying it gives the new file exactly (the new file's piece
hashes in the manifest verify it); and a weight that moved by one bf16 step differs by 1, which zstd
stores in a few bits where the new value itself took about 12 (bench/README.md, patch_size:
66x instead of 35x fewer bytes than the file for a Qwen3-0.6B shape at lr 1e-6).

The object, little-endian:

    fixed header (HEADER, 112 bytes)
      magic "VRLPATCH", format 2, word (1, 2, 4 or 8 bytes),
      size (bytes of both files), the 32-byte names of the base file and of the target file
      (the maker's choice; vrl's trainer gives each file's root, manifest.pieces_root),
      changed words n, tail: the target's last size % word bytes (zero-padded to 8)
    body: one zstd frame that decompresses to exactly n * (8 + word) bytes:
      the gaps between changed word positions (first = the first position, then
      position[i] - position[i-1] >= 1) as n uint64, byte-shuffled (all first bytes, then all
      second bytes, ...), which turns their high bytes into long runs of zeros that zstd
      removes; then the n deltas (new - old mod 2^(8 word)) as `word`-byte integers.

Reading one is bounded by the file it patches: n is at most the number of words, the body
must decompress to exactly its announced length, and every position is checked to be
inside the file and strictly increasing before any word is written; the decompressed
body (up to 9 times the file, for word 1) is streamed, never held (`apply_patch`). A patch
that fails any check is PatchError (one line, naming the object), and the buffer it was
applied to is left as it was. The manifest's sha256 of the patch object is checked before it
is parsed (the caller's job, as for every checkpoint file), so a patch from a bucket someone
else wrote never gets here; the bounds hold anyway.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from volunteer_rl.errors import VrlError

MAGIC = b"VRLPATCH"
FORMAT = 2
"""1 (schema 3) named the base and target by their sha256; 2 by whatever the maker gives
(the files' roots), so no reader or maker hashes a whole file for it."""
WORDS = (1, 2, 4, 8)
HEADER = struct.Struct("<8sIIQ32s32sQ8s")
"""magic, format, word, size, base name, target name, changed words, tail."""
CHUNK = 1 << 16
"""Changed words a patch is checked and applied by at a time: with MAX_WINDOW, what bounds the
memory beyond the file patched (about 25 bytes per word of a chunk)."""
MAX_WINDOW = 8 << 20
"""The largest zstd window a patch frame may ask for (a frame asking more is refused as no zstd
frame): each of the up to 9 streams an apply reads holds one. make_patch's level writes at
most 2 MiB windows; zstd's own default limit is 128 MiB."""
SKIP_BYTES = 1 << 20
"""Decompressed bytes read at a time while a stream skips to where its part of a body starts,
and while a body's length is counted."""
ZSTD_LEVEL = 3
"""Level 3 compresses the shuffled gaps and values of a 1 %-changed bf16 file within a few
percent of level 19, at hundreds of MB/s."""


class PatchError(VrlError):
    """A patch that cannot be applied: malformed, for another base, or out of bounds."""


@dataclass(frozen=True)
class PatchInfo:
    """What a patch's header says."""

    word: int
    size: int
    base: str
    """The base file's name, hex (what the maker gave: for vrl, its root)."""
    target: str
    changed: int


def _words(buf, word: int) -> np.ndarray:
    """The whole words of a byte buffer, as unsigned integers of `word` bytes (a view)."""
    return np.frombuffer(buf, dtype=f"<u{word}", count=len(buf) // word)


def _shuffle(a: np.ndarray) -> bytes:
    """Byte planes of an array of n k-byte integers: byte 0 of every one, then byte 1, ..."""
    return a.view(np.uint8).reshape(len(a), a.itemsize).T.tobytes()


def _name(hex_name: str) -> bytes:
    raw = bytes.fromhex(hex_name)
    if len(raw) != 32:
        raise ValueError(f"a patch names its files by 32 bytes, not {len(raw)}")
    return raw


def count_changed(base, target, word: int) -> int:
    """How many of the `word`-byte words differ between two buffers of the same length."""
    base, target = memoryview(base).cast("B"), memoryview(target).cast("B")
    return int(np.count_nonzero(_words(base, word) != _words(target, word)))


def make_patch(base, target, word: int, base_name: str, target_name: str,
               threads: int = -1) -> bytes:
    """The patch that turns the bytes `base` into the bytes `target` (same length), naming
    them `base_name` and `target_name` (32 bytes each, hex; the trainer gives their roots).
    `threads`: zstd's workers (-1: one per CPU, 0: none, compress on the calling thread)."""
    if word not in WORDS:
        raise ValueError(f"word {word} is not one of {WORDS}")
    base, target = memoryview(base).cast("B"), memoryview(target).cast("B")
    if len(base) != len(target):
        raise ValueError(f"base is {len(base)} bytes, target {len(target)}: a patch needs equal sizes")
    import zstandard

    old, new = _words(base, word), _words(target, word)
    where = np.flatnonzero(old != new)
    gaps = np.diff(where, prepend=0).astype("<u8")
    deltas = (new[where] - old[where]).astype(f"<u{word}")  # unsigned: wraps modulo 2^(8 word)
    whole = len(new) * word
    tail = bytes(target[whole:]).ljust(8, b"\0")
    header = HEADER.pack(MAGIC, FORMAT, word, len(target),
                         _name(base_name), _name(target_name), len(where), tail)
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=threads)
    body = cctx.compress(_shuffle(gaps) + deltas.tobytes())
    return header + body


def read_header(patch, name: str = "patch") -> PatchInfo:
    """The header of a patch object's bytes; PatchError naming `name` if it is not one."""
    patch = memoryview(patch).cast("B")
    if len(patch) < HEADER.size:
        raise PatchError(f"{name}: {len(patch)} bytes, shorter than a patch header")
    magic, fmt, word, size, base, target, changed, _ = HEADER.unpack_from(patch)
    if magic != MAGIC:
        raise PatchError(f"{name}: not a vrl weights patch")
    if fmt != FORMAT:
        raise PatchError(f"{name}: patch format {fmt}, this build reads {FORMAT}")
    if word not in WORDS:
        raise PatchError(f"{name}: word width {word} is not one of {WORDS}")
    if changed > size // word:
        raise PatchError(f"{name}: {changed} changed words in a file of {size // word}")
    return PatchInfo(word, size, base.hex(), target.hex(), changed)


def apply_patch(buf, patch, name: str = "patch", base: str | None = None) -> PatchInfo:
    """Rewrite `buf` (a writable buffer holding the base file) into the target file, in place.

    `base`, the name (root) the caller verified `buf` against, must be the patch's base (a
    patch for another version is refused before anything is written). Every bound is checked
    before the first word is written, so on PatchError `buf` is unchanged. Returns the header:
    its `target` names what `buf` now holds if the patch was made honestly (the caller checks
    the manifest's hashes of the result, which are what count).

    The body is never held: it is decompressed three times, CHUNK words at a time (its
    length counted; every position checked; then written), by streams that each start
    where their part lies (the k-th byte plane of the gaps at k * n, the deltas at 8 n), so
    memory beyond `buf` is a few CHUNK-long buffers and at most 9 zstd windows of
    MAX_WINDOW, whatever n is; the price is decompressing about 9 times as much as one pass."""
    info = read_header(patch, name)
    patch = memoryview(patch).cast("B")
    buf = memoryview(buf).cast("B")
    if len(buf) != info.size:
        raise PatchError(f"{name}: patches a file of {info.size} bytes, the base is {len(buf)}")
    if base is not None and base != info.base:
        raise PatchError(f"{name}: made for another base ({info.base[:12]}..., "
                         f"held {base[:12]}...)")
    n, word = info.changed, info.word
    body = _Body(patch[HEADER.size:], name)
    body.check_length(n * (8 + word))
    words = _words(buf, word)
    for write in (False, True):
        _walk(body, n, word, words, write)
    tail = info.size % word
    if tail:
        buf[info.size - tail:] = HEADER.unpack_from(patch)[7][:tail]
    return info


class _Body:
    """A patch's zstd frame, read as streams that start anywhere in what it decompresses to;
    any zstd error is PatchError naming the patch."""

    def __init__(self, frame: memoryview, name: str):
        self.frame, self.name = frame, name
        self.scratch = bytearray(SKIP_BYTES)

    def _stream(self):
        """A new stream of the frame from its start: each has its own decompression context
        (a zstandard decompressor runs one operation at a time)."""
        import zstandard

        return zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(self.frame)

    @contextlib.contextmanager
    def _zstd_errors(self) -> Iterator[None]:
        import zstandard

        try:
            yield
        except zstandard.ZstdError as exc:
            raise PatchError(f"{self.name}: body is not a zstd frame ({exc})") from None

    def _read(self, reader, view: memoryview) -> int:
        """Fill `view` from `reader` as far as the frame goes; the bytes read."""
        got = 0
        with self._zstd_errors():
            while got < len(view) and (k := reader.readinto(view[got:])):
                got += k
        return got

    def check_length(self, expected: int) -> None:
        """The frame decompresses to exactly `expected` bytes (counted, not held: a frame
        that says anything of its own size gets no more than `expected` + 1 bytes read)."""
        got, scratch = 0, memoryview(self.scratch)
        with self._zstd_errors(), self._stream() as reader:
            while got <= expected and (k := self._read(reader, scratch[:expected + 1 - got])):
                got += k
        if got != expected:
            held = f"more than {expected}" if got > expected else str(got)
            raise PatchError(f"{self.name}: body holds {held} bytes, the header announces {expected}")

    @contextlib.contextmanager
    def at(self, offset: int) -> Iterator[Callable[[memoryview], None]]:
        """A stream of the decompressed body from byte `offset` on, as a function that fills
        a view with the next bytes (the length was checked, so they are there)."""
        scratch = memoryview(self.scratch)
        with self._zstd_errors(), self._stream() as reader:
            while offset:
                skipped = self._read(reader, scratch[:min(offset, len(scratch))])
                if not skipped:
                    raise PatchError(f"{self.name}: body ended early")
                offset -= skipped

            def fill(view: memoryview) -> None:
                if self._read(reader, view) != len(view):
                    raise PatchError(f"{self.name}: body ended early")
            yield fill


def _walk(body: _Body, n: int, word: int, words: np.ndarray, write: bool) -> None:
    """Go through the n positions (made from the gaps) and, if `write`, add each delta to
    its word; PatchError at the first position outside the file or out of order. Called
    once to check and once to write, so a refused patch leaves `words` as they were."""
    planes = np.empty((8, min(CHUNK, n)), dtype=np.uint8)
    deltas = np.empty(min(CHUNK, n), dtype=f"<u{word}")
    with contextlib.ExitStack() as streams:
        gap_bytes = [streams.enter_context(body.at(j * n)) for j in range(8)]
        delta_bytes = streams.enter_context(body.at(8 * n)) if write else None
        last = 0
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            for j, fill in enumerate(gap_bytes):
                fill(memoryview(planes[j, :m]))
            gaps = np.ascontiguousarray(planes[:, :m].T).view("<u8").reshape(m)
            # gaps below the word count and a running position below it too: the sum of a
            # chunk cannot wrap (CHUNK * words is far below 2**64 for any file in memory)
            if int(gaps.max()) >= len(words) or (m > 1 and int(gaps[1:].min()) < 1) \
                    or (a > 0 and int(gaps[0]) < 1):
                raise PatchError(f"{body.name}: a position outside the file or out of order")
            at = np.cumsum(gaps, dtype=np.uint64) + np.uint64(last)
            last = int(at[-1])
            if last >= len(words):
                raise PatchError(f"{body.name}: a position outside the file or out of order")
            if write:
                delta_bytes(memoryview(deltas[:m]).cast("B"))
                # unsigned: wraps modulo 2^(8 word), as made
                words[at.astype(np.intp)] += deltas[:m]
