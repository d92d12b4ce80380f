"""protocol.draws: the committed Gumbel noise, pinned to the protocol's derivation, and
model.sampling's vectorised version of it, bit for bit."""
import hashlib
import math
import random
import struct

import pytest
import torch

from volunteer_rl.model.sampling import gumbel_noise, key_words, noise_bits as torch_bits
from volunteer_rl.protocol.draws import draw_key, group_keys, gumbel, mix32, noise_bits

NONCE = "5f1c0d2a9b8e7f6a5f1c0d2a9b8e7f6a"
FIELDS = ("run-7f3a", 12, "laptop-ab12", 3, 4021, 5, NONCE)
"""draw_key's arguments: run id, version, volunteer, seq, prompt id, index, nonce."""
# Computed once from this implementation; a change here is a protocol change (vrl-draw-v3).
KEY_HEX = "3b1ae5da77beeccbc3812b4329054ac0acca6ec20194837db69bede819f1a58e"
AT = [(0, 0), (0, 1), (1, 0), (31, 151935), (7, 65536)]  # (position, token)
BITS = [2106936098, 934355858, 2085882613, 2388180740, 3944414353]
GUMBEL = [0.33938368204627256, -0.42221854852604634, 0.3253813650920616, 0.5328802807190675,
          2.4634177914972395]


def spec_bits(fields: tuple, position: int, token: int) -> int:
    """The derivation as docs/PROTOCOL.md states it, written out again independently."""
    def lowbias32(x):
        x = ((x ^ (x >> 16)) * 0x7FEB352D) % 2 ** 32
        x = ((x ^ (x >> 15)) * 0x846CA68B) % 2 ** 32
        return x ^ (x >> 16)
    run_id, version, volunteer, seq, prompt_id, index, nonce = fields
    hashed = (run_id, version, nonce, volunteer, seq, prompt_id, index)  # the key's field order
    data = b"vrl-draw-v3" + b"".join(b"\x00" + str(f).encode("utf-8") for f in hashed)
    key = hashlib.sha256(data).digest()
    k0, k1 = int.from_bytes(key[0:4], "big"), int.from_bytes(key[4:8], "big")
    x = lowbias32(k0 ^ lowbias32(k1 ^ position)) ^ lowbias32(token)
    return lowbias32(x % 2 ** 16) ^ lowbias32(2 ** 16 + x // 2 ** 16)


def test_known_answer_vector():
    key = draw_key(*FIELDS)
    assert key.hex() == KEY_HEX
    assert [noise_bits(key, p, t) for p, t in AT] == BITS
    assert [gumbel(key, p, t) for p, t in AT] == GUMBEL
    assert [mix32(x) for x in (0, 1, 2 ** 32 - 1)] == [0, 1753845952, 1734902346]
    assert group_keys(*FIELDS[:5], 7, NONCE)[5] == key


@pytest.mark.parametrize("fields", [FIELDS, ("", 0, "", 0, 0, 0, ""),
                                    ("rün", 1, "v-é", 10**6, 7, 63, "ab")])
def test_implementation_equals_the_written_derivation(fields):
    key = draw_key(*fields)
    rng = random.Random(1)
    for position, token in [(0, 0), (2 ** 32 - 1, 2 ** 32 - 1)] + [
            (rng.randrange(512), rng.randrange(200_000)) for _ in range(200)]:
        assert noise_bits(key, position, token) == spec_bits(fields, position, token)


def test_torch_noise_equals_the_pure_python_bit_for_bit():
    """What a volunteer samples with (model.sampling) is what the protocol says, on every
    token of a 70k vocabulary (both halves of the tabulation) at random keys and positions."""
    rng = random.Random(2)
    keys = [rng.randbytes(32) for _ in range(6)]
    positions = [0, 1, 31, rng.randrange(1 << 20), 2 ** 32 - 1, rng.randrange(512)]
    vocab = 70_000
    words = key_words(keys, torch.device("cpu"))
    bits = torch_bits(words, torch.tensor(positions), vocab)
    g = gumbel_noise(words, torch.tensor(positions), vocab)
    for row, (key, p) in enumerate(zip(keys, positions)):
        tokens = [0, 1, 65535, 65536, vocab - 1] + [rng.randrange(vocab) for _ in range(300)]
        assert bits[row, tokens].tolist() == [noise_bits(key, p, t) for t in tokens]
        assert g[row, tokens].tolist() == pytest.approx([gumbel(key, p, t) for t in tokens],
                                                        rel=1e-14, abs=1e-14)
    assert struct.unpack(">2I", keys[0][:8]) == tuple(words[0].tolist())


def test_every_field_changes_the_noise():
    def first(fields):
        return [noise_bits(draw_key(*fields), p, t) for p in range(3) for t in range(3)]
    base = first(FIELDS)
    n = NONCE
    changed = [("run-7f3b", 12, "laptop-ab12", 3, 4021, 5, n),
               ("run-7f3a", 13, "laptop-ab12", 3, 4021, 5, n),
               ("run-7f3a", 12, "laptop-ab13", 3, 4021, 5, n),
               ("run-7f3a", 12, "laptop-ab12", 4, 4021, 5, n),
               ("run-7f3a", 12, "laptop-ab12", 3, 4022, 5, n),
               ("run-7f3a", 12, "laptop-ab12", 3, 4021, 6, n),
               ("run-7f3a", 12, "laptop-ab12", 3, 4021, 5, n[:-1] + "b"),  # another grant's
               ("run-7f3a1", 2, "laptop-ab12", 3, 4021, 5, n)]  # same characters, split differently
    noises = [first(f) for f in changed]
    assert all(n != base for n in noises)
    assert len({tuple(n) for n in noises}) == len(noises)


def test_the_noise_is_standard_gumbel_and_never_infinite():
    words = key_words([draw_key(*FIELDS[:5], j, NONCE) for j in range(8)], torch.device("cpu"))
    g = gumbel_noise(words, torch.arange(8), 50_000)  # 400,000 values
    assert g.isfinite().all()
    assert g.mean().item() == pytest.approx(0.5772157, abs=0.006)      # Euler's constant; 3 s.e.
    assert g.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.006)
    # P(g < 0) = exp(-1); the extremes of u = (h + 0.5) / 2**32 stay finite
    assert (g < 0).double().mean().item() == pytest.approx(math.exp(-1), abs=0.003)
    lo, hi = 0.5 * 2.0 ** -32, 1 - 0.5 * 2.0 ** -32
    assert math.isfinite(-math.log(-math.log(lo))) and math.isfinite(-math.log(-math.log(hi)))


