"""bench/covers.py at --quick size: a volunteer that covers a disliked group a turn with a
made-up group of equal rewards, after honest turns, in a live trainer. At --audit-cover-floor
1 every cover is replayed, so the first one denies it and none is taken (the default floor's
and the baseline's figures are random draws: the row is a measurement)."""
import math
import re

import pytest

from bench import covers


@pytest.mark.slow  # in-process trainer runs from the demo's v0, built once (minutes on a fresh clone)
def test_covers_quick_row_is_sane_and_a_floor_of_one_takes_no_cover():
    rows = covers.results(quick=True)
    assert [r.benchmark.rsplit(", ", 1)[1] for r in rows] == list(covers.STRATEGIES)
    for row in rows:
        assert row.command == "python -m bench.covers --quick"
        assert math.isclose(row.ratio, (row.baseline + 1) / (row.vrl + 1)), row
        for sent, caught, through in re.findall(r"(\d+) covers sent, (\d+) caught, (\d+) taken unreplayed",
                                                row.note):
            assert int(sent) > 0 and int(caught) + int(through) <= int(sent), row.note
    every = covers.run(covers.QUICK, covers.shared_v0(), 1.0, greedy=False)
    assert every["covers"] == 1 and every["caught"] == 1 and every["through"] == 0, every
    assert every["denied"] and every["honest_trained"] > 0, every
