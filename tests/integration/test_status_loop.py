"""`vrl status` against a live fleet: a trainer and two volunteers (real processes) on a folder
bucket, heartbeats every second. Both show up producing; a volunteer killed with SIGKILL is
called offline within two heartbeat periods (plus the time `vrl status` itself takes); one
stopped with SIGTERM says so in its last heartbeat. The trainer also keeps dashboard/ up, and
headless Chromium renders it."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from helpers.browser import CHROMIUM, inspect_dashboard
from helpers.vrlproc import Proc, run_vrl, wait_for
from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.observe.dashboard import PLOTS
from volunteer_rl.protocol import layout

PERIOD = 1.0


def status(bucket: Path, cwd: Path) -> tuple[dict, float]:
    """The `vrl status --json` document and how long the command took."""
    t0 = time.time()
    r = run_vrl(["status", "--bucket", str(bucket), "--json"], cwd=cwd, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), time.time() - t0


def by_id(doc: dict) -> dict[str, dict]:
    return {r["id"]: r for r in doc["volunteers"]}


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, template) -> dict:
    """The live scenario, run once for the tests that look at it: what `vrl status` said at
    each stage, and the bucket the run left behind (for the browser test). v0 is the
    template's warm-started model (conftest): no warm start of its own to wait for."""
    tmp_path = tmp_path_factory.mktemp("status-run")
    started = time.time()
    bucket = tmp_path / "bucket"
    bucket.mkdir()  # only the trainer makes a folder bucket; a volunteer may start first
    eval_csv = tmp_path / "eval20.csv"
    eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:21]))
    trainer = Proc(["trainer", "--bucket", str(bucket), "--model", str(template.model(tmp_path / "model")),
                    "--groups-per-step", "8", "--threads", "1", "--eval-every", "3",
                    "--eval-dataset", str(eval_csv), "--dashboard-every", "3",
                    "--work-dir", str(tmp_path / "tw")],
                   tmp_path / "trainer.log", tmp_path,
                   # one thread for v0's evaluation too: two OpenMP threads on a shared 2-core
                   # machine crawl whenever another process holds one of the cores
                   {"OMP_NUM_THREADS": "1"})
    vols = {vid: Proc(["volunteer", "--bucket", str(bucket), "--id", vid, "--threads", "1",
                       "--seed", str(i), "--heartbeat-seconds", str(PERIOD),
                       "--prompts-per-batch", "8", "--shard-groups", "8", "--shard-seconds", "2",
                       "--work-dir", str(tmp_path / "vw")], tmp_path / f"{vid}.log", tmp_path)
            for i, vid in enumerate(("vol-1", "vol-2"))}
    run = {"bucket": bucket, "volunteers": sorted(vols)}
    try:
        wait_for(lambda: (bucket / layout.manifest_history_key(4)).exists(), 240, "v4")
        print(f"v4 after {time.time() - started:.0f}s")

        def both_producing():
            doc, _ = status(bucket, tmp_path)
            rows = by_id(doc)
            ok = all(rows.get(v, {}).get("state") == "producing"
                     and rows[v]["completions_per_minute"] > 0
                     and rows[v]["acceptance_rate"] is not None for v in vols)
            return doc if ok else None

        run["producing"] = wait_for(both_producing, 60,
                                    "both volunteers producing, accepted by the trainer", 0.5)
        run["table"] = run_vrl(["status", "--bucket", str(bucket)], cwd=tmp_path, timeout=60)
        (tmp_path / "status.txt").write_text(run["table"].stdout)  # a real sample for the docs

        # Time one status call, then kill a volunteer as hard as possible.
        _, run["cli_seconds"] = status(bucket, tmp_path)
        vols["vol-2"].kill()
        killed = time.time()
        while True:
            doc, _ = status(bucket, tmp_path)
            if by_id(doc)["vol-2"]["state"] == "offline" or time.time() - killed > 30:
                break
        run["seen_offline"], run["after_kill"] = time.time() - killed, by_id(doc)
        print(f"offline seen after {run['seen_offline']:.2f}s; "
              f"one status call takes {run['cli_seconds']:.2f}s")
        run["vol-1 exit"] = vols["vol-1"].terminate()
        run["after_stop"] = by_id(status(bucket, tmp_path)[0])
        run["page"] = (bucket / "dashboard" / "index.html").read_text()  # --dashboard-every 3
        return run
    except AssertionError as exc:
        raise AssertionError(f"{exc}\ntrainer log:\n{trainer.text()[-3000:]}") from None
    finally:
        for p in [trainer, *vols.values()]:
            p.kill()


