"""bench/audit_cost.py at --quick size: short live runs with audits off, sampled and every
trained group verified, and rows whose figures add up."""
import math

import pytest

from bench.audit_cost import GOAL, results


@pytest.mark.slow  # three live runs at --quick size: a check of bench code, ~3 min
def test_audit_cost_quick_rows_are_sane():
    off, sampled = results(quick=True)
    for row in (off, sampled):
        assert row.vrl > 0 and row.baseline > 0
        assert math.isclose(row.ratio, row.vrl / row.baseline)
    assert off.met == (off.ratio >= GOAL) and sampled.met is None
    assert "replaying before steps" in off.note and "audited" in sampled.note
    assert not sampled.note.count("audited 0,")  # the sampled run audited
