"""Fuzzing the shard reader (issue 13): at least 10,000 mutated shards per run.

Every example starts from valid shards built the way a volunteer builds them (encode_shard)
and mutates one layer a volunteer controls, one strategy and one test per layer:

- gzip: bit flips, truncation, spliced bytes, broken headers and trailers, garbage and extra
  members around the stream, other containers (raw deflate, zlib, stored, no gzip at all);
  bombs that inflate to around the budget's cap are explicit examples;
- text: the decompressed JSONL with flipped, inserted, deleted and duplicated bytes, hostile
  number and string literals, duplicated and extra keys, other encodings and line ends, deep
  nesting, lines at the line budget and too many lines;
- structure: the parsed JSON with any value, key, line or the whole shard replaced by a
  hostile value (NaN, huge integers, lone surrogates, values just past a limit).

Each shard goes through decode_shard with a small manifest's Budget, and the outcome is either
a list of valid groups or a ShardError whose reason is in the documented set; nothing else
escapes. The reader's catch-all (an unforeseen error inside the parser becomes `bad_json`)
keeps the trainer alive, but an error it catches is a bug, so here it fails the test too. Cost
stays bounded: the bytes inflated never exceed the budget's cap (+1, the byte that tells it
was crossed) and no line longer than the line budget reaches the parser.

Per run: 3,400 + 3,300 + 3,300 generated shards and 16 explicit ones reach the reader, and the
last test checks the count. Examples are derandomized (every run the same) and there is no
example database; Hypothesis's own cache goes to the system's temp folder, not the repository.
"""
from __future__ import annotations

import copy
import gzip
import io
import json
import re
import zlib
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from volunteer_rl.protocol import shards
from volunteer_rl.protocol.shards import (
    LOGPROB_FLOOR,
    MAX_COMPLETIONS_PER_GROUP,
    MAX_GROUP_SEQ,
    MAX_GROUPS_PER_SHARD,
    MAX_TOKENS_PER_COMPLETION,
    Budget,
    Completion,
    Group,
    ShardError,
    decode_shard,
    encode_shard,
)

# Hypothesis's own files (its unicode tables, its constants cache) go to the system's temp
# folder, not into the repository; it reads this the first time it needs them.

K, MAX_NEW = 2, 8
BUDGET = Budget(K, MAX_NEW)
"""A small manifest's budget: lines of 2,176 bytes, a cap of 8.9 MB, both cheap to reach."""
CAP = BUDGET.decompressed_bytes

REASONS = {"too_large", "bad_gzip", "bad_json", "bad_schema", "empty", "bad_lengths",
           "too_many_groups", "line_too_long", "bad_number", "too_deep", "bad_logprob", "bad_seq"}
"""What the reader may answer."""

EXAMPLES = {"gzip": 3_400, "text": 3_300, "structure": 3_300}
"""Generated examples per layer; the explicit @examples come on top."""
FED = Counter()
"""Shards that reached the reader in this run, per layer."""


def test_the_reasons_are_the_documented_ones():
    doc = (Path(__file__).parents[2] / "docs" / "PROTOCOL.md").read_text()
    table = doc[doc.index("| reason code |"):]
    table = table[:table.index("\n\n")]
    assert REASONS <= set(re.findall(r"`([a-z_]+)`", table))
    raised = set(re.findall(r'ShardError\("([a-z_]+)"', Path(shards.__file__).read_text()))
    assert raised == REASONS


# -----------------------------------------------------------------------------
# The property


class Meter:
    """Stands in for the zlib module inside shards.py and counts the bytes it inflates."""

    def __init__(self):
        self.inflated = 0

    def __getattr__(self, name):
        return getattr(zlib, name)

    def decompressobj(self, *args, **kwargs):
        inner, meter = zlib.decompressobj(*args, **kwargs), self

        class Metered:
            def __getattr__(self, name):
                return getattr(inner, name)

            def decompress(self, data, max_length=0):
                out = inner.decompress(data, max_length)
                meter.inflated += len(out)
                return out

        return Metered()


