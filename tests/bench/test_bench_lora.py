"""bench/lora_bytes.py, lora_memory.py, lora_accuracy.py and catch_up.py's LoRA rows at --quick
size: the rows add up (not the figures: those are the benches' own, run idle)."""
import pytest

from bench import lora_bytes, lora_memory


@pytest.mark.slow  # a small Qwen3: a few AdamW steps and three adapters
def test_lora_bytes_quick_rows_are_sane():
    rows = lora_bytes.results(quick=True)
    assert [r.benchmark for r in rows] == [f"bytes per version, small Qwen3, LoRA rank {r}"
                                           for r in lora_bytes.RANKS]
    assert all(0 < r.vrl < r.baseline for r in rows)
    assert rows[0].vrl < rows[1].vrl < rows[2].vrl  # the adapter grows with the rank


@pytest.mark.slow  # five short trainer runs
def test_lora_memory_quick_rows_are_sane():
    rows = lora_memory.results(quick=True)
    assert len(rows) == 3 and rows[1].baseline == rows[2].baseline
    assert "both --gradient-checkpointing" in rows[0].benchmark and rows[0].met is not None
    assert all(r.vrl > 0 and r.baseline > 0 and r.command == "python -m bench.lora_memory --quick"
               for r in rows)
    assert "median step seconds: lora recomputed " in rows[0].note


@pytest.mark.slow  # three 60 s runs of a trainer and a volunteer, each scored on 100 prompts
def test_lora_accuracy_quick_rows_are_sane():
    from bench import lora_accuracy

    rows = lora_accuracy.results(quick=True, tasks=["calculator"])
    assert [r.benchmark for r in rows] == [
        f"held-out accuracy after 60s of RL, calculator, LoRA rank {r}, lr 0.003 vs full"
        for r in (1, 8)]
    assert all(0 <= r.vrl <= 1 and 0 < r.baseline <= 1 for r in rows)


@pytest.mark.slow  # the small Qwen3's chain of 21 versions, moto and the link, then LoRA's v1-v3
def test_catch_up_quick_lora_rows_are_sane():
    from bench import catch_up

    rows = catch_up.results(quick=True)
    lora = [r for r in rows if r.benchmark.startswith("LoRA")]
    assert len(rows) == 3 + 5 and len(lora) == 5
    new, behind, move, speed, replayed = lora
    assert new.vrl > 0 and new.baseline > 0 and behind.vrl > 0 and speed.vrl > 0
    assert "adapter" in new.note and "1 patch" in behind.note
    assert replayed.vrl == 0 and replayed.met, replayed.note  # no honest LoRA group rejected
