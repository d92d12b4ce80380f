"""A trainer that cannot start leaves nothing behind, and one restarted from anywhere finds its
key: the task, its datasets and the key are checked before the bucket is touched (no object,
no new folder bucket, no state folder); the default --work-dir is one per user and bucket
(config.default_work_dir), so a trainer started from another folder resumes the run; and a
trainer without the run's key never makes a new one for a bucket another key signs.

The four bad inputs go through `vrl trainer` in-process (CliRunner: they fail before any
signal handler or torch import); the runs are real `vrl trainer` processes on a folder bucket.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers.vrlproc import one_line_error, run_vrl
from volunteer_rl.config import PACKAGE_DATA, bucket_folder_name
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.signing import load_or_create_key, public_key_text
from volunteer_rl_cli.main import app

CALCULATOR = "python_expression,natural_language\n"


def vrl(*args: str, **env: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250", **env})


@pytest.fixture
def state(tmp_path, monkeypatch) -> Path:
    """This test's own per-user state folder ($XDG_STATE_HOME)."""
    folder = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(folder))
    return folder


BAD_STARTS = {
    "unknown task": (("--task", "nope"), "error: task 'nope' is not installed (installed: "),
    "bad row": (("--dataset", "{bad}"), "error: {bad}: row 1 (line 3): python_expression '1 +' "
                                        "does not evaluate"),
    "missing CSV": (("--dataset", "{missing}"), "error: {missing}: file not found"),
    "missing column": (("--eval-dataset", "{nocolumn}"),
                       "error: {nocolumn}: missing column 'natural_language' for task "
                       "'calculator' (header has ['python_expression', 'words'])"),
}


@pytest.mark.parametrize("case", BAD_STARTS)
def test_a_start_with_bad_input_is_one_line_and_leaves_nothing(case, tmp_path, state):
    files = {"bad": tmp_path / "bad.csv", "missing": tmp_path / "missing.csv",
             "nocolumn": tmp_path / "nocolumn.csv"}
    files["bad"].write_text(CALCULATOR + "1 + 2,one plus two\n1 +,broken\n")
    files["nocolumn"].write_text("python_expression,words\n1 + 2,one plus two\n")
    names = {name: str(path) for name, path in files.items()}
    flags, message = BAD_STARTS[case]
    bucket = tmp_path / "runs" / "bucket"
    r = vrl("trainer", "--bucket", str(bucket), *(f.format(**names) for f in flags))
    assert r.exit_code == 1 and r.stdout == "" and "Traceback" not in r.stderr, r.output
    (line,) = r.stderr.splitlines()
    assert line.startswith(message.format(**names)), line
    assert not (tmp_path / "runs").exists()  # no folder bucket, not even its parent
    assert not state.exists()  # and no work dir: no key, no state


def test_the_default_work_dir_is_per_user_and_per_bucket(tmp_path, state, monkeypatch):
    """The same bucket from two folders (two relative spellings) is one work dir; another
    bucket is another; --work-dir wins; nothing lands in the folder the command ran in."""
    from volunteer_rl.config import TrainerConfig, VolunteerConfig

    (tmp_path / "a").mkdir()
    (tmp_path / "c" / "d").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a")
    here = TrainerConfig(bucket="../b").work_dir
    monkeypatch.chdir(tmp_path / "c" / "d")
    assert TrainerConfig(bucket="../../b").work_dir == here
    assert TrainerConfig(bucket=f"file://{tmp_path}/b/").work_dir == here
    assert here == str(state / "vrl" / "trainer" / bucket_folder_name(str(tmp_path / "b")))
    assert TrainerConfig(bucket="../../other").work_dir != here
    assert VolunteerConfig(bucket="../../b").work_dir == str(
        state / "vrl" / "volunteer" / bucket_folder_name(str(tmp_path / "b")))
    assert TrainerConfig(bucket="s3://x/run1/").work_dir == TrainerConfig(bucket="s3://x/run1").work_dir
    assert Path(TrainerConfig(bucket="s3://x/run1").work_dir).name.startswith("s3-x-run1-")
    assert TrainerConfig(bucket="../../b", work_dir="w").work_dir == "w"


# --- real trainers on one bucket ----------------------------------------------------------------

