"""The price of withholding (trainer.withheld): a volunteer's missing share over its recent
group numbers, counted from number 0, open versions included, and the groups held back
while it is over the bound."""
from __future__ import annotations

from volunteer_rl.trainer.groups import ScoredGroup
from volunteer_rl.trainer.withheld import RECENT_NUMBERS, GroupNumbers, hold_back

BOUND = 0.05


def numbers_of(shards: list[tuple[int, list[int]]], volunteer: str = "v") -> GroupNumbers:
    """GroupNumbers that took `shards`, (version, numbers) each, in order."""
    n = GroupNumbers()
    for i, (version, seqs) in enumerate(shards):
        assert n.add(volunteer, f"rollouts/v{version:06d}/{volunteer}/s{i}.jsonl.gz", version, seqs) is None
    return n


def group(volunteer: str, seq: int) -> ScoredGroup:
    return ScoredGroup(0, 1, volunteer, [[1]], [[-0.1]], [0.0], "k", seq=seq)


def test_an_honest_volunteer_misses_nothing_open_or_closed():
    n = numbers_of([(1, list(range(0, 8))), (1, list(range(8, 16))), (2, list(range(16, 24)))])
    assert n.missing_share("v") == (0, 24)
    n.close_below(2)
    assert n.missing_share("v") == (0, 24) and not n.held("v", BOUND)


def test_numbers_before_the_first_one_sent_count_from_0():
    """One that sampled #0-#47 of its first version and sent only #42 (whose block of numbers,
    #40-#47, misses the rest: it counts too)."""
    n = numbers_of([(1, [42])])
    assert n.missing_share("v") == (43, 43) and n.held("v", BOUND)
    assert n.close_below(2) == {"v": (43, 42)}  # closed: the fleet totals count them too
    assert n.missing_share("v") == (43, 43)


def test_a_volunteer_that_keeps_a_fifth_of_its_groups_is_held_while_its_versions_are_open():
    kept = [s for s in range(256) if s % 5 == 0]
    n = numbers_of([(1, kept[:26]), (2, kept[26:])])
    missing, counted = n.missing_share("v")
    assert (missing, counted) == (256, 256) and n.held("v", BOUND)  # every block misses some
    trained, held = hold_back([group("v", 5), group("ok", 0), group("v", 10)], n, BOUND)
    assert [g.volunteer_id for g in trained] == ["ok"] and [g.seq for g in held] == [5, 10]


def test_one_lost_shard_stays_under_the_bound_and_an_old_gap_ages_out():
    n = numbers_of([(1, list(range(0, 496))), (2, list(range(528, 1100)))])  # #496-#527 lost
    n.close_below(3)
    assert n.missing_share("v") == (32, RECENT_NUMBERS) and not n.held("v", BOUND)
    n = numbers_of([(1, list(range(0, 100))), (2, list(range(400, 500)))])  # 300 missing
    assert n.held("v", BOUND)
    n.close_below(3)
    n.add("v", "rollouts/v000003/v/late.jsonl.gz", 3, list(range(500, 100 + RECENT_NUMBERS)))
    assert n.missing_share("v") == (300, RECENT_NUMBERS) and n.held("v", BOUND)
    n.add("v", "rollouts/v000003/v/later.jsonl.gz", 3, list(range(100 + RECENT_NUMBERS, 1500)))
    assert n.missing_share("v") == (0, RECENT_NUMBERS) and not n.held("v", BOUND)


def test_one_group_left_out_of_a_block_counts_the_whole_block():
    """The careful liar of bench.withholding: it leaves out the worst group of one block in
    ten, 1.2 % of its numbers, under a bound of 5 % if each number counted alone; counted
    with their blocks, 10 % of its numbers are missing and its groups are held. A crash that
    loses whole blocks counts no more than it lost (test above)."""
    dropped = {b * 8 + 3 for b in range(0, 128, 10)}  # 13 blocks of 128
    n = numbers_of([(1, [s for s in range(512) if s not in dropped]),
                    (2, [s for s in range(512, 1024) if s not in dropped])])
    assert n.missing_share("v") == (8 * len(dropped), 1024) and n.held("v", BOUND)
    n.close_below(3)  # the same once closed, as gaps
    assert n.missing_share("v") == (8 * len(dropped), 1024) and n.held("v", BOUND)
    trained, held = hold_back([group("v", 1), group("v", 2)], n, BOUND)
    assert trained == [] and len(held) == 2


def test_a_late_shard_fills_its_gap_and_the_hold_lifts():
    n = numbers_of([(1, list(range(0, 8))), (1, list(range(16, 24)))])  # #8-#15 not here yet
    assert n.held("v", BOUND)
    n.add("v", "rollouts/v000001/v/late.jsonl.gz", 1, list(range(8, 16)))
    assert n.missing_share("v") == (0, 24) and not n.held("v", BOUND)


