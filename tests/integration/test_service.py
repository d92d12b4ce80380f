"""`vrl volunteer --print-service systemd|launchd` (volunteer_rl.volunteer.service): the unit a
laptop owner installs so the volunteer starts at login and again after a crash. The systemd
unit passes `systemd-analyze verify`; the launchd agent parses with plistlib; both run the
flags given, and the command they run, started again after a kill -9 as the service manager
would, comes back under the same id."""
from __future__ import annotations

import os
import plistlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

from helpers.vrlproc import wait_for
from volunteer_rl.launch import vrl_command, vrl_env
from volunteer_rl.volunteer.service import USAGE_EXIT

ODD = "odd dir %h $HOME \"q\" \\ end"  # a working folder systemd would otherwise expand or split


def printed(kind: str, flags: list[str], cwd, env: dict | None = None) -> str:
    out = subprocess.run(vrl_command("volunteer", *flags, "--print-service", kind), cwd=cwd,
                         env=vrl_env(env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def systemd_words(line: str) -> list[str]:
    """The words of an ExecStart= value as printed (each double-quoted), systemd's escapes
    undone."""
    words = re.findall(r'"((?:[^"\\]|\\.)*)"', line)
    undo = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
    return [re.sub(r'\\\\|\\"|\\n', lambda m: undo[m.group()], w).replace("%%", "%").replace("$$", "$")
            for w in words]


def setting(unit: str, key: str) -> str:
    return re.search(rf"^{key}=(.*)$", unit, re.M).group(1)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_systemd_unit_verifies_and_runs_the_flags_given(tmp_path):
    cwd = tmp_path / ODD
    cwd.mkdir()
    flags = ["--bucket", "bucket 1", "--nice", "7", "--log-shards", "--work-dir", "vw"]
    key = "ed25519:" + "A" * 43 + "="
    unit = printed("systemd", flags, cwd, {"VRL_TRUST_KEY": key})
    path = tmp_path / "vrl-volunteer.service"
    path.write_text(unit)
    check = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                           text=True, timeout=120)
    # verify exits 0 on a setting it cannot parse, so its output must be empty too
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), check.stderr
    assert setting(unit, "WorkingDirectory").replace("%%", "%") == str(cwd)
    command = systemd_words(setting(unit, "ExecStart"))
    assert command[:4] == vrl_command("volunteer")
    given = command[4:]
    # the flags given, and the trust key that came by environment variable, and nothing else
    assert sorted(given) == sorted(flags + ["--trust-key", key])
    assert given[given.index("--trust-key") + 1] == key
    assert setting(unit, "Restart") == "on-failure"
    assert setting(unit, "RestartPreventExitStatus") == str(USAGE_EXIT)
    assert setting(unit, "WantedBy") == "default.target"
    assert "AWS_SECRET" not in unit


def test_the_launchd_agent_parses_and_restarts_only_after_a_failure(tmp_path):
    flags = ["--bucket", str(tmp_path / "b"), "--threads", "1"]
    agent = plistlib.loads(printed("launchd", flags, tmp_path).encode())
    assert agent["ProgramArguments"] == vrl_command("volunteer", *flags)
    assert agent["WorkingDirectory"] == str(tmp_path)
    assert agent["RunAtLoad"] is True and agent["KeepAlive"] == {"SuccessfulExit": False}
    assert agent["StandardOutPath"].endswith("Library/Logs/vrl-volunteer.log")


def test_a_bad_kind_is_a_usage_error_naming_the_flag(tmp_path):
    out = subprocess.run(vrl_command("volunteer", "--bucket", str(tmp_path), "--print-service",
                                     "cron"), env=vrl_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == USAGE_EXIT and "--print-service" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_service_command_comes_back_under_its_id_after_a_kill(tmp_path):
    """What systemd's Restart=on-failure and launchd's KeepAlive do after a crash: run the
    unit's command again, in its working folder."""
    (tmp_path / "bucket").mkdir()
    flags = ["--bucket", "bucket", "--work-dir", "vw", "--allow-unsigned", "--poll-seconds", "0.2"]
    agent = plistlib.loads(printed("launchd", flags, tmp_path).encode())
    command, cwd = agent["ProgramArguments"], agent["WorkingDirectory"]
    ids = []
    for run in range(2):
        log = tmp_path / f"run{run}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(command, cwd=cwd, env=vrl_env(), stdout=f, stderr=subprocess.STDOUT)
        try:
            ids.append(wait_for(lambda: re.search(r"^volunteer (\S+) on ", log.read_text(), re.M),
                                120, "the volunteer's first line").group(1))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        assert ("new volunteer id" in log.read_text()) == (run == 0), log.read_text()
    assert ids[0] == ids[1]
    assert (tmp_path / "vw" / "volunteer-ids").read_text().split() == [ids[0]]
    assert sys.executable == command[0]
