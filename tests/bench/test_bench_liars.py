"""bench/liars.py at --quick size: four liars against a live trainer, each row there and
adding up; with every trained group verified no lying group is trained and each liar that
sent lies is denied (not the baseline's figures, which are random draws)."""
import math
import re

import pytest

from bench.liars import LIARS, results


@pytest.mark.slow  # 8 short in-process trainer runs from the cached demo v0, ~2 min
def test_liars_quick_rows_are_sane():
    rows = results(quick=True)
    assert [r.benchmark for r in rows] == [f"lying groups trained, liar: {n}" for n in LIARS]
    for r in rows:
        assert r.vrl == 0 and r.met and r.goal == "0", r
        assert math.isclose(r.ratio, (r.baseline + 1) / (r.vrl + 1)), r
        every = r.note.split("--verify every: ")[1].split("; baseline")[0]
        sent = re.search(r"^0 of (\d+) lying groups trained.*denied in (\d+)/(\d+)", every)
        assert sent and int(sent[1]) > 0 and sent[2] == sent[3], r.note
        assert "(0 honest shards rejected)" in every, r.note
        assert r.command == "python -m bench.liars --quick"
