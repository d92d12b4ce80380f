"""Heartbeats, the trainer's fleet summary and `vrl status`, without a model or processes."""
from __future__ import annotations

import json
import math

import pytest

from helpers.status_fixtures import NOW, beat, manifest
from volunteer_rl.observe.status import (
    build_status,
    classify,
    heartbeat_lag,
    read_status,
    render,
    timeline_points,
    version_at,
)
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.credit import Credit, write_credit
from volunteer_rl.protocol.metrics import parse_lines
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import StorageError
from volunteer_rl.trainer.fleet import Counts, Fleet
from volunteer_rl.trainer.fleet_summary import (
    TIMELINE_POINTS,
    TIMELINE_SECONDS,
    FleetSummary,
    absorb_steps,
    add_point,
)
from volunteer_rl.volunteer.heartbeat import Heartbeat, Tally, heartbeat_payload

# --- classification -------------------------------------------------------------------------

@pytest.mark.parametrize("hb, state", [
    (beat(), "producing"),
    (beat(completions_per_minute=0), "idle"),
    (beat(version=None, completions_per_minute=0), "idle"),          # nothing loaded yet
    (beat(version=39), "stale-version"),                              # 42 - 39 > window 2
    (beat(version=40), "producing"),                                  # 42 - 40 = window: fine
    (beat(run_id="another-run"), "stale-version"),
    (beat(updated_at=NOW - 20), "producing"),                         # exactly 2 periods: alive
    (beat(updated_at=NOW - 20.5), "offline"),                         # more than 2 periods
    (beat(updated_at=NOW - 50, heartbeat_seconds=30), "producing"),   # its own period counts
    (beat(state="stopped"), "offline"),                               # said goodbye
    (beat(updated_at=NOW + 300), "producing"),                        # clock ahead: age 0
    (beat(updated_at="soon"), "offline"),                             # garbage: not alive
    (beat(heartbeat_seconds=1e12, updated_at=NOW - 7201), "offline"), # period clamped to 1 h
    (beat(heartbeat_seconds=True, updated_at=NOW - 59), "producing"), # not a number: 30 s
    (None, "unknown"),
])
def test_classify(hb, state):
    points = [(NOW - 3, 42)]  # v42 published 3 s ago; every heartbeat above is newer or unjudged
    assert classify(hb, NOW, "r1", 2, heartbeat_lag(hb or {}, NOW, points)) == state


# --- lag at the heartbeat's time --------------------------------------------------------------

def test_a_heartbeat_is_judged_against_the_version_of_its_own_time():
    """The issue's case: a 30 s heartbeat names v10; the trainer was at v10 then and has
    published 48 versions since. Producing, with lag 0 then and 48 now."""
    summary = {"timeline": [[NOW - 40, 8], [NOW - 31, 10], [NOW - 20, 30], [NOW - 5, 55]],
               "volunteers": {}}
    hb = beat(updated_at=NOW - 29, version=10, heartbeat_seconds=30.0)
    m = manifest(58)
    doc = build_status("/b", m, {"a": hb}, summary, [], [], NOW)
    row = doc["volunteers"][0]
    assert (row["state"], row["version_lag"], row["version_lag_now"]) == ("producing", 0, 48)
    # The same heartbeat naming v7 was 3 behind v10 at its time: stale, and nothing trained.
    doc = build_status("/b", m, {"a": {**hb, "version": 7}}, summary, [], [], NOW)
    assert doc["volunteers"][0]["state"] == "stale-version"
    # ...unless the trainer stepped on its groups within the last minute.
    summary["volunteers"]["a"] = {"last_version": 56, "last_trained_at": NOW - 10}
    doc = build_status("/b", m, {"a": {**hb, "version": 7}}, summary, [], [], NOW)
    assert doc["volunteers"][0]["state"] == "producing"
    summary["volunteers"]["a"]["last_trained_at"] = NOW - 300
    doc = build_status("/b", m, {"a": {**hb, "version": 7}}, summary, [], [], NOW)
    assert doc["volunteers"][0]["state"] == "stale-version"


def test_version_at_is_a_lower_bound_from_the_points():
    points = timeline_points([[NOW - 10, 3], [NOW - 5, 9]], NOW - 1, 12)
    assert [version_at(points, t) for t in (NOW - 11, NOW - 10, NOW - 6, NOW - 5, NOW)] == [None, 3, 3, 9, 12]
    # A heartbeat older than every point is not judged by version (its age still counts).
    assert heartbeat_lag(beat(updated_at=NOW - 11, version=0), NOW, points) is None


