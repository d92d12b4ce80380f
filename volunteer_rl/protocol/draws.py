"""Committed randomness: the Gumbel noise a volunteer must sample each completion with.

A volunteer holds the weights, so if it chose its own random numbers it could pick any tokens
it liked, compute their true logprobs and pass a logprob audit. Instead every completion's
sampling noise is a pure function of facts the trainer knows too, so the trainer can replay
the draw (model.replay) and check that each submitted token is the one the committed noise
selects under the policy's distribution. The token at position p is the Gumbel-max

    token[p] = argmax_t  z[t] + g(key, p, t)          z = logits / T (float32, then float64)

which is an exact sample of softmax(z), with one noise value per vocabulary entry:

    key    = sha256(b"vrl-draw-v3" + for each field of (run_id, version, nonce, volunteer_id,
                    seq, prompt_id, index): b"\\x00" + str(field).encode("utf-8"))
    k0, k1 = big-endian uint32 of key[0:4], key[4:8]
    b[p]   = mix32(k0 ^ mix32(k1 ^ p))                          one word per position
    x      = b[p] ^ mix32(t)
    h      = mix32(x & 0xFFFF) ^ mix32(0x10000 | (x >> 16))     (tabulation of x's halves)
    u      = (h + 0.5) * 2**-32                                 in (0, 1), exact in float64
    g      = -log(-log(u))                                      float64

with mix32 the 32-bit mixer below (lowbias32: xor-shifts and multiplications mod 2**32).
run_id is the manifest's run id, version the policy version the group is sampled with,
nonce the nonce of the block of numbers seq is in, which the trainer granted for that version
(protocol.grants: unknown to the volunteer until the number is bound to the version),
volunteer_id the volunteer's id, seq the group's number among this volunteer's groups of
this run (0, 1, 2, ... without gaps, across versions, so a volunteer cannot try several
keys for one prompt and keep the one it likes), prompt_id the dataset row and index the
completion's index 0..K-1 in its group. The prompt is committed too: group number seq of
a version is sampled for the prompt `pool_prompt` draws from that version's pool.

Why Gumbel-max and not one uniform per position by inverse CDF: in the tail of a real
vocabulary hundreds of tiny CDF intervals lie within float noise of one uniform, so a replay
that tolerates honest noise there tolerates a choice among them. With a value per token,
float noise changes the token only where the top two perturbed scores nearly tie, and the
alternatives are then exactly those two (model.replay).

Each completion's noise is keyed by what it is rather than by where it sits, so the draw
does not depend on batch composition, device, thread count or the order rows are sampled in.
The bits are integers, the same on every machine; only `g`'s last float64 bit may differ
between math libraries, far below the replay's tolerance. Pure Python here (hashlib, no
torch: every reader of the bucket can derive the same numbers); model.sampling computes the
same bits vectorised over the vocabulary, and tests/unit/test_draws.py pins that the two agree.
"""

from __future__ import annotations

import hashlib
import math
import struct

DOMAIN = b"vrl-draw-v3"
"""Domain tag: these hashes can never be mistaken for any other use of sha256 (v1 drew by
inverse CDF from a SHAKE-256 stream of uniforms, schema 4; v2 had no nonce, schema 8)."""

MASK32 = 0xFFFFFFFF
MIX32 = (0x7FEB352D, 0x846CA68B)
"""lowbias32's multipliers (C. Wellons, hash-prospector): x ^= x >> 16; x *= MIX32[0];
x ^= x >> 15; x *= MIX32[1]; x ^= x >> 16, every product mod 2**32. A bijection of 32-bit words."""


def mix32(x: int) -> int:
    """lowbias32 of a 32-bit word."""
    x ^= x >> 16
    x = (x * MIX32[0]) & MASK32
    x ^= x >> 15
    x = (x * MIX32[1]) & MASK32
    return x ^ (x >> 16)


