"""Rewards budgeted per batch, per shard, per volunteer and per poll (issue 41, point 4): a
real reward worker (task.bounded) running helpers.trap_tasks.TrapTask, whose reward of a
completion starting with "burn" takes BURN_SECONDS of CPU, within its 0.5 s bound; the
intake (trainer.ingest) on an in-memory bucket, with a stand-in decoder."""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import pytest
from test_audit_policy import Clock

from helpers.trap_tasks import BURN_SECONDS, TrapTask
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.protocol.shards import Completion, Group, encode_shard
from volunteer_rl.storage import open_storage
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded import BoundedRewards, RewardBoundExceeded, Spend
from volunteer_rl.trainer.checks import Rules
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.groups import IngestStats, Window
from volunteer_rl.trainer.ingest import Ingest
from volunteer_rl.trainer.reward_budget import (
    SHARE_BURST_SECONDS,
    RewardBudget,
    RewardShares,
    RewardStats,
)

TRAP = f"{TrapTask.__module__}:TrapTask"
ROW = Row(0, {"question": "q"})
EOS, OK, BURN = 100, 1, 2
"""Token ids: EOS; OK decodes to "ok" (reward 1.0); BURN to "burn"; any other t < 100 to
str(t), so [BURN, 7] is "burn7": a completion of its own, not a cache hit."""
SEQ = itertools.count()


@pytest.fixture
def bounded():
    with BoundedRewards(TRAP, TrapTask.reward_seconds, TrapTask.reward_memory_mb) as b:
        yield b


# -- a batch's bounds (task.bounded.Spend) ---------------------------------------------


def burns(n: int) -> list[tuple[str, Row]]:
    return [(f"burn{i}", ROW) for i in range(n)]


def test_a_batch_over_its_cpu_budget_is_a_reward_budget_breach_after_a_few_completions(bounded):
    spend = Spend(cpu_bound=0.5)
    with pytest.raises(RewardBoundExceeded) as caught:
        bounded.rewards(burns(20), spend)  # 4 s of CPU unbounded
    assert caught.value.code == "reward_budget"
    assert 2 <= caught.value.index <= 3, caught.value  # 0.5 s is spent during the third
    assert "over 0.5 s of CPU in all" in caught.value.detail
    assert 0.5 < spend.cpu < 0.5 + BURN_SECONDS, spend
    assert bounded.pid is None  # killed; the next call starts another
    assert bounded.rewards([("ok", ROW)], Spend(cpu_bound=0.5)) == [1.0]


def test_a_batch_past_its_deadline_is_cut_without_blame_and_keeps_what_it_computed(bounded):
    assert bounded.rewards([("ok", ROW)]) == [1.0]  # started: the deadline is the batch's
    spend = Spend(until=time.monotonic() + 0.5)
    got = bounded.rewards([("ok", ROW), *burns(20)], spend)
    assert 1 <= len(got) < 21 and got[0] == 1.0 and set(got[1:]) <= {0.0}, got
    assert spend.wall >= 0.5 and bounded.pid is None
    assert bounded.rewards([("ok", ROW)], Spend(until=time.monotonic() - 1)) == []  # spent


def test_a_stop_cuts_a_batch_mid_completion(bounded):
    """"spin" never ends on its own (its bound would end it after 0.5 s of CPU, or 10 s of
    wall clock if the worker were starved): the stop ends it first."""
    assert bounded.rewards([("ok", ROW)]) == [1.0]  # started: the stop lands mid-batch
    stopped = threading.Event()
    threading.Timer(0.2, stopped.set).start()
    spend = Spend(stop=stopped.is_set)
    assert bounded.rewards([("ok", ROW), ("spin", ROW), ("ok", ROW)], spend) == [1.0]
    assert bounded.pid is None and spend.cpu < TrapTask.reward_seconds, spend


# -- the intake's budgets (trainer.reward_budget through Ingest.poll) --------------------


def rules(bounded: BoundedRewards) -> Rules:
    return Rules([ROW], vocab_size=101, k=2, max_new_tokens=8, rewards=bounded.rewards,
                 decode=lambda ids: "".join({OK: "ok", BURN: "burn"}.get(t, str(t)) for t in ids),
                 eos_id=EOS, special_ids=frozenset({EOS}))


def shard(storage, volunteer: str, completions: list[list[int]], name: str) -> str:
    """One shard of groups of two completions each (token ids, EOS added), claiming the
    rewards TrapTask gives them."""
    groups = []
    for a, b in zip(completions[::2], completions[1::2]):
        pair = [a + [EOS], b + [EOS]]
        claims = [1.0 if c == [OK] else 0.0 for c in (a, b)]
        groups.append(Group(0, 0, volunteer, next(SEQ), [
            Completion(ids, [-0.5] * len(ids), "", r) for ids, r in zip(pair, claims)]))
    key = layout.shard_key(0, volunteer, name)
    storage.write(key, encode_shard(groups))
    return key


