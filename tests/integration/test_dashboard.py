"""dashboard/ in the bucket: plots and a static page from metrics and heartbeats (no model)."""
from __future__ import annotations

import json

from helpers.status_fixtures import NOW, beat, manifest  # noqa: E402
from helpers.vrlproc import run_vrl  # noqa: E402
from volunteer_rl.observe import dashboard
from volunteer_rl.observe.dashboard import (  # noqa: E402
    History,
    TrainerDashboard,
    read_history,
    staleness_counts,
    throughput_series,
    write_dashboard,
)
from volunteer_rl.protocol import layout  # noqa: E402
from volunteer_rl.protocol.metrics import parse_lines  # noqa: E402
from volunteer_rl.storage import open_storage  # noqa: E402


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

    def timed_write(storage, history):  # render + upload, taking cost["seconds"] of the clock
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
