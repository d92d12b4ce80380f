"""dashboard/ in the bucket: plots and a static page from metrics and heartbeats (no model)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest

from helpers.browser import CHROMIUM, inspect_dashboard
from helpers.status_fixtures import NOW, beat, manifest  # noqa: E402
from helpers.vrlproc import run_vrl  # noqa: E402
from volunteer_rl.observe import dashboard
from volunteer_rl.observe.dashboard import (  # noqa: E402
    History,
    TrainerDashboard,
    read_history,
    render_dashboard,
    staleness_counts,
    throughput_series,
    write_dashboard,
)
from volunteer_rl.observe.status import read_status
from volunteer_rl.protocol import layout  # noqa: E402
from volunteer_rl.protocol.metrics import parse_lines  # noqa: E402
from volunteer_rl.storage import open_storage  # noqa: E402

ARTIFACTS = Path(os.environ.get("VRL_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


def metrics_lines(version: int) -> list[dict]:
    step = {"kind": "step", "step": version, "version": version - 1, "time": NOW + 10 * version,
            "rollout/reward_mean": 0.1 * version, "rollout/staleness_hist": {"0": 6, "1": 2},
            "rollout/groups": 8, "ingest/groups": 40,
            "rollout/sources": {layout.shard_key(version - 1, "vol-1", "s"): 5,
                                layout.shard_key(version - 1, "vol-2", "s"): 3}}
    rows = [step]
    if version % 2 == 0:
        rows.append({"kind": "eval", "version": version, "time": NOW + 10 * version,
                     "eval/accuracy_greedy": 0.05 * version, "eval/accuracy_sampled": 0.04 * version})
    return rows


def bucket_with_run(s, versions: int = 6):
    s.write(layout.MANIFEST, manifest(versions).to_json())
    s.write(layout.heartbeat_key("vol-1"), json.dumps(beat(version=versions)).encode())
    for v in range(1, versions + 1):
        body = "".join(json.dumps(m) + "\n" for m in metrics_lines(v))
        s.create(layout.metrics_key(v), body.encode())


def test_history_sums():
    h = History()
    for v in range(1, 5):
        h.add(parse_lines(metrics_lines(v)))
    assert staleness_counts(h) == {0: 24, 1: 8}
    series = throughput_series(h, NOW, 20.0)
    assert series["vol-1: trained"] == {0: 15.0, 1: 30.0, 2: 15.0}  # 5 groups per 20 s bin step
    assert sum(series["all: received"].values()) == 4 * 40 * 3
    assert [e["version"] for e in h.evals] == [2, 4]


def test_write_dashboard_puts_plots_then_the_page():
    s = open_storage("memory://dash")
    bucket_with_run(s)
    keys = write_dashboard(s, read_history(s))
    assert keys[-1] == "dashboard/index.html"
    for name in ("accuracy", "reward", "throughput", "staleness"):
        assert s.read(f"dashboard/{name}.png").startswith(b"\x89PNG\r\n\x1a\n")
    page = s.read("dashboard/index.html").decode()
    assert "version 6" in page and "<td>vol-1</td><td>producing</td>" in page
    assert 'src="accuracy.png"' in page and "http" not in page.split("<body>")[1]  # relative only


class Clock:
    """An injected clock: time moves only when the test (or a fake write) moves it."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_trainer_dashboard_every_seconds_with_the_cost_guard(monkeypatch):
    clock, writes, took, cost = Clock(1000), [], [], {"seconds": 2.0}

    def timed_write(storage, history, pending=()):  # render + upload, taking cost["seconds"]
        writes.append(clock.now)
        took.append(cost["seconds"])
        clock.now += cost["seconds"]
    monkeypatch.setattr(dashboard, "write_dashboard", timed_write)
    d = TrainerDashboard(open_storage("memory://dash-cadence"), 60, print, clock=clock)

    def publish_at(t: float, final: bool = False) -> None:
        clock.now = t
        d.after_publish([], final)

    publish_at(1001)
    publish_at(1059)
    assert writes == [] and d.take_seconds() == 0.0
    publish_at(1060)  # the first, --dashboard-every seconds after the start
    assert writes == [1060] and d.take_seconds() == 2.0 and d.take_seconds() == 0.0
    publish_at(1061)
    publish_at(1130)  # 60 s have passed, but the last write took 2 s: not before 50 x 2 s
    assert writes == [1060]
    publish_at(1160)
    assert writes == [1060, 1160]
    cost["seconds"] = 0.1  # fast writes: the cadence is --dashboard-every again
    publish_at(1260)
    publish_at(1310)
    publish_at(1320.1)
    assert writes == [1060, 1160, 1260, 1320.1]
    publish_at(1321, final=True)  # the last publish is always written
    assert writes[-1] == 1321
    # each write took at most 2 % of the time until the next one (the final write aside)
    assert all(b - a >= dashboard.COST_RATIO * t for a, b, t in zip(writes, writes[1:-1], took))


