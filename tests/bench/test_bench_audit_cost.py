"""bench/audit_cost.py at --quick size: two short live runs, audits off and on, and a row
whose figures add up."""
import math

import pytest

from bench.audit_cost import GOAL, results


@pytest.mark.slow  # two live runs at --quick size: a check of bench code, ~2 min
def test_audit_cost_quick_row_is_sane():
    (row,) = results(quick=True)
    assert row.vrl > 0 and row.baseline > 0
    assert math.isclose(row.ratio, row.vrl / row.baseline)
    assert row.met == (row.ratio >= GOAL)
    assert "audited" in row.note and not row.note.count("audited 0,")  # the audited run audited
