"""bench/ingest_fleet.py at --quick sizes: the rows are there and add up (not the figures)."""
import math

import pytest

from bench.ingest_fleet import results


@pytest.mark.slow  # runs the benchmark at --quick size: a check of bench code, ~1 min
def test_ingest_fleet_quick_rows_are_sane():
    rows = results(quick=True)
    assert [r.measure for r in rows] == ["shards/s validated", "groups/s batched",
                                         "HTTP requests per trainer step"]
    for r in rows:
        assert r.vrl > 0 and r.baseline > 0
        assert math.isclose(r.ratio, r.vrl / r.baseline)
        assert r.command.startswith("python -m bench.ingest_fleet")
    # requests per step: the same with a short and a long history
    assert rows[2].met