@pytest.mark.parametrize("timeline", [
    "not a list", [["x", 1]], [[NOW, "v3"]], [[NOW, 2.5]], [[True, 1]], [[NOW]], [[NOW, 1, 2]],
    [{"t": NOW, "v": 1}], [[float("nan"), 1]], [[NOW, 10 ** 40]], [[NOW - 1, -5]],
    [[NOW - 1, 1]] * 100_000, [[[[[NOW - 1]]]]],
])
@pytest.mark.parametrize("hb", [
    beat(), beat(updated_at=NOW + 1e9), beat(updated_at=-1e300), beat(version=-(10 ** 30)),
    beat(version=10 ** 30), beat(version=float("inf")), beat(version=True), beat(version="7"),
    beat(run_id=["r1"]), beat(updated_at=None),
])
def test_hostile_timelines_and_heartbeats_give_a_state_never_an_exception(timeline, hb):
    doc = build_status("/b", manifest(), {"a": hb}, {"timeline": timeline, "volunteers": {"a": []}},
                       [], [], NOW)
    row = doc["volunteers"][0]
    assert row["state"] in ("producing", "idle", "stale-version", "offline")
    assert row["version_lag"] is None or row["version_lag"] >= 0
    json.dumps(doc)


def test_timeline_is_bounded_thinned_and_never_ahead_of_the_trainer():
    """Five versions a second for 40 minutes: at most TIMELINE_POINTS points over at most
    TIMELINE_SECONDS, and every time inside that span reads a version the trainer had reached,
    behind it by at most one slot's worth of publishes."""
    timeline: list = []
    rate, slot = 5, TIMELINE_SECONDS / TIMELINE_POINTS
    for i in range(rate * 2400):
        add_point(timeline, NOW + i / rate, i)
    assert len(timeline) <= TIMELINE_POINTS
    assert timeline[-1][0] - timeline[0][0] <= TIMELINE_SECONDS
    points = [tuple(p) for p in timeline]
    for t in range(math.ceil(timeline[0][0]), int(NOW + 2400)):
        truth = int((t - NOW) * rate)
        assert truth - rate * slot - 1 <= version_at(points, t) <= truth


# --- the heartbeat payload -------------------------------------------------------------------

def test_rate_is_completions_of_the_last_minute():
    t = Tally(started_at=NOW - 300)
    t.generated(2, 16, NOW - 90)    # out of the window
    t.generated(4, 32, NOW - 50)
    t.generated(4, 32, NOW - 10)
    assert t.per_minute(NOW) == 64.0
    assert t.per_minute(NOW + 100) == 0.0
    assert (t.groups, t.completions) == (10, 80)


def test_rate_right_after_start_is_over_the_time_since_start():
    t = Tally(started_at=NOW - 15)
    t.generated(2, 16, NOW - 1)
    assert t.per_minute(NOW) == 16 * 60 / 15


def test_heartbeat_payload_fields():
    t = Tally(started_at=NOW - 100)
    t.generated(3, 24, NOW - 5)
    t.uploaded(3, NOW - 2)
    host = {"os": "Linux", "python": "3.11", "torch": "2.13.0", "device": "cpu", "cpus": 2}
    p = heartbeat_payload("vol-1", "running", host, t, 30.0, "r1", 7, NOW)
    assert p == {"schema_version": 2, "volunteer_id": "vol-1", "state": "running", "host": host,
                 "started_at": NOW - 100, "updated_at": NOW, "heartbeat_seconds": 30.0,
                 "run_id": "r1", "version": 7, "groups_total": 3, "completions_total": 24,
                 "completions_per_minute": 24.0, "shards_uploaded": 1, "groups_uploaded": 3,
                 "last_upload_at": NOW - 2}
    json.dumps(p)


def test_a_failing_heartbeat_warns_once_and_is_never_fatal():
    class Broken:
        def write(self, key, data):
            raise StorageError(f"{key}: access denied")

    logs = []
    hb = Heartbeat(Broken(), "vol-1", 1.0, lambda state, now: {"state": state}, logs.append)
    assert not hb.beat("running") and not hb.beat("running") and not hb.beat("stopped")
    assert len(logs) == 1 and "volunteers/vol-1.json" in logs[0] and logs[0].startswith("warning")