def test_trainer_dashboard_reads_history_once_and_is_never_fatal():
    s = open_storage("memory://dash-trainer")
    bucket_with_run(s, 2)
    clock = Clock()
    d = TrainerDashboard(s, 60, print, clock=clock)

    def publish(version: int, final: bool = False) -> None:  # as Trainer.publish_next does
        d.after_publish(parse_lines(metrics_lines(version)), final)
        body = "".join(json.dumps(m) + "\n" for m in metrics_lines(version))
        s.create(layout.metrics_key(version), body.encode())

    publish(3)
    assert not s.exists("dashboard/index.html")  # not due yet
    clock.now += 60
    publish(4)
    assert s.exists("dashboard/index.html")
    s.delete("dashboard/index.html")
    clock.now += 1
    publish(5, final=True)
    assert s.exists("dashboard/index.html")
    assert [st["step"] for st in d.history.steps] == [1, 2, 3, 4, 5]  # read once, then fed

    logs = []
    broken = TrainerDashboard(open_storage("memory://dash-empty"), 1, logs.append)
    broken.after_publish([], final=True)  # no manifest: a warning, not an exception
    broken.after_publish([], final=True)
    assert len(logs) == 1 and logs[0].startswith("warning: dashboard/")


def test_dashboard_every_0_writes_nothing():
    s = open_storage("memory://dash-off")
    bucket_with_run(s, 2)
    d = TrainerDashboard(s, 0, print)
    d.after_publish(parse_lines(metrics_lines(3)))
    d.after_publish(parse_lines(metrics_lines(4)), final=True)
    assert s.list("dashboard") == [] and d.take_seconds() == 0.0


