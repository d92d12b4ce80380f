"""protocol.draws: the committed uniforms, pinned to the protocol's derivation."""
import hashlib

import pytest

from volunteer_rl.protocol.draws import completion_uniforms, draw_key, uniforms

FIELDS = ("run-7f3a", 12, "laptop-ab12", 3, 4021, 5)
# Computed once from this implementation; a change here is a protocol change (vrl-draw-v2).
KEY_HEX = "e7cb943f0af466449a60959be415005adffa78385ef899aede8e23a4d620e7df"
FIRST_FOUR = [0.30003392286520847, 0.22556910899671245, 0.7868683316552609, 0.8598068448945249]


def spec_uniforms(fields: tuple, n: int) -> list[float]:
    """The derivation as docs and protocol.draws state it, written out again independently."""
    data = b"vrl-draw-v1" + b"".join(b"\x00" + str(f).encode("utf-8") for f in fields)
    key = hashlib.sha256(data).digest()
    stream = hashlib.shake_256(key).digest(8 * n)
    return [(int.from_bytes(stream[8 * p: 8 * p + 8], "big") >> 11) * 2.0 ** -53
            for p in range(n)]


def test_known_answer_vector():
    key = draw_key(*FIELDS)
    assert key.hex() == KEY_HEX
    assert uniforms(key, 4) == FIRST_FOUR
    assert completion_uniforms(*FIELDS, 4) == FIRST_FOUR


@pytest.mark.parametrize("fields", [FIELDS, ("", 0, "", 0, 0, 0),
                                    ("rün", 1, "v-é", 10**6, 7, 63)])
def test_implementation_equals_the_written_derivation(fields):
    assert completion_uniforms(*fields, 40) == spec_uniforms(fields, 40)


def test_every_field_changes_the_stream():
    base = completion_uniforms(*FIELDS, 8)
    changed = [("run-7f3b", 12, "laptop-ab12", 3, 4021, 5),
               ("run-7f3a", 13, "laptop-ab12", 3, 4021, 5),
               ("run-7f3a", 12, "laptop-ab13", 3, 4021, 5),
               ("run-7f3a", 12, "laptop-ab12", 4, 4021, 5),
               ("run-7f3a", 12, "laptop-ab12", 3, 4022, 5),
               ("run-7f3a", 12, "laptop-ab12", 3, 4021, 6),
               ("run-7f3a1", 2, "laptop-ab12", 3, 4021, 5)]  # same characters, split differently
    streams = [completion_uniforms(*f, 8) for f in changed]
    assert all(s != base for s in streams)
    assert len({tuple(s) for s in streams}) == len(streams)


def test_values_are_in_the_unit_interval_and_look_uniform():
    values = uniforms(draw_key(*FIELDS), 20_000)
    assert all(0.0 <= u < 1.0 for u in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.01  # 4.9 standard errors
    assert sum(u < 0.25 for u in values) / len(values) == pytest.approx(0.25, abs=0.0125)


def test_a_longer_stream_starts_with_the_shorter_one():
    """The volunteer and the trainer may ask for different lengths: same values either way."""
    key = draw_key(*FIELDS)
    assert uniforms(key, 50)[:7] == uniforms(key, 7)
    assert uniforms(key, 0) == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        uniforms(draw_key(*FIELDS), -1)
    with pytest.raises(ValueError):  # NUL separates fields: "a\x00b" could mimic two fields
        draw_key("run\x00x", 1, "v", 0, 0, 0)
