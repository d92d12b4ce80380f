"""bench/replay_choice.py at --quick size: rows for both vocabularies whose figures add up, no
honest completion rejected and every forgery caught."""
import re

import pytest

from bench.replay_choice import results


@pytest.mark.slow  # samples and replays 32k and 151k vocabularies: a check of bench code, ~5 min
def test_replay_choice_quick_rows_are_sane():
    two, caught, rejected = results(quick=True)
    assert two.vrl <= 0.05 and two.baseline > 1  # % of positions; schema 4's band left a choice
    assert "honest positions within --replay-tolerance" in two.note
    assert caught.vrl == 100 and caught.met
    # every kind of forgery was tried and caught, the runner-up swap (the hardest) included
    for kind in ("runner-up", "likely", "neighbour"):
        got, forged = re.search(rf"{kind} (\d+(?:,\d{{3}})*)/(\d+(?:,\d{{3}})*)", caught.note).groups()
        assert forged == got and int(forged.replace(",", "")) > 0, caught.note
    assert rejected.vrl == 0 and rejected.met
