"""Every group a step trains is replayed first (trainer.verify, roles.Single.verified): a real
trainer resumed on a copy of the template's bucket, shards of real groups with reward
variance taken by its intake, and the batch verified as the loop verifies it.

The volunteers here are trusted (a record of many clean groups and an audit floor near 0),
so the intake's sampled audits let their shards through unreplayed: what keeps a lie out of
the step is the verification alone."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import TEMPLATE_VERSION

from helpers.bucket_objects import as_dicts, gz_lines, key
from helpers.honest_groups import covering, forged
from volunteer_rl.config import TrainerConfig
from volunteer_rl.protocol import layout
from volunteer_rl.trainer.fleet import Counts
from volunteer_rl.trainer.groups import IngestStats
from volunteer_rl.trainer.loop import Trainer

V = TEMPLATE_VERSION
TRUSTED = 10**6
"""Clean groups on a trusted volunteer's record: at the floor below, its shards go unaudited."""


def trainer_on(template, root, **settings) -> Trainer:
    bucket = template.copy(root / "bucket")
    cfg = TrainerConfig(**{"bucket": str(bucket), "eval_every": 0, "dashboard_every": 0,
                           "eval_dataset": str(template.eval_csv), "work_dir": str(root / "work"),
                           "signing_key": str(template.key), "audit_floor": 1e-9,
                           "groups_per_step": 4, "missing_bound": 1.0,  # conftest.PICKED
                           # a trusted volunteer's shards pass the intake unreplayed, so that
                           # each test sees what the step's replay does
                           "audit_cover_floor": 0.0, **settings})
    t = Trainer(cfg, log=lambda m: None)
    t.start()
    assert t.version == V
    return t


def trust(t: Trainer, *volunteers: str) -> None:
    for v in volunteers:
        t.fleet.counts[v] = Counts(accepted=TRUSTED, clean=TRUSTED, accepted_groups=TRUSTED)


def first_forgery(template, groups):
    return next(f for f in (forged(template, g) for g in groups) if f is not None)


def put(t: Trainer, volunteer: str, name: str, groups) -> str:
    k = key(volunteer, name)
    t.storage.write(k, gz_lines(as_dicts(groups, volunteer)))
    return k


def batch_of(t: Trainer, stats: IngestStats):
    """One intake round as the loop runs it: (groups left, the batch)."""
    buffer, batch, _, _ = t.role.intake_round([], stats, t.window())
    assert batch is not None and stats.audit.audited == 0, stats
    return buffer, batch


@pytest.fixture
def trainer(template, tmp_path):
    return trainer_on(template, tmp_path)


def test_a_forged_group_in_a_batch_is_dropped_before_the_step_and_denies_its_volunteer(template, trainer):
    t = trainer
    trust(t, "honest", "liar")
    honest = template.groups("honest")[:3]
    lies = template.groups("liar")
    lie = first_forgery(template, lies)
    put(t, "honest", "h1", honest)
    later = [g for g in lies if g.seq > lie.seq]
    liar_key = put(t, "liar", "l1", [lie, *later[:2]])
    put(t, "liar", "l2", later[2:4])  # honest groups: dropped all the same once it is denied
    stats = IngestStats()
    buffer, batch = batch_of(t, stats)
    assert any(g.key == liar_key and g.seq == lie.seq for g in batch), batch
    out, passed = t.role.verified(batch, stats)
    assert out is None  # no step on this batch
    assert stats.rejected == {"replay_mismatch": 1}, stats.rejected
    assert stats.audit.verify_failed == 1 and stats.audit.verified == len(batch), stats.audit
    assert json.loads(t.storage.read(layout.quarantine_key(liar_key)))["reason"] == "replay_mismatch"
    assert t.fleet.is_denied("liar") and "forged" in t.fleet.denied["liar"]["reason"]
    assert [g.seq for g in passed] == [g.seq for g in batch if g.seq != lie.seq or g.key != liar_key]
    assert all(g.verified for g in passed)
    # The next round: the liar's groups (those that passed too) are never handed out again,
    # the honest ones are, verified already (not replayed twice), and they are trained.
    stats = IngestStats()
    left = t.ingest.poll(t.window(), stats, passed + buffer)
    assert {g.volunteer_id for g in left} == {"honest"}, left
    assert key("liar", "l2") in {g.key for g in buffer}  # it was waiting: now it is not
    assert all(g.verified for g in left if g.key == key("honest", "h1"))


