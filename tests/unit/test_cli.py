"""The `vrl` commands in-process (typer's CliRunner): flags become the settings dataclasses,
known failures end in one `error:` line, bugs keep their traceback, the denylist commands."""
from __future__ import annotations

import json
from importlib import metadata

import pytest
from typer.testing import CliRunner

import volunteer_rl.protocol.fleet
from volunteer_rl.config import TrainerConfig, VolunteerConfig
from volunteer_rl.demo import DemoSettings
from volunteer_rl.storage.base import StorageError
from helpers.cli_stand_ins import stand_ins
from volunteer_rl_cli.main import app, main


def vrl(*args: str, **env: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250", **env})



@pytest.fixture
def built(monkeypatch) -> list:
    """The settings each command hands the library, from stand-in Trainer and Volunteer
    classes that do nothing; the trainer's signal handlers stay out of the test process."""
    return stand_ins(monkeypatch)


def test_vrl_is_the_installed_entry_point():
    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "vrl"]
    assert script.load() is main


# --- flags become the settings dataclasses ----------------------------------------------------

def test_help_shows_the_defaults_and_docs_of_the_config():
    out = vrl("trainer", "--help").stdout
    assert "AdamW learning rate of the RL phase (default: 3e-4, or ten times that with " \
           "--lora-rank, as \"LoRA Without Regret\" found best for LoRA)." in out
    for shown in ("[default: 32.0]", "[default: grpo]", "[default: 60.0]", "[x>=1]",
                  "[env var: VRL_ENDPOINT_URL]", "\n   vrl trainer --bucket s3://"):
        assert shown in out, shown
    out = vrl("volunteer", "--help").stdout
    assert "[0<=x<=19]" in out and "per-user state folder" in out and "--no-curriculum" not in out
    assert "--no-curriculum" in vrl("trainer", "--help").stdout  # the trainer's, since schema 6


def test_no_flags_give_the_dataclass_defaults(built, tmp_path):
    bucket = str(tmp_path / "b")
    for command in ("trainer", "volunteer", "demo"):
        r = vrl(command, *(("--bucket", bucket) if command != "demo" else ()))
        assert r.exit_code == 0, r.output
    assert built == [TrainerConfig(bucket=bucket), VolunteerConfig(bucket=bucket), DemoSettings()]


def test_flags_and_environment_reach_the_config(built, tmp_path):
    r = vrl("trainer", "-b", "s3://x/run", "-k", "4", "--lr", "5e-4", "--log-shards",
            "--weights-dtype", "bf16", "--max-seconds", "2.5", "--gradient-checkpointing",
            VRL_ENDPOINT_URL="http://s3:9000")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["trainer stopped at v3"], r.output
    # --seed: accepted and ignored (no setting holds it), as older command lines pass it
    r = vrl("volunteer", "--bucket", str(tmp_path), "--id", "laptop", "--seed", "3",
            VRL_TRUST_KEY="ed25519:abc")
    assert r.exit_code == 0 and "volunteer vol-1 stopped after uploading 7 groups" in r.stdout
    assert built == [
        TrainerConfig(bucket="s3://x/run", endpoint_url="http://s3:9000", k=4, lr=5e-4,
                      log_shards=True, weights_dtype="bf16", max_seconds=2.5,
                      gradient_checkpointing=True),
        VolunteerConfig(bucket=str(tmp_path), volunteer_id="laptop", trust_key="ed25519:abc")]


