"""A patient liar against a live `vrl trainer`: honest groups first, to earn a low audit rate,
then lying groups in one-group shards, each sent once the one before it had its outcome.

With sampled audits only (`--verify sampled`, the rule before issue 41) a lying shard is
audited at the volunteer's rate, here 1/n after n clean groups (`--audit-full-groups 1`), so
the first lies are taken unaudited and trained (about 1/rate lies per identity). With every
trained group verified (the default) the first lie that reaches a step fails its replay
before the backward pass: no lying group is trained, and the forgery denies the volunteer at
once, whatever its record.
"""
from __future__ import annotations

import json
import re

import pytest
from conftest import PICKED, TEMPLATE_VERSION

from helpers.bucket_objects import FolderBucket, as_dicts, committed, gz_lines, key
from helpers.honest_groups import forged
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.protocol import layout

V = TEMPLATE_VERSION
LIES = 6
"""Lying groups the liar has ready; it stops sending once it is denied."""
STEP = re.compile(r"^(\[rank 0\] )?step \d+ v\d+ reward ", re.M)


def trained(bucket) -> set[tuple[str, int]]:
    """(shard key, line) of every group the committed ledger records say was trained."""
    out = set()
    for v in committed(bucket.path):
        path = bucket.path / layout.ledger_key(v)
        for rec in map(json.loads, path.read_text().splitlines() if path.exists() else []):
            if rec["outcome"] == "trained":
                out.update((rec["key"], line) for line in rec["lines"])
    return out


@pytest.mark.parametrize("ranks", [1, 2], ids=["1-process", "2-ranks"])
def test_a_patient_liar_gets_no_lying_group_trained_and_is_denied_at_its_first_forgery(template, tmp_path, ranks):
    """Under ranks each rank replays its share of a batch and they drop the same groups: each
    lying shard is then an honest group and a lie, a batch of 2 whose lie is the second
    rank's to replay, and the first rank must not step on it either."""
    groups = template.groups("patient", V)
    lies = [g for g in (forged(template, g) for g in groups[-3 * LIES:]) if g is not None][-LIES:]
    lie_seqs = {g.seq for g in lies}
    honest = [g for g in groups if g.seq < min(lie_seqs)]
    if ranks > 1:  # three doses at most (it is denied at the first): an honest group each
        lies = lies[:3]
        honest, spare = honest[:-3], honest[-3:]
    else:
        spare = []
    honest = honest[:len(honest) - len(honest) % ranks]
    assert len(lies) >= 3 and len(honest) >= 12, (len(lies), len(honest))
    bucket = FolderBucket(template.copy(tmp_path / "bucket"))
    for i in range(0, len(honest), 6):  # its record: shards of 6 honest groups
        bucket.put(key("patient", f"a{i:03d}"), gz_lines(as_dicts(honest[i:i + 6], "patient")))
    steps = len(honest) // ranks + 1  # its honest groups, then one batch of a bystander's
    proc = Proc(["trainer", *bucket.args, "--groups-per-step", str(ranks), "--publish-every", "100000",
                 *PICKED, "--max-steps", str(steps),
                 "--audit-full-groups", "1", "--audit-share", "1", "--eval-every", "0",
                 "--eval-dataset", str(template.eval_csv), "--threads", "1",
                 "--poll-seconds", "0.05", "--log-shards", "--work-dir", str(tmp_path / "work"),
                 "--signing-key", str(template.key)], tmp_path / "trainer.log", tmp_path,
                env={"OMP_NUM_THREADS": "1"}, ranks=ranks if ranks > 1 else 0)
    try:
        # every honest group trained before the first lie: a lie verified earlier denies the
        # volunteer and withdraws the honest groups still waiting (as it should), and then the
        # step count the trainer stops at is never reached
        wait_for(lambda: len(STEP.findall(proc.text())) >= len(honest) // ranks, 300,
                 "the honest groups trained")
        sent = []
        for n, lie in enumerate(lies):
            if "denied volunteer patient" in proc.text():
                break
            dose = [*spare[n:n + 1], lie]  # the lie last: under 2 ranks the second rank's
            k = bucket.put(key("patient", f"b{n:03d}"), gz_lines(as_dicts(dose, "patient")))
            sent.append(k)
            # its outcome: trained (the next step took it), or rejected
            wait_for(lambda: f"rejected {k}" in proc.text() or
                     len(STEP.findall(proc.text())) > len(honest) // ranks + n, 300,
                     f"an outcome for {k}")
        wait_for(lambda: "denied volunteer patient" in proc.text(), 120, "the liar denied")
        # A bystander's honest batch: the last step, and the trainer publishes and exits.
        bucket.put(key("bystander", "s"), gz_lines(as_dicts(template.groups("bystander", V)[:ranks], "bystander")))
        assert proc.wait(300) == 0, proc.text()[-3000:]
    finally:
        proc.kill()
    log = proc.text()
    done = trained(bucket)
    assert not [k for k in sent if (k, ranks - 1) in done], (sent, log[-3000:])
    assert sum(1 for (k, _) in done if "/patient/a" in k) == len(honest), log[-3000:]
    quarantined = json.loads(bucket.read(layout.quarantine_key(sent[0])))
    assert quarantined["reason"] == "replay_mismatch", quarantined
    assert len(sent) == 1, sent  # denied at its first forgery: the rest never sent
    denylist = json.loads(bucket.read(layout.DENYLIST))["volunteers"]
    assert "patient" in denylist and "forged" in denylist["patient"]["reason"], denylist