def honest(storage, name: str = "s") -> str:
    return shard(storage, "good", [[OK], [3]], name)


def burner(storage, n: int, name: str, first: int = 10) -> str:
    """A shard of `n` "burn" completions, "burn<first>" on: none a cache hit of another's."""
    return shard(storage, "evil", [[BURN, first + i] for i in range(n)], name)


def intake(name: str, bounded: BoundedRewards, budget: RewardBudget):
    storage = open_storage(f"memory://reward-budget-{name}")
    ing = Ingest(storage, rules(bounded), Ledger(), Fleet(), None, LOG.append, budget=budget)
    return storage, ing


LOG: list[str] = []


WIN = Window(0, 2, {0})
LEAVING = Window(1, 1, {0, 1})
"""v0 (every shard's here) is inside the window and leaves it at the next publish."""


def test_a_shard_over_its_budget_is_rejected_and_an_honest_volunteer_still_gets_in(bounded):
    storage, ing = intake("shard", bounded, RewardBudget(shard_seconds=0.5, poll_seconds=60))
    hostile, good = burner(storage, 20, "s"), honest(storage)
    stats = IngestStats()
    taken = ing.poll(WIN, stats)
    assert stats.rejected == {"reward_budget": 1} and hostile in ing.taken
    assert f"rejected {hostile}: reward_budget: " in LOG[-1]
    assert "over 0.5 s of CPU in all (--shard-reward-seconds)" in LOG[-1], LOG[-1]
    assert [g.key for g in taken] == [good]
    assert 0 < stats.reward.seconds == stats.reward.poll_max and stats.reward.deferred == 0


def test_a_volunteer_past_its_share_of_the_poll_waits_and_the_others_get_in(bounded):
    """Two volunteers in the poll: each has half of its 2 s. The hostile one sorts first;
    each of its shards stays within its 0.6 s budget (two "burn"s of 0.2 s), and it has 12
    of them (at least 4.8 s): some wait for a later poll, the honest shard is taken now."""
    storage, ing = intake("share", bounded, RewardBudget(shard_seconds=0.6, poll_seconds=2.0))
    hostile = [burner(storage, 2, f"s{i:02d}", 10 + 2 * i) for i in range(12)]
    good = honest(storage)
    stats = IngestStats()
    first = ing.poll(WIN, stats)
    assert good in {g.key for g in first}
    assert stats.reward.deferred >= 1 and not stats.rejected, stats
    assert len([k for k in hostile if k in ing.taken]) < 12
    later = IngestStats()
    for _ in range(60):  # later polls take the rest
        if set(hostile) <= ing.taken:
            break
        ing.poll(WIN, later)
    assert set(hostile) <= ing.taken and not later.rejected, later


def test_a_shard_cut_by_the_polls_deadline_resumes_next_poll_and_is_rejected_at_its_budget(bounded):
    """Each poll may spend 0.3 s on rewards, a shard 1.0 s of CPU: a shard of 10 "burn"
    completions (2 s) is cut at each poll's deadline, its spending carried to the next, and
    rejected once the carried CPU time passes its budget: never re-read from scratch."""
    storage, ing = intake("cut", bounded, RewardBudget(shard_seconds=1.0, poll_seconds=0.5))
    hostile = burner(storage, 10, "s")
    polls = []
    while hostile not in ing.taken and len(polls) < 100:
        stats = IngestStats()
        ing.poll(WIN, stats)
        polls.append(stats)
    assert polls[-1].rejected == {"reward_budget": 1}, [s.rejected for s in polls]
    assert len(polls) >= 2 and all(s.reward.deferred == 1 for s in polls[:-1])
    assert LOG[-1].startswith(f"rejected {hostile}: reward_budget: ") and \
        "over 1 s of CPU in all (--shard-reward-seconds)" in LOG[-1], LOG[-1]
    assert hostile not in ing.budget.carried
    # the poll's cap holds, give or take the worker's start and the cut's latency
    assert max(s.reward.poll_max for s in polls) < 0.5 + 5.0


def test_a_stop_ends_a_polls_reading_and_leaves_the_shards_for_later(bounded):
    stop = threading.Event()
    storage, ing = intake("stop", bounded, RewardBudget(shard_seconds=60, poll_seconds=60,
                                                          stopping=stop.is_set))
    hostile, good = burner(storage, 16, "s"), honest(storage, "t")  # 3.2 s of CPU
    threading.Timer(0.5, stop.set).start()
    stats = IngestStats()
    assert ing.poll(WIN, stats) == []
    assert stats.reward.deferred == 1 and not stats.rejected  # cut, not blamed
    assert hostile not in ing.taken and good not in ing.taken  # both wait
    assert hostile in ing.budget.carried
    stop.clear()
    assert good in {g.key for g in ing.poll(WIN, IngestStats())}