def test_bad_arguments_are_refused():
    key = draw_key(*FIELDS)
    with pytest.raises(ValueError):
        noise_bits(key, -1, 0)
    with pytest.raises(ValueError):
        noise_bits(key, 0, 2 ** 32)
    with pytest.raises(ValueError):  # NUL separates fields: "a\x00b" could mimic two fields
        draw_key("run\x00x", 1, "v", 0, 0, 0, NONCE)


def test_the_noise_is_the_formula_on_the_bits_to_the_last_bit():
    """gumbel_noise takes its bits as int32 less 2**31 (model.sampling._signed_bits): the
    float64 noise must be exactly -log(-log((bits + 0.5) / 2**32)) on the int64 bits, the
    formula older builds compute, so a replay never differs from a sampler by a rounding."""
    rng = random.Random(3)
    keys = [rng.randbytes(32) for _ in range(8)]
    positions = torch.tensor([0, 1, 2, 31, 2 ** 31, 2 ** 32 - 1, rng.randrange(512), 7])
    words = key_words(keys, torch.device("cpu"))
    for vocab in (640, 70_000):
        bits = torch_bits(words, positions, vocab)
        assert int(bits.min()) >= 0 and int(bits.max()) < 2 ** 32
        want = bits.double().add_(0.5).mul_(2.0 ** -32).log_().neg_().log_().neg_()
        assert torch.equal(gumbel_noise(words, positions, vocab), want)
