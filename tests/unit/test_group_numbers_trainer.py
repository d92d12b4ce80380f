"""Group numbers and prompt pools through a real trainer (schema 6): a group's prompt must be
the one its number draws from its version's published pool, before and after a restart; the
numbers a volunteer used are remembered across the restart; the tail of a version it kept
back is counted missing once a later version's numbers arrive."""
from __future__ import annotations

import json

import pytest

from helpers.honest_groups import drawn_prompt
from helpers.trainers import started_trainer
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.shards import Completion, Group, encode_shard
from volunteer_rl.task.reward import completion_reward
from volunteer_rl.trainer.groups import IngestStats

SETTINGS = {"k": 2, "max_new_tokens": 4, "audit_tolerance": 0.0}  # no audit: numbers are the point


def group(t, volunteer: str, version: int, seq: int, prompt_id: int | None = None) -> Group:
    """A well-formed group with true rewards, for the prompt its number draws unless
    `prompt_id` says otherwise (what it samples is not checked here: audits are off)."""
    pid = drawn_prompt(t, version, volunteer, seq) if prompt_id is None else prompt_id
    p = t.published_policy
    comps = []
    for j in range(t.cfg.k):
        tokens = [t.prompt_ids[pid][j + 1], p.eos_id]
        reward = completion_reward(tokens, t.problems[pid]["python_expression"], p.decode_all, p.eos_id,
                                   p.special_ids)
        comps.append(Completion(tokens, [-1.0, -1.0], "", reward))
    return Group(pid, version, volunteer, seq, comps)


def put(t, version: int, volunteer: str, name: str, groups: list[Group]) -> str:
    key = layout.shard_key(version, volunteer, name)
    t.storage.write(key, encode_shard(groups))
    return key


def poll(t) -> IngestStats:
    stats = IngestStats()
    t.ingest.poll(t.window(), stats)
    return stats


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("numbers-trainer")


def test_each_version_publishes_a_pool_and_a_prompt_of_the_volunteers_choice_is_refused(root):
    t = started_trainer(root, **SETTINGS)
    assert 1 <= len(t.manifest.prompt_pool) <= t.cfg.prompt_pool and t.pools == {0: t.manifest.prompt_pool}
    honest = [group(t, "vol", 0, s) for s in range(4)]
    put(t, 0, "vol", "a", honest)
    wanted = next(i for i in range(len(t.problems)) if i not in t.manifest.prompt_pool)
    put(t, 0, "chooser", "a", [group(t, "chooser", 0, 0, prompt_id=wanted)])
    stats = poll(t)
    assert stats.by_volunteer == {"vol": [1, 0], "chooser": [0, 1]}
    assert stats.rejected == {"prompt_mismatch": 1}
    t.publish_next()
    assert t.manifest.version == 1 and set(t.pools) == {0, 1}


def test_a_restarted_trainer_remembers_numbers_and_pools_and_counts_a_dropped_tail(root):
    t = started_trainer(root, **SETTINGS)  # resumes at v1 from the state saved with it
    assert t.version == 1 and set(t.pools) == {0, 1}
    reused = put(t, 1, "vol", "b", [group(t, "vol", 1, 2)])  # number 2 went out under v0
    stats = poll(t)
    assert stats.rejected == {"seq_reused": 1}, stats
    assert json.loads(t.storage.read(layout.quarantine_key(reused)))["reason"] == "seq_reused"
    # 4..9 sampled under v0 or v1 and kept back; 10 and 11 sent under v1
    put(t, 1, "vol", "c", [group(t, "vol", 1, s) for s in (10, 11)])
    # the pool of v0, read back from its manifest copy, still rules v0's groups
    outside = next(i for i in range(len(t.problems)) if i not in t.pools[0])
    put(t, 0, "chooser2", "a", [group(t, "chooser2", 0, 0, prompt_id=outside)])
    stats = poll(t)
    assert stats.by_volunteer == {"vol": [1, 0], "chooser2": [0, 1]}, stats.rejected
    assert stats.rejected == {"prompt_mismatch": 1}
    for _ in range(3):  # v0 and v1 leave the window (max_staleness 2)
        t.publish_next()
    poll(t)
    t.publisher.write_views(final=True)  # fleet.json now, not at its next cadence
    c = t.fleet.counts["vol"]
    assert (c.numbered, c.missing) == (12, 6)  # 0..11 used, 4..9 never arrived
    doc = json.loads(t.storage.read(layout.FLEET))
    assert doc["volunteers"]["vol"]["groups_missing"] == 6
    assert doc["volunteers"]["vol"]["next_group_number"] == 12


def test_a_trainer_resumed_with_other_sampling_settings_is_refused_in_one_line(tmp_path):
    """Groups of the window's versions were sampled with the run's -k: a trainer resumed with
    another one refused every honest shard as bad_group_size and denied its volunteers. Now
    it refuses to start, naming the run's settings."""
    from volunteer_rl.trainer.preflight import TrainerError

    started_trainer(tmp_path, **SETTINGS)
    with pytest.raises(TrainerError) as err:
        started_trainer(tmp_path, **{**SETTINGS, "k": 4})
    msg = str(err.value)
    assert "-k 2 " in msg and "--max-new-tokens 4" in msg and "\n" not in msg, msg
    started_trainer(tmp_path, **SETTINGS)  # the run's own settings resume it