def test_a_batch_of_honest_trusted_groups_is_stepped_and_replayed_once(template, trainer):
    t = trainer
    trust(t, "steady")
    put(t, "steady", "s1", template.groups("steady")[:4])
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    out, passed = t.role.verified(batch, stats)
    assert out is batch and passed == [] and stats.audit.verified == 4, stats.audit
    assert all(g.verified for g in batch)
    again = IngestStats()
    assert t.role.verified(batch, again)[0] is batch and again.audit.verified == 0
    assert t.learner.step(batch, t.prompt_ids, t.version).applied


def test_groups_whose_versions_weights_are_not_held_are_withdrawn_and_charged_to_nobody(template, trainer):
    t = trainer
    trust(t, "unlucky")
    k = put(t, "unlucky", "u1", template.groups("unlucky")[:4])
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    del t.held.window.versions[V]  # as after a resume that could not read v2's checkpoint
    t.held.window.loaded = None
    out, passed = t.role.verified(batch, stats)
    assert out is None and passed == [] and not stats.rejected, stats.rejected
    assert not t.fleet.is_denied("unlucky") and t.fleet.counts["unlucky"].rejected == 0
    assert k in t.ingest.withdrawn


def test_with_verify_sampled_the_batch_goes_to_the_step_unreplayed(template, tmp_path):
    """--verify sampled: the intake's audits alone decide (the lie here is taken unaudited)."""
    t = trainer_on(template, tmp_path, verify="sampled")
    trust(t, "liar")
    lies = template.groups("liar")
    put(t, "liar", "l1", [first_forgery(template, lies), *lies[-3:]])
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    assert t.role.verified(batch, stats) == (batch, []) and stats.audit.verified == 0


def test_a_forgery_found_by_an_intake_audit_denies_at_once(template, trainer):
    """A new volunteer's shards are all audited; one replay_mismatch is enough to deny it
    (--deny-after 5 counts every other kind of rejection)."""
    t = trainer
    lies = template.groups("newcomer")
    k = put(t, "newcomer", "n1", [first_forgery(template, lies)])
    stats = IngestStats()
    t.ingest.poll(t.window(), stats)
    assert stats.rejected == {"replay_mismatch": 1} and t.fleet.counts["newcomer"].rejected == 1
    assert t.fleet.is_denied("newcomer"), t.fleet.denied
    denylist = json.loads(t.storage.read(layout.DENYLIST))["volunteers"]
    assert k in denylist["newcomer"]["reason"]


def test_a_forgers_groups_that_passed_an_audit_are_never_trained_either(template, tmp_path):
    """Denied for a forgery, a volunteer loses every group not trained yet, the ones an intake
    audit replayed and passed included (its first shard, audited as a newcomer's)."""
    t = trainer_on(template, tmp_path, groups_per_step=6)
    groups = template.groups("farmer")
    earned = put(t, "farmer", "f0", groups[:2])
    stats = IngestStats()
    buffer, batch, _, _ = t.role.intake_round([], stats, t.window())
    assert batch is None and stats.audit.by_volunteer == {"farmer": 1}, stats.audit
    assert all(g.verified for g in buffer)
    trust(t, "farmer", "honest")
    put(t, "honest", "h1", template.groups("honest")[:3])
    lie = first_forgery(template, groups[2:])
    put(t, "farmer", "f1", [lie])
    stats = IngestStats()
    buffer, batch, _, _ = t.role.intake_round(buffer, stats, t.window())
    assert [g.key for g in batch].count(earned) == 2 and lie.seq in [g.seq for g in batch]
    out, passed = t.role.verified(batch, stats)
    assert out is None and t.fleet.is_denied("farmer") and stats.audit.verified == 4, stats.audit
    assert earned not in t.ingest.withdrawn  # audited, so not withdrawn as unaudited shards are
    left = t.ingest.poll(t.window(), IngestStats(), passed + buffer)
    assert {g.volunteer_id for g in left} == {"honest"}, [g.key for g in left]


