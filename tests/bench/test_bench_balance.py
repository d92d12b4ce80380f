"""bench/balance.py at --quick size: both demos run until the trainer made 8 steps, and their
bucket adds up (not the figures)."""
import math

import pytest

from bench.balance import GOAL, results


@pytest.mark.slow  # a v0 of 100 warm-start steps (cached after the first run), two demos of 8 steps: ~5 min
def test_balance_quick_rows_are_sane():
    useful, accuracy = results(quick=True)
    assert 0 < useful.vrl <= 1 and 0 < useful.baseline <= 1
    assert math.isclose(useful.ratio, useful.vrl / useful.baseline)
    assert useful.met == (useful.vrl >= GOAL) and useful.goal == f">= {GOAL}"
    # the quota run's last manifest asks for one; the baseline's (--quota-headroom 0) does not
    vrl_note, base_note = useful.note.split("; baseline ", 1)
    assert "last quota {'groups': " in vrl_note and "last quota None" in base_note
    assert 0 <= accuracy.vrl <= 1 and 0 <= accuracy.baseline <= 1
    assert isinstance(accuracy.met, bool) and "held-out prompts" in accuracy.note
    assert useful.command == accuracy.command == "python -m bench.balance --quick"
