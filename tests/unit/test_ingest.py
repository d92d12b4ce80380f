"""The trainer's intake on an in-memory bucket: pure logic, a stand-in decoder."""
import itertools
import random

import pytest

from helpers.recording_storage import RecordingStorage
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.fleet import read_denylist
from volunteer_rl.protocol.layout import window
from volunteer_rl.protocol.ledger import Ledger, group_digest, rebuild
from volunteer_rl.protocol.shards import SHARD_GROUPS_LIMIT, Completion, Group, encode_shard
from volunteer_rl.storage import open_storage
from volunteer_rl.task.base import in_process
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.task.dataset import Problem
from volunteer_rl.trainer.audit import Auditor, Budget, Unavailable
from volunteer_rl.trainer.fleet import Counts, Fleet
from volunteer_rl.trainer.checks import Rules
from volunteer_rl.trainer.groups import IngestStats, Window
from volunteer_rl.trainer.ingest import MAX_TRAINER_FAULTS, Ingest

# token id t < 100 decodes to str(t): "12" is a completion whose text is 12; 100 is EOS
PROBLEMS = [Problem(0, "add 5 and 7", "5 + 7"), Problem(1, "double 4", "4 * 2")]
EOS = 100
SEQ = itertools.count()  # every group made here gets a number of its own


def rules():
    return Rules([p.row for p in PROBLEMS], vocab_size=101, k=2, max_new_tokens=8,
                 rewards=in_process(CalculatorTask()),
                 decode=lambda ids: "".join(str(t) for t in ids), eos_id=EOS,
                 special_ids=frozenset({EOS}))


def put(storage, version, vol, groups, name="s1"):
    key = layout.shard_key(version, vol, name)
    storage.write(key, encode_shard(groups))
    return key


def g(prompt_id, version, vol, tokens, claimed=None):
    """A group of completions `tokens`, each followed by EOS, whose claimed rewards are the
    true ones unless `claimed` says otherwise."""
    tokens = [t + [EOS] for t in tokens]
    if claimed is None:
        claimed = [rules().reward(prompt_id, t) if prompt_id < len(PROBLEMS) else 0.0
                   for t in tokens]
    return Group(prompt_id, version, vol, next(SEQ), [Completion(t, [-0.5] * len(t), "", r)
                                           for t, r in zip(tokens, claimed)])


def fresh_storage(name):
    return open_storage(f"memory://ingest-{name}")


def auditor(replay, floor=0.05, seed=0):
    return Auditor(replay, Budget(1.0), 10, floor, random.Random(seed))


def make(s, log=lambda m: None, audit=None, fleet=None):
    return Ingest(s, rules(), Ledger(), fleet or Fleet(), audit, log)


def win(version, staleness=2, published=None):
    low = max(0, version - staleness)
    return Window(version, staleness, set(range(low, version + 1)) if published is None else published)


def test_window():
    assert list(window(5, 2)) == [3, 4, 5]
    assert list(window(1, 3)) == [0, 1]


def test_rewards_are_recomputed_and_a_forged_claim_rejects_the_shard():
    s = fresh_storage("rewards")
    # completion [12] decodes to "12" (= 5 + 7, right); [99] is wrong
    put(s, 3, "v1", [g(0, 3, "v1", [[12], [99]], claimed=(1.0, 0.0))], name="honest")
    put(s, 3, "v2", [g(0, 3, "v2", [[12], [98]], claimed=(1.0, 1.0))], name="forged")
    stats = IngestStats()
    out = make(s).poll(win(3), stats)
    assert [x.rewards for x in out] == [[1.0, 0.0]] and out[0].volunteer_id == "v1"
    assert stats.rejected == {"reward_mismatch": 1}


def test_only_the_window_is_listed_and_shards_are_taken_once():
    s = fresh_storage("window")
    put(s, 0, "v1", [g(0, 0, "v1", [[12], [1]])])
    put(s, 4, "v1", [g(1, 4, "v1", [[8], [1]])])
    ing = make(s)
    listed = []
    real_list_level = s.list_level
    s.list_level = lambda prefix: listed.append(prefix) or real_list_level(prefix)
    out = ing.poll(win(5), IngestStats())
    assert [x.policy_version for x in out] == [4]
    assert listed == ["rollouts/v000003", "rollouts/v000004", "rollouts/v000005"]
    assert ing.poll(win(5), IngestStats()) == []


@pytest.mark.parametrize("groups, vol_in_key, reason", [
    ([g(7, 3, "v1", [[1], [2]])], "v1", "unknown_prompt"),
    ([g(0, 2, "v1", [[1], [2]])], "v1", "version_mismatch"),
    ([g(0, 4, "v1", [[1], [2]])], "v1", "unpublished_version"),
    ([g(0, 0, "v1", [[1], [2]])], "v1", "stale_version"),
    ([g(0, 3, "other", [[1], [2]])], "v1", "volunteer_mismatch"),
    ([g(0, 3, "v1", [[1], [200]])], "v1", "bad_token"),
    ([g(0, 3, "v1", [[1] * 9, [2]])], "v1", "too_many_tokens"),
    ([Group(0, 3, "v1", 0, [Completion([1, EOS], [-0.1, -0.1], "", 0.0)])], "v1", "bad_group_size"),
    ([g(0, 3, "v1", [[1, EOS, 2], [2]])], "v1", "after_eos"),
    ([Group(0, 3, "v1", 0, [Completion([1, 2], [-0.1, -0.1], "", 0.0)] * 2)], "v1",
     "short_completion"),
    # with the good group first, one more line than the manifest's max_shard_groups
    ([g(i % 2, 3, "v1", [[8], [i % 90]]) for i in range(SHARD_GROUPS_LIMIT)], "v1", "too_many_groups"),
])
def test_bad_groups_reject_the_whole_shard(groups, vol_in_key, reason):
    s = fresh_storage(f"bad-{reason}")
    good = g(1, 3, vol_in_key, [[8], [1]])
    put(s, 3, vol_in_key, [good] + groups)
    stats = IngestStats()
    logs = []
    out = make(s, logs.append).poll(win(3), stats)
    assert out == [] and stats.rejected == {reason: 1}
    assert logs and "rollouts/v000003/" in logs[0]
    record = s.read(f"quarantine/v000003/{vol_in_key}/s1.json")
    assert f'"reason": "{reason}"' in record.decode()