def test_vrl_dashboard_command(tmp_path):
    bucket = tmp_path / "bucket"
    bucket_with_run(open_storage(str(bucket)))
    r = run_vrl(["dashboard", "--bucket", str(bucket)], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (bucket / "dashboard" / "index.html").exists() and "index.html" in r.stdout
    (tmp_path / "empty").mkdir()  # a folder that does not exist is another error (test_cli_front_door)
    r = run_vrl(["dashboard", "--bucket", str(tmp_path / "empty")], cwd=tmp_path, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: manifest.json: not found in {tmp_path / 'empty'}"]


# --- issue 39: a page that tells the truth ----------------------------------------------------

def test_the_header_reward_is_the_step_the_plot_and_vrl_status_end_on():
    """The trainer writes dashboard/ before the publish's metrics object: the header read the
    bucket and lagged one step behind its own plot and `vrl status`. It takes the pending
    records in, through status.latest_step, as `vrl status` does."""
    s = open_storage("memory://dash-latest")
    bucket_with_run(s, 5)
    d = TrainerDashboard(s, 60, print, clock=Clock())
    d.after_publish([], final=False)  # (not due: history not read yet)
    s.write(layout.MANIFEST, manifest(6).to_json())
    records = parse_lines(metrics_lines(6))
    d.after_publish(records, final=True)  # as Trainer.publish_next: the page first...
    page = s.read("dashboard/index.html").decode()
    s.create(layout.metrics_key(6), "".join(json.dumps(m) + "\n" for m in metrics_lines(6)).encode())
    last_point = dashboard.plotted(d.history.steps, "reward")[-1]  # ...then the metrics
    status = read_status(s)["trainer"]
    assert (status["reward_step"], status["reward_mean"]) == (last_point["step"], last_point["reward"]) == (6, 0.1 * 6)
    assert f"reward {0.6:.3f} (step 6)" in page


def test_accuracy_is_plotted_in_percent_as_the_page_gives_it():
    h = History()
    for v in range(1, 5):
        h.add(parse_lines(metrics_lines(v)))
    fig = dashboard.accuracy_figure(h)
    for ax in fig.axes:
        assert ax.get_ylabel() == "accuracy (%)"
        sampled, greedy = ax.get_lines()
        assert list(sampled.get_ydata()) == [pytest.approx(4.0 * v) for v in (2, 4)]  # 0.04 v
        assert list(greedy.get_ydata()) == [pytest.approx(5.0 * v) for v in (2, 4)]
        assert ax.yaxis.get_major_formatter()(40, 0) == "40%"


def snapshot_bucket(root: Path, stopped: bool, ranks: int = 2) -> Path:
    """A bucket whose dashboard was written an hour ago, by a trainer that then stopped (it
    said so in fleet.json) or went silent, a volunteer producing at the time."""
    written = time.time() - 3600
    bucket = root / "bucket"
    s = open_storage(str(bucket))
    bucket_with_run(s)
    s.write(layout.MANIFEST, dataclasses.replace(manifest(6), created_at=written - 3).to_json())
    s.write(layout.heartbeat_key("vol-1"), json.dumps(beat(version=6, updated_at=written - 1)).encode())
    s.write(layout.FLEET, json.dumps({"run_id": "r1", "trainer": {
        "version": 6, "step": 6, "max_staleness": 2, "ranks": ranks,
        "stopped_at": written if stopped else None}}).encode())
    for key, data in render_dashboard(read_history(s), read_status(s, now=written), written).items():
        s.write(key, data)
    return bucket


def test_the_page_says_it_is_a_snapshot_and_when_the_trainer_stopped():
    page = (snapshot_bucket(Path(tempfile.mkdtemp()), True) / "dashboard" / "index.html").read_text()
    assert "The trainer stopped at" in page and "no longer reloads" in page
    assert 'http-equiv="refresh"' not in page and "reloads every" not in page
    assert "trained as 2 ranks (torchrun)" in page
    page = (snapshot_bucket(Path(tempfile.mkdtemp()), False, ranks=1) / "dashboard" / "index.html").read_text()
    assert 'http-equiv="refresh"' in page and "reloads every" in page and "stopped" not in page
    assert "ranks" not in page


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_an_hour_old_page_in_headless_chromium_says_so(tmp_path):
    """Issue 39: after everything stopped the page still said "producing, 3s ago" and
    "reloads every 30 s". Viewed an hour later in a real browser: the trainer's stop and its
    time, no reload, and every age taken at view time (a heartbeat an hour old says so);
    a trainer that went silent without saying it stopped gets the warning instead."""
    stopped = inspect_dashboard(snapshot_bucket(tmp_path / "stopped", True), tmp_path,
                                ARTIFACTS / "dashboard-stopped.png")
    hour = r"\d\d:\d\d:\d\d UTC \(6[01]m ago\)"  # a clock time, and its age when viewed
    assert not stopped["refresh"] and "reloads every" not in stopped["text"], stopped
    assert re.search("The trainer stopped at " + hour, stopped["text"]), stopped
    assert re.fullmatch(hour, stopped["seen"][0]), stopped
    assert not re.search(r"\b\d+s ago", stopped["text"]) and "trained as 2 ranks" in stopped["text"]

    silent = inspect_dashboard(snapshot_bucket(tmp_path / "silent", False), tmp_path / "silent",
                               ARTIFACTS / "dashboard-silent.png")
    assert silent["refresh"] and "No version published for over 15 min" in silent["text"], silent
    assert re.search("written at " + hour, silent["text"]), silent
