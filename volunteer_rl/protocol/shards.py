"""Rollout shards: gzip JSONL, one line per prompt group, written once by a volunteer.

A line:
    {"prompt_id": 17, "policy_version": 42, "volunteer_id": "laptop-ab12", "seq": 5,
     "completions": [{"token_ids": [..], "logprobs": [..], "text": "..", "reward": 1.0}, ..]}

`seq` numbers a volunteer's groups of one run 0, 1, 2, ... without gaps, across versions: it
draws the group's prompt from the version's pool and keys its committed sampling noise
(protocol.draws), and lets the trainer count the numbers it never received (trainer.withheld).

Volunteers are strangers, so decoding is defensive: decompression is streamed and stops at a
byte cap (a gzip bomb costs us the cap, not its size), a line's size is capped by what the
manifest's k and max_new_tokens allow before it is parsed (so parsing costs at most that),
numbers are parsed with bounds (no bignums, no NaN/Infinity literals), nesting is bounded,
and the schema is checked field by field before anything else sees the data. Anything else
that goes wrong is still a ShardError, never another exception. The reward a volunteer reports
is kept only for its own statistics; the trainer recomputes it.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import re
import time
import uuid
import zlib
from dataclasses import asdict, dataclass

from volunteer_rl.errors import VrlError
from volunteer_rl.protocol.jsonbounds import too_deep

MAX_SHARD_BYTES = 8 << 20          # compressed object size
MAX_DECOMPRESSED_BYTES = 64 << 20  # after gunzip
MAX_LINE_BYTES = 1 << 20
MAX_GROUPS_PER_SHARD = 4096
"""The most groups a shard may ever hold: what a manifest without `max_shard_groups` allows."""
SHARD_GROUPS_LIMIT = 256
"""Groups per shard a trainer of this build accepts, published as the manifest's
`max_shard_groups`; volunteers upload at most that many per shard (`--shard-groups` defaults
to 32). A forged shard costs the trainer a parse and a rescore of every line before its one
bad line is found: 256 lines cost a sixteenth of 4,096."""
MAX_COMPLETIONS_PER_GROUP = 64
MAX_TOKENS_PER_COMPLETION = 2048
MAX_INT_DIGITS = 18
"""Digits of a JSON integer (ids, versions): a longer literal is refused, not made a bignum."""
MAX_GROUP_SEQ = 1 << 40
"""Group numbers of one volunteer in one run are below this (numbering runs across versions):
a thousand groups a second for thirty years."""
MAX_NESTING = 4
"""A line is {completions: [{token_ids: [...]}]}: four levels. Deeper is refused before parsing."""
LOGPROB_FLOOR = -40.0
"""Behavior logprobs below this are raised to it at intake. A token sampled with probability
e^-40 does not happen; a claim of one is either a bug or a lever on the importance ratio, and
the floor (with the loss's own clamp) keeps it from reaching a tensor as a huge number."""
BYTES_PER_TOKEN = 100
"""Line budget per generated token: its id (<= 8 bytes), its logprob (<= 26) and up to 64 bytes
of JSON-escaped text. Budgeted per line, so a few long tokens are fine."""
BYTES_PER_COMPLETION = 128
BYTES_PER_LINE = 320


class ShardError(VrlError, ValueError):
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
    seq: int
    """This group's number among the volunteer's groups of the run (volunteer.numbering)."""
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


@dataclass(frozen=True)
class Budget:
    """The sizes a shard may have under one manifest: its k, max_new_tokens and
    max_shard_groups."""

    k: int = MAX_COMPLETIONS_PER_GROUP
    max_new_tokens: int = MAX_TOKENS_PER_COMPLETION
    groups: int = MAX_GROUPS_PER_SHARD

    @property
    def line_bytes(self) -> int:
        per_completion = BYTES_PER_COMPLETION + self.max_new_tokens * BYTES_PER_TOKEN
        return min(MAX_LINE_BYTES, BYTES_PER_LINE + self.k * per_completion)

    @property
    def lines(self) -> int:
        """Lines (groups) a shard may hold: the manifest's, never above MAX_GROUPS_PER_SHARD."""
        return min(self.groups, MAX_GROUPS_PER_SHARD)

    @property
    def decompressed_bytes(self) -> int:
        return min(MAX_DECOMPRESSED_BYTES, self.lines * (self.line_bytes + 1))


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ShardError("bad_number", f"an integer of {len(text)} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)  # never raises for what the JSON grammar calls a number
    if not math.isfinite(value):
        raise ShardError("bad_number", f"{text[:20]} is not a finite float")
    return value


def _no_constant(text: str):
    raise ShardError("bad_number", f"{text} is not JSON")


def _check_nesting(line: bytes) -> None:
    """Refuse a line nested deeper than MAX_NESTING (jsonbounds.too_deep: a linear scan of
    the brackets outside strings), so the parser never recurses on volunteer input beyond that."""
    if too_deep(line, MAX_NESTING):
        raise ShardError("too_deep", f"nested deeper than {MAX_NESTING}")


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
    return Completion(ids, [max(float(v), LOGPROB_FLOOR) for v in lps], raw["text"], float(raw["reward"]))


GROUP_FIELDS = {"prompt_id", "policy_version", "volunteer_id", "seq", "completions"}


def _group(line: bytes) -> Group:
    _check_nesting(line)
    try:
        # decoded here, strictly: json.loads on bytes would also take UTF-16/32 or a BOM,
        # where the byte-level nesting scan above does not see the brackets the parser sees
        raw = json.loads(line.decode("utf-8"), parse_int=_bounded_int, parse_float=_finite_float,
                         parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, ShardError):
            raise
        raise ShardError("bad_json", str(exc)[:80]) from None
    if not isinstance(raw, dict) or set(raw) != GROUP_FIELDS:
        raise ShardError("bad_schema", "group needs exactly prompt_id, policy_version, volunteer_id, "
                         "seq, completions")
    if not all(type(raw[f]) is int for f in ("prompt_id", "policy_version", "seq")):
        raise ShardError("bad_schema", "prompt_id, policy_version and seq must be integers")
    if not 0 <= raw["seq"] < MAX_GROUP_SEQ:
        raise ShardError("bad_seq", f"seq {raw['seq']} is outside 0..{MAX_GROUP_SEQ - 1}")
    if not isinstance(raw["volunteer_id"], str):
        raise ShardError("bad_schema", "volunteer_id must be a string")
    comps = raw["completions"]
    if not isinstance(comps, list) or not 0 < len(comps) <= MAX_COMPLETIONS_PER_GROUP:
        raise ShardError("bad_lengths", f"completions per group must be 1..{MAX_COMPLETIONS_PER_GROUP}")
    return Group(raw["prompt_id"], raw["policy_version"], raw["volunteer_id"], raw["seq"],
                 [_completion(c) for c in comps])


_NOT_BLANK = re.compile(rb"[^ \t\n\r\x0b\x0c]")
"""A byte bytes.strip() keeps: a line with one is a line, not a blank."""


def _line_spans(text: bytes, max_lines: int = MAX_GROUPS_PER_SHARD) -> list[tuple[int, int]]:
    """Start and end offsets of the lines of `text` that are not blank, at most `max_lines`
    of them (too_many_groups beyond). Offsets rather than a split: a
    shard of millions of tiny or empty lines costs a scan of its bytes, not a Python object
    per line (64 MiB of "12\n" made 22 million of them, over a gigabyte)."""
    spans = []
    pos = 0
    while (m := _NOT_BLANK.search(text, pos)) is not None:
        if len(spans) == max_lines:
            raise ShardError("too_many_groups", f"more than {max_lines} lines")
        start = text.rfind(b"\n", pos, m.start()) + 1
        end = text.find(b"\n", m.start())
        end = len(text) if end < 0 else end
        spans.append((max(start, pos), end))
        pos = end + 1
    return spans


def iter_groups(data: bytes, budget: Budget = Budget()):
    """Parse and schema-check a shard one line at a time, so a caller that checks each group
    as it comes stops paying at the first bad one. Raises ShardError with a reason code on
    anything off, and nothing else: an unforeseen error inside the parser is `bad_json`."""
    if len(data) > MAX_SHARD_BYTES:
        raise ShardError("too_large", f"{len(data)} compressed bytes")
    text = _gunzip_capped(data, budget.decompressed_bytes)
    lines = _line_spans(text, budget.lines)
    if not lines:
        raise ShardError("empty", "no groups")
    for start, end in lines:
        if end - start > budget.line_bytes:
            raise ShardError("line_too_long", f"a line of {end - start} bytes (at most {budget.line_bytes} "
                             f"for k={budget.k}, max_new_tokens={budget.max_new_tokens})")
    for start, end in lines:
        try:
            yield _group(text[start:end])
        except ShardError:
            raise
        except Exception as exc:  # a parser corner we did not foresee is still a rejection
            raise ShardError("bad_json", f"{type(exc).__name__}") from None


def decode_shard(data: bytes, budget: Budget = Budget()) -> list[Group]:
    """Every group of a shard (iter_groups, all at once)."""
    return list(iter_groups(data, budget))
