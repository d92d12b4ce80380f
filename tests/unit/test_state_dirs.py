"""Where state lives without --work-dir: the per-user state folder of each OS, and one folder
per bucket under it (config.user_state_dir, bucket_folder_name)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from volunteer_rl.config import bucket_folder_name, default_work_dir, user_state_dir


@pytest.mark.parametrize("platform, env, expected", [
    ("linux", {}, "~/.local/state/vrl"),
    ("linux", {"XDG_STATE_HOME": "/xdg/state"}, "/xdg/state/vrl"),
    ("linux", {"XDG_STATE_HOME": "relative/state"}, "~/.local/state/vrl"),  # the spec: ignored
    ("darwin", {}, "~/Library/Application Support/vrl"),
    ("darwin", {"XDG_STATE_HOME": "/xdg/state"}, "/xdg/state/vrl"),
    ("win32", {"LOCALAPPDATA": "/Users/a/AppData/Local"}, "/Users/a/AppData/Local/vrl"),
    ("win32", {}, "~/AppData/Local/vrl"),
])
def test_the_per_user_state_folder_of_each_platform(platform, env, expected, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("XDG_STATE_HOME", "LOCALAPPDATA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "platform", platform)
    assert user_state_dir() == Path(expected.replace("~", str(tmp_path)))


def test_the_test_suite_never_writes_into_the_real_home():
    """conftest.py points $XDG_STATE_HOME at a folder of its own for the whole session."""
    assert not user_state_dir().is_relative_to(Path.home() / ".local")
    assert Path(os.environ["XDG_STATE_HOME"]).name.startswith("volunteer_rl-state-")


def test_one_folder_per_bucket(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = {bucket_folder_name(b) for b in ("runs/b", "./runs/b/", str(tmp_path / "runs" / "b"),
                                             f"file://{tmp_path}/runs/b")}
    assert len(names) == 1 and names.pop().startswith("b-")
    assert bucket_folder_name("s3://my-bucket/run1") == bucket_folder_name("s3://my-bucket/run1/")
    others = {bucket_folder_name(b) for b in ("s3://my-bucket/run1", "s3://my-bucket/run2",
                                              "gs://my-bucket/run1", "runs/b", "runs/c")}
    assert len(others) == 5
    for name in others | {bucket_folder_name("s3://a/../../x"), bucket_folder_name("/")}:
        assert "/" not in name and not name.startswith((".", "-")) and len(name) <= 51, name
    assert default_work_dir("eval", "runs/b") == user_state_dir() / "eval" / bucket_folder_name("runs/b")
