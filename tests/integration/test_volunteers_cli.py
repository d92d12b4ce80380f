"""`vrl volunteers` as a real process: what a user sees of a known error is one line, exit 1.

The commands' behaviour is tested in-process (tests/unit/test_cli.py); only a real
interpreter shows that nothing else reaches the terminal (no traceback, no second line).
"""
from __future__ import annotations

from helpers.vrlproc import run_vrl


def test_malformed_denylist_is_a_one_line_error(tmp_path):
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    (bucket / "denylist.json").write_text("{not json")
    out = run_vrl(["volunteers", "list", "--bucket", str(bucket)], tmp_path)
    assert out.returncode == 1 and out.stderr.startswith("error: denylist.json: malformed")
    assert "Traceback" not in out.stderr
    assert len(out.stderr.splitlines()) == 1 and out.stdout == ""
