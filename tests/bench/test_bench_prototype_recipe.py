"""bench/prototype_recipe.py at --quick size: both kinds of run happen and are scored (not the figures)."""
import math

import pytest

from bench.prototype_recipe import SETTINGS, results


@pytest.mark.slow  # three 40 s runs and their scoring: a check of bench code, ~5 min
def test_prototype_recipe_quick_rows_are_sane():
    rows = results(quick=True)
    assert len(rows) == len(SETTINGS)
    for r, (n, lr) in zip(rows, SETTINGS):
        assert f"recipe {n}x8 lr {lr:g}" in r.benchmark
        assert 0 <= r.vrl <= 1 and 0 < r.baseline <= 1
        assert math.isclose(r.ratio, r.vrl / r.baseline)
        # the goal is vrl ahead by more than 2 standard errors: never met from behind
        assert isinstance(r.met, bool) and (r.vrl > r.baseline or not r.met)
        assert " steps" in r.note and r.command == "python -m bench.prototype_recipe --quick"
