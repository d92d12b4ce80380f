import gzip
import json

import pytest

from volunteer_rl.shards import (MAX_DECOMPRESSED_BYTES, Completion, Group, ShardError,
                                 decode_shard, encode_shard, new_shard_name)
from volunteer_rl import layout


def group(**over):
    g = {"prompt_id": 3, "policy_version": 1, "volunteer_id": "v1",
         "completions": [{"token_ids": [5, 6, 1], "logprobs": [-0.1, -0.2, -0.3],
                          "text": "1 + 2", "reward": 1.0}]}
    g.update(over)
    return g


def raw(*groups) -> bytes:
    return gzip.compress("\n".join(json.dumps(g) for g in groups).encode())


def test_round_trip():
    g = Group(3, 1, "v1", [Completion([5, 6, 1], [-0.1, -0.2, -0.3], "1 + 2", 1.0)])
    assert decode_shard(encode_shard([g, g])) == [g, g]


def test_shard_names_never_collide():
    names = {new_shard_name(i % 3) for i in range(2000)}
    assert len(names) == 2000 and all(layout.is_safe_name(n) for n in names)


@pytest.mark.parametrize("data, reason", [
    (b"not gzip at all", "bad_gzip"),
    (raw(group())[:-9], "bad_gzip"),                                   # truncated stream
    (gzip.compress(b"{not json"), "bad_json"),
    (gzip.compress(b""), "empty"),
    (raw(group(extra=1)), "bad_schema"),
    (raw(group(prompt_id="3")), "bad_schema"),
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
    assert e.value.reason == "bad_logprob"


def test_gzip_bomb_stops_at_the_cap():
    bomb = gzip.compress(b"0" * (MAX_DECOMPRESSED_BYTES + 1024), compresslevel=9)
    assert len(bomb) < 200_000
    with pytest.raises(ShardError) as e:
        decode_shard(bomb)
    assert e.value.reason == "too_large"
