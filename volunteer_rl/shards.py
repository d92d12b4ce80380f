"""Rollout shards: gzip JSONL, one line per prompt group, written once by a volunteer.

A line:
    {"prompt_id": 17, "policy_version": 42, "volunteer_id": "laptop-ab12",
     "completions": [{"token_ids": [..], "logprobs": [..], "text": "..", "reward": 1.0}, ..]}

Volunteers are strangers, so decoding is defensive: decompression is streamed and stops at a
byte cap (a gzip bomb costs us the cap, not its size), every count is bounded, and the schema
is checked field by field before anything else sees the data. The reward a volunteer reports
is kept only for its own statistics; the trainer recomputes it.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import time
import uuid
import zlib
from dataclasses import asdict, dataclass

MAX_SHARD_BYTES = 8 << 20          # compressed object size
MAX_DECOMPRESSED_BYTES = 64 << 20  # after gunzip
MAX_LINE_BYTES = 1 << 20
MAX_GROUPS_PER_SHARD = 4096
MAX_COMPLETIONS_PER_GROUP = 64
MAX_TOKENS_PER_COMPLETION = 2048


class ShardError(ValueError):
    """A shard that must not be trained on; `reason` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # behavior logprobs of each generated token at the manifest temperature
    text: str
    reward: float


@dataclass
class Group:
    prompt_id: int
    policy_version: int
    volunteer_id: str
    completions: list[Completion]


def new_shard_name(seq: int) -> str:
    """Unique without coordination: millisecond clock, a per-volunteer counter, randomness."""
    return f"{int(time.time() * 1000):013d}-{seq:06d}-{uuid.uuid4().hex[:8]}"


def encode_shard(groups: list[Group]) -> bytes:
    lines = (json.dumps(asdict(g), separators=(",", ":")) for g in groups)
    return gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=6, mtime=0)


def _gunzip_capped(data: bytes, cap: int) -> bytes:
    """Decompress a gzip stream, refusing to produce more than `cap` bytes."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out = io.BytesIO()
    try:
        chunk = d.decompress(data, cap + 1)
        while True:
            out.write(chunk)
            if out.tell() > cap:
                raise ShardError("too_large", f"more than {cap} bytes after decompression")
            if not d.unconsumed_tail:
                break
            chunk = d.decompress(d.unconsumed_tail, cap + 1 - out.tell())
    except zlib.error as exc:
        raise ShardError("bad_gzip", str(exc)) from None
    if not d.eof:
        raise ShardError("bad_gzip", "truncated gzip stream")
    return out.getvalue()


def _int_list(value, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise ShardError("bad_schema", f"{what} must be a list of integers")
    return value


def _completion(raw) -> Completion:
    if not isinstance(raw, dict) or set(raw) != {"token_ids", "logprobs", "text", "reward"}:
        raise ShardError("bad_schema", "completion needs exactly token_ids, logprobs, text, reward")
    ids = _int_list(raw["token_ids"], "token_ids")
    lps = raw["logprobs"]
    if not isinstance(lps, list) or not all(isinstance(v, (int, float)) and type(v) is not bool for v in lps):
        raise ShardError("bad_schema", "logprobs must be a list of numbers")
    if not 0 < len(ids) <= MAX_TOKENS_PER_COMPLETION or len(lps) != len(ids):
        raise ShardError("bad_lengths", f"{len(ids)} tokens with {len(lps)} logprobs")
    if not all(math.isfinite(v) and v <= 0.0 for v in lps):
        raise ShardError("bad_logprob", "logprobs must be finite and <= 0")
    if not isinstance(raw["text"], str) or not isinstance(raw["reward"], (int, float)):
        raise ShardError("bad_schema", "text must be a string and reward a number")
    return Completion(ids, [float(v) for v in lps], raw["text"], float(raw["reward"]))


def _group(line: bytes) -> Group:
    try:
        raw = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ShardError("bad_json", str(exc)[:80]) from None
    if not isinstance(raw, dict) or set(raw) != {"prompt_id", "policy_version", "volunteer_id", "completions"}:
        raise ShardError("bad_schema", "group needs exactly prompt_id, policy_version, volunteer_id, completions")
    if type(raw["prompt_id"]) is not int or type(raw["policy_version"]) is not int:
        raise ShardError("bad_schema", "prompt_id and policy_version must be integers")
    if not isinstance(raw["volunteer_id"], str):
        raise ShardError("bad_schema", "volunteer_id must be a string")
    comps = raw["completions"]
    if not isinstance(comps, list) or not 0 < len(comps) <= MAX_COMPLETIONS_PER_GROUP:
        raise ShardError("bad_lengths", f"completions per group must be 1..{MAX_COMPLETIONS_PER_GROUP}")
    return Group(raw["prompt_id"], raw["policy_version"], raw["volunteer_id"],
                 [_completion(c) for c in comps])


def decode_shard(data: bytes) -> list[Group]:
    """Parse and schema-check a shard; raises ShardError with a reason code on anything off."""
    if len(data) > MAX_SHARD_BYTES:
        raise ShardError("too_large", f"{len(data)} compressed bytes")
    text = _gunzip_capped(data, MAX_DECOMPRESSED_BYTES)
    lines = [ln for ln in text.split(b"\n") if ln.strip()]
    if not lines:
        raise ShardError("empty", "no groups")
    if len(lines) > MAX_GROUPS_PER_SHARD:
        raise ShardError("too_many_groups", f"{len(lines)} lines")
    for ln in lines:
        if len(ln) > MAX_LINE_BYTES:
            raise ShardError("line_too_long", f"a line of {len(ln)} bytes")
    return [_group(ln) for ln in lines]
