"""Issue 39: --report-to, the trainer's metrics lines to TensorBoard and Weights & Biases
(offline) besides metrics/ in the bucket (trainer.reporters), under metrics/'s own names.
TensorBoard's event files are read back with its own EventAccumulator; wandb is tested where
it is installed (it is not a test dependency: about 100 MB). A real 2-rank trainer reports to
TensorBoard in tests/integration/test_ranks_loop.py."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import ConfigError
from volunteer_rl.protocol import metrics
from volunteer_rl.stopping import StopSignal
from volunteer_rl.trainer.reporters import Reporters, folder, scalars
from volunteer_rl_cli.main import app


def step_line(step: int, version: int, reward: float) -> dict:
    """A step line as records.Records.step writes one, with some of its maps and Nones."""
    return {metrics.KIND: metrics.STEP_LINE, metrics.STEP: step, metrics.VERSION: version,
            metrics.TIME: 1.7e9 + step, metrics.REWARD_MEAN: reward, "train/loss": -0.25 * step,
            metrics.GROUPS: 16, "rollout/frac_reward_zero_std": None,
            metrics.STALENESS_HIST: {"0": 12, "1": 4}, "ingest/rejected": {},
            "audit/skipped": False}


LINES = [step_line(1, 0, 0.25), step_line(2, 0, 0.5),
         {metrics.KIND: metrics.EVAL_LINE, metrics.VERSION: 1, metrics.TIME: 1.7e9 + 3,
          metrics.ACCURACY_GREEDY: 0.4, metrics.ACCURACY_SAMPLED: 0.3, metrics.EVAL_PROMPTS: 10}]


def test_the_numbers_of_a_line_are_reported_under_their_metrics_names():
    assert scalars(LINES[0]) == {metrics.VERSION: 0.0, metrics.REWARD_MEAN: 0.25,
                                 "train/loss": -0.25, metrics.GROUPS: 16.0}
    assert scalars({metrics.REWARD_MEAN: float("nan"), "x": float("inf")}) == {}


def test_nothing_is_asked_of_a_trainer_that_reports_nowhere(tmp_path):
    r = Reporters(TrainerConfig(bucket="b", work_dir=str(tmp_path)), print)
    r.record(LINES, "run-1")
    r.close()
    assert not any(tmp_path.iterdir())


def tensorboard_scalars(where: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(where))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_each_line_at_its_step_under_work_dir_runs(tmp_path):
    pytest.importorskip("tensorboard")  # the test extra installs it
    said = []
    r = Reporters(TrainerConfig(bucket="b", work_dir=str(tmp_path), report_to="tensorboard"),
                  said.append)
    r.record(LINES[:1], "run-1")  # one publish's lines, then the next's
    r.record(LINES[1:], "run-1")
    r.close()
    where = tmp_path / "runs" / "run-1"
    assert folder(r.cfg, "run-1") == where and said == [f"reporting metrics to tensorboard in {where}"]
    got = tensorboard_scalars(where)
    assert got[metrics.REWARD_MEAN] == [(1, 0.25), (2, 0.5)]
    assert got["train/loss"] == [(1, -0.25), (2, -0.5)]
    # an eval line: at the step before it, the last of the version it evaluates
    assert got[metrics.ACCURACY_GREEDY] == [(2, pytest.approx(0.4))]
    assert not {metrics.KIND, metrics.STEP, metrics.TIME, metrics.STALENESS_HIST} & set(got)


def test_logging_dir_puts_the_files_where_it_says(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = TrainerConfig(bucket="b", work_dir=str(tmp_path / "w"), report_to="tensorboard",
                        logging_dir=str(tmp_path / "tb"))
    r = Reporters(cfg, print)
    r.record(LINES, "run-1")
    r.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")) and not (tmp_path / "w").exists()


def test_a_sink_that_fails_is_a_warning_and_training_goes_on(tmp_path):
    pytest.importorskip("tensorboard")
    said = []
    r = Reporters(TrainerConfig(bucket="b", work_dir=str(tmp_path), report_to="tensorboard"),
                  said.append)
    r.record(LINES[:1], "run-1")
    r.sinks["tensorboard"].add_scalar = lambda *a, **k: (_ for _ in ()).throw(OSError("disk full"))
    r.record(LINES[1:], "run-1")
    r.record(LINES[1:], "run-1")  # dropped: no second warning
    assert said[1:] == ["warning: --report-to tensorboard: OSError: disk full; no more reports "
                        "to it (metrics/ in the bucket goes on)"]


def no_package(monkeypatch, name: str) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == name else find_spec(n, *a))


@pytest.mark.parametrize("name,install", [
    ("tensorboard", "pip install tensorboard (what vrl's [tensorboard] extra adds)"),
    ("wandb", "pip install wandb")])
def test_a_package_not_installed_is_one_line_saying_what_to_install(monkeypatch, tmp_path,
                                                                    name, install):
    no_package(monkeypatch, name)
    with pytest.raises(ConfigError) as e:
        Reporters(TrainerConfig(bucket="b", report_to=name), print)
    assert str(e.value) == f"--report-to {name}: {name} is not installed here; {install}, " \
                           f"or leave {name} out"


def test_the_trainer_stops_at_start_on_a_missing_package(monkeypatch, tmp_path):
    """The real `vrl trainer` (no stand-in): one `error:` line, exit 1, before the bucket is
    touched beyond its folder."""
    no_package(monkeypatch, "wandb")
    monkeypatch.setattr(StopSignal, "install", lambda self: self)
    r = CliRunner().invoke(app, ["trainer", "--bucket", str(tmp_path / "b"), "--report-to",
                                 "tensorboard,wandb"])
    assert r.exit_code == 1, r.output
    assert r.output.strip().splitlines()[-1].startswith(
        "error: --report-to wandb: wandb is not installed here; pip install wandb")
    assert not any((tmp_path / "b").iterdir())


def test_wandb_is_written_offline_where_it_is_installed(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    r = Reporters(TrainerConfig(bucket="b", work_dir=str(tmp_path), report_to="wandb"), print)
    r.record(LINES, "run-1")
    run = r.sinks["wandb"]
    assert run.settings.mode == "offline" and run.name == "run-1"
    # wandb commits a step's row once a later step comes (the eval line joins step 2's row)
    assert run.summary[metrics.REWARD_MEAN] == 0.25 and run.summary["_step"] == 1
    r.close()  # ...or at the finish, which writes the offline run's file whole
    assert wandb.run is None
    (written,) = (tmp_path / "runs" / "run-1" / "wandb").glob("offline-run-*/run-*.wandb")
    data = written.read_bytes()  # protobuf records, whose names are stored as they are
    assert b"eval/accuracy_greedy" in data and data.count(b"rollout/reward_mean") >= 2  # 2 rows
