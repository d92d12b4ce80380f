"""The audit's policy, without a model: rates per volunteer in groups, the time budget, the
draw made once per shard, window weights, group numbers on both sides, fleet counts."""
from __future__ import annotations

import json
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
    shard_chance,
)
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.withheld import GroupNumbers


def test_a_new_or_caught_volunteer_is_audited_on_every_group_then_about_one_in_n():
    assert [audit_rate(n, 10, 0.005) for n in (0, 1, 9)] == [1.0, 1.0, 1.0]
    assert audit_rate(10, 10, 0.005) == 1.0
    assert audit_rate(20, 10, 0.005) == 0.5
    assert audit_rate(100, 10, 0.005) == pytest.approx(0.1)
    assert audit_rate(10_000, 10, 0.005) == 0.005  # the floor


def test_with_every_group_verified_only_volunteers_without_a_record_are_drawn_at_intake():
    """--verify every replays each trained group before its step, so the intake's draws are
    for the first `full_groups` clean groups only (new or just caught volunteers)."""
    assert [audit_rate(n, 10, 0.005, trusted=False) for n in (0, 9)] == [1.0, 1.0]
    assert [audit_rate(n, 10, 0.005, trusted=False) for n in (10, 20, 10_000)] == [0.0] * 3
    a = Auditor(lambda v, g: None, Budget(1.0), 10, 0.005, random.Random(3), trusted=False)
    assert all(a.due(f"new{i}", 9, 256) for i in range(50))
    assert not any(a.due(f"old{i}", 10, 256) for i in range(2000))


COVER_FLOOR = 0.5


def test_with_every_group_verified_groups_no_step_replays_are_each_drawn_at_the_cover_floor():
    """Zero-variance and repeated groups are never trained, so --verify every never replays
    them: each is drawn on its own (Auditor.spot) at its volunteer's rate, never below
    COVER_FLOOR, so a shard of many such groups replays about that share of them, not all;
    a shard seen again gets the same draws; with sampled audits `due` draws the whole shard."""
    a = Auditor(lambda v, g: None, Budget(1.0), 10, 0.005, random.Random(3), trusted=False,
                cover_floor=COVER_FLOOR)
    assert all(a.spot(f"fresh{i}", 10, [0, 1, 2]) == {0, 1, 2} for i in range(50))  # 10 / 10
    one = sum(len(a.spot(f"old{i}", 100_000, [0])) for i in range(4000)) / 4000
    assert abs(one - COVER_FLOOR) < 0.04, one
    drawn = [a.spot(f"big{i}", 100_000, list(range(256))) for i in range(50)]
    share = sum(map(len, drawn)) / (50 * 256)
    assert abs(share - COVER_FLOOR) < 0.03, share
    assert all(0 < len(d) < 256 for d in drawn)  # drawn per group, not per shard
    assert all(a.spot(f"big{i}", 100_000, list(range(256))) == d for i, d in enumerate(drawn))
    assert all(a.spot(f"none{i}", 10, []) == set() for i in range(50))
    # floor 0 (the default): the audit rate alone, 10 / 1,000 here: about 80 of 8,000 groups
    no_floor = Auditor(lambda v, g: None, Budget(1.0), 10, 0.005, random.Random(3), trusted=False)
    assert sum(len(no_floor.spot(f"r{i}", 1000, [0, 1])) for i in range(4000)) < 160
    sampled = Auditor(lambda v, g: None, Budget(1.0), 10, 0.005, random.Random(3), cover_floor=1.0)
    assert all(sampled.spot(f"s{i}", 10, [0, 1, 2, 3]) == set() for i in range(50))


def test_a_big_shard_is_as_likely_to_be_audited_as_its_groups_in_small_shards():
    """Trust counted in groups: one shard of 256 groups is audited with the chance that any of
    256 one-group shards is, not with the chance of one of them."""
    assert shard_chance(0.005, 1) == pytest.approx(0.005)
    assert shard_chance(0.005, 256) == pytest.approx(1 - 0.995 ** 256)  # 72 %
    a = Auditor(lambda v, g: None, Budget(1.0), 10, 0.005, random.Random(3))
    trusted = 100_000  # clean groups: at the floor
    big = sum(a.due(f"big{i}", trusted, 256) for i in range(2000)) / 2000
    small = sum(any(a.due(f"s{i}-{j}", trusted, 1) for j in range(256)) for i in range(300)) / 300
    assert abs(big - 0.72) < 0.04 and abs(small - 0.72) < 0.08


def test_a_rejected_shard_sets_the_clean_count_back_to_zero():
    fleet = Fleet(deny_after=0)
    for _ in range(30):
        fleet.note("a", True, 16)
    assert fleet.clean("a") == 30 * 16  # counted in groups
    fleet.note("a", False, 4)
    assert fleet.clean("a") == 0 and fleet.counts["a"].accepted == 30
    assert fleet.clean("never-seen") == 0