def read(layer: str, data: bytes) -> None:
    """decode_shard(data) gives valid groups or a documented ShardError, within its budget."""
    FED[layer] += 1
    meter, hidden, group = Meter(), [], shards._group

    def watched_group(line: bytes) -> Group:
        assert len(line) <= BUDGET.line_bytes, "a line over the budget reached the parser"
        try:
            return group(line)
        except ShardError:
            raise
        except Exception as exc:  # the reader's catch-all would make this bad_json
            hidden.append(exc)
            raise

    with mock.patch.object(shards, "zlib", meter), mock.patch.object(shards, "_group", watched_group):
        try:
            groups = decode_shard(data, BUDGET)
        except ShardError as exc:
            assert exc.reason in REASONS, exc
            outcome = exc.reason
        else:
            outcome = "accepted"
            assert_valid(groups)
    assert not hidden, f"the catch-all hid {hidden[0]!r}"
    assert meter.inflated <= CAP + 1
    event(f"{layer}: {outcome}")


def assert_valid(groups: list[Group]) -> None:
    """What decode_shard promises about every group it returns."""
    assert 0 < len(groups) <= MAX_GROUPS_PER_SHARD
    for g in groups:
        assert type(g.prompt_id) is int and type(g.policy_version) is int
        assert isinstance(g.volunteer_id, str)
        assert type(g.seq) is int and 0 <= g.seq < MAX_GROUP_SEQ
        assert 0 < len(g.completions) <= MAX_COMPLETIONS_PER_GROUP
        for c in g.completions:
            assert 0 < len(c.token_ids) <= MAX_TOKENS_PER_COMPLETION
            assert all(type(t) is int for t in c.token_ids)
            assert len(c.logprobs) == len(c.token_ids)
            assert all(type(v) is float and LOGPROB_FLOOR <= v <= 0.0 for v in c.logprobs)
            assert isinstance(c.text, str) and type(c.reward) is float