def test_heartbeat_thread_writes_and_the_last_one_says_stopped():
    s = open_storage("memory://hb-thread")
    hb = Heartbeat(s, "vol-1", 0.05, lambda state, now: {"state": state, "t": now}, print)
    hb.start()
    first = json.loads(s.read("volunteers/vol-1.json"))
    assert first["state"] == "running"
    hb.stop()
    assert json.loads(s.read("volunteers/vol-1.json"))["state"] == "stopped"


def test_heartbeat_keys():
    assert layout.heartbeat_key("vol-1") == "volunteers/vol-1.json"
    assert layout.parse_heartbeat_key("volunteers/vol-1.json") == "vol-1"
    for bad in ("volunteers/a/b.json", "volunteers/..json", "fleet.json", "volunteers/x.txt"):
        assert layout.parse_heartbeat_key(bad) is None
    with pytest.raises(ValueError):
        layout.heartbeat_key("../x")


# --- the trainer's summary -------------------------------------------------------------------

def step(n, sources):
    return {"kind": "step", "step": n, "version": 5, "time": NOW + n, "rollout/reward_mean": 0.5,
            "rollout/sources": sources}


def test_absorb_steps_counts_groups_and_newest_version_per_volunteer():
    vols: dict = {}
    absorb_steps(vols, parse_lines([
        step(1, {layout.shard_key(4, "a", "s1"): 5, layout.shard_key(5, "b", "s2"): 3}),
        step(2, {layout.shard_key(3, "a", "s0"): 2, "not/a/shard": 9}),
        {"kind": "eval", "version": 5}]))
    assert vols["a"] == {"groups_trained": 7, "last_version": 4, "last_trained_at": NOW + 2}
    assert vols["b"]["groups_trained"] == 3 and vols["b"]["last_version"] == 5


def test_summary_is_written_at_most_every_interval_and_carried_over_a_restart():
    s = open_storage("memory://summary")
    clock = [NOW]
    fleet = Fleet(counts={"a": Counts(3, 1)}, denied={"c": {}})
    summary = FleetSummary(s, print, interval=5.0, clock=lambda: clock[0])
    summary.after_publish(manifest(5), 10, parse_lines([step(1, {layout.shard_key(5, "a", "s1"): 4})]), fleet)
    first = json.loads(s.read(layout.FLEET))
    clock[0] += 1
    summary.after_publish(manifest(6), 11, parse_lines([
        step(2, {layout.shard_key(6, "a", "s2"): 4}),
        {"kind": "eval", "version": 6, "time": NOW, "eval/accuracy_sampled": 0.4}]), fleet)
    assert json.loads(s.read(layout.FLEET)) == first  # not due yet
    clock[0] += 5
    summary.after_publish(manifest(7), 12, [], fleet)
    doc = json.loads(s.read(layout.FLEET))
    assert doc["trainer"] == {"version": 7, "step": 12, "max_staleness": 2, "ranks": 1,
                              "stopped_at": None, "missing_bound": 1.0}
    assert doc["volunteers"]["a"] == {"accepted_shards": 3, "rejected_shards": 1, "audited_shards": 0,
                                      "groups_numbered": 0, "groups_missing": 0,
                                      "next_group_number": 0, "numbers_recent": 0, "missing_recent": 0,
                                      "held_back": False, "groups_trained": 8,
                                      "last_version": 6, "version_lag": 1,
                                      "last_trained_at": NOW + 2, "denied": False,
                                      "groups_received_recent": 0, "groups_trained_recent": 0,
                                      "useful_fraction": None}
    assert doc["volunteers"]["c"]["denied"] and doc["evals"][0]["accuracy_sampled"] == 0.4
    restarted = FleetSummary(s, print, interval=5.0, clock=lambda: clock[0])
    clock[0] += 5
    restarted.after_publish(manifest(8), 13, parse_lines([step(3, {layout.shard_key(8, "a", "s3"): 1})]),
                            fleet)
    doc = json.loads(s.read(layout.FLEET))
    assert doc["volunteers"]["a"]["groups_trained"] == 9 and doc["schema_version"] == 6
    assert doc["timeline"] == [[NOW, 5], [NOW + 6, 7], [NOW + 11, 8]]  # v6 came within a slot


# --- the status document ---------------------------------------------------------------------

