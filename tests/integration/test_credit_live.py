"""Credit in a live run: `vrl volunteers credit --csv`, a real process, says what the committed
ledgers say, through a crash and a resume, with a denied volunteer earning nothing.

Six shards of four real groups each (conftest.template) wait in the bucket, one from each of
vol-0 ... vol-5; vol-5 is on the denylist before the trainer starts. A trainer (a real
process) is killed with SIGKILL between the ledger and credit objects of its second version
and that version's manifest (VRL_CRASH_AT before_manifest:2), so the bucket holds a credit
object that was never committed; a second trainer resumes and trains the rest. The CSV must
then equal, volunteer by volunteer, the sums over the `trained` records of the committed
versions' ledger objects: groups (their lines), tokens, and first and last times. A resume
that carried on from the uncommitted object, or summed every ledger object, would count the
groups of the crashed version twice."""
from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

from conftest import PICKED

from helpers.bucket_objects import committed, honest_shards, ledger_sums, trained_lines
from helpers.vrlproc import Proc, run_vrl, wait_for
from volunteer_rl.observe.leaderboard import COLUMNS, iso
from volunteer_rl.protocol import layout

SHARDS = 6
DENIED = "vol-5"


def trainer(bucket: Path, root: Path, name: str, eval_csv: Path, key: Path,
            crash: str | None = None) -> Proc:
    return Proc(["trainer", *PICKED, "--bucket", str(bucket), "--groups-per-step", "4",
                 "--max-staleness", "50", "--eval-every", "0", "--eval-dataset", str(eval_csv),
                 "--threads", "1", "--poll-seconds", "0.05", "--work-dir", str(root / "work"),
                 "--signing-key", str(key), "--dashboard-every", "0"],
                root / f"{name}.log", root, {"VRL_CRASH_AT": crash} if crash else {})


def test_credit_csv_matches_the_committed_ledgers_through_a_crash_and_a_resume(template, tmp_path):
    bucket = template.copy(tmp_path / "bucket")
    keys = honest_shards(template, bucket, SHARDS)
    (bucket / layout.DENYLIST).write_text(json.dumps({"schema_version": 1, "volunteers": {
        DENIED: {"since": time.time(), "by": "operator", "reason": "test"}}}))
    expected = {(k, line) for k in keys if f"/{DENIED}/" not in k for line in range(4)}

    first = trainer(bucket, tmp_path, "crashed", template.eval_csv, template.key,
                    "before_manifest:2")
    assert first.wait(180) == -9 and "crash point before_manifest" in first.text(), first.text()[-2000:]
    done = committed(bucket)
    debris = [int(p.stem[1:]) for p in (bucket / layout.CREDIT).glob("v*.json")
              if int(p.stem[1:]) not in done]
    assert debris, "the crash should leave a credit object of a version never committed"
    assert json.loads((bucket / layout.credit_key(debris[0])).read_text())["total_groups"] > 0

    second = trainer(bucket, tmp_path, "resumed", template.eval_csv, template.key)
    try:
        wait_for(lambda: set(trained_lines(bucket)) == expected, 180, "every allowed group trained")
        assert second.terminate() == 0, second.text()[-2000:]
    finally:
        second.kill()
    assert "resuming" in second.text() and "credit summed" not in second.text()

    out = run_vrl(["volunteers", "credit", "--csv", "--bucket", str(bucket)], cwd=tmp_path,
                  timeout=120)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert tuple(csv.reader(io.StringIO(out.stdout)).__next__()) == COLUMNS
    sums = ledger_sums(bucket, committed(bucket))
    got = {r["volunteer"]: r for r in rows}
    assert set(got) == set(sums) == {f"vol-{i}" for i in range(SHARDS - 1)}  # vol-5 earns nothing
    total = sum(s["groups"] for s in sums.values())
    assert total == len(expected) == 4 * (SHARDS - 1)
    assert sum(int(r["groups_trained"]) for r in rows) == total  # none counted twice
    for vid, s in sums.items():
        r = got[vid]
        assert (int(r["groups_trained"]), int(r["tokens_trained"])) == (s["groups"], s["tokens"]), vid
        assert s["tokens"] > 0 and float(r["share"]) == round(s["groups"] / total, 6)
        assert (r["first_seen"], r["last_seen"]) == (iso(min(s["times"])), iso(max(s["times"])))

    status = run_vrl(["status", "--json", "--bucket", str(bucket)], cwd=tmp_path, timeout=120)
    doc = json.loads(status.stdout)["credit"]
    assert doc["total_groups"] == total and doc["total_tokens"] == sum(s["tokens"] for s in sums.values())
    assert {r["volunteer"] for r in doc["leaders"]} == set(sums)
    table = run_vrl(["volunteers", "credit", "--bucket", str(bucket)], cwd=tmp_path, timeout=120)
    assert table.returncode == 0 and f"{total} groups" in table.stdout and "vol-0" in table.stdout
