"""A due publish waits while the version it would push out of the window has shards the intake
listed and has not read (trainer.loop.DRAIN_STEPS, Ingest.unread_low): shards uploaded in
time are read, if only as stale, and their numbers are not counted missing.

A real trainer resumed on a copy of the template's bucket at v(V), run by its own loop. One
volunteer has 60 one-group shards of V waiting, more than three polls read
(MAX_SHARDS_PER_VOLUNTEER_POLL, 16, per volunteer per poll); another's groups make a step at
every poll, and a step publishes. Without the hold the third publish pushes V out of the
window with 12 of the 60 never read.

Every shard is read at the poll's cap only if no intake replay waits on the audit budget (a
share of wall time): the records below skip the sampled audits, and audit_cover_floor 0 the
draws of never-trained groups (at 0.5, 24 of the 60 were drawn, and a busy CI machine left 23
shards unread when the fourth step ended the run)."""
from __future__ import annotations

from conftest import TEMPLATE_VERSION

from helpers.bucket_objects import as_dicts, gz_lines, key
from volunteer_rl.config import TrainerConfig
from volunteer_rl.trainer.fleet import Counts
from volunteer_rl.trainer.listing import MAX_SHARDS_PER_VOLUNTEER_POLL
from volunteer_rl.trainer.loop import Trainer

V = TEMPLATE_VERSION
SHARDS = 60
TRUSTED = 10**6


def test_a_publish_waits_until_the_shards_of_the_version_it_pushes_out_are_read(template, tmp_path):
    assert 3 * MAX_SHARDS_PER_VOLUNTEER_POLL < SHARDS <= 4 * MAX_SHARDS_PER_VOLUNTEER_POLL
    bucket = template.copy(tmp_path / "bucket")
    cfg = TrainerConfig(bucket=str(bucket), eval_every=0, dashboard_every=0,
                        eval_dataset=str(template.eval_csv), work_dir=str(tmp_path / "work"),
                        signing_key=str(template.key), audit_floor=1e-9, audit_cover_floor=0.0,
                        groups_per_step=4,
                        missing_bound=1.0, max_staleness=2, max_steps=4, max_seconds=90,
                        poll_seconds=0.05)
    t = Trainer(cfg, log=lambda m: None)
    t.start()
    assert t.version == V
    for v in ("slow", "steady"):  # records that skip intake audits: the poll reads at its cap
        t.fleet.counts[v] = Counts(accepted=TRUSTED, clean=TRUSTED, accepted_groups=TRUSTED)
    slow = [t.storage.write(k, gz_lines(as_dicts([g], "slow"))) or k
            for n, g in enumerate(template.every_group("slow")[:SHARDS])
            for k in [key("slow", f"s{n:03d}")]]
    steady = template.groups("steady")[:32]
    for n in range(0, len(steady), 4):
        t.storage.write(key("steady", f"t{n:03d}"), gz_lines(as_dicts(steady[n:n + 4], "steady")))
    t.run()
    read = t.fleet.counts["slow"].accepted - TRUSTED  # shards taken in
    assert read == len(slow), f"{len(slow) - read} of the slow volunteer's shards never read"
    assert t.steps == 4  # (without the hold the loop runs out of fresh groups at 3)