def test_a_group_for_another_prompt_than_its_number_draws_rejects_the_shard():
    """Schema 6: the pool of each version is published, and group number n of a volunteer
    is for pool_prompt(pool, run, version, volunteer, n); any other prompt is a choice the
    volunteer made (resampling a number with prompts until it likes one)."""
    from volunteer_rl.protocol.draws import pool_prompt
    from volunteer_rl.protocol.grants import seq_nonce

    s = fresh_storage("prompt-draw")
    pools = {3: (0, 1)}
    r = rules()
    r.run_id = "run-p"
    honest, chosen = [], []
    for seq in range(40):  # about half the numbers draw each of the two prompts
        drawn = pool_prompt(pools[3], "run-p", 3, "v1", seq, seq_nonce(r.secret, "run-p", "v1", 3, seq))
        grp = g(drawn, 3, "v1", [[12], [8]])
        grp.seq = seq
        (honest if seq < 20 else chosen).append(grp)
    chosen = [x for x in chosen if x.prompt_id == 1]  # only prompt 1's numbers...
    for x in chosen:
        x.prompt_id = 0  # ...sent for prompt 0 instead
        x.completions = [Completion(c.token_ids, c.logprobs, c.text, r.reward(0, c.token_ids))
                         for c in x.completions]
    assert chosen
    put(s, 3, "v1", honest, name="a-honest")
    put(s, 3, "v1", chosen, name="b-chosen")
    stats = IngestStats()
    ing = Ingest(s, r, Ledger(), Fleet(), None, lambda m: None)
    out = ing.poll(Window(3, 2, {1, 2, 3}, pools), stats)
    assert {x.seq for x in out} <= set(range(20)) and out
    assert stats.rejected == {"prompt_mismatch": 1}
    assert stats.by_volunteer == {"v1": [1, 1]}


def test_unreadable_shard_is_reported_and_skipped():
    s = fresh_storage("garbage")
    s.write("rollouts/v000001/v1/x.jsonl.gz", b"\x1f\x8b garbage")
    s.write("rollouts/v000001/v1/notes.txt", b"not a shard key")
    stats = IngestStats()
    logs = []
    assert make(s, logs.append).poll(win(1), stats) == []
    assert stats.rejected == {"bad_gzip": 1, "bad_key": 1}
    assert len(logs) == 2


def scored(version, prompt_id=0):
    from volunteer_rl.trainer.groups import ScoredGroup
    return ScoredGroup(prompt_id, version, "v1", [[1], [2]], [[-1.0], [-1.0]], [1.0, 0.0], "k")


def test_staleness_filter():
    from volunteer_rl.trainer.groups import split_fresh
    groups = [scored(v) for v in (3, 7, 5, 6, 4, 8)]
    fresh, stale = split_fresh(groups, version=7, max_staleness=2)
    assert [g.policy_version for g in fresh] == [7, 6, 5]        # newest first, window 5..7
    assert sorted(g.policy_version for g in stale) == [3, 4, 8]  # too old, or from the future
    fresh, stale = split_fresh(groups, version=7, max_staleness=0)
    assert [g.policy_version for g in fresh] == [7]


def test_a_version_whose_publish_crashed_is_not_accepted():
    s = fresh_storage("gap")
    put(s, 2, "v1", [g(1, 2, "v1", [[8], [1]])])
    stats = IngestStats()
    assert make(s).poll(win(3, published={1, 3}), stats) == []
    assert stats.rejected == {"unpublished_version": 1}


def test_duplicates_count_once_and_a_shard_of_own_repeats_is_neither_credit_nor_charge():
    s = fresh_storage("dups")
    put(s, 3, "a", [g(1, 3, "a", [[8], [1]])], name="s1")
    again = g(1, 3, "a", [[8], [1]])  # the same content under a fresh number
    put(s, 3, "a", [again], name="s2")
    put(s, 3, "b", [g(1, 3, "b", [[8], [1]]), g(0, 3, "b", [[12], [3]])], name="s3")
    stats = IngestStats()
    ing = make(s)
    out = ing.poll(win(3), stats)
    assert [(x.volunteer_id, x.prompt_id) for x in out] == [("a", 1), ("b", 0)]
    # s2 is what a confident policy samples again under its next number: nothing new to
    # train, so not counted as accepted (repeats would dilute rejects), and not charged
    # either (an honest volunteer would be denied for it). s3 brings one new group.
    assert stats.duplicates == 2 and stats.rejected == {}
    a = ing.fleet.counts["a"]
    assert (a.accepted, a.rejected, a.accepted_groups, a.rejected_groups) == (1, 0, 1, 0)
    assert ing.fleet.counts["b"].accepted == 1 and ing.fleet.counts["b"].rejected == 0
    outcomes = {(r["key"].split("/")[-1], r["outcome"]) for r in ing.ledger.pending}
    assert outcomes == {("s2.jsonl.gz", "duplicate"), ("s3.jsonl.gz", "duplicate")}
    assert not s.exists("quarantine/v000003/a/s2.json")
    assert again.seq in ing.numbers.by["a"].got  # its number arrived: not missing