def test_build_status_joins_heartbeats_summary_and_metrics():
    summary = {"updated_at": NOW - 2, "trainer": {"version": 42, "step": 80},
               "evals": [{"version": 30, "accuracy_sampled": 0.3, "accuracy_greedy": 0.4}],
               "volunteers": {"a": {"accepted_shards": 9, "rejected_shards": 1, "groups_trained": 50,
                                    "last_version": 41},
                              "old-build": {"accepted_shards": 2, "rejected_shards": 0}}}
    rows = [{"kind": "step", "step": 84, "version": 42, "rollout/reward_mean": 0.75},
            {"kind": "eval", "version": 40, "eval/accuracy_sampled": 0.35, "eval/accuracy_greedy": 0.45}]
    doc = build_status("/b", manifest(), {"a": beat(), "b": beat(updated_at=NOW - 100),
                                         "broken": {"unreadable": "bad json"}},
                       summary, ["b"], parse_lines(rows), NOW)
    by_id = {r["id"]: r for r in doc["volunteers"]}
    assert [r["id"] for r in doc["volunteers"]] == ["a", "b", "broken", "old-build"]
    assert by_id["a"]["state"] == "producing" and by_id["a"]["acceptance_rate"] == 0.9
    assert by_id["a"]["version_lag"] == 2 and by_id["a"]["version_lag_now"] == 2
    assert by_id["a"]["trainer_version_lag"] == 1
    assert by_id["b"]["state"] == "offline" and by_id["b"]["denied"]
    assert by_id["broken"]["state"] == "unknown" and by_id["broken"]["heartbeat_error"] == "bad json"
    assert by_id["old-build"]["state"] == "unknown" and by_id["old-build"]["acceptance_rate"] == 1.0
    assert doc["counts"] == {"producing": 1, "paused": 0, "idle": 0, "stale-version": 0,
                             "offline": 1, "unknown": 2}
    t = doc["trainer"]
    assert (t["version"], t["step"], t["reward_mean"]) == (42, 84, 0.75)
    assert [e["version"] for e in t["evals"]] == [30, 40]
    json.dumps(doc)
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render(doc))
    text = console.export_text()
    assert "producing" in text and "offline denied" in text and "v30 30.0%" in text


def test_read_status_from_a_bucket():
    s = open_storage("memory://status-read")
    s.write(layout.MANIFEST, manifest().to_json())
    s.write(layout.heartbeat_key("a"), json.dumps(beat()).encode())
    s.write("volunteers/notes.txt", b"ignored")
    s.write(layout.heartbeat_key("big"), b"{" + b" " * (70 << 10) + b"}")
    s.write(layout.metrics_key(42), b'{"kind": "step", "step": 3, "rollout/reward_mean": 0.5}\nnot json\n')
    doc = read_status(s, now=NOW)
    assert {r["id"]: r["state"] for r in doc["volunteers"]} == {"a": "producing", "big": "unknown"}
    assert doc["trainer"]["step"] == 3 and doc["trainer"]["reward_mean"] == 0.5


def test_status_without_a_manifest_raises_a_storage_error():
    with pytest.raises(StorageError, match="manifest.json"):
        read_status(open_storage("memory://status-empty"))


def test_missing_group_numbers_show_in_status_and_on_the_dashboard():
    """What a volunteer did not upload (fleet.json's groups_missing of groups_numbered, and
    missing_recent of numbers_recent), and that its groups are held back for it, are in `vrl
    status --json`, its table and the dashboard's fleet table."""
    from rich.console import Console

    from volunteer_rl.observe.dashboard import fleet_rows_html
    from volunteer_rl.observe.status import volunteer_table

    summary = {"volunteers": {"vol": {"groups_numbered": 40, "groups_missing": 10, "numbers_recent": 48,
                                      "missing_recent": 12, "held_back": True}}}
    status = build_status("/b", manifest(), {"vol": beat()}, summary, [], [], NOW)
    (row,) = status["volunteers"]
    assert (row["groups_missing"], row["groups_missing_rate"]) == (10, 0.25)
    assert (row["missing_recent_rate"], row["numbers_recent"], row["held_back"]) == (0.25, 48, True)
    assert "<td>25% of its last 48, held back; 25% (10) of all</td>" in fleet_rows_html(status)
    console = Console(width=120, record=True)
    console.print(volunteer_table(status, 120)[0])
    text = console.export_text()
    assert "25%" in text and "producing held" in text
    older = build_status("/b", manifest(), {"vol": beat()}, {"volunteers": {"vol": {}}}, [], [], NOW)
    assert (older["volunteers"][0]["missing_recent_rate"], older["volunteers"][0]["held_back"]) == (None, False)