def step_replaying(t: Trainer, batch, stats: IngestStats):
    """The loop's step with no step since the publish: the version in hand's groups are left
    by `verified` to the step's own forward. (the step's result, its StepReplay, the groups
    to wait in front of the buffer)."""
    check = t.role.step_replay(unpublished=0)
    assert check is not None and check.version == V
    assert t.role.verified(batch, stats, check.version) == (batch, [])
    assert stats.audit.verified == 0  # nothing replayed before the step
    result = t.learner.step(batch, t.prompt_ids, t.version, check)
    return result, check, t.role.replayed_in_step(batch, check, stats)


def test_a_forgery_of_the_version_in_hand_is_caught_by_the_steps_own_forward_before_any_update(
        template, trainer):
    t = trainer
    trust(t, "honest", "liar")
    lies = template.groups("liar")
    lie = first_forgery(template, lies)
    put(t, "honest", "h1", template.groups("honest")[:3])
    liar_key = put(t, "liar", "l1", [lie])
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    at = next(i for i, g in enumerate(batch) if g.key == liar_key)
    before = {k: v.clone() for k, v in t.learner.policy.model.state_dict().items()}
    result, check, passed = step_replaying(t, batch, stats)
    assert not result.applied and list(check.problems) == [at], check.problems
    assert check.problems[at][0] == "replay_mismatch"
    after = t.learner.policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # no update, no moments
    assert not t.learner.opt.state
    assert stats.rejected == {"replay_mismatch": 1}, stats.rejected
    assert stats.audit.verify_failed == 1 and stats.audit.verified == len(batch), stats.audit
    quarantined = json.loads(t.storage.read(layout.quarantine_key(liar_key)))
    assert quarantined["reason"] == "replay_mismatch"
    assert t.fleet.is_denied("liar") and "forged" in t.fleet.denied["liar"]["reason"]
    assert [g.key for g in passed] == [key("honest", "h1")] * 3 and all(g.verified for g in passed)


def test_honest_groups_of_the_version_in_hand_are_replayed_by_the_step_itself(template, trainer):
    t = trainer
    trust(t, "steady")
    put(t, "steady", "s1", template.groups("steady")[:4])
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    result, check, passed = step_replaying(t, batch, stats)
    assert result.applied and passed == [] and not check.problems
    assert check.replayed == 4 and stats.audit.verified == 4 and stats.audit.verify_seconds > 0
    assert all(g.verified for g in batch)
    # after a step the weights are no version's: every group is replayed before the next one
    assert t.role.step_replay(unpublished=1) is None


def test_a_made_up_group_of_equal_rewards_is_drawn_at_its_volunteers_rate_and_denies_it(
        template, trainer):
    """A group whose rewards are all equal is never trained, so no step replays it, yet it
    makes its number count as received: made up, it would cover a number its volunteer kept
    back. With every trained group verified, a volunteer past `--audit-full-groups` clean
    groups has no shard drawn whole, but such groups are still drawn at the rate sampled
    audits use, never below COVER_FLOOR (Auditor.spot): 10 / 10 here, so surely."""
    t = trainer
    for v in ("coverer", "steady"):
        t.fleet.counts[v] = Counts(accepted=1, clean=10, accepted_groups=10)
    cover = next(c for c in map(lambda g: covering(template, g), template.every_group("coverer"))
                 if c is not None)
    usable = [g for g in template.groups("coverer") if g.seq > cover.seq][:3]
    k = put(t, "coverer", "c1", [cover, *usable])
    stats = IngestStats()
    assert t.ingest.poll(t.window(), stats) == []
    assert stats.rejected == {"replay_mismatch": 1}, stats.rejected
    assert json.loads(t.storage.read(layout.quarantine_key(k)))["reason"] == "replay_mismatch"
    assert t.fleet.is_denied("coverer") and "forged" in t.fleet.denied["coverer"]["reason"]
    # An honest shard with equal-reward groups: only those are replayed at intake, and taken;
    # its usable groups wait for the replay before their step.
    every = template.every_group("steady")
    varied = [i for i, g in enumerate(every) if len({c.reward for c in g.completions}) > 1]
    equal = [i for i, g in enumerate(every) if len({c.reward for c in g.completions}) == 1]
    # numbers 0, 1, ... up to the later of its second group with variance and its first
    # without (what the numbers draw depends on the template's run id)
    honest = every[:max(varied[1], equal[0]) + 1]
    put(t, "steady", "s1", honest)
    stats = IngestStats()
    taken = t.ingest.poll(t.window(), stats)
    assert not stats.rejected and stats.audit.audited == 1, (stats.rejected, stats.audit)
    assert taken and not any(g.verified for g in taken)