def test_a_volunteer_whose_rejected_groups_outweigh_its_accepted_ones_is_denied():
    """Many one-group honest shards do not dilute a few big rejected ones: the rejected share
    is also counted in groups."""
    fleet = Fleet(deny_after=5, deny_rate=0.5)
    for _ in range(1000):
        fleet.note("farmer", True, 1)
    crossed = [fleet.note("farmer", False, 256) for _ in range(5)]
    assert crossed == [False] * 4 + [True]
    c = fleet.counts["farmer"]
    assert (c.accepted, c.rejected, c.accepted_groups, c.rejected_groups) == (1000, 5, 1000, 1280)  # 0.5 % of its shards


def test_fleet_counts_survive_a_save_and_old_states_still_load():
    fleet = Fleet()
    fleet.note("a", True, 7)
    fleet.count_audit("a")
    fleet.count_numbers("a", 10, 3)
    again = Fleet()
    again.load_counts(fleet.to_json())
    assert again.counts == fleet.counts
    old = Fleet()
    old.load_counts({"b": [4, 1]})  # a state saved before audits: accepted, rejected only
    c = old.counts["b"]
    assert (c.accepted, c.rejected, c.clean, c.audited, c.numbered, c.missing) == (4, 1, 0, 0, 0, 0)
    assert (c.accepted_groups, c.rejected_groups) == (0, 0)


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


def auditor(replay, share=1.0, full=10, floor=0.005, seed=1):
    return Auditor(replay, Budget(share), full, floor, random.Random(seed))


def test_every_shard_of_a_new_volunteer_is_replayed_and_failures_are_reported():
    calls = []

    def replay(version, groups):
        calls.append((version, groups))
        return ("replay_mismatch", "group 0") if groups == ["bad"] else None

    a, stats = auditor(replay), AuditStats()
    assert a.surely_due("k1", 0) and a.due("k2", 9, 1)
    assert a.run("k1", "vol", 7, ["ok"], stats) == ("passed", None)
    assert a.run("k2", "vol", 7, ["bad"], stats) == ("failed", ("replay_mismatch", "group 0"))
    assert calls == [(7, ["ok"]), (7, ["bad"])]
    assert (stats.audited, stats.by_volunteer) == (2, {"vol": 2})


def test_a_trusted_volunteer_is_audited_at_its_rate_and_a_draw_found_due_stays_due():
    a = auditor(lambda v, g: None)
    due = [a.due(f"k{i}", 1000, 1) for i in range(4000)]
    assert 0.006 < sum(due) / len(due) < 0.014  # rate max(0.005, 10/1000) = 0.01
    skipped = next(f"k{i}" for i, d in enumerate(due) if not d)
    # asking again at the same rate cannot turn a skip into an audit
    assert all(a.due(skipped, 1000, 1) is False for _ in range(50))
    drawn = next(f"k{i}" for i, d in enumerate(due) if d)
    assert a.due(drawn, 10**9, 1)  # more trust since cannot undo a draw
    assert a.surely_due(skipped, 0)  # a caught volunteer's rate is 1: due, and it stays so
    assert a.due(skipped, 10**9, 1)


class Uniforms:
    """An rng whose draws are given: `first` for the first key, then `rest`."""

    def __init__(self, first, rest):
        self.values = iter([first])
        self.rest = rest

    def random(self) -> float:
        return next(self.values, self.rest)


def test_a_draw_found_due_stays_due_when_the_table_fills_and_the_table_stays_bounded(monkeypatch):
    """A trusted volunteer's shard drawn due, then many more keys drawn than the table holds:
    the due one is still due (clearing the table gave it a new draw, and 28 % of such shards
    were then taken unaudited), and the draws not due are dropped, oldest first."""
    import volunteer_rl.trainer.audit as audit

    monkeypatch.setattr(audit, "MAX_DECISIONS", 8)
    a = Auditor(lambda v, g: None, Budget(1.0), 10, 0.005, Uniforms(0.001, 0.999))
    trusted = 10**6  # rate at the floor: only a draw below 0.005 is due
    assert a.surely_due("due", trusted)
    for i in range(100):
        assert not a.surely_due(f"k{i}", trusted)
        assert len(a.draws) <= 8
    assert a.surely_due("due", trusted) and a.draws["due"].u == 0.001
    assert "k99" in a.draws and "k0" not in a.draws  # the newest are kept
    for i in range(20):  # due draws are never dropped; they leave with the window (forget)
        a.draws[f"d{i}"] = audit.Draw(0.0, due=True)
    for i in range(100, 200):
        a.surely_due(f"k{i}", trusted)
    assert all(f"d{i}" in a.draws for i in range(20)) and len(a.draws) <= 21 + 8
    a.forget(lambda k: not k.startswith("d"))
    assert len(a.draws) <= 8


def test_the_budget_is_reserved_at_admission_and_settled_after_the_audit():
    clock = Clock()
    a = Auditor(lambda v, g: None, Budget(0.1, clock), 10, 0.005, random.Random(0))
    assert a.budget.tokens == 1.0
    assert a.admit("k1", 256)  # no audit timed yet: one at a time, costed a whole burst
    assert a.budget.tokens == 1.0 - BURST_SECONDS and not a.admit("k2", 256)
    a.run("k1", "vol", 1, ["g"] * 4, AuditStats())  # gives back what it did not use
    assert a.budget.tokens > 0.9 and a.per_group is not None
    a.per_group = 0.01
    before = a.budget.tokens
    assert a.admit("k2", 256) and a.budget.tokens == pytest.approx(before - 2.56)  # by its size
    before = a.budget.tokens
    a.settle()  # k2 was never audited: its reservation comes back
    assert a.budget.tokens == pytest.approx(before + 2.56)
    before = a.budget.tokens
    assert a.admit("k3", 256, replaying=3) and a.budget.tokens == pytest.approx(before - 0.03)


