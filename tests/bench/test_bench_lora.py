"""bench/lora_bytes.py and bench/lora_memory.py at --quick size: the rows add up (not the
figures: those are the benches' own, run idle)."""
import pytest

from bench import lora_bytes, lora_memory


@pytest.mark.slow  # a small Qwen3: a few AdamW steps and three adapters
def test_lora_bytes_quick_rows_are_sane():
    rows = lora_bytes.results(quick=True)
    assert [r.benchmark for r in rows] == [f"bytes per version, small Qwen3, LoRA rank {r}"
                                           for r in lora_bytes.RANKS]
    assert all(0 < r.vrl < r.baseline for r in rows)
    assert rows[0].vrl < rows[1].vrl < rows[2].vrl  # the adapter grows with the rank


@pytest.mark.slow  # three short trainer runs
def test_lora_memory_quick_rows_are_sane():
    rows = lora_memory.results(quick=True)
    assert len(rows) == 2 and rows[0].baseline == rows[1].baseline
    assert all(r.vrl > 0 and r.baseline > 0 and r.command == "python -m bench.lora_memory --quick"
               for r in rows)


@pytest.mark.slow  # three 60 s runs of a trainer and a volunteer, each scored on 100 prompts
def test_lora_accuracy_quick_rows_are_sane():
    from bench import lora_accuracy

    rows = lora_accuracy.results(quick=True, tasks=["calculator"])
    assert [r.benchmark for r in rows] == [
        f"held-out accuracy after 60s of RL, calculator, LoRA rank {r} vs full" for r in (1, 8)]
    assert all(0 <= r.vrl <= 1 and 0 < r.baseline <= 1 for r in rows)