def test_a_trusted_volunteers_made_up_group_of_equal_rewards_is_drawn_at_the_cover_floor(
        template, tmp_path):
    """Past the audit rate's floor (a trusted volunteer: 10 / 10^6 clean groups, and
    --audit-floor 1e-9), groups no step replays are still drawn at --audit-cover-floor: at 1
    every one is replayed at intake, so a cover denies its volunteer in its first shard, and
    the honest groups beside it in the shard are never trained."""
    t = trainer_on(template, tmp_path, audit_cover_floor=1.0)
    trust(t, "coverer")
    cover = next(c for c in map(lambda g: covering(template, g), template.every_group("coverer"))
                 if c is not None)
    usable = [g for g in template.groups("coverer") if g.seq > cover.seq][:3]
    k = put(t, "coverer", "c1", [*usable, cover])
    stats = IngestStats()
    assert t.ingest.poll(t.window(), stats) == []
    assert stats.rejected == {"replay_mismatch": 1} and stats.audit.audited == 1, stats
    assert json.loads(t.storage.read(layout.quarantine_key(k)))["reason"] == "replay_mismatch"
    assert t.fleet.is_denied("coverer") and "forged" in t.fleet.denied["coverer"]["reason"]


def test_after_a_failure_in_the_step_the_groups_it_never_reached_are_replayed_next_time(
        template, tmp_path):
    """One group a micro-batch (--micro-batch K rows): the step's forward stops at the
    micro-batch that fails, so the groups after it were never replayed and must not count as
    verified; those before it were, and do."""
    t = trainer_on(template, tmp_path, micro_batch=8)
    trust(t, "honest", "liar")
    lie = first_forgery(template, template.groups("liar"))
    put(t, "honest", "h1", template.groups("honest")[:3])
    liar_key = put(t, "liar", "l1", [lie])
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    at = next(i for i, g in enumerate(batch) if g.key == liar_key)
    if at == len(batch) - 1:  # the lie in the middle: groups on both sides of it
        batch.insert(1, batch.pop())
        at = 1
    result, check, passed = step_replaying(t, batch, stats)
    assert not result.applied and list(check.problems) == [at] and check.replayed == at + 1
    assert [g.verified for g in passed] == [True] * at + [False] * (len(batch) - at - 1)


def test_a_failure_before_the_step_leaves_the_version_in_hands_groups_unverified(template, trainer):
    """The step's own forward replays the version in hand's groups (`leave`), so `verified`
    replays only the others. When one of those fails, the round ends and the groups that
    passed wait in front of the buffer: the version in hand's were never replayed and must
    not come back marked verified, or the next step's forward would skip them and one burnt
    identity would carry another's lies into a step."""
    t = trainer
    trust(t, "burner", "liar")
    put(t, "burner", "b1", template.groups("burner")[:1])
    lie = first_forgery(template, template.groups("liar"))
    liar_key = put(t, "liar", "l1", [lie])
    put(t, "honest", "h1", template.groups("honest")[:2])
    trust(t, "honest")
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    burnt = next(g for g in batch if g.volunteer_id == "burner")
    burnt.policy_version = V - 1  # sampled under v(V-1) as it says: its replay there fails
    out, passed = t.role.verified(batch, stats, leave=V)
    assert out is None and stats.audit.verify_failed == 1, stats.audit
    assert t.fleet.is_denied("burner")
    waiting = [g for g in passed if g.key == liar_key]
    assert waiting and not any(g.verified for g in waiting)
    # the next round's step replays it in its own forward and is refused
    result, check, _ = step_replaying(t, passed, IngestStats())
    assert not result.applied and check.problems, check
    assert t.fleet.is_denied("liar")