def test_the_ledger_survives_a_restart_through_the_bucket():
    s = fresh_storage("ledger")
    key = put(s, 3, "a", [g(1, 3, "a", [[8], [1]]), g(1, 3, "a", [[8], [2]])])
    ing = make(s)
    first, second = ing.poll(win(3), IngestStats())
    ing.ledger.record(key, "trained", [first.line], 2, [first.digest], step=1)
    ing.ledger.flush(s, 4)
    # a new trainer process: rebuilt from ledger/v000004.jsonl, it takes only the other group
    again = Ingest(s, rules(), rebuild(s, [4]), Fleet(), None, lambda m: None)
    assert [x.line for x in again.poll(win(3), IngestStats())] == [second.line]
    again.ledger.record(key, "trained", [second.line], 2, [second.digest], step=2)
    assert again.ledger.finished(key)
    assert again.poll(win(3), IngestStats()) == []


def test_audit_mismatch_rejects_the_shard():
    s = fresh_storage("audit")
    put(s, 3, "a", [g(1, 3, "a", [[8], [1]])])
    stats = IngestStats()
    ing = make(s, audit=auditor(lambda v, groups: ("replay_mismatch", "token 0 was not drawn")))
    assert ing.poll(win(3), stats) == [] and stats.rejected == {"replay_mismatch": 1}
    assert stats.audit.by_volunteer == {"a": 1} and ing.fleet.counts["a"].audited == 1


def test_a_stale_shard_is_audited_against_its_own_version_or_waits_for_its_weights():
    s = fresh_storage("audit-stale")
    key = put(s, 2, "a", [g(1, 2, "a", [[8], [1]])])
    held, asked = set(), []

    def replay(version, groups):
        asked.append(version)
        if version not in held:
            raise Unavailable(version)
        return None

    ing, stats = make(s, audit=auditor(replay)), IngestStats()
    assert ing.poll(win(3), stats) == [] and stats.audit.deferred == 1 and not stats.rejected
    held.add(2)
    assert [x.key for x in ing.poll(win(3), stats)] == [key]
    assert asked == [2, 2] and stats.audit.audited == 1


def test_a_shard_waiting_for_the_audit_budget_is_not_fetched_until_it_can_be_audited():
    s = RecordingStorage(fresh_storage("budget"))
    key = put(s, 3, "new", [g(1, 3, "new", [[8], [1]])])
    clock = [0.0]
    budget = Budget(0.1, lambda: clock[0])
    budget.spend(5.0)  # an earlier audit ran long
    ing, stats = make(s, audit=Auditor(lambda v, groups: None, budget, 10, 0.05)), IngestStats()
    for _ in range(3):
        assert ing.poll(win(3), stats) == []
    assert stats.audit.deferred == 3 and s.calls["read"] == 0 and not stats.rejected
    clock[0] += 60.0
    assert [x.key for x in ing.poll(win(3), stats)] == [key]
    assert s.calls["read"] == 1 and stats.audit.audited == 1


def test_a_group_number_used_twice_rejects_the_later_shard():
    s = fresh_storage("seq")
    first = g(1, 3, "a", [[8], [1]])
    again = g(0, 3, "a", [[12], [2]])
    again.seq = first.seq
    put(s, 3, "a", [first], name="s1")
    put(s, 3, "a", [again], name="s2")
    stats = IngestStats()
    assert [x.seq for x in make(s).poll(win(3), stats)] == [first.seq]
    assert stats.rejected == {"seq_reused": 1}


def test_missing_group_numbers_are_counted_when_their_version_leaves_the_window():
    s = fresh_storage("withheld")
    groups = [g(1, 3, "a", [[8], [i + 1]]) for i in range(5)]
    for i, x in enumerate(groups):
        x.seq = [0, 1, 2, 6, 9][i]  # 3, 4, 5, 7 and 8 never uploaded
    put(s, 3, "a", groups)
    fleet = Fleet()
    ing = make(s, fleet=fleet)
    ing.poll(win(3), IngestStats())
    ing.poll(win(5), IngestStats())  # v3 is still in the window
    assert (fleet.counts["a"].numbered, fleet.counts["a"].missing) == (0, 0)
    ing.poll(win(6), IngestStats())
    assert (fleet.counts["a"].numbered, fleet.counts["a"].missing) == (10, 5)


def test_a_volunteer_that_keeps_failing_is_denied_until_allowed():
    s = fresh_storage("deny")
    for i in range(3):
        put(s, 3, "evil", [g(7, 3, "evil", [[1], [2]])], name=f"bad{i}")
    fleet = Fleet(deny_after=3, deny_rate=0.5)
    ing = make(s, fleet=fleet)
    stats = IngestStats()
    ing.poll(win(3), stats)
    assert stats.rejected == {"unknown_prompt": 3}
    entries, _ = read_denylist(s)
    assert set(entries) == {"evil"} and entries["evil"]["rejected"] == 3
    put(s, 3, "evil", [g(1, 3, "evil", [[8], [1]])], name="good")
    stats = IngestStats()
    assert ing.poll(win(3), stats) == [] and stats.denied == 1
    from volunteer_rl.protocol.fleet import update_denylist
    update_denylist(s, lambda e: bool(e.pop("evil", None)))           # what `allow` does
    assert len(ing.poll(win(3), IngestStats())) == 1
    assert fleet.counts["evil"].rejected == 0 and fleet.counts["evil"].accepted == 1