def test_a_huge_number_costs_arithmetic_only_and_the_share_survives_a_save():
    n = numbers_of([(1, [0, 1, 2]), (2, [2 ** 60])])
    assert n.missing_share("v") == (RECENT_NUMBERS - 1, RECENT_NUMBERS)
    n.close_below(3)
    again = GroupNumbers.from_json(n.to_json())
    assert again.missing_share("v") == n.missing_share("v") == (RECENT_NUMBERS - 1, RECENT_NUMBERS)
    assert again.by["v"].gaps == [[2 ** 60 + 1 - RECENT_NUMBERS, 2 ** 60]]


def test_a_bound_of_1_holds_nothing():
    n = numbers_of([(1, [900])])
    assert hold_back([group("v", 900)], n, 1.0) == ([group("v", 900)], [])


def test_the_unsent_tail_of_a_grant_is_missing_once_its_version_leaves_the_window():
    """Numbers granted for a version (trainer.granting) and never sent count as missing when
    the version closes, even with nothing sent after them: before grants the end of a
    volunteer's last version was invisible. While the version is open they do not count:
    an honest volunteer is still sampling them."""
    n = numbers_of([(1, list(range(0, 4)))])
    n.grant("v", 0, 16, 1)  # a grant of 16, of which 4 were sent
    n.grant("v", 16, 24, 2)  # the next grant, for v2, not sampled yet
    assert n.missing_share("v") == (0, 4) and n.granted_end("v") == 24
    assert n.close_below(2) == {"v": (16, 12)}
    assert n.missing_share("v") == (16, 16) and n.held("v", BOUND)  # #0-#3 share a block with #4-#7
    assert n.close_below(3) == {"v": (8, 8)}  # v2's grant: nothing of it ever came
    again = GroupNumbers.from_json(n.to_json())  # kept with the trainer's state
    assert again.missing_share("v") == (24, 24) and again.granted_end("v") == 24


def test_numbers_granted_under_a_leaving_version_and_not_received_are_in_flight():
    """What the publish that would push a version out waits for (roles.Single.in_flight)."""
    n = numbers_of([(1, list(range(0, 8)))])
    n.grant("v", 8, 16, 1)  # granted under v1, not received yet
    keep = lambda v: False  # noqa: E731 (skip none)
    assert n.outstanding(2, keep) == 1  # the next publish pushes v1 out
    assert n.outstanding(1, keep) == 0  # it pushes out only v0: nothing of v1 counts
    assert n.outstanding(2, lambda v: v == "v") == 0
    assert n.add("v", "rollouts/v000001/v/s9.jsonl.gz", 1, list(range(8, 12))) is None
    assert n.outstanding(2, keep) == 1  # half of the grant still out
    assert n.add("v", "rollouts/v000001/v/s10.jsonl.gz", 1, list(range(12, 16))) is None
    assert n.outstanding(2, keep) == 0
    # A volunteer that went past a grant (it lost its number file) is not waited for.
    n.grant("w", 0, 8, 1)
    assert n.add("w", "rollouts/v000002/w/s0.jsonl.gz", 2, [8]) is None
    assert n.outstanding(2, keep) == 0


def test_a_publish_waits_for_no_grant_of_a_held_denied_or_waiting_volunteer():
    """roles.Single.in_flight: a volunteer that leaves its grants unsampled holds one
    publish back, then is held for its missing share and holds none; a denied one, or one
    whose shards wait for its reward share, holds none."""
    from types import SimpleNamespace

    from volunteer_rl.trainer.groups import Window
    from volunteer_rl.trainer.roles import Single

    n = GroupNumbers()
    n.grant("v", 0, 8, 1)
    out = {"v": True}
    role = object.__new__(Single)
    role.cfg = SimpleNamespace(missing_bound=BOUND)
    role.publisher = SimpleNamespace(numbers=n)
    role.ingest = SimpleNamespace(waits_for=lambda v: out[v])
    assert role.in_flight(Window(2, 2, {0, 1, 2})) == 0  # v1 stays in the window
    assert role.in_flight(Window(3, 2, {1, 2, 3})) == 1
    out["v"] = False  # denied, or waiting for its reward share
    assert role.in_flight(Window(3, 2, {1, 2, 3})) == 0
    out["v"] = True
    n.close_below(2)  # the publish went; the grant was never sampled
    n.grant("v", 8, 16, 3)
    assert n.held("v", BOUND)
    assert role.in_flight(Window(5, 2, {3, 4, 5})) == 0
