"""bench/startup.py at --quick size: three runs of real trainers reach v0 and the rows add up."""
import math

import pytest

from bench.startup import results


@pytest.mark.slow  # starts five trainers, two at a time: a check of bench code, ~4 min when busy
def test_startup_quick_rows_are_sane():
    side_by_side, vs_alone = results(quick=True)
    assert side_by_side.vrl > 0 and side_by_side.baseline > 0 and vs_alone.baseline > 0
    assert side_by_side.vrl == vs_alone.vrl  # the same pair with --threads 1 in both rows
    assert math.isclose(side_by_side.ratio, side_by_side.baseline / side_by_side.vrl)
    assert side_by_side.met == (side_by_side.ratio >= 1.0)
    assert math.isclose(vs_alone.ratio, vs_alone.baseline / vs_alone.vrl) and vs_alone.met is None