def test_a_volunteer_denied_mid_poll_has_its_prefetched_shards_skipped():
    s = fresh_storage("deny-mid-poll")
    for i in range(4):
        put(s, 3, "evil", [g(7, 3, "evil", [[1], [2]])], name=f"bad{i}")
    stats = IngestStats()
    ing = make(s, fleet=Fleet(deny_after=2, deny_rate=0.5))
    assert ing.poll(win(3), stats) == []
    # fetched ahead in parallel, but checked in order: denied after the second rejection
    assert stats.rejected == {"unknown_prompt": 2} and stats.denied == 2


@pytest.mark.parametrize("history", [5, 40])
def test_a_polls_storage_calls_and_memory_do_not_grow_with_history(history):
    s = fresh_storage(f"history-{history}")
    for v in range(history):
        for vol, wrong in (("a", 1), ("b", 2)):
            put(s, v, vol, [g(1, v, vol, [[8], [wrong]])])
    counting = RecordingStorage(s)
    ing = make(counting)
    top = history - 1
    out = ing.poll(win(top), IngestStats())
    assert len(out) == 6  # two volunteers x the window's three versions
    # one LIST of folder names per version, one bounded LIST per volunteer folder
    assert counting.calls == {"read_if_changed": 1, "list_level": 3, "list": 6, "read": 6}
    put(s, top, "c", [g(0, top, "c", [[12], [1]])])
    counting.calls.clear()
    assert len(ing.poll(win(top), IngestStats())) == 1
    assert counting.calls == {"read_if_changed": 1, "list_level": 3, "list": 7, "read": 1}
    # moving on forgets the keys that left the window
    put(s, top + 1, "a", [g(1, top + 1, "a", [[8], [3]])], name="late")
    ing.poll(win(top + 1), IngestStats())
    assert {layout.parse_shard_key(k)[0] for k in ing.taken} == {top - 1, top, top + 1}


def test_an_unforeseen_error_is_a_recorded_rejection_and_the_poll_goes_on(monkeypatch):
    """Reading one object ends in "accepted" or a reason code: an exception nobody planned for
    while checking a volunteer's bytes (here from hashing its groups) is logged with its
    traceback, quarantined and put in the ledger, so a restarted trainer does not read the
    shard again, and later shards are still taken."""
    import volunteer_rl.trainer.checks as ingest_mod

    s = fresh_storage("unforeseen")
    bad = put(s, 3, "a", [g(1, 3, "a", [[8], [77]])], name="s1")
    good = put(s, 3, "b", [g(0, 3, "b", [[12], [1]])], name="s2")

    def digest(prompt_id, version, token_ids):
        if [77, EOS] in token_ids:
            raise OverflowError("int too large to convert to float")
        return group_digest(prompt_id, version, token_ids)

    monkeypatch.setattr(ingest_mod, "group_digest", digest)
    logs = []
    ing = make(s, log=logs.append, audit=auditor(lambda v, groups: None))
    stats = IngestStats()
    out = ing.poll(win(3), stats)
    assert [x.key for x in out] == [good]
    assert stats.rejected == {"internal_error": 1}
    assert any("Traceback" in m and "OverflowError" in m for m in logs)
    assert s.exists(layout.quarantine_key(bad))
    ing.ledger.flush(s, 4)
    assert rebuild(s, [4]).finished(bad)


def test_the_trainers_own_fault_in_the_replay_is_never_charged_to_the_volunteer():
    """A replay that runs out of memory is the trainer's fault: the shard is retried at later
    polls, then left (`trainer_error`) without a rejection, a quarantine record or a ledger
    record, and its volunteer is never denied for it, however often it happens."""
    s = fresh_storage("trainer-fault")
    keys = [put(s, 3, "honest", [g(1, 3, "honest", [[8], [i]])], name=f"s{i}") for i in range(6)]
    calls = []

    def replay(version, groups):
        calls.append(groups[0].key)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    logs, fleet = [], Fleet(deny_after=5, deny_rate=0.5)
    ing = make(s, log=logs.append, audit=auditor(replay), fleet=fleet)
    stats = IngestStats()
    for _ in range(40):  # an audit at a time: none was timed yet
        assert ing.poll(win(3), stats) == []
        assert not stats.rejected and not fleet.is_denied("honest")
    assert fleet.counts.get("honest") is None or fleet.counts["honest"].rejected == 0
    assert stats.trainer_errors == 6 and sorted(set(calls)) == keys
    assert all(calls.count(k) == MAX_TRAINER_FAULTS for k in keys)  # retried, then left
    assert not any(s.exists(layout.quarantine_key(k)) for k in keys) and not ing.ledger.pending
    assert any("Traceback" in m and "out of memory" in m for m in logs)


def test_a_shard_whose_replay_faulted_once_is_taken_at_a_later_poll():
    s = fresh_storage("trainer-fault-once")
    key = put(s, 3, "honest", [g(1, 3, "honest", [[8], [1]])])
    faults = [RuntimeError("out of memory")]

    def replay(version, groups):
        if faults:
            raise faults.pop()
        return None

    ing, stats = make(s, audit=auditor(replay)), IngestStats()
    assert ing.poll(win(3), stats) == []
    assert [x.key for x in ing.poll(win(3), stats)] == [key]
    assert not stats.rejected and stats.audit.audited == 1


