"""The trainer's intake split over ranks (trainer.shares): each rank reads its own volunteers,
and what one volunteer's shards cannot show alone (a copy of another's content, the same
content claimed twice) is still caught when the two volunteers belong to different ranks.

The ranks here are two Ingests on two threads over one bucket; their exchange is a
threading.Barrier standing in for the all-gather (ranks.all_gather_bytes, which the 2-rank
live tests run for real). The rules are test_ingest's."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

from test_ingest import SEQ, fresh_storage, g, honest_groups, put, rules, win

from helpers.recording_storage import RecordingStorage
from volunteer_rl.protocol.ledger import Ledger, group_digest
from volunteer_rl.protocol.shards import Group
from volunteer_rl.trainer.audit import Auditor, Budget
from volunteer_rl.trainer.fleet import Counts, Fleet
from volunteer_rl.trainer.groups import IngestStats, train_order
from volunteer_rl.trainer.ingest import Ingest
from volunteer_rl.trainer.ranks import owner_rank
from volunteer_rl.trainer.shares import agree_on_batch


def ids_of(rank: int, n: int, prefix: str) -> list[str]:
    """The first `n` volunteer ids starting with `prefix` that hash to `rank` of 2."""
    out, i = [], 0
    while len(out) < n:
        if owner_rank(f"{prefix}{i}", 2) == rank:
            out.append(f"{prefix}{i}")
        i += 1
    return out


class Board:
    """What two thread-ranks exchange through: one slot each, and a barrier."""

    def __init__(self, world: int = 2):
        self.slots: list = [None] * world
        # a hang guard (a rank that never comes), not a pace: a rank's audits between two
        # meetings take seconds on a busy machine
        self.barrier = threading.Barrier(world, timeout=300)


class ThreadShare:
    """A rank's Share (trainer.shares.Share's interface) over a Board instead of gloo."""

    def __init__(self, rank: int, board: Board):
        self.rank, self.board = rank, board
        self.owns_nobodys = rank == 0
        self.exchanges = 0

    def owns(self, volunteer: str) -> bool:
        return owner_rank(volunteer, len(self.board.slots)) == self.rank

    def exchange(self, report: dict) -> list[dict]:
        self.exchanges += 1
        self.board.slots[self.rank] = json.loads(json.dumps(report))  # JSON, as on the wire
        self.board.barrier.wait()
        out = list(self.board.slots)
        self.board.barrier.wait()
        return out


class Never:
    """The auditor's random generator for volunteers it trusts: no shard is ever drawn."""

    def random(self):
        return 0.999


def trusted(*volunteers):
    return Fleet(deny_after=0, counts={v: Counts(accepted=10**4, clean=10**4, accepted_groups=10**4)
                                       for v in volunteers})


def digest(x: Group) -> str:
    return group_digest(x.prompt_id, x.policy_version, [c.token_ids for c in x.completions])


class Sampled:
    """Who really sampled what: a replay passes a group only under an id that sampled it
    (committed noise is keyed by the volunteer), as trainer.step.audit_groups does."""

    def __init__(self):
        self.by: dict[str, set[str]] = {}
        self.replayed: list[tuple[str, int]] = []

    def shard(self, storage, vol, groups, name):
        for x in groups:
            self.by.setdefault(digest(x), set()).add(vol)
        return put(storage, 3, vol, groups, name=name)

    def replay(self, version, groups):
        self.replayed.append((groups[0].volunteer_id, len(groups)))
        bad = [x for x in groups if x.volunteer_id not in self.by.get(x.digest, set())]
        return ("replay_mismatch", "not sampled by its volunteer") if bad else None


def as_(vol: str, x: Group) -> Group:
    """`x`'s content sent under `vol`'s id (a copy, or the same sample drawn twice)."""
    return Group(x.prompt_id, x.policy_version, vol, next(SEQ), x.completions)


def two_ranks(storage, fleets, replay=None):
    """Two Ingests of one bucket, rank 0 and rank 1, each with its own ledger and fleet."""
    board = Board()
    return [Ingest(storage, rules(), Ledger(), fleets[r],
                   None if replay is None else Auditor(replay, Budget(1.0), 10, 0.005, Never()),
                   lambda m: None, share=ThreadShare(r, board))
            for r in range(2)]


def poll_both(ingests, stats=None, waiting=None):
    """One poll of every rank at once (the exchanges are collective)."""
    stats = stats or [IngestStats(), IngestStats()]
    waiting = waiting or [[], []]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ing.poll, win(3), s, w) for ing, s, w in zip(ingests, stats, waiting)]
        return [f.result() for f in futures]


