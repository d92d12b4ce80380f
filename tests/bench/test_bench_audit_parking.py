"""bench/audit_parking.py at --quick size: two short live runs, alone and with a parking id, and
a row whose figures add up (not the figures themselves)."""
import math
import re

import pytest

from bench.audit_parking import GOAL, results


@pytest.mark.slow  # two live runs of 40 s at --quick size: a check of bench code, ~3 min
def test_audit_parking_quick_row_is_sane():
    (row,) = results(quick=True)  # its pieces pass the trainer's check_shard (self_check) first
    assert row.vrl > 0 and row.baseline > 0
    assert math.isclose(row.ratio, row.vrl / row.baseline)
    assert row.met == (row.ratio >= GOAL)
    assert row.command == "python -m bench.audit_parking --quick"
    written = re.search(r"([\d,]+) shards in (\d+) versions", row.note)
    assert written and int(written[1].replace(",", "")) > 0  # the writer parked shards
    assert re.search(r"parker's shards audited \d+", row.note)