def fuzz(layer: str):
    return settings(max_examples=EXAMPLES[layer], derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -----------------------------------------------------------------------------
# Valid shards, as a volunteer writes them


def pick(draw, choices):
    """One of `choices` (st.sampled_from, without building a strategy per call)."""
    return choices[draw(st.integers(0, len(choices) - 1))]


@st.composite
def valid_groups(draw) -> list[Group]:
    """One to three groups of one or two completions, from few draws (a token id is a byte,
    its logprob and the reward follow from the ids): the mutations bring the variety."""
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        completions = []
        for _ in range(draw(st.integers(1, K))):
            ids = list(draw(st.binary(min_size=1, max_size=MAX_NEW)))
            completions.append(Completion(ids, [-t / 7 for t in ids], draw(st.text(max_size=MAX_NEW)),
                                          float(ids[0] % 2)))
        groups.append(Group(draw(st.integers(0, 10_000)), draw(st.integers(0, 100)), "laptop-ab12",
                            draw(st.integers(0, 1000)), completions))
    return groups


def shard_text(groups: list[Group]) -> bytes:
    return gzip.decompress(encode_shard(groups))


# -----------------------------------------------------------------------------
# Layer 1: the gzip bytes


def _flip_bits(draw, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        out[draw(st.integers(0, len(out) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


def _set_header_byte(draw, data: bytes) -> bytes:
    i = draw(st.integers(0, min(9, len(data) - 1)))
    return data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]


def _flip_trailer_byte(draw, data: bytes) -> bytes:
    i = len(data) - draw(st.integers(1, min(8, len(data))))
    return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1:]


def _truncate(draw, data: bytes) -> bytes:
    return data[:draw(st.integers(0, len(data) - 1))]


def _splice(draw, data: bytes) -> bytes:
    i = draw(st.integers(0, len(data)))
    j = draw(st.integers(i, min(len(data), i + 16)))
    return data[:i] + draw(st.binary(max_size=16)) + data[j:]


TAILS = (st.binary(min_size=1, max_size=64) | valid_groups().map(encode_shard)
         | st.sampled_from([gzip.compress(b""), gzip.compress(b"{not json}\n"), b"\x1f\x8b", b"\x00" * 8]))
HEADS = st.binary(min_size=1, max_size=16) | valid_groups().map(encode_shard)


def _append(draw, data: bytes) -> bytes:
    return data + draw(TAILS)


def _prepend(draw, data: bytes) -> bytes:
    return draw(HEADS) + data


GZIP_OPS = [_flip_bits, _set_header_byte, _flip_trailer_byte, _truncate, _splice, _append, _prepend]


def container(how: str, text: bytes) -> bytes:
    """The text in a gzip stream as encode_shard writes it, or in another container."""
    if how == "raw deflate":
        c = zlib.compressobj(9, zlib.DEFLATED, -15)
        return c.compress(text) + c.flush()
    if how == "zlib":
        return zlib.compress(text)
    if how == "plain":
        return text
    if how == "two members":
        return gzip.compress(text[:len(text) // 2], mtime=0) + gzip.compress(text[len(text) // 2:], mtime=0)
    if how == "named":  # a file name in the header, and an mtime
        buf = io.BytesIO()
        with gzip.GzipFile(filename="\u00e9" * 40 + ".jsonl", mode="wb", fileobj=buf, mtime=1) as f:
            f.write(text)
        return buf.getvalue()
    return gzip.compress(text, compresslevel={"stored": 0, "fast": 1, "gzip": 6}[how], mtime=0)


@st.composite
def gzip_mutant(draw) -> bytes:
    how = pick(draw, ["gzip", "gzip", "gzip", "stored", "fast", "named", "two members",
                      "raw deflate", "zlib", "plain"])
    data = container(how, shard_text(draw(valid_groups())))
    for op in draw(st.lists(st.sampled_from(GZIP_OPS), min_size=1 if how == "gzip" else 0, max_size=3)):
        data = op(draw, data) if data else data
    return data


class Bomb(bytes):
    """A gzip stream of each part's bytes repeated its number of times, after the bytes
    `before`. A failure's report shows its name, not megabytes."""

    def __new__(cls, name: str, *parts: tuple[bytes, int], before: bytes = b""):
        c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        self = super().__new__(cls, before + b"".join(c.compress(b * n) for b, n in parts) + c.flush())
        self.name = name
        return self

    def __repr__(self):
        return f"Bomb({self.name!r})"


LINE = json.dumps(asdict(Group(0, 5, "v1", 0, [Completion([1], [-0.5], "1", 0.0)] * K))).encode() + b"\n"


@fuzz("gzip")
@given(data=gzip_mutant())
@example(data=b"")
@example(data=b"\x1f\x8b")
@example(data=b"\x1f\x8b\x08\x00" + b"\x00" * 6)
@example(data=gzip.compress(b"\n \t\r\x0b\x0c\n"))
@example(data=Bomb("the cap exactly, all blank", (b"\n", CAP)))
@example(data=Bomb("one byte over", (b"\n", CAP + 1)))
@example(data=Bomb("one group padded to the cap", (LINE, 1), (b" ", CAP - len(LINE))))
@example(data=Bomb("the same, one byte over", (LINE, 1), (b" ", CAP - len(LINE) + 1)))
@example(data=Bomb("far over", (b"0", 4 * CAP)))
@example(data=Bomb("one line the size of the cap", (b"[", CAP)))
@example(data=Bomb("millions of tiny lines", (b"1\n", CAP // 2)))
@example(data=Bomb("one line too many", (LINE, MAX_GROUPS_PER_SHARD + 1)))
@example(data=Bomb("a bomb as the second member", (b" ", 4 * CAP), before=gzip.compress(LINE)))
@example(data=Bomb("a bomb behind garbage", (b"\n", 4 * CAP), before=b"x"))
def test_gzip_layer(data):
    read("gzip", data)


# -----------------------------------------------------------------------------
# Layer 2: the decompressed JSONL text

FIELDS = ["prompt_id", "policy_version", "volunteer_id", "seq", "completions",
          "token_ids", "logprobs", "text", "reward"]
NUMBERS = [b"NaN", b"-NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999", b"1e-999", b"1E400",
           b"1.7976931348623157e308", b"4.9e-324", b"-0", b"-0.0", b"9" * 18, b"-" + b"9" * 18,
           b"1" * 19, b"-" + b"9" * 19, b"1" * 5000, b"0." + b"0" * 3000 + b"1", b"1" + b"0" * 400 + b".0",
           b"0x10", b"01", b"1.", b".5", b"1e", b"+1", b"--1", b"1_000", b"\xd9\xa5",
           b"true", b"false", b"null", b'"3"', b"[]", b"{}", b"[1]", b'{"a":1}', b"[[[[[1]]]]]"]
STRINGS = [b'""', b'"\\ud800"', b'"\\udc00\\ud800"', b'"\\ud83d\\ude00"', b'"\\u0000"', b'"\\x"',
           b'"\\u12"', b'"\\uZZZZ"', b'"\t"', b'"\x00"', b'"\xed\xa0\x80"', b'"\xc0\x80"', b'"\xff"',
           b'"\xf4\x90\x80\x80"', b'"\\u202e"', '"\u00e9\u4e2d\U0001f600"'.encode(), b'"\\"', b'"\\\\"',
           b'"' + b'\\"' * 1000 + b'"', b'"' + b'\\"' * 1000, b'"[[[[[[{{{{"', b'"' + b"a" * 3000 + b'"']
TOKENS = [b"[", b"]", b"{", b"}", b'"', b"\\", b",", b":", b"\\u", b"\\ud800", b"\x00", b"\xff",
          b"\xed\xa0\x80", b"\n", b"\r", b"\t", b" ", b"\x0b", b"\x0c", b"\xef\xbb\xbf", b"\xff\xfe",
          b"\xfe\xff", b"[" * 5, b"[" * 1000, b'{"a":' * 6, b"]" * 5, b"}" * 5, b'"\\', b'\\\\"',
          b"\xe2\x80\xa8", b"\xc2\x85", b"//"]
NUMBER = re.compile(rb"-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')

any_text = st.text(st.characters(exclude_categories=()), max_size=12)
"""Any code point, lone surrogates included."""


def _pos(draw, text: bytes) -> int:
    return draw(st.integers(0, len(text)))


def _span(draw, text: bytes, longest: int) -> tuple[int, int]:
    i = _pos(draw, text)
    return i, draw(st.integers(i, min(len(text), i + longest)))


def _flip_byte(draw, text: bytes) -> bytes:
    if not text:
        return text
    i = draw(st.integers(0, len(text) - 1))
    return text[:i] + bytes([text[i] ^ draw(st.integers(1, 255))]) + text[i + 1:]


INSERTS = (st.sampled_from(TOKENS) | st.binary(min_size=1, max_size=8)
           | any_text.map(lambda s: s.encode("utf-8", "surrogatepass")))
NEW_STRINGS = st.sampled_from(STRINGS) | any_text.map(
    lambda s: json.dumps(s, ensure_ascii=False).encode("utf-8", "surrogatepass"))


def _insert(draw, text: bytes) -> bytes:
    i = _pos(draw, text)
    return text[:i] + draw(INSERTS) + text[i:]


def _delete(draw, text: bytes) -> bytes:
    i, j = _span(draw, text, 40)
    return text[:i] + text[j:]


def _duplicate(draw, text: bytes) -> bytes:
    i, j = _span(draw, text, 200)
    k = _pos(draw, text)
    return text[:k] + text[i:j] + text[k:]


def _replace_number(draw, text: bytes) -> bytes:
    spans = [m.span() for m in NUMBER.finditer(text)]
    if not spans:
        return text
    i, j = pick(draw, spans)
    return text[:i] + pick(draw, NUMBERS) + text[j:]


def _replace_string(draw, text: bytes) -> bytes:
    spans = [m.span() for m in STRING.finditer(text)]
    if not spans:
        return text
    i, j = pick(draw, spans)
    return text[:i] + draw(NEW_STRINGS) + text[j:]


def _add_key(draw, text: bytes) -> bytes:
    """A duplicated or extra key right after an opening brace."""
    braces = [m.end() for m in re.finditer(rb"\{", text)]
    if not braces:
        return text
    i = pick(draw, braces)
    name = pick(draw, FIELDS + ["extra", "", "prompt_id ", "prompt_\u0456d"])
    value = pick(draw, NUMBERS + STRINGS)
    return text[:i] + json.dumps(name).encode() + b":" + value + b"," + text[i:]


def _line_ends(draw, text: bytes) -> bytes:
    return text.replace(b"\n", pick(draw, [b"\r\n", b"\r", b"\n\n", b"\n \t\n", b"\x0b", b"\x00\n", b"\n\x00",
                                          b"\xe2\x80\xa8", b" "]))


def _reencode(draw, text: bytes) -> bytes:
    """One line, or all of them, in an encoding the protocol does not allow."""
    encoding = pick(draw, ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig", "latin-1"])
    lines = text.split(b"\n")
    which = draw(st.integers(-1, len(lines) - 1))
    return b"\n".join(line.decode("utf-8", "replace").encode(encoding, "replace") if which in (-1, n)
                      else line for n, line in enumerate(lines))


def _pad_line(draw, text: bytes) -> bytes:
    """One line at, or one byte past, the line budget: blanks after its opening brace."""
    lines = text.split(b"\n")
    n = draw(st.integers(0, len(lines) - 1))
    if not lines[n].startswith(b"{"):
        return text
    target = pick(draw, [BUDGET.line_bytes, BUDGET.line_bytes + 1, 2 * BUDGET.line_bytes])
    lines[n] = b"{" + b" " * max(0, target - len(lines[n])) + lines[n][1:]
    return b"\n".join(lines)


def _many_lines(draw, text: bytes) -> bytes:
    line = text.split(b"\n", 1)[0]
    return (line + b"\n") * pick(draw, [2, 64, MAX_GROUPS_PER_SHARD + 1])


def _nest(draw, text: bytes) -> bytes:
    """A value wrapped in brackets, a few levels or a thousand."""
    spans = [m.span() for m in NUMBER.finditer(text)] + [m.span() for m in STRING.finditer(text)]
    if not spans:
        return text
    i, j = pick(draw, spans)
    depth = pick(draw, [1, 2, 3, 4, 1000])
    opener, closer = pick(draw, [(b"[", b"]"), (b'{"a":', b"}")])
    return text[:i] + opener * depth + text[i:j] + closer * depth + text[j:]


TEXT_OPS = [_flip_byte, _insert, _delete, _duplicate, _replace_number, _replace_string, _add_key,
            _line_ends, _reencode, _pad_line, _many_lines, _nest]


@st.composite
def text_mutant(draw) -> bytes:
    text = shard_text(draw(valid_groups()))
    for op in draw(st.lists(st.sampled_from(TEXT_OPS), min_size=1, max_size=4)):
        text = op(draw, text)
    return gzip.compress(text, compresslevel=1, mtime=0)


@fuzz("text")
@given(data=text_mutant())
@example(data=gzip.compress(b'{"prompt_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
@example(data=gzip.compress(b'"' + b'\\"' * 1000))  # an open string of escaped quotes (was quadratic)
def test_text_layer(data):
    read("text", data)


# -----------------------------------------------------------------------------
# Layer 3: the parsed JSON structure


def _deep(depth: int, leaf=0):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


EDGES = [None, True, 0, -1, 0.5, "0", [], {}, [0], [-0.5], [1.5], [True], ["1"], [[1]], {"0": 0},
         _deep(5), _deep(100), 2 ** 63, -(2 ** 63) - 1, 10 ** 18 - 1, 10 ** 18, -(10 ** 18), 10 ** 400,
         float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 1e308, -1e30, "\x00", "\ud800",
         "\u202e", "[[[[[", "\\", '"', "a" * 3000, "NaN",
         list(range(MAX_TOKENS_PER_COMPLETION)), list(range(MAX_TOKENS_PER_COMPLETION + 1)),
         [-0.5] * (MAX_TOKENS_PER_COMPLETION + 1), [{}] * (MAX_COMPLETIONS_PER_GROUP + 1)]
"""Values at and just past a limit, and the odd ones json.dumps still writes."""

hostile = st.one_of(
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | any_text,
                 lambda kids: st.lists(kids, max_size=4)
                 | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), kids, max_size=4),
                 max_leaves=10),
    st.sampled_from(EDGES).map(copy.deepcopy),  # a fresh copy: the ops below mutate in place
)
KEY_NAMES = st.sampled_from(FIELDS + ["extra", "", "prompt_\u0456d", "\ud800"]) | st.text(max_size=6)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _at(root, path):
    for p in path:
        root = root[p]
    return root


def _set(draw, lines: list) -> list:
    path = pick(draw, list(_paths(lines)))
    value = draw(hostile)
    if not path:
        return value if isinstance(value, list) else [value]
    _at(lines, path[:-1])[path[-1]] = value
    return lines


def _drop_key(draw, lines: list) -> list:
    dicts = [p for p in _paths(lines) if isinstance(_at(lines, p), dict) and _at(lines, p)]
    if dicts:
        d = _at(lines, pick(draw, dicts))
        del d[pick(draw, sorted(d))]
    return lines


def _extra_key(draw, lines: list) -> list:
    dicts = [p for p in _paths(lines) if isinstance(_at(lines, p), dict)]
    if dicts:
        name = draw(KEY_NAMES)
        _at(lines, pick(draw, dicts))[name] = draw(hostile)
    return lines


def _wrap(draw, lines: list) -> list:
    path = pick(draw, list(_paths(lines))[1:])
    parent = _at(lines, path[:-1])
    wrap = pick(draw, [lambda v: [v], lambda v: {"v": v}, lambda v: _deep(4, v)])
    parent[path[-1]] = wrap(parent[path[-1]])
    return lines


def _lines(draw, lines: list) -> list:
    how = pick(draw, ["drop", "repeat", "none", "reverse"])
    if how == "drop":
        del lines[draw(st.integers(0, len(lines) - 1))]
    elif how == "repeat":
        lines.append(copy.deepcopy(lines[draw(st.integers(0, len(lines) - 1))]))
    elif how == "none":
        lines.clear()
    else:
        lines.reverse()
    return lines


STRUCTURE_OPS = [_set, _set, _set, _drop_key, _extra_key, _wrap, _lines]


@st.composite
def structure_mutant(draw) -> bytes:
    lines = [asdict(g) for g in draw(valid_groups())]  # fresh dicts and lists, mutated below
    for op in draw(st.lists(st.sampled_from(STRUCTURE_OPS), min_size=1, max_size=3)):
        if lines:
            lines = op(draw, lines)
    ascii_only = draw(st.booleans())
    text = "".join(json.dumps(line, ensure_ascii=ascii_only, separators=(",", ":")) + "\n" for line in lines)
    return gzip.compress(text.encode("utf-8", "surrogatepass"), compresslevel=1, mtime=0)


@fuzz("structure")
@given(data=structure_mutant())
def test_structure_layer(data):
    read("structure", data)


# -----------------------------------------------------------------------------


def test_at_least_ten_thousand_mutated_shards_per_run():
    """Issue 13's count, over the layer tests above (pytest runs them first, in file order)."""
    if set(FED) != set(EXAMPLES):
        pytest.skip("only counts when every layer test ran")
    assert sum(FED.values()) >= 10_000, dict(FED)
