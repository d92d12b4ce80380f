"""bench/__main__.py's report: rerunning benchmarks keeps the sections people wrote."""
from pathlib import Path

from bench.__main__ import REPRODUCE, render, written_notes
from bench.common import Row


def row(ratio: float) -> Row:
    return Row(benchmark="b", measure="m", vrl=ratio, baseline=1.0, ratio=ratio, goal=">= 1",
               met=ratio >= 1, command="python -m bench.b", note="n")


def test_hand_written_sections_survive_a_rerun(tmp_path: Path):
    out = tmp_path / "PERFORMANCE.md"
    assert written_notes(out) == ""  # no file yet
    out.write_text(render({"b": ([row(0.5)], None, 3.0)}, False))
    assert written_notes(out) == ""  # only the generated part
    notes = "## Why b is slow\n\nBecause.\n\n## Another\n\nText.\n"
    out.write_text(out.read_text() + "\n" + notes)
    assert written_notes(out) == notes
    rerun = render({"b": ([row(2.0)], None, 4.0)}, False, {"b": "2026-11-23"})
    assert "| 2.00 |" in rerun and "0.50" not in rerun and "(b, 4 s here, 2026-11-23)" in rerun
    assert REPRODUCE in rerun and written_notes(out) == notes
