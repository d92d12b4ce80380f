"""bench/checkpoint_sync.py at --quick size: it runs the product's publish and fetch against
raw copies on a folder and on moto, and its rows add up."""
import math

import pytest

from bench.checkpoint_sync import results


@pytest.mark.slow  # runs the benchmark at --quick size: a check of bench code, ~1 min
def test_checkpoint_sync_quick_rows_are_sane():
    rows = results(quick=True)
    timed = [r for r in rows if r.measure.endswith("seconds")]
    # "folder fp32, warm page cache: seconds" -> ("fetch", "folder fp32"); fetch-and-load rows aside
    cells = {(r.benchmark.split()[-1], r.measure.split(":")[0].split(",")[0]) for r in timed
             if r.benchmark in ("checkpoint publish", "checkpoint fetch")}
    assert cells == {(way, f"{b} {d}") for way in ("publish", "fetch")
                     for b in ("folder", "s3") for d in ("fp32", "bf16")}
    for r in timed:
        assert r.vrl > 0 and r.baseline > 0
        assert math.isclose(r.ratio, r.baseline / r.vrl)  # times: raw / vrl, > 1 = vrl faster
        # fetch-and-load rows report a figure with no goal; the others meet theirs or say not
        assert r.met == (None if r.benchmark == "checkpoint fetch and load" else r.ratio >= 0.8)
    (size,) = [r for r in rows if r.benchmark == "checkpoint bytes per version"]
    assert 1.8 < size.ratio < 2.0 and math.isclose(size.ratio, size.baseline / size.vrl)