def test_a_version_whose_weights_are_not_held_defers_the_shard():
    def replay(version, groups):
        raise Unavailable(version)

    stats = AuditStats()
    assert auditor(replay).run("k", "vol", 3, ["g"], stats) == ("deferred", None)
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
    assert seen.add("a", "k1", 5, [0, 1, 2]) is None
    assert seen.add("a", "k2", 5, [5, 6]) is None  # 3 and 4 never arrive
    assert seen.add("a", "k3", 5, [6, 7]) == "seq_reused"  # 6 again: refused, 7 not recorded
    assert seen.add("a", "k4", 5, [8, 8]) == "seq_reused"
    assert seen.add("a", "k2", 5, [5, 6]) is None  # the same shard read again (a restart)
    assert seen.add("b", "k5", 5, [0]) is None and seen.add("a", "k6", 6, [9]) is None
    assert seen.close_below(6) == {"a": (7, 2), "b": (1, 0)}
    assert seen.close_below(6) == {}  # closed once
    assert seen.add("a", "k7", 6, [10]) is None


def test_the_tail_a_volunteer_drops_shows_once_a_later_version_arrives():
    seen = GroupNumbers()
    assert seen.add("a", "k1", 5, list(range(0, 10))) is None  # 10..19 sampled, kept back
    assert seen.add("a", "k2", 6, list(range(20, 30))) is None
    assert seen.close_below(6) == {"a": (10, 0)}  # v5's own numbers: nothing missing yet
    assert seen.close_below(7) == {"a": (20, 10)}  # v5's tail counted with v6
    assert seen.next_number("a") == 30 and seen.next_number("nobody") == 0


def test_numbers_out_of_order_with_their_versions_are_refused():
    """An honest volunteer's numbers grow with its versions: a number kept back under v5 and
    sampled again under v6 (a new prompt and new noise) after higher ones went out is not."""
    seen = GroupNumbers()
    assert seen.add("a", "k1", 5, [0, 1, 2, 3]) is None
    assert seen.add("a", "k2", 6, [2]) == "seq_reused"
    assert seen.add("a", "k3", 6, [4, 5]) is None
    assert seen.add("a", "k4", 5, [6]) == "seq_order"  # v5 above a v6 number
    assert seen.add("a", "k5", 7, [5]) == "seq_reused"
    assert seen.add("a", "k6", 7, [3]) == "seq_reused"
    assert seen.close_below(6) == {"a": (4, 0)}
    assert seen.add("a", "k7", 7, [6]) is None
    assert seen.add("a", "k8", 6, [1]) == "seq_order"  # below the closed frontier


def test_group_numbers_survive_the_trainers_state_file():
    seen = GroupNumbers()
    assert seen.add("a", "k1", 5, [0, 1, 2, 7, 8]) is None
    assert seen.add("b", "k2", 6, [3]) is None
    seen.close_below(6)
    again = GroupNumbers.from_json(json.loads(json.dumps(seen.to_json())))
    assert again.add("b", "k3", 6, [3]) == "seq_reused"  # a restart forgets no number
    assert again.add("b", "k2", 6, [3]) is None  # but the same shard may be read again
    assert again.add("a", "k4", 6, [5]) == "seq_order"  # v5 closed at 9: 3..6 missing
    assert again.next_number("a") == 9 and again.next_number("b") == 4
    with pytest.raises(ValueError):
        GroupNumbers.from_json({"a": {"frontier": "x", "shards": []}})


def test_an_audit_stops_at_the_first_failing_chunk_and_replays_a_passing_shard_whole():
    """A lying first group costs a one-group replay (a new id's 256 made-up groups used to cost
    the whole replay, and with it everyone's audit budget); a lie in the last group is still
    found, and a shard that passes has every group replayed."""
    calls = []

    def replay(version, groups):
        calls.append(len(groups))
        bad = [g for g in groups if g == "lie"]
        return ("replay_mismatch", "a lie") if bad else None

    auditor = Auditor(replay, Budget(1.0), 10, 0.05, random.Random(0))
    stats = AuditStats()
    assert auditor.run("k1", "v", 0, ["lie"] + ["ok"] * 255, stats) == ("failed", ("replay_mismatch", "a lie"))
    assert calls == [1]
    calls.clear()
    assert auditor.run("k2", "v", 0, ["ok"] * 255 + ["lie"], stats)[0] == "failed"
    assert sum(calls) == 256 and calls[0] == 1
    calls.clear()
    assert auditor.run("k3", "v", 0, ["ok"] * 100, stats) == ("passed", None)
    assert sum(calls) == 100 and len(calls) <= 5