def test_each_rank_reads_only_its_volunteers_and_together_they_take_what_one_process_takes():
    storage = fresh_storage("shares-split")
    volunteers = ids_of(0, 3, "v") + ids_of(1, 3, "v")
    for i, vol in enumerate(volunteers):
        put(storage, 3, vol, honest_groups(vol, 3, 5000 + 10 * i))
    single = Ingest(storage, rules(), Ledger(), Fleet(), None, lambda m: None).poll(win(3), IngestStats())
    seen = [RecordingStorage(storage), RecordingStorage(storage)]
    ingests = [Ingest(seen[r], rules(), Ledger(), Fleet(), None, lambda m: None,
                      share=ThreadShare(r, board))
               for board in [Board()] for r in range(2)]
    outs = poll_both(ingests)
    for r, out in enumerate(outs):
        assert out and {x.volunteer_id for x in out} == {v for v in volunteers if owner_rank(v, 2) == r}
        assert seen[r].calls["read"] == 3  # its own volunteers' shards: one GET each
    assert sorted((x.key, x.line) for out in outs for x in out) == sorted((x.key, x.line) for x in single)


def test_a_copy_read_by_another_rank_is_replayed_and_fails_there():
    """ann (rank 0) and cat (rank 1) are trusted: neither is ever drawn for an audit. cat
    hides one group copied from ann's shard of the same poll among its own. Only the other
    rank parsed the original, yet both groups are contested: replayed under their ids, the
    copy fails and cat's shard is rejected on rank 1; ann's is taken whole on rank 0. A copy
    of content rank 0 took in an earlier poll fails the same way."""
    (ann,), (cat,) = ids_of(0, 1, "ann"), ids_of(1, 1, "cat")
    storage, sampled = fresh_storage("shares-copy"), Sampled()
    mine = honest_groups(ann, 8, 6000)
    ann_key = sampled.shard(storage, ann, mine, "s1")
    cats = honest_groups(cat, 7, 6100)
    for x in cats:
        sampled.by.setdefault(digest(x), set()).add(cat)
    cat_key = put(storage, 3, cat, [as_(cat, mine[2]), *cats], name="s1")
    ingests = two_ranks(storage, [trusted(ann), trusted(cat)], sampled.replay)
    stats = [IngestStats(), IngestStats()]
    outs = poll_both(ingests, stats)
    assert {x.key for x in outs[0]} == {ann_key} and len(outs[0]) == 8 and not outs[1]
    assert ingests[1].ledger.rejected[cat_key] == "replay_mismatch"
    assert stats[1].rejected == {"replay_mismatch": 1} and not stats[0].rejected
    assert sorted(sampled.replayed) == [(ann, 1), (cat, 1)]  # the shared group, not whole shards
    assert ingests[1].ledger.owner(digest(mine[5])) == ann  # rank 0's claims are known on rank 1

    sampled.replayed.clear()
    late = put(storage, 3, cat, [as_(cat, mine[5]), *honest_groups(cat, 1, 6200)], name="s2")
    for x in honest_groups(cat, 1, 6200):
        sampled.by.setdefault(digest(x), set()).add(cat)
    stats = [IngestStats(), IngestStats()]
    outs = poll_both(ingests, stats)
    assert not outs[1] and ingests[1].ledger.rejected[late] == "replay_mismatch"
    assert sampled.replayed == [(cat, 1)]


def test_the_same_content_from_two_ranks_in_one_poll_is_taken_once():
    """ann (rank 0) and bob (rank 1) both sampled one identical group, as honest volunteers
    of a confident policy do: both replays pass, both ranks claim it, and the exchange after
    the poll leaves it to the lower rank; rank 1 records its copy a duplicate, so it is
    trained once, as one process would."""
    (ann,), (bob,) = ids_of(0, 1, "ann"), ids_of(1, 1, "bob")
    storage, sampled = fresh_storage("shares-twice"), Sampled()
    shared = g(1, 3, ann, [[8], [77, 7]])
    sampled.shard(storage, ann, [shared, *honest_groups(ann, 3, 7000)], "s1")
    bob_key = sampled.shard(storage, bob, [as_(bob, shared), *honest_groups(bob, 3, 7100)], "s1")
    ingests = two_ranks(storage, [trusted(ann), trusted(bob)], sampled.replay)
    stats = [IngestStats(), IngestStats()]
    outs = poll_both(ingests, stats)
    digests = [x.digest for out in outs for x in out]
    assert digests.count(digest(shared)) == 1 and len(digests) == 7
    assert digest(shared) in {x.digest for x in outs[0]}
    assert stats[1].duplicates == 1 and not stats[0].rejected and not stats[1].rejected
    assert ingests[1].ledger.is_done(bob_key, 0) and ingests[1].ledger.owner(digest(shared)) == ann


