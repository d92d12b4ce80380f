"""Metric lines read back as typed records: the one reader, on honest and hostile bytes."""
from __future__ import annotations

import json

import pytest

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.metrics import (
    MAX_METRICS_BYTES,
    EvalRecord,
    Source,
    StepRecord,
    decode_metrics,
    json_int,
    json_number,
    parse_line,
    parse_lines,
    read_metrics,
)
from volunteer_rl.storage import open_storage

A, B = layout.shard_key(4, "a", "s1"), layout.shard_key(5, "b", "s2")
STEP = {"kind": "step", "step": 3, "version": 5, "time": 100.5, "rollout/reward_mean": 0.25,
        "rollout/groups": 8, "ingest/groups": 40, "rollout/staleness_hist": {"0": 6, "1": 2},
        "rollout/sources": {A: 5, B: 3}, "train/loss": 0.1, "ingest/rejected": {}}
EVAL = {"kind": "eval", "version": 6, "time": 101.0, "eval/accuracy_greedy": 0.4,
        "eval/accuracy_sampled": 0.35, "eval/prompts": 200}


def body(*lines) -> bytes:
    """A metrics object as the trainer writes it."""
    return "".join(json.dumps(m, sort_keys=True) + "\n" for m in lines).encode()


def test_a_trainer_step_line_and_eval_line():
    step, ev = decode_metrics(body(STEP, EVAL))
    assert step == StepRecord(step=3, version=5, time=100.5, reward_mean=0.25, groups=8,
                              received=40, staleness={0: 6, 1: 2},
                              sources=(Source(4, "a", 5), Source(5, "b", 3)))
    assert ev == EvalRecord(version=6, time=101.0, accuracy_greedy=0.4, accuracy_sampled=0.35,
                            prompts=200)
    assert ev.short() == {"version": 6, "time": 101.0, "accuracy_greedy": 0.4,
                          "accuracy_sampled": 0.35, "prompts": 200}


def test_in_memory_lines_and_bytes_give_the_same_records():
    assert parse_lines([STEP, EVAL]) == decode_metrics(body(STEP, EVAL))


def test_bad_lines_are_skipped():
    data = (b"not json\n" + b"[" * 100_000 + b"\n" + b"\xff\xfe\n" + b'"a string"\n[1, 2]\n'
            + b'{"kind": "other"}\n{"no": "kind"}\n{"kind": "eval"}\n{"kind": "eval", "version": "6"}\n'
            + body(EVAL))
    assert decode_metrics(data) == [parse_line(EVAL)]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), True, "0.5", [0.5], {"x": 1}, None])
def test_non_finite_or_wrong_typed_numbers_read_as_missing(value):
    step = parse_line({**STEP, "step": value, "version": value, "time": value,
                       "rollout/reward_mean": value, "rollout/groups": value,
                       "ingest/groups": value})
    assert (step.step, step.version, step.time, step.reward_mean) == (None, None, None, None)
    assert (step.groups, step.received) == (0, 0)
    ev = parse_line({**EVAL, "time": value, "eval/accuracy_greedy": value,
                     "eval/accuracy_sampled": value, "eval/prompts": value})
    assert ev == EvalRecord(6, None, None, None, None)
    assert parse_line({**EVAL, "version": value}) is None


def test_nan_literals_on_disk_are_no_numbers():
    (step,) = decode_metrics(b'{"kind": "step", "rollout/reward_mean": NaN, "time": Infinity}\n')
    assert step.reward_mean is None and step.time is None


def test_sources_and_staleness_keep_only_what_parses():
    step = parse_line({**STEP, "rollout/sources": {A: 5, "not/a/shard": 9, B: 2.5, "rollouts/x": 1,
                                                   layout.shard_key(6, "c", "s"): "7"},
                       "rollout/staleness_hist": {"0": 6, "x": 1, "1": True, "2": 3.0,
                                                  "9" * 5000: 1, " 3": 1}})
    assert step.sources == (Source(4, "a", 5),)
    assert step.staleness == {0: 6, 2: 3}
    for junk in ("a list", [A], 3, None):
        step = parse_line({**STEP, "rollout/sources": junk, "rollout/staleness_hist": junk})
        assert (step.sources, step.staleness) == ((), {})


def test_whole_numbers():
    assert [json_int(x) for x in (3, 3.0, 3.5, True, "3", float("nan"))] == [3, 3, None, None, None, None]
    assert [json_number(x) for x in (3, 0.5, False, float("-inf"))] == [3.0, 0.5, None, None]


def test_read_metrics_is_bounded_and_never_raises():
    s = open_storage("memory://metrics-read")
    s.write(layout.metrics_key(1), body(STEP))
    s.write(layout.metrics_key(2), b" " * (MAX_METRICS_BYTES + 1))
    assert read_metrics(s, layout.metrics_key(1)) == [parse_line(STEP)]
    assert read_metrics(s, layout.metrics_key(2)) == []   # too large: a gap, not an error
    assert read_metrics(s, layout.metrics_key(3)) == []   # not written yet