def test_a_lie_of_the_version_in_hand_fails_in_the_steps_own_forward_and_is_never_trained(
        template, tmp_path):
    """The trainer holds v(V) and has taken no step since: a group of V is replayed by the
    step's own forward (trainer.step.StepReplay), not before the step. A liar's first shard,
    one honest group, is audited as a newcomer's; its second, one lying group, is past
    `--audit-full-groups 1` and taken unaudited. The batch of the two fails inside the step:
    no update, the lie's shard rejected, the liar denied. A bystander's batch is the step."""
    groups = template.groups("quick", V)
    lie = next(f for f in (forged(template, g) for g in groups[1:]) if f is not None)
    bucket = FolderBucket(template.copy(tmp_path / "bucket"))
    proc = Proc(["trainer", *bucket.args, "--groups-per-step", "2", *PICKED, "--max-steps", "1",
                 "--audit-full-groups", "1", "--eval-every", "0",
                 "--eval-dataset", str(template.eval_csv), "--threads", "1",
                 "--poll-seconds", "0.05", "--log-shards", "--work-dir", str(tmp_path / "work"),
                 "--signing-key", str(template.key)], tmp_path / "trainer.log", tmp_path,
                env={"OMP_NUM_THREADS": "1"})
    try:
        first = bucket.put(key("quick", "a"), gz_lines(as_dicts(groups[:1], "quick")))
        wait_for(lambda: f"took {first}" in proc.text(), 300, "the honest shard taken")
        sent = bucket.put(key("quick", "b"), gz_lines(as_dicts([lie], "quick")))
        wait_for(lambda: "denied volunteer quick" in proc.text() or STEP.search(proc.text()),
                 300, "the lie's outcome")
        bucket.put(key("bystander", "s"),
                   gz_lines(as_dicts(template.groups("bystander", V)[:2], "bystander")))
        assert proc.wait(300) == 0, proc.text()[-3000:]
    finally:
        proc.kill()
    log = proc.text()
    assert f"took {sent}" in log, log[-3000:]  # taken unaudited: the step found it
    done = trained(bucket)
    assert (sent, 0) not in done and (first, 0) not in done, (done, log[-3000:])
    assert {k for k, _ in done} == {key("bystander", "s")}, done
    quarantined = json.loads(bucket.read(layout.quarantine_key(sent)))
    assert quarantined["reason"] == "replay_mismatch", quarantined
    denylist = json.loads(bucket.read(layout.DENYLIST))["volunteers"]
    assert "forged" in denylist["quick"]["reason"], denylist