def test_status_sees_producers_and_a_killed_volunteer_goes_offline(live_run):
    doc = live_run["producing"]
    rows = by_id(doc)
    assert doc["trainer"]["version"] >= 4 and doc["trainer"]["step"] >= 4
    assert doc["trainer"]["evals"] and doc["trainer"]["reward_mean"] is not None
    for vid in live_run["volunteers"]:
        assert rows[vid]["heartbeat_seconds"] == PERIOD
        assert rows[vid]["host"]["device"] == "cpu" and rows[vid]["groups_trained"] > 0
    table = live_run["table"]
    assert table.returncode == 0 and "vol-1" in table.stdout and "producing" in table.stdout

    rows = live_run["after_kill"]
    assert rows["vol-2"]["state"] == "offline", rows["vol-2"]
    # The last heartbeat was at most one period old when it died: offline after 2 periods,
    # seen by the first status call that starts after that (each call takes cli_seconds).
    seen_offline, cli_seconds = live_run["seen_offline"], live_run["cli_seconds"]
    assert seen_offline <= offline_bound(cli_seconds), (seen_offline, cli_seconds)
    assert rows["vol-1"]["state"] == "producing", rows["vol-1"]
    assert rows["vol-2"]["reported_state"] == "running"  # no goodbye after SIGKILL

    assert live_run["vol-1 exit"] == 0
    rows = live_run["after_stop"]
    assert rows["vol-1"]["state"] == "offline" and rows["vol-1"]["reported_state"] == "stopped"
    assert rows["vol-1"]["shards_uploaded"] >= 1
    page = live_run["page"]
    assert "<td>vol-1</td>" in page and (live_run["bucket"] / "dashboard" / "reward.png").exists()


def offline_bound(cli_seconds: float) -> float:
    """2 periods, then at worst one call that just missed it and one that sees it, plus 1 s
    of slack for a loaded machine."""
    return 2 * PERIOD + 2 * cli_seconds + 1.0


ARTIFACTS = Path(os.environ.get("VRL_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_dashboard_renders_in_headless_chromium(live_run, tmp_path):
    """The dashboard the live run left, opened in a real browser from the bucket served as
    a static site: the fleet table lists the run's volunteers and every plot image loads.
    The screenshot is kept in test-artifacts/."""
    seen = inspect_dashboard(live_run["bucket"], tmp_path, ARTIFACTS / "dashboard.png")
    assert set(seen["volunteers"]) >= {"vol-1", "vol-2"}, seen
    assert [i["src"] for i in seen["images"]] == [f"{p}.png" for p in PLOTS], seen
    assert all(i["loaded"] for i in seen["images"]), seen
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000


def test_a_producer_with_slow_heartbeats_is_producing_however_fast_the_trainer_publishes(template, tmp_path):
    """Issue 12's case, live: a volunteer with the default 30 s heartbeat feeding a trainer that
    publishes several versions a second. By the time `vrl status` reads the heartbeat the
    trainer is far past the version it names (the old rule called it stale-version, lag 48);
    judged at the heartbeat's own time, it is producing. v0 is the template's warm-started
    model (conftest): no warm start to wait for."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()  # only the trainer makes a folder bucket; a volunteer may start first
    window = 4
    trainer = Proc(["trainer", "--bucket", str(bucket), "--model", str(template.model(tmp_path / "model")),
                    "--groups-per-step", "1", "--max-staleness", str(window), "--threads", "1",
                    # v0's evaluation on 10 rows, not the default 500: not under test here
                    "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
                    "--dashboard-every", "0", "--poll-seconds", "0.05",
                    "--work-dir", str(tmp_path / "tw")],
                   tmp_path / "trainer.log", tmp_path, {"OMP_NUM_THREADS": "1"})
    vol = Proc(["volunteer", "--bucket", str(bucket), "--id", "slow-beat", "--threads", "1",
                "--heartbeat-seconds", "30", "--prompts-per-batch", "8", "--shard-groups", "8",
                "--shard-seconds", "1", "--poll-seconds", "0.1", "--work-dir", str(tmp_path / "vw")],
               tmp_path / "vol.log", tmp_path, {"OMP_NUM_THREADS": "1"})
    try:
        def named_version():  # the first heartbeat is written before any weights are loaded
            hb = bucket / layout.heartbeat_key("slow-beat")
            return hb.exists() and json.loads(hb.read_text()).get("version") is not None
        wait_for(named_version, 180, "a heartbeat naming a version")
        seen = []
        deadline = time.time() + 75
        while time.time() < deadline:
            doc, _ = status(bucket, tmp_path)
            row = by_id(doc)["slow-beat"]
            seen.append((time.time(), doc["trainer"]["version"], row["state"],
                         row["version_lag"], row["version_lag_now"]))
            if sum(s[4] is not None and s[4] > 3 * window for s in seen) >= 3:
                break
            time.sleep(1.0)
        far_behind = [s for s in seen if s[4] is not None and s[4] > 3 * window]
        (t0, v0, *_), (t1, v1, *_) = seen[0], seen[-1]
        rate = (v1 - v0) / (t1 - t0)
        print(f"trainer published {rate:.1f} versions/s; samples (time, version, state, lag then, "
              f"lag now): {seen}")
        assert rate >= 2, seen  # several versions a second
        assert len(far_behind) >= 3, seen  # the heartbeat was long out of date when read
        assert all(s[2] == "producing" for s in seen), seen
        assert all(s[3] is not None and s[3] <= window for s in far_behind), seen
        assert json.loads((bucket / layout.FLEET).read_text())["timeline"]
    finally:
        for p in (trainer, vol):
            p.kill()