# -- each volunteer's share of the trainer's time (RewardShares, --reward-share) ----------


def test_a_volunteers_share_is_a_token_bucket_it_may_overdraw_once_then_waits():
    clock = Clock()
    shares = RewardShares(0.1, clock)
    assert shares.level("evil") == SHARE_BURST_SECONDS and not shares.owes("evil")  # new: full
    shares.take("evil", 2.0)  # one shard, scored while the bucket was above zero
    assert shares.level("evil") == pytest.approx(SHARE_BURST_SECONDS - 2.0) and shares.owes("evil")
    assert not shares.owes("good")  # each volunteer its own bucket
    clock.now += 14.9  # 0.1 s earned a second: still owes 0.01 s
    assert shares.owes("evil") and shares.owing() == 1
    clock.now += 0.2
    assert not shares.owes("evil") and shares.owing() == 0
    clock.now += 3600  # an idle spell refills it to the burst, no more
    assert shares.level("evil") == SHARE_BURST_SECONDS
    assert shares.owing() == 0 and shares.buckets == {}  # full buckets are not kept
    # Over T seconds a volunteer that keeps sending costs at most burst + one shard + share x T.
    spent, shard = 0.0, 2.0
    for _ in range(1000):
        clock.now += 1.0
        if not shares.owes("evil"):
            shares.take("evil", shard)
            spent += shard
    assert spent <= SHARE_BURST_SECONDS + shard + 0.1 * 1000, spent


def test_an_unbounded_share_never_makes_anyone_wait():
    shares = RewardShares()
    shares.take("evil", 1e9)
    assert not shares.owes("evil") and shares.buckets == {}


def test_the_budget_charges_a_shards_rewards_to_its_volunteer_but_not_the_workers_start():
    clock = Clock()
    budget = RewardBudget(shard_seconds=2.0, poll_seconds=60, shares=RewardShares(0.01, clock))
    stats = RewardStats()
    budget.begin(2, stats)
    spend = budget.spend("a", "evil")
    spend.wall, spend.start = 3.0, 2.9  # a worker start of 2.9 s, then 0.1 s of rewards
    budget.charge("a", "evil", spend, False, stats)
    assert budget.shares.level("evil") == pytest.approx(SHARE_BURST_SECONDS - 0.1)
    spend = budget.spend("b", "evil")
    spend.wall = 2.0
    budget.charge("b", "evil", spend, False, stats)
    assert budget.owes("evil") and budget.spend("c", "evil") is None  # waits
    assert budget.spend("d", "good") is not None
    budget.begin(2, stats)
    assert stats.waiting == 1 and stats.seconds == 5.0
    for _ in range(3):  # a follower rank's report after each of its polls: the most, not a sum
        stats.add(dataclasses.asdict(RewardStats(waiting=1)))
    assert stats.waiting == 1


def test_a_volunteer_past_its_share_of_the_trainers_time_waits_unfetched_and_the_others_get_in(bounded):
    """Each "burn" shard (4 completions, 0.8 s) is within its budget (1 s); the burner's share
    is 1 % of the trainer's time, on a clock the test moves: its first shard is scored and
    overdraws its bucket, and its other shards wait, neither fetched nor rejected, polls on
    end, while the honest volunteer's shards are taken at every poll. Once the clock has
    given back what it overdrew, its next shard is scored, and overdraws it again. Its shards wait in the version the
    next publish pushes out of the window, and do not hold that publish back."""
    clock = Clock()
    storage, ing = intake("time-share", bounded, RewardBudget(
        shard_seconds=1.0, poll_seconds=60, shares=RewardShares(0.01, clock)))
    hostile = [burner(storage, 4, f"s{i:02d}", 40 + 4 * i) for i in range(3)]
    fetched: list[str] = []
    read = storage.read

    def counted(key, *args, **kwargs):
        fetched.append(key)
        return read(key, *args, **kwargs)

    storage.read = counted
    first, good = IngestStats(), honest(storage, "h0")
    assert good in {g.key for g in ing.poll(LEAVING, first)}
    assert hostile[0] in ing.taken and first.reward.deferred == 2, first.reward
    for n in range(1, 4):
        fetched.clear()
        stats = IngestStats()
        good = shard(storage, "good", [[OK], [3 + n]], f"h{n}")  # not a duplicate of h0
        assert good in {g.key for g in ing.poll(LEAVING, stats)}
        assert not set(hostile[1:]) & ing.taken and not stats.rejected
        assert fetched == [good], fetched  # the burner's shards wait unfetched
        assert stats.reward.deferred == 2 and stats.reward.waiting == 1, stats.reward
        assert ing.unread_low == 0
    clock.now += 1000  # 10 s earned (a shard's wall clock on a loaded machine): above zero
    stats = IngestStats()
    ing.poll(LEAVING, stats)
    assert hostile[1] in ing.taken and hostile[2] not in ing.taken, stats.reward
