"""bench/host_share.py at --quick size: its two rows add up (the figures are the bench's own,
run idle)."""
import pytest


@pytest.mark.slow  # two 90 s runs of the demo's fleet, each scored on 100 prompts
def test_host_share_quick_rows_are_sane():
    from bench import host_share

    rows = host_share.results(quick=True)
    assert [r.benchmark.split(",")[0] for r in rows] == \
        ["fleet intake", "held-out accuracy after 90s"] * len(host_share.SHARES)
    for intake, accuracy, share in zip(rows[::2], rows[1::2], host_share.SHARES):
        assert intake.vrl > 0 and intake.baseline > 0 and 0 <= accuracy.vrl <= 1
        assert f"--cpu-share {share:g}" in intake.benchmark and "demo-2" in intake.note
    assert all(r.command == "python -m bench.host_share --quick" for r in rows)
