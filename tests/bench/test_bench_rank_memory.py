"""bench/rank_memory.py at --quick size: a tiny Qwen3 shape trained by one process and by 2
torchrun ranks, each publishing v1, and the rows add up (not the figures)."""
import pytest

from bench.rank_memory import results


@pytest.mark.slow  # two short trainer runs (~30 s)
def test_rank_memory_quick_rows_are_sane():
    rows = results(quick=True)
    assert len(rows) == 2 and all(r.vrl > 0 and r.baseline > 0 for r in rows)
    assert all(r.command == "python -m bench.rank_memory --quick" for r in rows)
