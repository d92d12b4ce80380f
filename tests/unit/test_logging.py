"""Issue 39: the log level (--log-level, progress.Log) and a torchrun rank's lines (`[rank R]`,
its first line naming rank, world and backend, "trainer stopped" from the writer alone).
The commands run in-process (CliRunner) with stand-ins for the library that log through the
`log` the command hands them; tests/integration/test_logging_levels.py runs a real trainer."""
from __future__ import annotations

import types

import pytest
import torch
from typer.testing import CliRunner

from volunteer_rl import config, progress
from volunteer_rl.progress import LOG, Log, level_of
from volunteer_rl.trainer.ranks import Ranks, announce, single
from helpers.cli_stand_ins import fake_module
from volunteer_rl.stopping import StopSignal
from volunteer_rl_cli.main import app

LINES = ["step 1 v0 reward 0.500", "warning: fleet.json not written", "error: a shard failed",
         "debug: a detail"]


@pytest.fixture(autouse=True)
def fresh_log():
    """LOG is the process's own: a command sets its level, a trainer rank its prefix; put
    them back for the tests that run after these in this process."""
    yield
    LOG.level, LOG.prefix = "info", ""


def test_the_settings_offer_the_levels_the_log_knows():
    assert config.LOG_LEVELS == progress.LOG_LEVELS


def test_a_line_is_leveled_by_its_first_word():
    assert [level_of(line) for line in LINES] == ["info", "warning", "error", "debug"]
    assert level_of("took rollouts/v000001/a/b.jsonl.gz: warning-free") == "info"


@pytest.mark.parametrize("level,shown", [
    ("debug", LINES), ("info", LINES[:3]), ("warning", LINES[1:3]), ("error", LINES[2:3])])
def test_a_level_shows_its_own_lines_and_the_more_severe(capsys, level, shown):
    log = Log(level)
    for line in LINES:
        log(line)
    assert capsys.readouterr().out.splitlines() == shown


def test_a_rank_prefix_starts_every_line_of_a_message(capsys):
    Log(prefix="[rank 1] ")("error: intake failed:\n  File x\nValueError")
    assert capsys.readouterr().out.splitlines() == [
        "[rank 1] error: intake failed:", "[rank 1]   File x", "[rank 1] ValueError"]


def test_no_bar_is_drawn_when_info_lines_are_hidden(monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    assert progress.interactive()
    LOG.level = "warning"
    assert not progress.interactive()  # --log-level warning: no bar either


def test_a_joined_rank_names_itself_first_and_prefixes_its_lines(capsys):
    cpu = torch.device("cpu")
    announce(Ranks(rank=1, world_size=2, device=cpu, joined=True), LOG)
    LOG("took a shard")
    assert capsys.readouterr().out.splitlines() == [
        "[rank 1] rank 1 of 2, backend gloo, device cpu: follows rank 0",
        "[rank 1] took a shard"]
    assert Ranks(rank=0, world_size=4, device=cpu, joined=True).describe() == \
        "rank 0 of 4, backend gloo, device cpu: the writer, it publishes"
    LOG.prefix = ""
    announce(single(), LOG)  # a single process says nothing and keeps its lines as they are
    LOG("published v1")
    assert capsys.readouterr().out == "published v1\n"


# --- the commands ---------------------------------------------------------------------------

def logging_stand_ins(monkeypatch, writer: bool = True) -> None:
    """A Trainer and a Volunteer that log LINES through the command's log and return; the
    trainer is the writer rank or a follower."""
    class Trainer:
        def __init__(self, cfg, log, stop, **_):
            self.log, self.manifest = log, types.SimpleNamespace(version=3)
            self.ranks = types.SimpleNamespace(is_writer=writer)

        def start(self):
            pass

        def run(self):
            for line in LINES:
                self.log(line)
            return self.manifest

    class Volunteer:
        id = "vol-1"

        def __init__(self, cfg, log, stop):
            self.log = log

        def run(self):
            for line in LINES:
                self.log(line)
            return 7

    fake_module(monkeypatch, "volunteer_rl.trainer.loop", Trainer=Trainer)
    fake_module(monkeypatch, "volunteer_rl.volunteer.loop", Volunteer=Volunteer)
    monkeypatch.setattr(StopSignal, "install", lambda self: self)


def vrl(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


@pytest.mark.parametrize("command", ["trainer", "volunteer"])
def test_log_level_warning_keeps_warnings_and_errors_only(monkeypatch, tmp_path, command):
    logging_stand_ins(monkeypatch)
    bucket = tmp_path / "b"
    bucket.mkdir()
    r = vrl(command, "--bucket", str(bucket), "--log-level", "warning")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == LINES[1:3]  # no step line, no "... stopped ..." line
    r = vrl(command, "--bucket", str(bucket))  # the default, info
    assert r.stdout.splitlines()[:3] == LINES[:3] and "stopped" in r.stdout.splitlines()[-1]
    assert "debug: a detail" in vrl(command, "--bucket", str(bucket), "--log-level", "debug").stdout


@pytest.mark.parametrize("command", ["trainer", "volunteer"])
def test_a_bad_log_level_is_a_usage_error_naming_the_flag(monkeypatch, tmp_path, command):
    logging_stand_ins(monkeypatch)
    r = vrl(command, "--bucket", str(tmp_path), "--log-level", "loud")
    assert r.exit_code == 2
    assert "Invalid value for '--log-level': use debug or info or warning or error, not 'loud'" \
        in " ".join(r.output.replace("│", " ").split())


def test_only_the_writer_rank_says_the_trainer_stopped(monkeypatch, tmp_path):
    logging_stand_ins(monkeypatch, writer=False)
    r = vrl("trainer", "--bucket", str(tmp_path))
    assert r.exit_code == 0 and "trainer stopped" not in r.stdout, r.output
    logging_stand_ins(monkeypatch, writer=True)
    assert "trainer stopped at v3" in vrl("trainer", "--bucket", str(tmp_path)).stdout


def test_storage_retry_warnings_obey_the_level_and_carry_the_rank(capsys):
    from volunteer_rl.storage.retry import warn

    LOG.level, LOG.prefix = "error", "[rank 1] "
    warn("s3://b/manifest.json: timed out; again in 1s")
    assert capsys.readouterr().err == ""
    LOG.level = "warning"
    warn("s3://b/manifest.json: timed out; again in 1s")
    assert capsys.readouterr().err == "[rank 1] warning: s3://b/manifest.json: timed out; again in 1s\n"