TRAINER = ["trainer", "--warm-start-steps", "0", "--max-seconds", "0.1", "--eval-every", "0",
           "--threads", "1", "--dashboard-every", "0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run made by a trainer with no --work-dir, started in a folder of its own."""
    root = tmp_path_factory.mktemp("keys")
    eval_csv = root / "eval.csv"
    eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:5]))
    bucket, first = root / "bucket", root / "first"
    first.mkdir()
    state = root / "state"
    env = {"XDG_STATE_HOME": str(state)}
    r = run_vrl([*TRAINER, "--bucket", str(bucket), "--eval-dataset", str(eval_csv)], first,
                timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    work = state / "vrl" / "trainer" / bucket_folder_name(str(bucket))
    key = public_key_text(load_or_create_key(work / "signing-key.pem")[0])
    return {"root": root, "bucket": bucket, "eval": eval_csv, "env": env, "work": work,
            "key": key, "first": r.stdout}


def test_the_first_run_keeps_its_key_in_the_per_user_folder(run):
    assert f"created manifest signing key {run['work'] / 'signing-key.pem'}" in run["first"]
    assert "published v0 of run-" in run["first"]
    assert not (run["root"] / "first" / ".vrl").exists()  # nothing in the folder it ran in


def test_a_trainer_restarted_from_another_folder_resumes_with_the_same_key(run):
    other = run["root"] / "elsewhere" / "deeper"
    other.mkdir(parents=True)
    r = run_vrl([*TRAINER, "--bucket", os.path.relpath(run["bucket"], other),
                 "--eval-dataset", str(run["eval"])], other, timeout=300, env=run["env"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"loaded manifest signing key {run['work'] / 'signing-key.pem'}" in r.stdout
    assert "resuming run-" in r.stdout and "created" not in r.stdout


def test_a_trainer_without_the_runs_key_makes_none_and_says_where_to_point(run):
    """Another user (another per-user folder), or another --work-dir: no key there, and the
    bucket is signed, so one line naming the signer, the path looked at and the flags; no key
    file is left behind."""
    history = sorted((run["bucket"] / layout.MANIFESTS).iterdir())
    for label, flags, env in (
            ("another user", (), {"XDG_STATE_HOME": str(run["root"] / "state-2")}),
            ("another work dir", ("--work-dir", str(run["root"] / "w2")), run["env"])):
        r = run_vrl([*TRAINER, "--bucket", str(run["bucket"]), "--eval-dataset", str(run["eval"]),
                     *flags], run["root"], timeout=300, env=env)
        looked = (Path(flags[1]) if flags else run["root"] / "state-2" / "vrl" / "trainer"
                  / bucket_folder_name(str(run["bucket"]))) / "signing-key.pem"
        assert one_line_error(r) == (
            f"error: manifest.json of {run['bucket']} is signed by {run['key']}, and there is no "
            f"signing key at {looked}; a new key could not resume this run, so none was made; "
            "start the trainer with --signing-key FILE (the key that signed this run) or "
            "--work-dir DIR (the folder holding its signing-key.pem)"), label
        assert not looked.exists() and not looked.with_name("signing-key.pem.pub").exists(), label
    assert sorted((run["bucket"] / layout.MANIFESTS).iterdir()) == history  # nothing published


def test_a_trainer_with_another_key_names_it_and_how_to_point_at_the_right_one(run):
    other = run["root"] / "other.pem"
    mine = public_key_text(load_or_create_key(other)[0])
    r = run_vrl([*TRAINER, "--bucket", str(run["bucket"]), "--eval-dataset", str(run["eval"]),
                 "--signing-key", str(other)], run["root"], timeout=300, env=run["env"])
    assert one_line_error(r) == (
        f"error: manifest.json: signed by {run['key']}, not by the trusted key {mine} (this "
        f"trainer's key {other}); start the trainer with --signing-key FILE (the key that signed "
        "this run) or --work-dir DIR (the folder holding its signing-key.pem)")


def test_public_key_of_a_bucket_is_the_trainers_default_key(run, tmp_path):
    r = vrl("public-key", "--bucket", str(run["bucket"]), XDG_STATE_HOME=run["env"]["XDG_STATE_HOME"])
    assert (r.exit_code, r.stdout) == (0, run["key"] + "\n"), r.output
    elsewhere = tmp_path / "state"  # another user: no key for this run, and none made
    r = vrl("public-key", "--bucket", str(run["bucket"]), XDG_STATE_HOME=str(elsewhere))
    assert r.exit_code == 1 and "is signed by " + run["key"] in r.stderr, r.output
    assert not elsewhere.exists()
    r = vrl("public-key", XDG_STATE_HOME=str(elsewhere))
    assert (r.exit_code, r.stderr) == (1, "error: vrl public-key: give --bucket (the trainer "
                                          "keeps a key per bucket), --work-dir or --signing-key\n")
