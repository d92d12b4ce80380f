"""The audit's policy, without a model: rates per volunteer, the time budget, the decision
drawn once per shard, window weights, group numbers on both sides, fleet counts."""
from __future__ import annotations

import random

import pytest
import torch

from volunteer_rl.trainer.audit import (
    BURST_SECONDS,
    Auditor,
    AuditStats,
    Budget,
    Unavailable,
    WindowWeights,
    audit_rate,
)
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.withheld import GroupNumbers
from volunteer_rl.volunteer.numbering import GroupNumbers as VolunteerNumbers


def test_a_new_or_caught_volunteer_is_audited_on_every_shard_then_about_one_in_n():
    assert [audit_rate(n, 10, 0.05) for n in (0, 1, 9)] == [1.0, 1.0, 1.0]
    assert audit_rate(10, 10, 0.05) == 1.0
    assert audit_rate(20, 10, 0.05) == 0.5
    assert audit_rate(100, 10, 0.05) == pytest.approx(0.1)
    assert audit_rate(10_000, 10, 0.05) == 0.05  # the floor


def test_a_rejected_shard_sets_the_clean_count_back_to_zero():
    fleet = Fleet(deny_after=0)
    for _ in range(30):
        fleet.note("a", True)
    assert fleet.clean("a") == 30
    fleet.note("a", False)
    assert fleet.clean("a") == 0 and fleet.counts["a"].accepted == 30
    assert fleet.clean("never-seen") == 0


def test_fleet_counts_survive_a_save_and_old_states_still_load():
    fleet = Fleet()
    fleet.note("a", True)
    fleet.count_audit("a")
    fleet.count_numbers("a", 10, 3)
    again = Fleet()
    again.load_counts(fleet.to_json())
    assert again.counts == fleet.counts
    old = Fleet()
    old.load_counts({"b": [4, 1]})  # a state saved before audits: accepted, rejected only
    c = old.counts["b"]
    assert (c.accepted, c.rejected, c.clean, c.audited, c.numbered, c.missing) == (4, 1, 0, 0, 0, 0)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_refills_at_its_share_of_wall_time_up_to_a_burst():
    clock = Clock()
    b = Budget(0.1, clock)
    assert b.allows()
    b.spend(5.0)  # an audit that ran long: the bucket goes negative
    assert not b.allows()
    clock.now += 39.0  # 3.9 s of audit time earned: still in debt
    assert not b.allows()
    clock.now += 2.0
    assert b.allows()
    clock.now += 10_000  # a long idle spell earns no more than the burst
    b.allows()
    assert b.tokens == BURST_SECONDS


def auditor(replay, share=1.0, full=10, floor=0.05, seed=1):
    return Auditor(replay, Budget(share), full, floor, random.Random(seed))


def test_every_shard_of_a_new_volunteer_is_replayed_and_failures_are_reported():
    calls = []

    def replay(version, groups):
        calls.append((version, groups))
        return ("replay_mismatch", "group 0") if groups == ["bad"] else None

    a, stats = auditor(replay), AuditStats()
    assert a.run("k1", "vol", 0, 7, ["ok"], stats) == ("passed", None)
    assert a.run("k2", "vol", 3, 7, ["bad"], stats) == ("failed", ("replay_mismatch", "group 0"))
    assert calls == [(7, ["ok"]), (7, ["bad"])]
    assert (stats.audited, stats.skipped, stats.by_volunteer) == (2, 0, {"vol": 2})


def test_a_trusted_volunteer_is_audited_at_its_rate_and_the_draw_is_made_once_per_shard():
    a, stats = auditor(lambda v, g: None, floor=0.05), AuditStats()
    outcomes = [a.run(f"k{i}", "vol", 1000, 1, ["g"], stats)[0] for i in range(4000)]
    share = outcomes.count("passed") / len(outcomes)
    assert 0.03 < share < 0.07  # rate max(0.05, 10/1000) = 0.05
    skipped = next(f"k{i}" for i, o in enumerate(outcomes) if o == "skipped")
    # asking again about the same key cannot turn a skip into an audit or back
    assert all(a.due(skipped, 1000) is False for _ in range(50))


def test_a_shard_drawn_while_the_budget_is_spent_is_deferred_and_keeps_its_draw():
    clock = Clock()
    a = Auditor(lambda v, g: None, Budget(0.1, clock), 10, 0.05, random.Random(0))
    a.budget.spend(100.0)
    stats = AuditStats()
    assert a.run("k", "vol", 0, 1, ["g"], stats) == ("deferred", None)
    assert a.due("k", 10_000) is True  # still drawn for an audit, whatever its rate is now
    clock.now += 2000
    assert a.run("k", "vol", 10_000, 1, ["g"], stats) == ("passed", None)
    assert (stats.deferred, stats.audited) == (1, 1)


def test_a_version_whose_weights_are_not_held_defers_the_shard():
    def replay(version, groups):
        raise Unavailable(version)

    stats = AuditStats()
    assert auditor(replay).run("k", "vol", 0, 3, ["g"], stats) == ("deferred", None)
    assert stats.deferred == 1 and stats.audited == 0


def test_window_weights_hold_each_version_as_published_and_drop_old_ones():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    w = WindowWeights()
    w.add(1, model, torch.bfloat16)
    first = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    w.add(2, model, torch.bfloat16)
    target = torch.nn.Linear(4, 3)
    assert w.load_into(1, target)
    for n, p in target.named_parameters():  # bf16-rounded, upcast exactly
        assert torch.equal(p, first[n].to(torch.bfloat16).float())
    w.drop_below(2)
    assert not w.load_into(1, target) and w.load_into(2, target)


def test_group_numbers_count_gaps_when_their_version_leaves_the_window():
    seen = GroupNumbers()
    assert seen.add("a", 5, [0, 1, 2])
    assert seen.add("a", 5, [5, 6])  # 3 and 4 never arrive
    assert not seen.add("a", 5, [6, 7])  # 6 again: refused, and 7 not recorded
    assert not seen.add("a", 5, [8, 8])
    assert seen.add("b", 5, [0]) and seen.add("a", 6, [0])
    assert seen.close_below(6) == {"a": (7, 2), "b": (1, 0)}
    assert seen.close_below(6) == {}  # closed once
    assert seen.add("a", 6, [1])


def test_a_volunteer_goes_on_numbering_where_it_stopped_after_a_restart(tmp_path):
    path = tmp_path / "numbers.json"
    n = VolunteerNumbers(path)
    assert n.take("run-a", 3, 16) == 0
    assert n.take("run-a", 3, 16) == 16
    again = VolunteerNumbers(path)  # restarted inside version 3
    assert again.take("run-a", 3, 4) == 32
    assert again.take("run-a", 4, 4) == 0  # a new version starts at 0
    assert again.take("run-b", 4, 1) == 0  # so does a new run
    path.write_text("{not json")
    assert VolunteerNumbers(path).take("run-b", 4, 1) == 0