def test_a_copy_taken_before_its_original_is_re_audited_by_its_own_rank():
    """cat (rank 1) sends a copy of content whose original (ann, rank 0) is not in the bucket
    yet: trusted, cat's shard is taken without a replay. When ann's original arrives it is
    contested (rank 1 took that content), passes its replay, and rank 0 asks rank 1 to
    re-audit cat's shard: the copy fails, cat's shard is rejected and its groups withdrawn."""
    (ann,), (cat,) = ids_of(0, 1, "ann"), ids_of(1, 1, "cat")
    storage, sampled = fresh_storage("shares-recheck"), Sampled()
    original = honest_groups(ann, 4, 8000)
    for x in original:
        sampled.by.setdefault(digest(x), set()).add(ann)
    cats = honest_groups(cat, 3, 8100)
    for x in cats:
        sampled.by.setdefault(digest(x), set()).add(cat)
    cat_key = put(storage, 3, cat, [as_(cat, original[1]), *cats], name="s1")  # with the copy
    ingests = two_ranks(storage, [trusted(ann), trusted(cat)], sampled.replay)
    waiting = poll_both(ingests)
    assert len(waiting[1]) == 4 and not sampled.replayed  # taken unaudited

    ann_key = put(storage, 3, ann, original, name="s1")
    stats = [IngestStats(), IngestStats()]
    outs = poll_both(ingests, stats, waiting)
    assert sorted(sampled.replayed) == [(ann, 1), (cat, 1)]
    assert ingests[1].ledger.rejected[cat_key] == "replay_mismatch" and not outs[1]
    assert {x.key for x in outs[0]} == {ann_key}


def test_the_ranks_agree_on_the_batch_one_process_would_take():
    """Each rank holds its own fresh groups; the batch is the first of their merged lists in
    training order (newest version, arrival, key, line), the same on both ranks, and each
    rank gives up exactly the prefix of its own list that went into it."""
    storage = fresh_storage("shares-batch")
    volunteers = ids_of(0, 2, "w") + ids_of(1, 2, "w")
    for i, vol in enumerate(volunteers):
        for version in (2, 3):
            put(storage, version, vol, [g(1, version, vol, [[8], [i + 1, version]])],
                name=f"s{version}")
    single = Ingest(storage, rules(), Ledger(), Fleet(), None, lambda m: None).poll(win(3), IngestStats())
    single.sort(key=train_order)
    board = Board()
    shares = [ThreadShare(r, board) for r in range(2)]
    mine = [sorted((x for x in single if owner_rank(x.volunteer_id, 2) == r), key=train_order)
            for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(agree_on_batch, shares[r], mine[r], 6, {"rank": r}) for r in range(2)]
        results = [f.result() for f in futures]
    expected = [(x.key, x.line) for x in single[:6]]
    for r, (batch, taken, reports) in enumerate(results):
        assert [(x.key, x.line) for x in batch] == expected
        assert taken == sum(1 for x in single[:6] if owner_rank(x.volunteer_id, 2) == r)
        assert [rep["rank"] for rep in reports] == [0, 1]
    assert 0 < results[0][1] < 6
    with ThreadPoolExecutor(2) as pool:  # not enough between them: no batch, nothing taken
        futures = [pool.submit(agree_on_batch, shares[r], mine[r], 99, {}) for r in range(2)]
        assert [f.result()[:2] for f in futures] == [(None, 0), (None, 0)]


def test_a_ranks_counts_reach_the_writer_whole():
    """IngestStats through JSON (a follower's report) adds up on the writer: the reason
    counts, the per-volunteer rows and the audit's figures included."""
    theirs = IngestStats(shards=3, groups=7, zero_variance=1, duplicates=2, denied=1)
    theirs.rejected.update({"bad_gzip": 2, "reward_mismatch": 1})
    theirs.by_volunteer = {"ann": [2, 1], "bob": [1, 0]}
    theirs.audit.audited, theirs.audit.seconds, theirs.audit.by_volunteer = 2, 0.5, {"ann": 2}
    mine = IngestStats(shards=1, groups=2)
    mine.rejected["bad_gzip"] = 1
    mine.by_volunteer = {"ann": [1, 0]}
    mine.add_json(json.loads(json.dumps(theirs.to_json())))
    assert (mine.shards, mine.groups, mine.zero_variance, mine.duplicates, mine.denied) == (4, 9, 1, 2, 1)
    assert mine.rejected == {"bad_gzip": 3, "reward_mismatch": 1}
    assert mine.by_volunteer == {"ann": [3, 1], "bob": [1, 0]}
    assert (mine.audit.audited, mine.audit.seconds, mine.audit.by_volunteer) == (2, 0.5, {"ann": 2})
