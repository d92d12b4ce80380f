"""Issue 41, point 7: an honest `vrl volunteer` has no group number counted missing, through
a stop of its own mid-batch and a restart, and a trainer killed with SIGKILL and resumed
while the volunteer samples and uploads the numbers it was granted before (a trainer that is
down grants none, so that is all the backlog a resumed trainer finds).

A live `vrl trainer` (resuming the template's run) and one `vrl volunteer`, a folder bucket.
No quota (--quota-headroom 0), so the volunteer samples without pause: a SIGTERM lands while
it samples a batch, whose numbers are reserved. Steps of 32 groups, one batch each, so the
trainer publishes no faster than the volunteer samples and no group goes stale in flight.
The volunteer's numbers are all closed once fleet.json counts as many as it had reserved
when the trainer came back; none of them may be missing.
"""
from __future__ import annotations

import json
import re

from helpers.vrlproc import Proc, wait_for
from volunteer_rl.protocol import layout

VID = "honest"


def granted_end(bucket) -> int:
    """One past the last number the trainer granted to the volunteer (its grant object)."""
    from volunteer_rl.protocol.grants import decode_grants, grants_key

    _, grants = decode_grants((bucket / grants_key(VID)).read_bytes(), grants_key(VID))
    return max(g.end for g in grants)


def fleet_row(bucket) -> dict:
    try:
        return json.loads((bucket / layout.FLEET).read_text())["volunteers"].get(VID, {})
    except (OSError, ValueError, KeyError):
        return {}


def reserved(work) -> int:
    """The first group number the volunteer has not sampled, as saved in its work dir
    (volunteer.numbering)."""
    return json.loads((work / VID / "group-numbers.json").read_text())["next"]


def test_an_honest_volunteer_misses_no_number_through_stops_and_trainer_restarts(template, tmp_path):
    bucket = template.copy(tmp_path / "bucket")
    work = tmp_path / "vw"
    targs = ["trainer", "--bucket", str(bucket), "--groups-per-step", "32", "--quota-headroom", "0",
             "--audit-tolerance", "0", "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
             "--threads", "1", "--poll-seconds", "0.05", "--work-dir", str(tmp_path / "tw"),
             "--signing-key", str(template.key)]
    vargs = ["volunteer", "--bucket", str(bucket), "--id", VID, "--trust-key", f"{template.key}.pub",
             "--threads", "1", "--prompts-per-batch", "32", "--shard-groups", "1",
             "--poll-seconds", "0.2", "--heartbeat-seconds", "1", "--work-dir", str(work)]
    procs = [Proc(targs, tmp_path / "trainer1.log", tmp_path),
             Proc(vargs, tmp_path / "volunteer1.log", tmp_path)]
    trainer, volunteer = procs
    try:
        # 1. The volunteer stopped while it samples, and started again.
        wait_for(lambda: fleet_row(bucket).get("accepted_shards", 0) >= 16, 240, "shards taken")
        assert volunteer.terminate() == 0, volunteer.text()[-3000:]
        first = volunteer.text()
        volunteer = Proc(vargs, tmp_path / "volunteer2.log", tmp_path)
        procs.append(volunteer)
        wait_for(lambda: re.search(r"^now on v\d+ ", volunteer.text(), re.M), 120, "the restart")

        # 2. The trainer killed; the volunteer goes on with the version it holds.
        trainer.kill()
        # A trainer that is down grants nothing: the volunteer samples and uploads what it
        # was granted (the batch in hand and the one granted ahead), then waits.
        end = granted_end(bucket)
        wait_for(lambda: reserved(work) >= end, 240, f"the numbers granted up to {end} sampled")
        trainer = Proc(targs, tmp_path / "trainer2.log", tmp_path)
        procs.append(trainer)
        wait_for(lambda: "resuming" in trainer.text(), 120, "the trainer resumed")
        goal = reserved(work)

        # 3. Every number reserved by then is closed (its version left the window).
        wait_for(lambda: fleet_row(bucket).get("groups_numbered", 0) >= goal, 240,
                 f"numbers up to {goal} closed")
        assert trainer.terminate() == 0, trainer.text()[-3000:]
        assert volunteer.terminate() == 0, volunteer.text()[-3000:]
    finally:
        for p in procs:
            p.kill()
    row = fleet_row(bucket)
    assert row["groups_missing"] == 0, (row, goal)
    assert row["rejected_shards"] == 0, row
    assert "finishing the batches granted, uploading them and stopping" in first, first[-2000:]



def test_a_volunteer_slower_than_the_versions_misses_no_number(template, tmp_path):
    """The trainer publishes a version per step of 2 groups, fed by a quick volunteer that
    samples 4 groups at a time; the slow one samples 16 at a time, granted together under the
    newest version. About 4 publishes pass while it samples them, and a window of 3 versions
    would have pushed their version out before they were uploaded: without the publish held
    for the grant, they count as missing."""
    bucket = template.copy(tmp_path / "bucket")
    targs = ["trainer", "--bucket", str(bucket), "--groups-per-step", "2", "--quota-headroom", "0",
             "--audit-tolerance", "0", "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
             "--dashboard-every", "0", "--threads", "1", "--poll-seconds", "0.05",
             "--work-dir", str(tmp_path / "tw"), "--signing-key", str(template.key)]

    def volunteer(vid: str, batch: int) -> list[str]:
        return ["volunteer", "--bucket", str(bucket), "--id", vid, "--trust-key", f"{template.key}.pub",
                "--threads", "1", "--prompts-per-batch", str(batch), "--shard-groups", str(batch),
                "--shard-seconds", "1", "--poll-seconds", "0.05", "--heartbeat-seconds", "1",
                "--work-dir", str(tmp_path / "vw")]

    procs = [Proc(targs, tmp_path / "trainer.log", tmp_path),
             Proc(volunteer("quick", 4), tmp_path / "quick.log", tmp_path),
             Proc(volunteer(VID, 16), tmp_path / "slow.log", tmp_path)]
    try:
        # 128 of the slow volunteer's numbers closed: 8 grants.
        wait_for(lambda: fleet_row(bucket).get("groups_numbered", 0) >= 128, 300, "128 numbers closed")
        for p in procs:
            assert p.terminate() == 0, p.text()[-3000:]
    finally:
        for p in procs:
            p.kill()
    fleet = json.loads((bucket / layout.FLEET).read_text())["volunteers"]
    for vid in ("quick", VID):
        assert fleet[vid]["groups_missing"] == 0, fleet
        assert fleet[vid]["rejected_shards"] == 0, fleet
