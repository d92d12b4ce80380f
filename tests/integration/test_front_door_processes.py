"""The front door as a user meets it, in real `vrl` processes (issue 27): a volunteer given a
bucket it can never reach exits at once with one line instead of waiting forever, and a real
device mistake ends before anything is said about the device."""
from __future__ import annotations

import time

import torch
from helpers.vrlproc import Proc, one_line_error, run_vrl, wait_for


def test_a_volunteer_on_a_mistyped_or_missing_bucket_exits_at_once_and_makes_nothing(tmp_path):
    for bucket, expected in (
            ("s3:/x", "error: --bucket s3:/x: looks like a URL missing its '//' (such as "
                      "s3://...); for a folder of that name write ./s3:/x"),
            (str(tmp_path / "no" / "such"), f"error: --bucket {tmp_path / 'no' / 'such'}: no such "
                                            "folder (only the trainer creates a folder bucket; "
                                            "check the path)")):
        started = time.monotonic()
        r = run_vrl(["volunteer", "--bucket", bucket, "--id", "v",
                     "--work-dir", str(tmp_path / "vw")], cwd=tmp_path, timeout=60)
        assert one_line_error(r) == expected
        # a hang guard: it exits in about a second, where the failure waits forever
        assert time.monotonic() - started < 60 and r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no s3: folder, no work dir


def test_version_and_a_cuda_mistake_as_processes(tmp_path):
    r = run_vrl(["--version"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("vrl ") and len(r.stdout.splitlines()) == 1
    if torch.cuda.is_available():
        return
    (tmp_path / "bucket").mkdir()
    r = run_vrl(["volunteer", "--bucket", str(tmp_path / "bucket"), "--device", "cuda",
                 "--id", "v", "--work-dir", str(tmp_path / "vw")], cwd=tmp_path, timeout=120)
    assert one_line_error(r).startswith("error: --device cuda: this torch ")
    assert "cuda" not in r.stdout  # nothing said "on cuda" first


def test_a_volunteer_on_a_bucket_with_nothing_published_says_it_waits_for_the_first_version(tmp_path):
    (tmp_path / "bucket").mkdir()
    p = Proc(["volunteer", "--bucket", str(tmp_path / "bucket"), "--id", "v",
              "--work-dir", str(tmp_path / "vw")], tmp_path / "v.log", tmp_path)
    try:
        wait_for(lambda: "waiting for the trainer's first version" in p.text(), 120,
                 "the volunteer's waiting line")
    finally:
        code = p.terminate()
    line = next(x for x in p.text().splitlines() if "first version" in x)
    assert line.startswith("waiting for the trainer's first version: no manifest.json in "), line
    assert code == 0
