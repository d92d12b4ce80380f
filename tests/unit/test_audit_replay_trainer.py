"""The trainer's replay audit through its real path: shards in a folder bucket, taken by
`Trainer.ingest.poll`, replayed by the trainer's own replay (WindowWeights, audit_groups) with
a real tiny model, at two published versions whose weights differ.

Two defences no other test could fail (issue 26, point 9): every group of an audited shard
is replayed, not only the first; and a stale group is replayed against the weights of its
own version, not the current ones."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from helpers.honest_groups import drawn_prompt, honest_group, secret_of
from helpers.trainers import started_trainer
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.shards import Completion, Group, encode_shard
from volunteer_rl.task.reward import completion_reward
from volunteer_rl.trainer.groups import IngestStats
from volunteer_rl.trainer.loop import Trainer

K, MAX_NEW = 4, 8


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A trainer at v1 with audits on (every shard of a new volunteer is audited, a budget no
    test here exhausts), and the policy of its v0: v1 is v0 with every weight perturbed, so
    a group replayed against the wrong version's weights does not pass."""
    root = tmp_path_factory.mktemp("audit-trainer")
    # One thread: two wait for each other at every op on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t = started_trainer(root, k=K, max_new_tokens=MAX_NEW, max_staleness=2, audit_share=1.0)
    v0 = copy.deepcopy(t.published_policy)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in t.policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    t.publish_next()
    assert t.version == 1 and sorted(t.window_weights.versions) == [0, 1]
    yield t, v0
    torch.set_num_threads(threads)


def group(t: Trainer, policy, volunteer: str, seq: int, version: int) -> Group:
    """The group `volunteer` uploads as its number `seq` of `version`, for the prompt that
    number draws, sampled with `policy` under the committed draws of (version, volunteer,
    seq): honest if `policy` holds the weights of `version`."""
    prompt_id = drawn_prompt(t, version, volunteer, seq)
    samples = honest_group(policy, t.run_id, version, volunteer, seq, prompt_id,
                           t.prompt_ids[prompt_id], K, t.cfg.temperature, MAX_NEW, secret_of(t))
    return Group(prompt_id, version, volunteer, seq, [completion(t, prompt_id, s.token_ids, s.logprobs)
                                                      for s in samples])


def completion(t: Trainer, prompt_id: int, tokens: list[int], logprobs: list[float]) -> Completion:
    """A completion claiming its true reward (the trainer recomputes it)."""
    p = t.published_policy
    reward = completion_reward(tokens, t.problems[prompt_id]["python_expression"], p.decode_all, p.eos_id,
                               p.special_ids)
    return Completion(tokens, logprobs, "", reward)


def forged(t: Trainer, g: Group) -> Group:
    """`g` with the first token of every completion that has one before its last replaced by
    another ordinary token: what the draw did not select, with the honest logprobs kept."""
    p = t.published_policy
    vocab = len(p.tokenizer)
    out = []
    for c in g.completions:
        tokens = list(c.token_ids)
        if len(tokens) >= 2:
            swap = (tokens[0] + 1) % vocab
            while swap == tokens[0] or swap == p.eos_id or swap in p.special_ids:
                swap = (swap + 1) % vocab
            tokens[0] = swap
        out.append(completion(t, g.prompt_id, tokens, c.logprobs))
    assert out != g.completions, "no completion long enough to forge"
    return Group(g.prompt_id, g.policy_version, g.volunteer_id, g.seq, out)


def put(t: Trainer, version: int, volunteer: str, groups: list[Group]) -> str:
    key = layout.shard_key(version, volunteer, "s1")
    t.storage.write(key, encode_shard(groups))
    return key


def quarantined(t: Trainer, key: str) -> dict:
    return json.loads(t.storage.read(layout.quarantine_key(key)))


def test_an_audited_shard_whose_last_group_lies_is_rejected(trainer):
    """Honest groups first, a forged one last: an audit that replayed only the first group
    (or any prefix) would take the forgery."""
    t, _ = trainer
    policy = t.published_policy
    honest = [group(t, policy, "tail-honest", i, 1) for i in range(3)]
    lying = [group(t, policy, "tail-liar", i, 1) for i in range(3)]
    lying[-1] = forged(t, lying[-1])
    put(t, 1, "tail-honest", honest)
    liar_key = put(t, 1, "tail-liar", lying)
    stats = IngestStats()
    t.ingest.poll(t.window(), stats)
    assert stats.audit.by_volunteer == {"tail-honest": 1, "tail-liar": 1}
    assert stats.by_volunteer == {"tail-honest": [1, 0], "tail-liar": [0, 1]}
    assert stats.rejected == {"replay_mismatch": 1}
    record = quarantined(t, liar_key)
    assert record["reason"] == "replay_mismatch", record
    assert record["detail"].startswith("replay_mismatch: group 2 "), record  # the last one


def test_a_stale_group_is_audited_against_its_own_versions_weights(trainer):
    """v1's weights differ from v0's. An honest group sampled with v0 and labelled v0 passes
    (replayed against v1 it would not); a group sampled with v1 but labelled v0, under v0's
    committed draws, is rejected (replayed against v1 it would pass)."""
    t, v0 = trainer
    assert not all(torch.equal(t.window_weights.versions[0][n], t.window_weights.versions[1][n])
                   for n in t.window_weights.versions[0])
    honest = [group(t, v0, "stale-honest", i, 0) for i in range(3)]
    mislabelled = [group(t, t.published_policy, "stale-mislabel", i, 0)
                   for i in range(3)]
    put(t, 0, "stale-honest", honest)
    mislabelled_key = put(t, 0, "stale-mislabel", mislabelled)
    stats = IngestStats()
    t.ingest.poll(t.window(), stats)
    assert stats.audit.by_volunteer == {"stale-honest": 1, "stale-mislabel": 1}
    assert stats.by_volunteer == {"stale-honest": [1, 0], "stale-mislabel": [0, 1]}, stats.rejected
    assert quarantined(t, mislabelled_key)["reason"] in ("replay_mismatch", "logprob_mismatch")
