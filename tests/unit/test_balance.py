"""Balance (issue 27): the quota the trainer asks of each volunteer per version (pure rule,
trainer/balance.py), the volunteer's stop and resume at it (volunteer/quota.py), and the
useful fraction the trainer measures."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Dataset, Manifest, ManifestError, Quota, Sampling, TaskRef
from volunteer_rl.trainer.balance import (
    PRIOR_USABLE,
    USABLE_FLOOR,
    WAIT_BOUNDS,
    Balance,
    participation,
    quota_groups,
    quota_wait,
)
from volunteer_rl.volunteer.quota import LOG_EVERY_SECONDS, Allowance

# --- the quota rule ---------------------------------------------------------------------------


def test_participation_counts_volunteers_by_their_shares():
    assert participation({}) == 0
    assert participation({"a": 50, "b": 50}) == 2
    assert participation({"a": 10, "b": 10, "c": 10}) == pytest.approx(3)
    # a thousand ids that sent one group each beside two that sent 1,000 each: about 4.5, not
    # 1,002 (they would shrink every honest volunteer's quota 500-fold)
    dust = {f"sybil-{i}": 1 for i in range(1000)}
    assert participation({"a": 1000, "b": 1000, **dust}) == pytest.approx(4.5, abs=0.01)


@pytest.mark.parametrize("need, buffered, usable, volunteers, headroom, quota", [
    (32, 0, 1.0, 1, 1.0, 32),      # one volunteer, every group usable: exactly the need
    (32, 0, 0.5, 2, 1.0, 32),      # half usable, two volunteers: 64 groups, 32 each
    (32, 0, 0.5, 2, 1.5, 48),      # with headroom
    (32, 16, 0.5, 2, 1.5, 24),     # 16 usable groups in hand: ask only for the rest
    (32, 40, 0.5, 2, 1.5, 2),      # more in hand than a version needs: a token amount, not 0
    (32, 0, 0.0, 2, 1.0, 1600),    # nothing usable: the floor, 1 % (not a division by zero)
    (32, 0, 0.3, 3, 1.2, 43),      # rounded up: 32 * 1.2 / 0.9 = 42.7
    (1e9, 0, 0.01, 1, 100, 1 << 20),  # bounded by what a manifest may say
])
def test_the_quota_is_the_share_of_a_versions_need_with_headroom(need, buffered, usable,
                                                                volunteers, headroom, quota):
    assert quota_groups(need, buffered, usable, volunteers, headroom) == quota
    assert USABLE_FLOOR == 0.01


def test_the_wait_follows_the_trainers_busy_time_inside_its_bounds():
    lo, hi = WAIT_BOUNDS
    assert quota_wait([]) == lo                          # nothing measured yet
    assert quota_wait([0.1, 0.2, 0.3]) == lo             # a fast trainer: the floor
    assert quota_wait([1.0, 5.0, 2.0]) == 6.0            # 3 x the median, not the mean
    assert quota_wait([100.0]) == hi


def step(b: Balance, now: float, received: dict, trained: dict, unusable: int = 0, waited: float = 0.0):
    b.after_step(now, Counter(received), Counter(trained), sum(received.values()), unusable, waited)


def test_before_a_versions_need_was_received_the_quota_assumes_the_prior_and_one_volunteer():
    b = Balance(groups_per_step=32, headroom=1.5)
    prior = Quota(quota_groups(32, 0, PRIOR_USABLE, 1, 1.5), WAIT_BOUNDS[0])
    assert b.quota(0.0, 0) == prior == Quota(96, 2.0)   # v0: nothing measured
    step(b, 1.0, {"a": 20}, {"a": 10})
    assert b.quota(1.0, 0) == prior == b.current        # 20 < 32 received: still too few
    step(b, 2.0, {"a": 20, "b": 20}, {"a": 10, "b": 10}, unusable=20)
    q = b.quota(2.0, 0)
    # 60 received, 20 of them unusable; a sent 40 and b 20: 1.8 volunteers by their shares
    usable, n = 2 / 3, participation({"a": 40, "b": 20})
    assert n == pytest.approx(1.8)
    assert q == Quota(quota_groups(32, 0, usable, n, 1.5), WAIT_BOUNDS[0]) == b.current
    assert Balance(groups_per_step=32, headroom=0).quota(2.0, 0) is None  # --quota-headroom 0


def test_the_window_forgets_old_steps_and_the_useful_fraction_is_trained_over_received():
    b = Balance(groups_per_step=4, headroom=1.0, window=60.0)
    step(b, 0.0, {"a": 100}, {"a": 4}, unusable=90)
    step(b, 30.0, {"a": 10, "b": 10}, {"a": 2, "b": 2}, unusable=4)
    assert b.useful_fraction(30.0) == pytest.approx(8 / 120)
    assert b.usable_fraction(30.0) == pytest.approx(1 - 94 / 120)
    # 61 s later the first step left the window
    assert b.useful_fraction(61.0) == pytest.approx(4 / 20)
    assert b.usable_fraction(61.0) == pytest.approx(1 - 4 / 20)
    fleet, rows = b.summary(61.0)
    assert fleet["groups_received"] == 20 and fleet["groups_trained"] == 4
    assert fleet["useful_fraction"] == 0.2 and fleet["volunteers"] == 2.0
    assert rows["a"] == {"groups_received_recent": 10, "groups_trained_recent": 2,
                         "useful_fraction": 0.2}
    assert b.useful_fraction(200.0) is None and b.summary(200.0)[0]["useful_fraction"] is None


def test_need_and_wait_come_from_the_recent_publishes_busy_time_not_their_waiting():
    b = Balance(groups_per_step=8, publish_every=1, headroom=1.0)
    b.after_publish(0.0)                                 # the first publish only starts the clock
    assert list(b.busy) == [] and b.need() == 8
    for i in range(3):                                   # each version: 2 steps, 9 s of 10 waiting
        t0 = 10.0 * i
        step(b, t0 + 5, {"a": 8}, {"a": 8}, waited=4.5)
        step(b, t0 + 9, {"a": 8}, {"a": 8}, waited=4.5)
        b.after_publish(t0 + 10)
    assert list(b.busy) == [1.0, 1.0, 1.0] and b.need() == 16
    assert b.quota(30.0, 0).wait_seconds == 3.0          # 3 x 1 s busy, not 3 x 10 s apart


# --- the volunteer's stop and resume ----------------------------------------------------------


def manifest(version=3, quota=Quota(8, 5.0), run_id="run"):
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id=run_id, version=version, checkpoint=layout.checkpoint_prefix(version),
                    files={}, dataset=Dataset("train", "datasets/train-0.csv", "0" * 64, 1, 1),
                    sampling=Sampling(8, 1.0, 32), max_staleness=2, quota=quota)


def test_a_volunteer_stops_at_its_quota_and_samples_another_after_the_wait():
    lines = []
    a = Allowance(log=lines.append)
    m = manifest()
    assert a.room(m, 0, 100.0) == 8 and a.waiting is None    # a newcomer starts at once
    assert a.room(m, 5, 100.0) == 3
    assert a.room(m, 8, 101.0) == 0                          # at the quota: wait
    assert a.waiting == "quota of v3 reached (8 groups)"
    assert lines == ["waiting: quota of v3 reached (8 groups); for a newer version, or 5s "
                     "before sampling 8 more"]
    assert a.room(m, 8, 105.9) == 0                          # still within the wait
    assert a.room(m, 8, 106.0) == 8 and a.waiting is None    # no new version: another quota
    assert "no version after v3 for 5s: sampling 8 more groups of it (quota now 16)" in lines[-1]
    assert a.room(m, 16, 107.0) == 0 and a.waiting == "quota of v3 reached (16 groups)"
    assert a.room(m, 16, 112.0) == 16                        # each further wait: twice as many
    assert a.room(m, 32, 112.0) == 0 and a.room(m, 32, 117.0) == 32
    # a new version: a fresh quota, at once, whatever was made before
    assert a.room(manifest(version=4, quota=Quota(3, 5.0)), 0, 117.5) == 3 and a.waiting is None
    # no quota (v0 of a run, or --quota-headroom 0): no limit
    assert a.room(manifest(version=5, quota=None), 10_000, 118.0) > 10_000


def test_the_volunteers_own_cap_and_the_quota_whichever_leaves_less():
    a = Allowance(cap=6, batch=4, cap_patience=2.0, log=lambda line: None)
    m = manifest(quota=Quota(8, 5.0))
    assert a.room(m, 0, 0.0) == 6
    assert a.room(m, 6, 1.0) == 0 and a.waiting == "--max-groups-per-version of v3 reached (6 groups)"
    assert not a.quota_reached                               # its own cap: the shard stays buffered
    assert a.room(m, 6, 3.0) == 2                            # its patience: one batch more, but
    assert a.room(m, 8, 3.5) == 0 and a.waiting == "quota of v3 reached (8 groups)"  # the quota is 8
    assert a.quota_reached                                   # the trainer's: what it holds goes out


def test_waits_are_logged_at_most_every_interval_and_count_the_rest():
    lines = []
    a = Allowance(log=lines.append)
    for v in range(5):                                       # five versions, each at its quota
        a.room(manifest(version=v), 8, 10.0 + v)
    assert len(lines) == 1
    a.room(manifest(version=9), 8, 10.0 + LOG_EVERY_SECONDS)
    assert len(lines) == 2 and lines[1].endswith("(4 more like it since the last such line)")


# --- the manifest's field -------------------------------------------------------------------


def signed_raw(quota) -> dict:
    raw = json.loads(manifest().to_json())
    raw["quota"] = quota
    return raw


@pytest.mark.parametrize("quota, why", [
    (0, "quota must be null or an object of groups and wait_seconds"),
    ({"groups": 5}, "quota must be null or an object of groups and wait_seconds"),
    ({"groups": 5, "wait_seconds": 1, "more": 1}, "quota must be null or an object"),
    ({"groups": 0, "wait_seconds": 1}, "quota.groups 0 is not an integer in 1..1048576"),
    ({"groups": (1 << 20) + 1, "wait_seconds": 1}, "quota.groups 1048577 is not an integer in 1..1048576"),
    ({"groups": 2.0, "wait_seconds": 1}, "quota.groups 2.0 is not an integer"),
    ({"groups": True, "wait_seconds": 1}, "quota.groups True is not an integer"),
    ({"groups": 5, "wait_seconds": 0.01}, "quota.wait_seconds 0.01 is not a number in 0.1..3600"),
    ({"groups": 5, "wait_seconds": 1e9}, "quota.wait_seconds 1000000000.0 is not a number in 0.1..3600"),
    ({"groups": 5, "wait_seconds": "2"}, "quota.wait_seconds '2' is not a number"),
    ({"groups": 5, "wait_seconds": False}, "quota.wait_seconds False is not a number"),
])
def test_a_manifest_quota_out_of_bounds_is_refused_in_one_line(quota, why):
    with pytest.raises(ManifestError) as e:
        Manifest.from_raw(signed_raw(quota))
    msg = str(e.value)
    assert msg.startswith(f"manifest.json: malformed (ValueError: {why}") and msg.endswith(")")
    assert "\n" not in msg


def test_a_manifest_quota_round_trips_and_is_required_since_schema_7():
    assert Manifest.from_raw(signed_raw({"groups": 7, "wait_seconds": 2})).quota == Quota(7, 2.0)
    assert Manifest.from_raw(signed_raw(None)).quota is None
    raw = signed_raw(None)
    del raw["quota"]
    with pytest.raises(ManifestError, match=r"^manifest.json: malformed \(KeyError: 'quota'\)$"):
        Manifest.from_raw(raw)
