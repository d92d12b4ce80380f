"""The README's `vrl demo`, end to end, against the issue's bar. Slow: select with -m slow."""
import re
import time

import pytest

from helpers.vrlproc import run_vrl


@pytest.mark.slow
def test_demo_learns_within_ten_minutes(tmp_path):
    started = time.time()
    r = run_vrl(["demo", "--bucket", str(tmp_path / "bucket")], cwd=tmp_path, timeout=900)
    elapsed = time.time() - started
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = dict((int(v), (float(g), float(s))) for v, g, s in
                re.findall(r"^\s+v(\d+)\s+([\d.]+)%\s+([\d.]+)%$", r.stdout, re.M))
    first, last = rows[0], rows[max(rows)]
    print(f"demo: {elapsed:.0f}s, v0 greedy/sampled {first}, v{max(rows)} {last}")
    assert elapsed <= 600
    assert last[1] - first[1] >= 20.0, (first, last)   # sampled accuracy up >= 20 points
    assert last[0] >= first[0], (first, last)           # greedy does not fall