class Uniforms:
    """Stands in for the auditor's random generator: the given uniforms, then `rest`."""

    def __init__(self, values, rest=0.99):
        self.values, self.rest = list(values), rest

    def random(self):
        return self.values.pop(0) if self.values else self.rest


def lying_replay(lies):
    """A replay that fails the groups whose number is in `lies` (they were not sampled)."""
    def replay(version, groups):
        bad = [x for x in groups if x.seq in lies]
        return ("replay_mismatch", f"seq {bad[0].seq} was not sampled") if bad else None
    return replay


def honest_groups(vol, n, start):
    return [g(1, 3, vol, [[8], [(start + i) // 90 + 1, (start + i) % 90]]) for i in range(n)]


def test_a_trusted_volunteer_caught_lying_has_every_untrained_shard_audited():
    """Trust farmed with one-group shards, then lying shards of four groups: the first lying
    shards are drawn unaudited (one in an earlier poll, still waiting for a step, one in the
    same poll), the next is audited and fails. Every shard of that volunteer not yet trained
    is then audited: the lying ones are all rejected and their waiting groups withdrawn, the
    honest one stays; the lying shards after it are audited too (its rate is back to 1)."""
    s = fresh_storage("farmer")
    fleet = Fleet(deny_after=0, counts={"farmer": Counts(accepted=500, clean=500, accepted_groups=500)})
    lies: set[int] = set()

    def lying(name, n=4):
        groups = honest_groups("farmer", n, 1000 + 10 * len(lies))
        lies.update(x.seq for x in groups)
        return put(s, 3, "farmer", groups, name=name)

    ing = make(s, fleet=fleet, audit=Auditor(lying_replay(lies), Budget(1.0), 10, 0.005,
                                             Uniforms([0.99, 0.99, 0.99, 0.0])))
    early = lying("s0-lie")
    waiting = ing.poll(win(3), IngestStats())  # drawn unaudited: taken, waiting for a step
    assert {x.key for x in waiting} == {early}
    honest = put(s, 3, "farmer", honest_groups("farmer", 1, 0), name="s1-honest")
    later = [lying(f"s{i}-lie") for i in range(2, 6)]  # s2 unaudited, s3 audited, s4, s5 after
    stats = IngestStats()
    out = ing.poll(win(3), stats, waiting)
    assert [x.key for x in out] == [honest]
    assert stats.rejected == {"replay_mismatch": 5}
    rejected = {k for k, why in ing.ledger.rejected.items() if why == "replay_mismatch"}
    assert rejected == {early, *later}
    c = fleet.counts["farmer"]
    assert (c.accepted, c.rejected, c.clean) == (501, 5, 0)  # the two re-audited count once
    assert all(ing.ledger.owner(x.digest) is None for x in waiting)  # their claims given back


def test_shards_due_for_an_audit_wait_unfetched_and_are_fetched_once():
    """A new id parks 40 shards, all due for an audit: each poll fetches only those the budget
    has room for, reserved at admission, so no shard is fetched and parsed and then turned
    away: over all polls, one GET per shard audited."""
    s = RecordingStorage(fresh_storage("parked"))
    for i in range(40):
        put(s, 3, "parker", honest_groups("parker", 2, 2 * i), name=f"s{i:02d}")
    clock = [0.0]
    a = Auditor(lambda v, groups: None, Budget(0.1, lambda: clock[0]), 10, 0.005)
    a.per_group = 0.1  # as measured: a 256-group shard is reserved 25.6 s, a 2-group one 0.2 s
    ing, stats = make(s, audit=a), IngestStats()
    taken, polls = [], 0
    while stats.audit.audited < 40:
        polls += 1
        assert polls < 200
        taken += ing.poll(win(3), stats)
        assert s.calls["read"] == stats.audit.audited  # nothing fetched that was not audited
        clock[0] += 60.0
    assert len(taken) == 80 and polls > 1 and stats.audit.deferred > 0 and not stats.rejected


def test_one_id_cannot_take_a_poll_from_the_others(monkeypatch):
    """A flood of shards from one id costs a poll at most MAX_SHARDS_PER_VOLUNTEER_POLL parses;
    the other volunteers' shards are read in the same poll. With the audit budget short, the
    volunteers take turns at its room, so the flooder does not get it every poll."""
    import volunteer_rl.trainer.listing as ingest_mod

    monkeypatch.setattr(ingest_mod, "MAX_SHARDS_PER_VOLUNTEER_POLL", 4)
    s = RecordingStorage(fresh_storage("share"))
    for i in range(30):
        put(s, 3, "aaa-flood", honest_groups("aaa-flood", 1, i), name=f"s{i:02d}")
    calm = put(s, 3, "calm", honest_groups("calm", 1, 500))
    ing = make(s)
    out = ing.poll(win(3), IngestStats())
    assert calm in {x.key for x in out} and s.calls["read"] == 5
    # audits on, room for about one audit per poll: the calm volunteer is not starved
    s2 = fresh_storage("share-audit")
    for i in range(30):
        put(s2, 3, "aaa-flood", honest_groups("aaa-flood", 1, i), name=f"s{i:02d}")
    calm = put(s2, 3, "calm", honest_groups("calm", 1, 500))
    clock = [0.0]

    def replay(version, groups):  # an audit takes a second per group
        clock[0] += len(groups)

    a = Auditor(replay, Budget(0.1, lambda: clock[0]), 10, 0.005)
    a.per_group = 1.0  # an unparsed shard is reserved 256 s: one admitted per poll
    ing, taken = make(s2, audit=a), []
    for _ in range(2):
        taken += [x.key for x in ing.poll(win(3), IngestStats())]
        clock[0] += 3000.0
    assert calm in taken


def test_a_copy_under_another_id_never_trains_and_never_costs_its_author():
    """Volunteer `abe` (trusted, so rarely audited, and sorting first) uploads the groups of
    `zed` under its own id. Committed noise is keyed by the volunteer, so the copies fail
    their replay; the replay here fails every group not sampled by the id it is under. In
    every order the copy is rejected and charged to `abe`, and `zed`'s groups are taken."""
    sampler: dict[str, str] = {}  # digest -> the volunteer that sampled it

    def replay(version, groups):
        bad = [x for x in groups if sampler.get(x.digest, x.volunteer_id) != x.volunteer_id]
        return ("replay_mismatch", "not sampled by its volunteer") if bad else None

    def original(s, name, start):
        groups = honest_groups("zed", 2, start)
        copies = [Group(x.prompt_id, x.policy_version, "abe", x.seq, x.completions) for x in groups]
        key = put(s, 3, "zed", groups, name=name)
        for x in groups:
            sampler[group_digest(x.prompt_id, 3, [c.token_ids for c in x.completions])] = "zed"
        return key, put(s, 3, "abe", copies, name=name)

    def trainer(s, budget, trusted=("abe", "zed"), ledger=None):
        fleet = Fleet(deny_after=0, counts={v: Counts(accepted=10**4, clean=10**4, accepted_groups=10**4)
                                            for v in trusted})
        ing = make(s, fleet=fleet, audit=Auditor(replay, budget, 10, 0.005, Uniforms([], rest=0.99)))
        ing.ledger = ledger or ing.ledger
        return ing

    def charged(ing):
        return {v: c.rejected for v, c in ing.fleet.counts.items() if c.rejected}

    # 1. the same poll, the copy listed first, both volunteers trusted (neither drawn)
    s = fresh_storage("copy-same-poll")
    orig, copy = original(s, "s1", 0)
    ing, stats = trainer(s, Budget(1.0)), IngestStats()
    out = ing.poll(win(3), stats)
    assert {x.key for x in out} == {orig}
    assert stats.rejected == {"replay_mismatch": 1} and charged(ing) == {"abe": 1}
    # 2. a copy, in a later poll, of content taken (and trained) before
    ing.ledger.record(orig, "trained", [x.line for x in out], 2, [x.digest for x in out], step=1)
    late = layout.shard_key(3, "abe", "s9")
    s.write(late, s.read(copy))
    ing, stats = trainer(s, Budget(1.0), ledger=ing.ledger), IngestStats()
    assert ing.poll(win(3), stats) == [] and ing.ledger.rejected[late] == "replay_mismatch"
    assert charged(ing) == {"abe": 1} and stats.duplicates == 0
    # 3. the original waits for its audit (a new volunteer, no room) while the copy is taken
    s = fresh_storage("copy-first")
    orig, copy = original(s, "s1", 20)
    clock = [0.0]
    budget = Budget(0.1, lambda: clock[0])
    budget.spend(50.0)  # no room: zed's shard (new: due) waits unfetched
    ing, stats = trainer(s, budget, trusted=("abe",)), IngestStats()
    waiting = ing.poll(win(3), stats)
    assert {x.key for x in waiting} == {copy}  # taken unaudited, not trained yet
    clock[0] += 1000.0
    out = ing.poll(win(3), stats, waiting)
    assert {x.key for x in out} == {orig} and stats.duplicates == 0
    assert stats.rejected == {"replay_mismatch": 1} and charged(ing) == {"abe": 1}


def test_a_contest_replays_only_the_shared_groups_and_a_copied_group_still_fails():
    """Two trusted volunteers (never drawn) send 8-group shards sharing one identical group,
    as honest volunteers sampling one prompt from a confident policy do: only that group is
    replayed, once per shard, not both shards whole, and both are taken. A third volunteer
    hides one group copied from a fresh shard among seven of its own: that group is replayed
    under the copier's id and fails, so the copier's shard is rejected and charged to it,
    and the original's groups are all taken. Later, a copy of a group taken before without
    an audit has only the shared group replayed in the original's shard too."""
    sampler: dict[str, set[str]] = {}  # digest -> the volunteers that sampled it
    replayed: list[tuple[str, int]] = []  # (volunteer, groups) per replay call

    def replay(version, groups):
        replayed.append((groups[0].volunteer_id, len(groups)))
        bad = [x for x in groups if x.volunteer_id not in sampler.get(x.digest, {x.volunteer_id})]
        return ("replay_mismatch", "not sampled by its volunteer") if bad else None

    def digest(x):
        return group_digest(x.prompt_id, x.policy_version, [c.token_ids for c in x.completions])

    def shard(s, vol, groups, name):
        for x in groups:
            sampler.setdefault(digest(x), set()).add(vol)
        return put(s, 3, vol, groups, name=name)

    def as_(vol, x):
        return Group(x.prompt_id, x.policy_version, vol, next(SEQ), x.completions)

    s = fresh_storage("contest")
    shared = g(1, 3, "ann", [[8], [77, 7]])
    ann = shard(s, "ann", [shared, *honest_groups("ann", 7, 3000)], "s1")
    bob = shard(s, "bob", [as_("bob", shared), *honest_groups("bob", 7, 3100)], "s1")
    trusted = {v: Counts(accepted=10**4, clean=10**4, accepted_groups=10**4) for v in ("ann", "bob", "cat")}
    fleet = Fleet(deny_after=0, counts=trusted)
    ing = make(s, fleet=fleet, audit=Auditor(replay, Budget(1.0), 10, 0.005, Uniforms([], rest=0.99)))
    stats = IngestStats()
    out = ing.poll(win(3), stats)
    assert sorted(replayed) == [("ann", 1), ("bob", 1)]
    assert {x.key for x in out} == {ann, bob} and len(out) == 15 and not stats.rejected
    assert stats.duplicates == 1 and stats.audit.audited == 2

    replayed.clear()
    fresh = honest_groups("ann", 8, 3200)
    ann2 = shard(s, "ann", fresh, "s2")
    cat = put(s, 3, "cat", [as_("cat", fresh[3]), *honest_groups("cat", 7, 3300)], name="s2")
    for x in honest_groups("cat", 7, 3300):
        sampler.setdefault(digest(x), set()).add("cat")
    stats = IngestStats()
    out = ing.poll(win(3), stats)
    assert {x.key for x in out} == {ann2} and len(out) == 8
    assert stats.rejected == {"replay_mismatch": 1} and ing.ledger.rejected[cat] == "replay_mismatch"
    assert fleet.counts["cat"].rejected == 1 and fleet.counts["ann"].rejected == 0
    assert ("cat", 1) in replayed and ("cat", 8) not in replayed

    # ann's s2 was taken without an audit and is not trained: bob now sends one of its groups
    replayed.clear()
    bob2 = shard(s, "bob", [as_("bob", fresh[5]), *honest_groups("bob", 7, 3400)], "s2")
    stats = IngestStats()
    out = ing.poll(win(3), stats)
    assert {x.key for x in out} == {bob2} and not stats.rejected
    assert sorted(replayed) == [("ann", 1), ("bob", 1)]  # ann's shard re-checked on that group
    # groups that passed a replay (the one cat copied, this one) leave ann's unaudited rest
    assert [x.seq for x in ing.unaudited["ann"][ann2]] == [x.seq for i, x in enumerate(fresh) if i not in (3, 5)]


def test_junk_under_a_volunteer_prefix_is_charged_to_it_quarantined_and_recorded_small():
    """Objects that are no shard used to be free: never counted, never denied, and each left a
    ledger record holding its whole key. Now each is a rejection of the id in its path, with a
    quarantine record, a ledger record of bounded size, and denial like any other reject."""
    s = fresh_storage("junk")
    long_name = "x" * 900
    junk = [f"rollouts/v000003/spammer/notes-{i}.txt" for i in range(5)]
    junk.append(f"rollouts/v000003/spammer/zz/{long_name}")  # listed last
    for k in junk:
        s.write(k, b"hi")
    good = put(s, 3, "honest", [g(0, 3, "honest", [[12], [1]])])
    fleet = Fleet(deny_after=5, deny_rate=0.5)
    ing, logs = make(s, fleet=fleet), []
    ing.log = logs.append
    stats = IngestStats()
    assert [x.key for x in ing.poll(win(3), stats)] == [good]
    assert stats.rejected == {"bad_key": 5}  # the sixth was skipped: denied after five
    assert fleet.is_denied("spammer") and "spammer" in read_denylist(s)[0]
    assert all(s.exists(layout.quarantine_key(k)) for k in junk[:5])
    assert all(len(r["key"]) <= 160 for r in ing.ledger.pending)
    ing.ledger.flush(s, 4)
    rebuilt = rebuild(s, [4])
    assert all(rebuilt.finished(k) for k in junk[:5])
    # a long key is recorded shortened, and looked up the same way
    s.delete(layout.DENYLIST)  # lifted: its objects are read again by a new trainer
    ing2 = make(s, fleet=Fleet(deny_after=0))
    ing2.poll(win(3), IngestStats())
    assert ing2.ledger.finished(junk[-1])
    assert max(len(r["key"]) for r in ing2.ledger.pending) <= 160


def test_objects_past_the_per_volunteer_cap_are_skipped_unread(monkeypatch):
    import volunteer_rl.trainer.listing as ingest_mod

    monkeypatch.setattr(ingest_mod, "MAX_OBJECTS_PER_VOLUNTEER_VERSION", 3)
    s = fresh_storage("cap")
    for i in range(6):
        put(s, 3, "busy", [g(0, 3, "busy", [[12], [i]])], name=f"s{i}")
    put(s, 3, "calm", [g(1, 3, "calm", [[8], [1]])])
    stats = IngestStats()
    ing = make(s)
    out = ing.poll(win(3), stats)
    assert sorted((x.volunteer_id, x.key.rsplit("/", 1)[1]) for x in out) == [
        ("busy", "s0.jsonl.gz"), ("busy", "s1.jsonl.gz"), ("busy", "s2.jsonl.gz"),
        ("calm", "s1.jsonl.gz")]
    assert stats.over_cap == 1 and not stats.rejected  # one folder over the cap
    stats = IngestStats()
    assert ing.poll(win(3), stats) == [] and stats.over_cap == 0  # counted once per version


def test_which_shards_are_audited_is_not_predictable_from_the_seed():
    """Two trainers with the same seed must not audit the same shards of a trusted volunteer:
    a liar that could predict the choice would lie only in the others."""
    s = fresh_storage("unpredictable")
    for i in range(40):
        put(s, 3, "a", [g(0, 3, "a", [[12], [j // 10, j % 10]]) for j in range(4 * i, 4 * i + 4)],
            name=f"s{i}")
    picks = []
    for _ in range(2):
        chosen = []
        fleet = Fleet(counts={"a": Counts(accepted=1000, clean=1000)})  # trusted: rate 0.5
        audit = Auditor(lambda v, groups: chosen.append(groups[0].key), Budget(1.0), 10, 0.5)
        make(s, audit=audit, fleet=fleet).poll(win(3), IngestStats())
        picks.append(chosen)
    assert all(0 < len(p) < 40 for p in picks) and picks[0] != picks[1]  # same by chance: 2**-40


def flood(tmp_path, version, vol, n):
    """`n` junk objects in a volunteer folder, written straight to the folder bucket."""
    folder = tmp_path / layout.rollout_volunteer_prefix(version, vol)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"junk-{i:05d}.txt").write_bytes(b"x")


def test_a_polls_listing_is_bounded_by_the_cap_not_by_what_a_volunteer_wrote(tmp_path, monkeypatch):
    import volunteer_rl.trainer.listing as ingest_mod

    monkeypatch.setattr(ingest_mod, "MAX_OBJECTS_PER_VOLUNTEER_VERSION", 4)
    s = RecordingStorage(open_storage(str(tmp_path)))
    flood(tmp_path, 3, "flooder", 500)
    honest = put(s, 3, "honest", [g(0, 3, "honest", [[12], [1]])])
    stats = IngestStats()
    ing = make(s, fleet=Fleet(deny_after=100))
    assert [x.key for x in ing.poll(win(3, staleness=0), stats)] == [honest]
    assert s.lists == [("list_level", "rollouts/v000003", None, 2),
                       ("list", "rollouts/v000003/flooder/", 5, 5),
                       ("list", "rollouts/v000003/honest/", 5, 1)]
    assert stats.over_cap == 1 and stats.rejected == {"bad_key": 4}
    # the folder found over the cap is not listed again in this version, nor counted again
    flood(tmp_path, 3, "flooder", 1000)
    s.lists.clear()
    stats = IngestStats()
    assert ing.poll(win(3, staleness=0), stats) == []
    assert s.lists == [("list_level", "rollouts/v000003", None, 2),
                       ("list", "rollouts/v000003/honest/", 5, 1)]
    assert stats.over_cap == 0 and not stats.rejected


def test_a_denied_volunteers_folder_is_not_listed(tmp_path):
    s = RecordingStorage(open_storage(str(tmp_path)))
    flood(tmp_path, 3, "evil", 50)
    honest = put(s, 3, "honest", [g(0, 3, "honest", [[12], [1]])])
    fleet = Fleet()
    fleet.deny(s, "evil", "test")
    stats = IngestStats()
    assert [x.key for x in make(s, fleet=fleet).poll(win(3, staleness=0), stats)] == [honest]
    assert [p for op, p, _, _ in s.lists if op == "list"] == ["rollouts/v000003/honest/"]
    assert stats.denied == 1 and not stats.rejected  # one skipped folder, not 50 objects


def test_keys_outside_volunteer_folders_are_rejected_and_capped(tmp_path, monkeypatch):
    """Objects directly in a version folder are no volunteer's: up to the cap of them are taken
    (and rejected `bad_key`, charged to nobody), in one sorted order with the shards."""
    import volunteer_rl.trainer.listing as ingest_mod

    monkeypatch.setattr(ingest_mod, "MAX_OBJECTS_PER_VOLUNTEER_VERSION", 3)
    s = open_storage(str(tmp_path))
    for name in ("a.txt", "b.txt", "zz.txt", "zzz.txt"):
        s.write(f"rollouts/v000003/{name}", b"x")
    shard = put(s, 3, "m-vol", [g(0, 3, "m-vol", [[12], [1]])])
    order = []
    stats = IngestStats()
    ing = make(s, log=order.append)
    assert [x.key for x in ing.poll(win(3, staleness=0), stats)] == [shard]
    assert stats.rejected == {"bad_key": 3} and not stats.by_volunteer["m-vol"][1]
    assert [m.split()[1].rstrip(":") for m in order] == [
        "rollouts/v000003/a.txt", "rollouts/v000003/b.txt", "rollouts/v000003/zz.txt"]


def test_a_new_volunteers_lying_shard_costs_one_group_of_replay_and_a_trusted_ones_one_call():
    """The audit replays a volunteer with no clean groups in growing chunks, stopping at the
    first failure (one new id parking big lying shards took every step from the trainer while
    each audit replayed them whole); a trusted volunteer's audited shard goes in one call."""
    calls = []

    def lying(version, groups):
        calls.append(len(groups))
        return ("replay_mismatch", "not sampled")

    s = fresh_storage("chunk-new")
    put(s, 3, "newbie", [g(0, 3, "newbie", [[12], [i]]) for i in range(20)])
    stats = IngestStats()
    make(s, audit=auditor(lying)).poll(win(3), stats)
    assert calls == [1] and stats.rejected == {"replay_mismatch": 1}

    calls.clear()

    def honest(version, groups):
        calls.append(len(groups))
        return None

    s = fresh_storage("chunk-trusted")
    put(s, 3, "old", [g(0, 3, "old", [[12], [i]]) for i in range(20)])
    fleet = Fleet()
    fleet.counts["old"] = Counts(accepted=50, clean=500)
    always = Auditor(honest, Budget(1.0), 10 ** 9, 0.05, random.Random(0))  # every shard due
    stats = IngestStats()
    make(s, audit=always, fleet=fleet).poll(win(3), stats)
    assert calls == [20] and stats.audit.audited == 1 and not stats.rejected
