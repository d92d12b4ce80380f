"""bench/intake_ranks.py at --quick size: the intake of a new and of a trusted fleet, as one
process and as 2 torchrun ranks, every shard honest (none rejected), and the rows add up
(not the figures)."""
import math

import pytest

from bench.intake_ranks import results


@pytest.mark.slow  # a v0 of 100 warm-start steps (cached after the first run), four intakes
def test_intake_ranks_quick_rows_are_sane():
    new, trusted = results(quick=True)
    for row, fleet in ((new, "new"), (trusted, "trusted")):
        assert f" {fleet} volunteers" in row.benchmark
        assert row.vrl > 0 and row.baseline > 0 and math.isclose(row.ratio, row.vrl / row.baseline)
        assert row.goal == ">= 1.6x" and row.met == (row.ratio >= 1.6)
        assert "no shard rejected" in row.note and "rank 1 took" in row.note
        assert row.command == "python -m bench.intake_ranks --quick"
