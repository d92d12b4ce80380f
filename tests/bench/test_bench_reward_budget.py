"""bench/reward_budget.py: its verdict (a row whose trap never ran, whose burner's cost spilled
past its phase, or whose trainer lost a rank never meets the goal; steps are sorted into
phases by their times), and, at --quick size, one process and 2 ranks each with the
worst-case reward volunteer in their middle phase (not the figures)."""
import json
import math

import pytest

from bench.reward_budget import GOAL, STEP_LINE, Phases, Result, phases_of, results, row

BURNED = {"reward_budget": 5}


def result(steps, reward_seconds=(0.0, 10.0, 0.0), rejected=BURNED, lost="",
           denied=(15.0, "trainer")):
    """Phases of 10 s from 0; the burner's is [10, 20)."""
    return Result(Phases([0.0, 10.0, 20.0], list(steps), list(reward_seconds), [0, 0, 0]),
                  lost, written=7, rejected=rejected, denied=denied)


def test_ratio_is_the_burner_phase_over_the_mean_of_the_phases_alone():
    r = row("one process", result([20, 19, 18]), 10.0, "cmd")
    assert math.isclose(r.ratio, 19 / 19) and r.met
    assert math.isclose(r.vrl, 1.9) and math.isclose(r.baseline, 1.9)
    assert "20/19/18 steps" in r.note and "no rank lost" in r.note
    assert "denied by the trainer at 5.0s of its phase" in r.note
    assert not row("one process", result([20, 17, 20]), 10.0, "cmd").met  # 0.85 < GOAL
    assert 17 / 20 < GOAL


def test_a_trap_that_never_ran_is_no_result():
    for quiet in (result([20, 20, 20], reward_seconds=(0.0, 0.5, 0.0)),  # under half a budget
                  result([20, 20, 20], reward_seconds=(1.0, 1.9, 1.0))):  # ... more than alone
        r = row("one process", quiet, 10.0, "cmd")
        assert r.ratio == 1.0 and not r.met and "THE TRAP NEVER RAN" in r.note
    # its rewards ran, cut by its share and not yet rejected: a result
    assert row("one process", result([20, 20, 20], (1.0, 3.0, 1.0), rejected={}), 10.0, "cmd").met


def test_a_burner_denied_by_the_bench_at_the_end_of_its_phase_is_contained():
    r = row("one process", result([20, 19, 18], denied=(20.5, "operator")), 10.0, "cmd")
    assert r.met and "denied by the bench at 10.5s of its phase" in r.note


def test_a_burner_denied_after_its_phase_is_no_result():
    for late in (result([20, 20, 20], denied=(23.0, "operator")), result([20, 20, 20], denied=None)):
        r = row("one process", late, 10.0, "cmd")
        assert not r.met and "NOT DENIED WITHIN ITS PHASE" in r.note


def test_a_lost_rank_fails_the_row():
    r = row("2 ranks", result([20, 20, 20], lost="vrl trainer exited with 1"), 10.0, "cmd")
    assert not r.met and "RANK LOST" in r.note


def test_without_denial_the_row_has_no_goal():
    r = row("one process", result([20, 5, 8], denied=None), 10.0, "cmd", denial=False)
    assert r.met is None and r.goal == "-" and "never denied" in r.benchmark
    assert r.ratio == 5 / 20 and "NOT DENIED" not in r.note  # the last phase reads its backlog


def test_steps_are_sorted_into_phases_by_their_times(tmp_path):
    (tmp_path / "metrics").mkdir()
    lines = [{"kind": "eval", "time": 101.0},
             {"kind": "step", "time": 99.0, "ingest/reward_seconds": 7.0},  # before the phases
             {"kind": "step", "time": 100.0, "ingest/reward_seconds": 0.1},
             {"kind": "step", "time": 112.0, "ingest/reward_seconds": 2.5, "ingest/reward_deferred": 1,
              "ingest/reward_waiting": 1},
             {"kind": "step", "time": 119.9}, {"kind": "step", "time": 125.0},
             {"kind": "step", "time": 130.0}]  # after the last phase
    (tmp_path / "metrics" / "v000001.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines[:3]))
    (tmp_path / "metrics" / "v000002.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines[3:]))
    p = phases_of(tmp_path, [100.0, 110.0, 120.0], 10.0)
    assert p.steps == [1, 2, 1] and p.reward_seconds == [0.1, 2.5, 0.0] and p.deferred == [0, 1, 0]
    assert p.waiting == [0, 1, 0]


def test_the_first_step_is_seen_in_either_shape():
    assert STEP_LINE.match("step 1 v0 reward 0.625 lag {1: 32} zero-std 0.24 dropped 12")
    assert STEP_LINE.match("[rank 0] step 65 v64 reward 0.625 lag {1: 32} zero-std 0.24")
    assert not STEP_LINE.match("[rank 0] 29 usable groups, 19 without reward variance")
    assert not STEP_LINE.match("warm start step 1/100 loss 6.511 (1s)")


@pytest.mark.slow  # the demo's v0 (900 warm-start steps, cached), two runs of three 30 s phases
def test_reward_budget_quick_rows_are_sane():
    one, ranks = results(quick=True)
    for r, shape in ((one, "one process"), (ranks, "2 ranks")):
        assert f"trainer ({shape})" in r.benchmark
        assert r.vrl > 0 and r.baseline > 0 and math.isclose(r.ratio, r.vrl / r.baseline)
        assert r.goal == f">= {GOAL}x, no rank lost"
        assert "burner:" in r.note and "no rank lost" in r.note and "NEVER RAN" not in r.note
        assert r.met == (r.ratio >= GOAL and "NOT DENIED WITHIN ITS PHASE" not in r.note)
        assert r.command == "python -m bench.reward_budget --quick"