# --- the trainer stopped, its ranks, the newest reward (issue 39) -----------------------------

def text_at(doc: dict, width: int) -> str:
    from rich.console import Console

    console = Console(record=True, width=width)
    console.print(render(doc))
    return console.export_text()


def test_the_trainers_last_write_says_it_stopped_and_how_many_ranks_it_ran_as():
    s = open_storage("memory://summary-stop")
    clock = [NOW]
    summary = FleetSummary(s, print, clock=lambda: clock[0], ranks=2)
    summary.after_publish(manifest(5), 10, [], Fleet())
    assert json.loads(s.read(layout.FLEET))["trainer"] == {
        "version": 5, "step": 10, "max_staleness": 2, "ranks": 2, "stopped_at": None, "missing_bound": 1.0}
    clock[0] += 1
    summary.after_publish(manifest(6), 11, [], Fleet(), final=True)  # not due, but the last
    assert json.loads(s.read(layout.FLEET))["trainer"]["stopped_at"] == NOW + 1


def test_status_says_when_the_trainer_stopped_and_its_ranks():
    from volunteer_rl.observe.status import utc_clock

    trainer = {"version": 42, "step": 84, "max_staleness": 2, "ranks": 2, "stopped_at": NOW - 1200}
    summary = {"run_id": "r1", "trainer": trainer}
    m = manifest(42)
    doc = build_status("/b", m, {}, summary, [], [], NOW)
    assert (doc["trainer"]["stopped_at"], doc["trainer"]["ranks"]) == (NOW - 1200, 2)
    text = text_at(doc, 200)
    assert f"stopped {utc_clock(NOW - 1200, NOW)} (20m ago)" in text and ", 2 ranks" in text
    # A manifest that old would be flagged OLD; the trainer's own word replaces the guess.
    old = build_status("/b", manifest(42).__class__(**{**m.__dict__, "created_at": NOW - 3600}),
                       {}, summary, [], [], NOW)
    assert old["trainer"]["manifest_old"] and "OLD" not in text_at(old, 200)
    # A version published after the stop (a restarted trainer) or another run's file: running.
    for later in (build_status("/b", manifest(43), {}, summary, [], [], NOW),
                  build_status("/b", manifest(42, run_id="r2"), {}, summary, [], [], NOW)):
        assert later["trainer"]["stopped_at"] is None and "stopped" not in text_at(later, 200)
    # One process, an older fleet.json or nonsense: no ranks said.
    for ranks in (1, None, "2", 0, -3, 2.5, 10 ** 30, True):
        doc = build_status("/b", m, {}, {"trainer": {"ranks": ranks}}, [], [], NOW)
        assert doc["trainer"]["ranks"] in (1, None) and "ranks" not in text_at(doc, 200)


def test_the_reward_is_the_newest_steps_of_metrics_and_fleet_json():
    """fleet.json can be newer than the metrics read (they go up after it): the reward shown
    is the highest step's, whichever source has it, and names that step."""
    rows = [{"kind": "step", "step": n, "version": n, "rollout/reward_mean": n / 10} for n in (3, 1, 2)]
    newer = {"last_step": {"step": 4, "version": 4, "reward_mean": 0.4}}
    doc = build_status("/b", manifest(), {}, newer, [], parse_lines(rows), NOW)
    assert (doc["trainer"]["reward_mean"], doc["trainer"]["reward_step"]) == (0.4, 4)
    older = {"last_step": {"step": 2, "version": 2, "reward_mean": 0.9}}
    doc = build_status("/b", manifest(), {}, older, [], parse_lines(rows + rows), NOW)
    assert (doc["trainer"]["reward_mean"], doc["trainer"]["reward_step"]) == (0.3, 3)
    assert [r["step"] for r in doc["trainer"]["rewards"]] == [1, 2, 3]  # each step once


# --- `vrl status` at 80 columns and piped ------------------------------------------------------

