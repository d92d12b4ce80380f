"""bench/withholding.py at --quick size: three volunteers in a live trainer, a row each; with
the price of withholding on, the volunteer that uploads only the best fifth of what it sampled
gets nothing trained and fleet.json shows it held, and the honest one is never held (not the
`edge` figure, which is a measurement, nor the baseline's, which are random draws)."""
import math
import re

import pytest

from bench.withholding import GOAL_SE, VOLUNTEERS, results


@pytest.mark.slow  # in-process trainer runs from the demo's v0, built once (minutes on a fresh clone)
def test_withholding_quick_rows_are_sane():
    rows = results(quick=True)
    assert [r.benchmark for r in rows] == [f"withholding volunteer's trained reward, volunteer: {n}"
                                           for n in VOLUNTEERS]
    for r in rows:
        assert r.command == "python -m bench.withholding --quick"
        assert r.goal == f"within {GOAL_SE:g} s.e., or nothing trained"
        assert math.isclose(r.ratio, (abs(r.baseline) + 1) / (abs(r.vrl) + 1)), r
        now = r.note.split("--missing-bound 0.05: ")[1].split("; baseline")[0]
        sampled = re.search(r"^sampled (\d+) \((\d+) usable\), uploaded (\d+), trained (\d+)", now)
        assert sampled and int(sampled[1]) > 0 and int(sampled[3]) > 0, r.note
        assert re.search(r"missing_recent \d+ of numbers_recent \d+", now), r.note
    fifth, _, honest = rows
    now = fifth.note.split("--missing-bound 0.05: ")[1].split("; baseline")[0]
    assert "trained 0 (" in now and "nothing trained" in now, fifth.note
    assert fifth.vrl == 0 and fifth.met, fifth
    held = re.search(r"held_back True, held in (\d+) of its (\d+) writes", now)
    assert held and held[1] == held[2] and int(held[2]) >= 2, fifth.note  # shown held in every write
    off = fifth.note.split("baseline --missing-bound 1: ")[1]
    assert re.search(r"trained [1-9]\d* \(", off), fifth.note  # the price off, its groups train
    now = honest.note.split("--missing-bound 0.05: ")[1].split("; baseline")[0]
    assert "missing_recent 0 of" in now and "held_back False, held in 0 of" in now, honest.note
    assert not re.search(r"trained 0 \(", now), honest.note