@pytest.mark.parametrize("args,message", [
    (("trainer", "--bucket", "b", "--algo", "ppo"), "'--algo': use reinforce or grpo, not 'ppo'"),
    (("trainer", "--bucket", "b", "--temperature", "0"), "'--temperature': must be more than 0"),
    (("demo", "--algo", "ppo"), "'--algo': use reinforce or grpo, not 'ppo'"),
    (("trainer", "--bucket", "b", "--keep-versions", "0"), "--keep-versions"),
    (("volunteer", "--bucket", "b", "--nice", "20"), "--nice"),
    (("gc", "--bucket", "b", "--keep-versions", "0"), "--keep-versions"),
    (("eval", "--bucket", "b", "--version", "-1"), "--version"),
])
def test_a_refused_flag_value_is_a_usage_error_before_anything_runs(built, args, message):
    r = vrl(*args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and "Traceback" not in r.stderr
    assert built == []


# --- how failures end ------------------------------------------------------------------------

def read_denylist_raising(monkeypatch, exc: BaseException) -> None:
    def fails(storage):
        raise exc
    monkeypatch.setattr(volunteer_rl.protocol.fleet, "read_denylist", fails)


def test_a_known_error_is_one_line_and_exit_1(monkeypatch, tmp_path):
    read_denylist_raising(monkeypatch, StorageError("denylist.json: connection reset"))
    r = vrl("volunteers", "list", "--bucket", str(tmp_path))
    assert (r.exit_code, r.stdout, r.stderr) == (1, "", "error: denylist.json: connection reset\n")


def test_an_unsafe_volunteer_id_is_a_known_error(tmp_path):
    r = vrl("volunteer", "--bucket", str(tmp_path), "--id", "../x", "--work-dir", str(tmp_path))
    assert r.exit_code == 1, r.output
    assert r.stderr.splitlines() == [
        "error: --id '../x': use 1-64 of A-Z a-z 0-9 _ . - (not starting with . or -)"]


@pytest.mark.parametrize("bug", [ZeroDivisionError("division by zero"), ValueError("a bug")])
def test_any_other_exception_is_a_bug_and_keeps_its_traceback(monkeypatch, tmp_path, bug):
    read_denylist_raising(monkeypatch, bug)
    r = vrl("volunteers", "list", "--bucket", str(tmp_path))
    assert r.exception is bug and r.exit_code == 1
    assert "error:" not in r.stderr


def test_ctrl_c_is_interrupted_and_exit_130(monkeypatch, tmp_path):
    read_denylist_raising(monkeypatch, KeyboardInterrupt())
    r = vrl("volunteers", "list", "--bucket", str(tmp_path))
    assert (r.exit_code, r.stderr) == (130, "interrupted\n")


# --- vrl volunteers: the denylist on a folder bucket --------------------------------------------

def test_deny_list_allow_round_trip(tmp_path):
    bucket = str(tmp_path / "bucket")
    (tmp_path / "bucket").mkdir()  # only the trainer makes a folder bucket
    out = vrl("volunteers", "list", "--bucket", bucket)
    assert out.exit_code == 0 and "no volunteer is denied" in out.stdout
    out = vrl("volunteers", "deny", "spammer-1", "--bucket", bucket, "--reason", "junk")
    assert out.exit_code == 0 and "spammer-1: denied" in out.stdout
    entries = json.loads((tmp_path / "bucket" / "denylist.json").read_text())["volunteers"]
    assert entries["spammer-1"]["by"] == "operator" and entries["spammer-1"]["reason"] == "junk"
    out = vrl("volunteers", "list", "--bucket", bucket)
    assert "spammer-1" in out.stdout and "junk" in out.stdout
    out = vrl("volunteers", "allow", "spammer-1", "--bucket", bucket)
    assert out.exit_code == 0 and "allowed again" in out.stdout
    assert json.loads((tmp_path / "bucket" / "denylist.json").read_text())["volunteers"] == {}
    out = vrl("volunteers", "allow", "spammer-1", "--bucket", bucket)
    assert "was not denied" in out.stdout


def test_a_bad_id_is_refused_and_nothing_is_written(tmp_path):
    bucket = tmp_path / "bucket"
    out = vrl("volunteers", "deny", "../etc", "--bucket", str(bucket))
    assert out.exit_code != 0 and "not a volunteer id" in out.stderr
    assert "Traceback" not in out.stderr
    assert out.exit_code == 2 and not (bucket / "denylist.json").exists()
