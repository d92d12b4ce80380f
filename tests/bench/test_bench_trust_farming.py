"""bench/trust_farming.py at --quick size: the row is there and adds up (not the figures)."""
import math

import pytest

from bench.trust_farming import results


@pytest.mark.slow  # 2 x 2 trials of the policy at --quick size, ~25 s
def test_trust_farming_quick_row_is_sane():
    (row,) = results(quick=True)
    assert 0 <= row.vrl <= 1 and 0 <= row.baseline <= 1
    assert math.isclose(row.ratio, row.vrl / row.baseline)
    assert row.vrl > row.baseline  # counted in groups, the big lying shards are caught sooner
    assert "Denied in 2/2" in row.note and row.command.startswith("python -m bench.trust_farming")
