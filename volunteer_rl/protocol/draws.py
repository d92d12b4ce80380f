"""Committed randomness: the uniforms a volunteer must sample each completion with.

A volunteer holds the weights, so if it chose its own random numbers it could pick any tokens
it liked, compute their true logprobs and pass a logprob audit. Instead every completion's
sampling noise is a pure function of facts the trainer knows too, so the trainer can replay
the draw (model.replay) and check that each submitted token is the one the committed uniform
selects under the policy's distribution:

    key    = sha256(b"vrl-draw-v1" + for each field of (run_id, version, volunteer_id, seq,
                    prompt_id, index): b"\\x00" + str(field).encode("utf-8"))
    stream = shake_256(key).digest(8 * n)
    u[p]   = (big-endian uint64 of stream[8p : 8p + 8] >> 11) * 2**-53      in [0, 1)

run_id is the manifest's run id, version the policy version the group is sampled with,
volunteer_id the volunteer's id, seq the group's number among this volunteer's groups of
this version (0, 1, 2, ... without gaps, so a volunteer cannot try several keys for one
prompt and keep the one it likes), prompt_id the dataset row and index the completion's
index 0..K-1 in its group. u[p] is the uniform of the token at position p; model.sampling
turns it into a token by inverse CDF.

Each completion has its own stream, keyed by what it is rather than by where it sits, so the
draw does not depend on batch composition, device, thread count or the order rows are
sampled in: only the distribution itself (up to float noise, which the replay's tolerance
covers) decides the token. Pure Python (hashlib): no torch here, every reader of the bucket
can derive the same numbers.
"""

from __future__ import annotations

import hashlib
import struct

DOMAIN = b"vrl-draw-v1"
"""Domain tag: these hashes can never be mistaken for any other use of sha256."""

_SCALE = 2.0 ** -53  # 53 random bits, a float64's whole mantissa: every value exact, < 1


def draw_key(run_id: str, version: int, volunteer_id: str, seq: int, prompt_id: int,
             index: int) -> bytes:
    """The 32-byte key of one completion's stream. A field containing NUL is refused: NUL
    separates the fields, so such a field could make two different tuples share a key."""
    h = hashlib.sha256(DOMAIN)
    for field in (run_id, version, volunteer_id, seq, prompt_id, index):
        text = str(field)
        if "\x00" in text:
            raise ValueError(f"a draw key field may not contain NUL: {text!r:.40}")
        h.update(b"\x00" + text.encode("utf-8"))
    return h.digest()


def uniforms(key: bytes, n: int) -> list[float]:
    """The first `n` uniforms in [0, 1) of the stream of `key`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    words = struct.unpack(f">{n}Q", hashlib.shake_256(key).digest(8 * n))
    return [(w >> 11) * _SCALE for w in words]


def completion_uniforms(run_id: str, version: int, volunteer_id: str, seq: int, prompt_id: int,
                        index: int, n: int) -> list[float]:
    """`uniforms(draw_key(...), n)`: the stream one completion is sampled with."""
    return uniforms(draw_key(run_id, version, volunteer_id, seq, prompt_id, index), n)
