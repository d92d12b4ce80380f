import gzip
import json

import pytest

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.shards import (
    LOGPROB_FLOOR,
    MAX_DECOMPRESSED_BYTES,
    Budget,
    Completion,
    Group,
    ShardError,
    decode_shard,
    encode_shard,
    new_shard_name,
)


def group(**over):
    g = {"prompt_id": 3, "policy_version": 1, "volunteer_id": "v1", "seq": 0,
         "completions": [{"token_ids": [5, 6, 1], "logprobs": [-0.1, -0.2, -0.3],
                          "text": "1 + 2", "reward": 1.0}]}
    g.update(over)
    return g


def raw(*groups) -> bytes:
    return gzip.compress("\n".join(json.dumps(g) for g in groups).encode(), mtime=0)


def test_round_trip():
    g = Group(3, 1, "v1", 7, [Completion([5, 6, 1], [-0.1, -0.2, -0.3], "1 + 2", 1.0)])
    assert decode_shard(encode_shard([g, g])) == [g, g]


def test_shard_names_never_collide():
    names = {new_shard_name(i % 3) for i in range(2000)}
    assert len(names) == 2000 and all(layout.is_safe_name(n) for n in names)


@pytest.mark.parametrize("data, reason", [
    (b"not gzip at all", "bad_gzip"),
    (raw(group())[:-9], "bad_gzip"),                                   # truncated stream
    (gzip.compress(b"{not json", mtime=0), "bad_json"),  # mtime 0: the same test id every run
    (gzip.compress(b"", mtime=0), "empty"),
    (raw(group(extra=1)), "bad_schema"),
    (raw(group(prompt_id="3")), "bad_schema"),
    (raw(group(seq="3")), "bad_schema"),
    (raw(group(seq=True)), "bad_schema"),
    (raw(group(seq=-1)), "bad_seq"),
    (raw(group(seq=1 << 40)), "bad_seq"),
    (raw({k: v for k, v in group().items() if k != "seq"}), "bad_schema"),  # a schema-1 line
    (raw(group(completions=[])), "bad_lengths"),
    (raw(group(completions=[{"token_ids": [1], "logprobs": [-0.1, -0.2], "text": "", "reward": 0}])), "bad_lengths"),
    (raw(group(completions=[{"token_ids": [1], "logprobs": [0.5], "text": "", "reward": 0}])), "bad_logprob"),
    (raw(group(completions=[{"token_ids": [1.5], "logprobs": [-1], "text": "", "reward": 0}])), "bad_schema"),
    (raw(group(completions=[{"token_ids": [True], "logprobs": [-1], "text": "", "reward": 0}])), "bad_schema"),
])
def test_bad_shards_are_rejected_with_a_reason(data, reason):
    with pytest.raises(ShardError) as e:
        decode_shard(data)
    assert e.value.reason == reason


def test_nan_logprob_rejected():
    text = json.dumps(group()).replace("-0.1", "NaN")
    with pytest.raises(ShardError) as e:
        decode_shard(gzip.compress(text.encode()))
    assert e.value.reason == "bad_number"  # refused by the parser, before any float exists


@pytest.mark.parametrize("literal, reason", [
    ("1" * 400, "bad_number"),       # float(10**400) would raise OverflowError later
    ("-" + "9" * 19, "bad_number"),
    ("1e999", "bad_number"),         # parses to inf
    ("Infinity", "bad_number"),
    ("-Infinity", "bad_number"),
])
def test_numbers_are_parsed_with_bounds(literal, reason):
    for field in ("prompt_id", "logprob"):
        text = json.dumps(group())
        text = text.replace('"prompt_id": 3', f'"prompt_id": {literal}') if field == "prompt_id" \
            else text.replace("-0.1", literal)
        with pytest.raises(ShardError) as e:
            decode_shard(gzip.compress(text.encode()))
        assert e.value.reason == reason, field


def test_deep_nesting_is_refused_before_parsing():
    line = b'{"prompt_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ShardError) as e:
        decode_shard(gzip.compress(line))
    assert e.value.reason == "too_deep"


def test_brackets_inside_strings_do_not_count_as_nesting():
    g = group(completions=[{"token_ids": [1], "logprobs": [-0.5], "text": "[[[[[[{{{{", "reward": 0}])
    assert decode_shard(raw(g))[0].completions[0].text == "[[[[[[{{{{"


def test_logprobs_are_floored_at_intake():
    g = group(completions=[{"token_ids": [1, 2], "logprobs": [-1e30, -0.5], "text": "", "reward": 0}])
    assert decode_shard(raw(g))[0].completions[0].logprobs == [LOGPROB_FLOOR, -0.5]


def test_line_budget_follows_the_manifest():
    """A line bigger than k completions of max_new_tokens tokens can hold is refused before
    it is parsed: a 99 KiB shard can no longer cost seconds and hundreds of MB."""
    budget = Budget(k=8, max_new_tokens=32)
    ids = list(range(2000))
    big = group(completions=[{"token_ids": ids, "logprobs": [-0.5] * 2000, "text": "", "reward": 0}] * 8)
    with pytest.raises(ShardError) as e:
        decode_shard(raw(big), budget)
    assert e.value.reason == "line_too_long"
    honest = group(completions=[{"token_ids": ids[:32], "logprobs": [-1.2345678901234567e-05] * 32,
                                 "text": "\u00e9" * 64, "reward": 0}] * 8)
    assert len(decode_shard(raw(honest), budget)) == 1


def test_groups_per_shard_follow_the_manifest():
    """max_shard_groups bounds the lines before any is parsed; without it, MAX_GROUPS_PER_SHARD."""
    lines = [group(prompt_id=i) for i in range(9)]
    assert len(decode_shard(raw(*lines[:8]), Budget(k=1, max_new_tokens=8, groups=8))) == 8
    with pytest.raises(ShardError) as e:
        decode_shard(raw(*lines), Budget(k=1, max_new_tokens=8, groups=8))
    assert e.value.reason == "too_many_groups"
    assert len(decode_shard(raw(*lines), Budget(k=1, max_new_tokens=8))) == 9
    assert Budget(k=1, max_new_tokens=8, groups=8).decompressed_bytes == 8 * (Budget(k=1, max_new_tokens=8).line_bytes + 1)


def test_gzip_bomb_stops_at_the_cap():
    bomb = gzip.compress(b"0" * (MAX_DECOMPRESSED_BYTES + 1024), compresslevel=9)
    assert len(bomb) < 200_000
    with pytest.raises(ShardError) as e:
        decode_shard(bomb)
    assert e.value.reason == "too_large"