def test_the_groups_in_hand_are_replayed_while_the_loop_waits_and_a_forgery_among_them_denies(
        template, tmp_path):
    """Fewer groups than a batch in hand: the loop spends its wait replaying them
    (roles.Single.verify_waiting), as the batch that takes them would. A forgery is handled
    as before a step; the version the step's own forward replays (`leave`) and a volunteer
    held back for its missing share are left alone."""
    t = trainer_on(template, tmp_path, groups_per_step=6)
    trust(t, "honest", "liar")
    put(t, "honest", "h1", template.groups("honest")[:3])
    lie = first_forgery(template, template.groups("liar"))
    liar_key = put(t, "liar", "l1", [lie])
    stats = IngestStats()
    buffer, batch, _, _ = t.role.intake_round([], stats, t.window())
    assert batch is None and len(buffer) == 4
    assert t.role.verify_waiting(buffer, IngestStats(), leave=V) == buffer  # all of v(V)
    assert not any(g.verified for g in buffer)
    left = t.role.verify_waiting(buffer, stats, leave=None)
    assert stats.audit.verified == 4 and stats.audit.verify_failed == 1, stats.audit
    assert stats.rejected == {"replay_mismatch": 1}, stats.rejected
    assert json.loads(t.storage.read(layout.quarantine_key(liar_key)))["reason"] == "replay_mismatch"
    assert t.fleet.is_denied("liar")
    assert [g.volunteer_id for g in left] == ["honest"] * 3 and all(g.verified for g in left)


def test_a_volunteer_held_for_its_missing_share_is_not_replayed_while_waiting(template, tmp_path):
    t = trainer_on(template, tmp_path, groups_per_step=6, missing_bound=0.05)
    trust(t, "gappy")
    # Template.groups skips the numbers whose rewards are all equal: a 5 % bound holds it
    put(t, "gappy", "g1", template.groups("gappy")[:4])
    stats = IngestStats()
    buffer, batch, _, _ = t.role.intake_round([], stats, t.window())
    assert batch is None and buffer and stats.held_missing == len(buffer), stats
    assert t.role.verify_waiting(buffer, stats, leave=None) == buffer
    assert stats.audit.verified == 0 and not any(g.verified for g in buffer)


def test_the_loop_replays_in_its_wait_what_the_next_batch_then_finds_verified(template, tmp_path):
    """The loop itself: after its first step (no longer the published version's weights,
    so nothing is left to a step's forward) it waits with two groups in hand; they are
    replayed in the wait, and the batch that takes them finds them verified."""
    t = trainer_on(template, tmp_path, groups_per_step=3, publish_every=2, max_steps=2)
    trust(t, "steady")
    groups = template.groups("steady")
    put(t, "steady", "s1", groups[:3])
    put(t, "steady", "s2", groups[3:5])
    seen, wait = [], t.stop.wait

    def wait_and_send(seconds):  # the third group arrives once the loop has waited
        if not seen or seen[-1] != "sent":
            put(t, "steady", "s3", groups[5:6])
            seen.append("sent")
        return wait(seconds)

    verified = t.role.verified

    def spy(batch, stats, leave=None):
        seen.append([(g.key, g.verified) for g in batch])
        return verified(batch, stats, leave)

    t.stop.wait, t.role.verified = wait_and_send, spy
    t.run()
    batches = [s for s in seen if s != "sent"]
    assert len(batches) == 2 and "sent" in seen, seen
    assert batches[1] == [(key("steady", "s2"), True)] * 2 + [(key("steady", "s3"), False)], batches
