"""The trainer's intake on an in-memory bucket: pure logic, a stand-in decoder."""
import pytest

from volunteer_rl import layout
from volunteer_rl.ingest import Ingest, IngestStats, Rules, window
from volunteer_rl.shards import Completion, Group, encode_shard
from volunteer_rl.storage import open_storage
from volunteer_rl.task import Problem

# token id t decodes to str(t): "12" is a completion whose text is 12
PROBLEMS = [Problem(0, "add 5 and 7", "5 + 7"), Problem(1, "double 4", "4 * 2")]


def rules():
    return Rules(PROBLEMS, vocab_size=100, k=2, max_new_tokens=8,
                 decode=lambda ids: "".join(str(t) for t in ids))


def put(storage, version, vol, groups, name="s1"):
    key = layout.shard_key(version, vol, name)
    storage.write(key, encode_shard(groups))
    return key


def g(prompt_id, version, vol, tokens, claimed=(0.0, 0.0)):
    return Group(prompt_id, version, vol, [Completion(t, [-0.5] * len(t), "", r)
                                           for t, r in zip(tokens, claimed)])


def fresh_storage(name):
    return open_storage(f"memory://ingest-{name}")


def test_window():
    assert list(window(5, 2)) == [3, 4, 5]
    assert list(window(1, 3)) == [0, 1]


def test_rewards_are_recomputed_not_trusted():
    s = fresh_storage("rewards")
    # completion [12] decodes to "12" (= 5 + 7, right); [99] is wrong but claims reward 1
    put(s, 3, "v1", [g(0, 3, "v1", [[12], [99]], claimed=(0.0, 1.0))])
    out = Ingest(s, rules(), log=lambda m: None).poll(3, 2, IngestStats())
    assert [x.rewards for x in out] == [[1.0, 0.0]]


def test_only_the_window_is_listed_and_shards_are_taken_once():
    s = fresh_storage("window")
    put(s, 0, "v1", [g(0, 0, "v1", [[12], [1]])])
    put(s, 4, "v1", [g(1, 4, "v1", [[8], [1]])])
    ing = Ingest(s, rules(), log=lambda m: None)
    listed = []
    real_list = s.list
    s.list = lambda prefix: listed.append(prefix) or real_list(prefix)
    out = ing.poll(5, 2, IngestStats())
    assert [x.policy_version for x in out] == [4]
    assert listed == ["rollouts/v000003", "rollouts/v000004", "rollouts/v000005"]
    assert ing.poll(5, 2, IngestStats()) == []


@pytest.mark.parametrize("groups, vol_in_key, reason", [
    ([g(7, 3, "v1", [[1], [2]])], "v1", "unknown_prompt"),
    ([g(0, 2, "v1", [[1], [2]])], "v1", "version_mismatch"),
    ([g(0, 3, "other", [[1], [2]])], "v1", "volunteer_mismatch"),
    ([g(0, 3, "v1", [[1], [200]])], "v1", "bad_token"),
    ([g(0, 3, "v1", [[1] * 9, [2]])], "v1", "too_many_tokens"),
    ([Group(0, 3, "v1", [Completion([1], [-0.1], "", 0.0)])], "v1", "bad_group_size"),
])
def test_bad_groups_reject_the_whole_shard(groups, vol_in_key, reason):
    s = fresh_storage(f"bad-{reason}")
    good = g(1, 3, vol_in_key, [[8], [1]])
    put(s, 3, vol_in_key, [good] + groups)
    stats = IngestStats()
    logs = []
    out = Ingest(s, rules(), log=logs.append).poll(3, 2, stats)
    assert out == [] and stats.rejected == {reason: 1}
    assert logs and "rollouts/v000003/" in logs[0]


def test_unreadable_shard_is_reported_and_skipped():
    s = fresh_storage("garbage")
    s.write("rollouts/v000001/v1/x.jsonl.gz", b"\x1f\x8b garbage")
    s.write("rollouts/v000001/v1/notes.txt", b"not a shard key")
    stats = IngestStats()
    logs = []
    assert Ingest(s, rules(), log=logs.append).poll(1, 2, stats) == []
    assert stats.rejected == {"bad_gzip": 1, "bad_key": 1}
    assert len(logs) == 2


def scored(version, prompt_id=0):
    from volunteer_rl.ingest import ScoredGroup
    return ScoredGroup(prompt_id, version, "v1", [[1], [2]], [[-1.0], [-1.0]], [1.0, 0.0], "k")


def test_staleness_filter():
    from volunteer_rl.ingest import split_fresh
    groups = [scored(v) for v in (3, 7, 5, 6, 4, 8)]
    fresh, stale = split_fresh(groups, version=7, max_staleness=2)
    assert [g.policy_version for g in fresh] == [7, 6, 5]        # newest first, window 5..7
    assert sorted(g.policy_version for g in stale) == [3, 4, 8]  # too old, or from the future
    fresh, stale = split_fresh(groups, version=7, max_staleness=0)
    assert [g.policy_version for g in fresh] == [7]