def draw_key(run_id: str, version: int, volunteer_id: str, seq: int, prompt_id: int,
             index: int, nonce: str) -> bytes:
    """The 32-byte key of one completion's noise. A field containing NUL is refused: NUL
    separates the fields, so such a field could make two different tuples share a key."""
    h = hashlib.sha256(DOMAIN)
    for field in (run_id, version, nonce, volunteer_id, seq, prompt_id, index):
        text = str(field)
        if "\x00" in text:
            raise ValueError(f"a draw key field may not contain NUL: {text!r:.40}")
        h.update(b"\x00" + text.encode("utf-8"))
    return h.digest()


def group_keys(run_id: str, version: int, volunteer_id: str, seq: int, prompt_id: int,
               k: int, nonce: str) -> list[bytes]:
    """The keys of a group's K completions (index 0..k-1), what `model.sampling.sample`
    takes for one prompt to sample that group honestly."""
    return [draw_key(run_id, version, volunteer_id, seq, prompt_id, j, nonce) for j in range(k)]


PROMPT_DOMAIN = b"vrl-prompt-v2"
"""Domain tag of the prompt draw: a group's prompt is no choice of the volunteer's either."""


def prompt_index(run_id: str, version: int, volunteer_id: str, seq: int, pool_size: int,
                 nonce: str) -> int:
    """Which entry of version `version`'s prompt pool (the manifest's `prompt_pool`, of
    `pool_size` rows) group number `seq` of `volunteer_id` must be sampled for:

        h = sha256(b"vrl-prompt-v2" + for each field of (run_id, version, nonce, volunteer_id,
                   seq):
                   b"\\x00" + str(field).encode("utf-8"))
        index = (big-endian uint64 of h[0:8]) mod pool_size

    A volunteer sees the prompt of a number only once the trainer has bound the number to a
    version (the nonce comes with the grant), and can then only upload the group or leave a
    gap (trainer.withheld counts those). The modulo's bias is below 2**-50 for
    any pool a manifest may hold."""
    if pool_size < 1:
        raise ValueError("the prompt pool is empty")
    h = hashlib.sha256(PROMPT_DOMAIN)
    for field in (run_id, version, nonce, volunteer_id, seq):
        text = str(field)
        if "\x00" in text:
            raise ValueError(f"a draw key field may not contain NUL: {text!r:.40}")
        h.update(b"\x00" + text.encode("utf-8"))
    return struct.unpack(">Q", h.digest()[:8])[0] % pool_size


def pool_prompt(pool, run_id: str, version: int, volunteer_id: str, seq: int, nonce: str) -> int:
    """The dataset row (prompt id) group number `seq` must be sampled for: pool[prompt_index]."""
    return pool[prompt_index(run_id, version, volunteer_id, seq, len(pool), nonce)]


def key_words(key: bytes) -> tuple[int, int]:
    """(k0, k1): the two 32-bit words of `key` the noise uses."""
    return struct.unpack(">2I", key[:8])


def position_word(key: bytes, position: int) -> int:
    """b[p]: the word shared by every token's noise at `position`."""
    if not 0 <= position <= MASK32:
        raise ValueError(f"position must be in [0, 2**32), not {position}")
    k0, k1 = key_words(key)
    return mix32(k0 ^ mix32(k1 ^ position))


def noise_bits(key: bytes, position: int, token: int) -> int:
    """h: the 32 bits of the noise of `token` at `position` of the completion of `key`."""
    if not 0 <= token <= MASK32:
        raise ValueError(f"token must be in [0, 2**32), not {token}")
    x = position_word(key, position) ^ mix32(token)
    return mix32(x & 0xFFFF) ^ mix32(0x10000 | (x >> 16))


def gumbel(key: bytes, position: int, token: int) -> float:
    """g: the standard Gumbel noise added to `token`'s scaled logit at `position`."""
    u = (noise_bits(key, position, token) + 0.5) * 2.0 ** -32
    return -math.log(-math.log(u))