def narrow_bucket(root) -> str:
    import dataclasses
    import time

    now = time.time()  # `vrl status` judges with the real clock
    s = open_storage(str(root))
    s.write(layout.MANIFEST, dataclasses.replace(manifest(), created_at=now - 3).to_json())
    evals = [{"version": v, "accuracy_sampled": 0.3 + v / 1000, "accuracy_greedy": 0.4}
             for v in range(0, 42, 6)]
    volunteers = {"alice-laptop": {"accepted_shards": 1090, "rejected_shards": 1,
                                   "groups_trained": 109000, "groups_numbered": 200000,
                                   "groups_missing": 3, "audited_shards": 100},
                  "a-volunteer-with-a-long-id": {"accepted_shards": 2, "rejected_shards": 0}}
    balance = {"window_seconds": 60, "groups_received": 1990, "groups_trained": 1234,
               "useful_fraction": 0.62, "usable_fraction": 0.7,
               "quota": {"groups": 40, "wait_seconds": 2}}
    s.write(layout.FLEET, json.dumps({"run_id": "r1", "evals": evals, "balance": balance,
                                      "trainer": {"version": 42, "step": 84, "ranks": 2},
                                      "volunteers": volunteers}).encode())
    s.write(layout.heartbeat_key("alice-laptop"), json.dumps(beat(
        updated_at=now - 1, completions_total=109234.0, host={"device": "cuda:0 NVIDIA H100"})).encode())
    s.write(layout.heartbeat_key("a-volunteer-with-a-long-id"), json.dumps(beat(
        updated_at=now - 100, completions_total=5e6)).encode())
    long_id = "a-volunteer-with-a-very-long-id-" + "x" * 31  # 63 characters, the most but one
    write_credit(s, Credit().fold([
        {"key": layout.shard_key(40, "alice-laptop", "s"), "outcome": "trained",
         "lines": list(range(1000)), "tokens": 123456789, "time": now - 7000},
        {"key": layout.shard_key(40, long_id, "s"), "outcome": "trained",
         "lines": list(range(90)), "tokens": 4567890, "time": now - 30}], 42, now))
    return str(root)


@pytest.mark.parametrize("env", [{"COLUMNS": "80"}, {"COLUMNS": None}], ids=["80 columns", "piped"])
def test_vrl_status_at_80_columns_or_piped_shows_fewer_columns_each_whole(tmp_path, env):
    """Issue 39: every column was cut to an ellipsis (`s…`, `vers…`, `109,…`). Now the table
    drops columns (README: device first) and shows the rest whole; the lines above it break
    between their parts, and the held-out line keeps the newest evaluations that fit."""
    from typer.testing import CliRunner

    from volunteer_rl_cli.main import app

    r = CliRunner().invoke(app, ["status", "--bucket", narrow_bucket(tmp_path)], env=env)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "…" not in r.stdout and all(len(line.rstrip()) <= 80 for line in lines), r.stdout
    header = next(line for line in lines if line.startswith("volunteer ")).split()
    assert header == ["volunteer", "state", "seen", "version", "/min", "accepted", "trained",
                      "useful"], r.stdout
    alice = next(line for line in lines if line.startswith("alice-laptop ")).split()
    assert alice[:2] + alice[3:] == ["alice-laptop", "producing", "v40", "-2", "120", "100%", "of",
                                     "1091", "109,000", "-"] and alice[2].endswith("s"), r.stdout
    assert "left out at 80 columns: made, audited, missing, device (--json has every field)" in r.stdout
    (held,) = [i for i, line in enumerate(lines) if line.startswith("held-out accuracy")]
    assert lines[held].endswith("v36 33.6% (40.0% greedy)") and lines[held + 1].startswith("useful:")
    assert "2 ranks" in r.stdout
    # the credit leaderboard under the table, a long id folded, every number whole
    assert "credit as of v42: 1,090 groups (128,024,679 tokens) trained from 2 volunteers" \
        in r.stdout
    top = next(line for line in lines if line.startswith("1  alice-laptop")).split()
    assert top[2:5] == ["1,000", "123,456,789", "91.7%"], r.stdout

    wide = CliRunner().invoke(app, ["status", "--bucket", str(tmp_path)], env={"COLUMNS": "250"})
    header = next(line for line in wide.stdout.splitlines() if line.startswith("volunteer ")).split()
    assert header[-1] == "device" and len(header) == 12 and "left out" not in wide.stdout
    assert "a-volunteer-with-a-long-id" in wide.stdout and "cuda:0 NVIDIA H100" in wide.stdout
