"""`vrl volunteers list / deny / allow` as real subprocesses on a folder bucket."""
from __future__ import annotations

import json

from helpers.vrlproc import run_vrl


def test_deny_list_allow_round_trip(tmp_path):
    bucket = str(tmp_path / "bucket")
    out = run_vrl(["volunteers", "list", "--bucket", bucket], tmp_path)
    assert out.returncode == 0 and "no volunteer is denied" in out.stdout
    out = run_vrl(["volunteers", "deny", "spammer-1", "--bucket", bucket, "--reason", "junk"], tmp_path)
    assert out.returncode == 0 and "spammer-1: denied" in out.stdout
    entries = json.loads((tmp_path / "bucket" / "denylist.json").read_text())["volunteers"]
    assert entries["spammer-1"]["by"] == "operator" and entries["spammer-1"]["reason"] == "junk"
    out = run_vrl(["volunteers", "list", "--bucket", bucket], tmp_path)
    assert "spammer-1" in out.stdout and "junk" in out.stdout
    out = run_vrl(["volunteers", "allow", "spammer-1", "--bucket", bucket], tmp_path)
    assert out.returncode == 0 and "allowed again" in out.stdout
    assert json.loads((tmp_path / "bucket" / "denylist.json").read_text())["volunteers"] == {}
    out = run_vrl(["volunteers", "allow", "spammer-1", "--bucket", bucket], tmp_path)
    assert "was not denied" in out.stdout


def test_bad_id_and_malformed_denylist_are_one_line_errors(tmp_path):
    bucket = tmp_path / "bucket"
    out = run_vrl(["volunteers", "deny", "../etc", "--bucket", str(bucket)], tmp_path)
    assert out.returncode != 0 and "not a volunteer id" in out.stderr and "Traceback" not in out.stderr
    bucket.mkdir()
    (bucket / "denylist.json").write_text("{not json")
    out = run_vrl(["volunteers", "list", "--bucket", str(bucket)], tmp_path)
    assert out.returncode == 1 and out.stderr.startswith("error: denylist.json: malformed")
    assert "Traceback" not in out.stderr
