"""bench/reward_budget.py at --quick size: one process and 2 ranks, each alone and beside the
worst-case reward volunteer; the rows add up and no rank is lost (not the figures)."""
import math

import pytest

from bench.reward_budget import results


@pytest.mark.slow  # four 60 s demo runs of the trap task, two of them as 2 torchrun ranks
def test_reward_budget_quick_rows_are_sane():
    one, ranks = results(quick=True)
    for row, shape in ((one, "one process"), (ranks, "2 ranks")):
        assert f"trainer ({shape})" in row.benchmark
        assert row.vrl > 0 and row.baseline > 0 and math.isclose(row.ratio, row.vrl / row.baseline)
        assert row.goal == ">= 0.9x" and row.met == (row.ratio >= 0.9)
        assert "burner:" in row.note and "no rank lost" in row.note
        assert row.command == "python -m bench.reward_budget --quick"
