"""bench/rank_steps.py at --quick size: the demo's processes with the trainer as one process
and as 2 torchrun ranks each train, and the row adds up (not the figure)."""
import math

import pytest

from bench.rank_steps import results


@pytest.mark.slow  # a v0 of 100 warm-start steps (cached after the first run), two demos of 60 s
def test_rank_steps_quick_row_is_sane():
    (row,) = results(quick=True)
    assert row.vrl > 0 and row.baseline > 0 and math.isclose(row.ratio, row.vrl / row.baseline)
    assert row.goal == "-" and row.met is None and "2 ranks: " in row.note
    assert row.command == "python -m bench.rank_steps --quick"
