"""The metric lines of `metrics/v000042.jsonl`: the names other parts read, the typed records
they read them as, and the one reader that turns a metrics object's bytes into records.

The trainer writes one JSON object per line (docs/PROTOCOL.md lists every name); fleet.json,
`vrl status` and the dashboard read back a few of them. Whatever the bucket holds is read
within bounds: an object over MAX_METRICS_BYTES or unreadable gives no records, a line that
is not a JSON object of a known kind is skipped, and a number that is not finite, or not of
the type its name says, reads as missing. Names only the trainer uses (`train/*`, `time/*`,
most of `ingest/*`) are spelled where it writes them.

Numbers from untrusted JSON (`json_number`, `json_int`) are judged here for every reader of
the bucket's JSON objects, heartbeats and fleet.json included.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Iterable

from volunteer_rl.protocol import layout
from volunteer_rl.storage.base import Storage, StorageError

MAX_METRICS_BYTES = 4 << 20
"""Readers cap one metrics object at this size; a larger one reads as no records."""

KIND = "kind"
STEP_LINE = "step"
"""`kind` of the line one optimizer step writes."""
EVAL_LINE = "eval"
"""`kind` of the line one held-out evaluation writes."""
STEP = "step"
VERSION = "version"
TIME = "time"
REWARD_MEAN = "rollout/reward_mean"
SOURCES = "rollout/sources"
STALENESS_HIST = "rollout/staleness_hist"
GROUPS = "rollout/groups"
INGEST_GROUPS = "ingest/groups"
ACCURACY_GREEDY = "eval/accuracy_greedy"
ACCURACY_SAMPLED = "eval/accuracy_sampled"
EVAL_PROMPTS = "eval/prompts"
USEFUL_FRACTION = "fleet/useful_fraction"
"""Groups trained / groups received over the trainer's recent window (trainer.balance)."""
USABLE_FRACTION = "fleet/usable_fraction"
"""Share of the groups received over that window with reward variance and no duplicates."""

_LAG = re.compile(r"-?[0-9]{1,9}")  # a staleness_hist key; bounded, so int() is cheap


def json_number(x) -> float | None:
    """A finite number from untrusted JSON, else None (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def json_int(x) -> int | None:
    """A whole number from untrusted JSON (`3` or `3.0`), else None."""
    n = json_number(x)
    return int(n) if n is not None and n == int(n) else None


@dataclass(frozen=True)
class Source:
    """Groups of one step's batch that came from one shard (`rollout/sources`)."""

    version: int
    volunteer: str
    groups: int


@dataclass(frozen=True)
class StepRecord:
    """What readers use of a `step` line; a field the line lacks or gets wrong is None (0 for
    the counts, empty for the maps)."""

    step: int | None
    version: int | None
    time: float | None
    reward_mean: float | None
    groups: int
    """Groups trained on in the step (`rollout/groups`)."""
    received: int
    """Groups accepted from shards since the previous step (`ingest/groups`)."""
    staleness: dict[int, int]
    """Lag in versions -> groups of the step's batch (`rollout/staleness_hist`)."""
    sources: tuple[Source, ...]
    """The batch's shards; a key that is no shard key, or a count that is no whole number,
    is left out."""
    useful_fraction: float | None = None
    """`fleet/useful_fraction` (absent from lines of older trainers)."""


@dataclass(frozen=True)
class EvalRecord:
    """An `eval` line. A line without a whole-number version is no record."""

    version: int
    time: float | None
    accuracy_greedy: float | None
    accuracy_sampled: float | None
    prompts: int | None

    def short(self) -> dict:
        """The form fleet.json and `vrl status` keep: version, time and the `eval/*` fields
        with their prefix dropped."""
        values = {ACCURACY_GREEDY: self.accuracy_greedy, ACCURACY_SAMPLED: self.accuracy_sampled,
                  EVAL_PROMPTS: self.prompts}
        return {"version": self.version, "time": self.time,
                **{name.split("/", 1)[1]: value for name, value in values.items()}}


Record = StepRecord | EvalRecord


def _fraction(raw) -> float | None:
    """A share in 0..1 from untrusted JSON, else None."""
    x = json_number(raw)
    return x if x is not None and 0 <= x <= 1 else None


def _sources(raw) -> tuple[Source, ...]:
    if not isinstance(raw, dict):
        return ()
    out = []
    for key, n in raw.items():
        parsed = layout.parse_shard_key(key) if isinstance(key, str) else None
        groups = json_int(n)
        if parsed is not None and groups is not None:
            out.append(Source(parsed[0], parsed[1], groups))
    return tuple(out)


def _staleness(raw) -> dict[int, int]:
    if not isinstance(raw, dict):
        return {}
    out = {}
    for lag, n in raw.items():
        groups = json_int(n)
        if isinstance(lag, str) and _LAG.fullmatch(lag) and groups is not None:
            out[int(lag)] = groups
    return out


def parse_line(line) -> Record | None:
    """The record of one decoded metric line (a dict, as the trainer holds it in memory or
    json gives it back), None for anything else."""
    if not isinstance(line, dict):
        return None
    kind = line.get(KIND)
    if kind == STEP_LINE:
        return StepRecord(step=json_int(line.get(STEP)), version=json_int(line.get(VERSION)),
                          time=json_number(line.get(TIME)),
                          reward_mean=json_number(line.get(REWARD_MEAN)),
                          groups=json_int(line.get(GROUPS)) or 0,
                          received=json_int(line.get(INGEST_GROUPS)) or 0,
                          staleness=_staleness(line.get(STALENESS_HIST)),
                          sources=_sources(line.get(SOURCES)),
                          useful_fraction=_fraction(line.get(USEFUL_FRACTION)))
    version = json_int(line.get(VERSION))
    if kind == EVAL_LINE and version is not None:
        return EvalRecord(version=version, time=json_number(line.get(TIME)),
                          accuracy_greedy=json_number(line.get(ACCURACY_GREEDY)),
                          accuracy_sampled=json_number(line.get(ACCURACY_SAMPLED)),
                          prompts=json_int(line.get(EVAL_PROMPTS)))
    return None


def parse_lines(lines: Iterable) -> list[Record]:
    """The records of decoded metric lines, in order; lines that are none skipped."""
    return [r for r in map(parse_line, lines) if r is not None]


def decode_metrics(data: bytes) -> list[Record]:
    """The records of a metrics object's bytes: one JSON object per line, bad lines skipped."""
    lines = []
    for text in data.decode(errors="replace").splitlines():
        try:
            lines.append(json.loads(text))
        except (ValueError, RecursionError):  # not JSON, or nested deep enough to stop json
            continue
    return parse_lines(lines)


def read_metrics(storage: Storage, key: str) -> list[Record]:
    """The records of one metrics object, read within MAX_METRICS_BYTES; [] if it cannot be
    read (not written yet, removed, too large: a reader's trend just has a gap)."""
    try:
        data = storage.read(key, max_bytes=MAX_METRICS_BYTES)
    except StorageError:
        return []
    return decode_metrics(data)
