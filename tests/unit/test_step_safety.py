"""A step whose loss or gradient is not finite is never applied (issue 13).

Intake floors logprobs and the loss clamps ratios, so no shard that passes intake can make a
step non-finite; these tests feed train_step groups that skip intake (a NaN behavior logprob)
to show the last line holds anyway: weights and optimizer state stay as they were, the groups
to blame are found, and their shards are rejected with a quarantine record and charged."""
from __future__ import annotations

import json

import pytest
import torch

from helpers.trainers import started_trainer
from volunteer_rl.protocol import layout
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup
from volunteer_rl.trainer.loop import Trainer
from volunteer_rl.trainer.step import non_finite_groups, train_step


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-safety")
    return started_trainer(root, k=4)


def group(t: Trainer, i: int, volunteer: str, logprob: float = -1.0) -> ScoredGroup:
    ids = [[5 + i, 6, 7], [8, 9 + i], [10, 11, 12], [13]]
    key = layout.shard_key(0, volunteer, f"s{i}")
    return ScoredGroup(prompt_id=i, policy_version=0, volunteer_id=volunteer, token_ids=ids,
                       behavior_logprobs=[[logprob] * len(x) for x in ids],
                       rewards=[1.0, 0.0, 0.0, 1.0], key=key, line=0, digest=f"d{i}{volunteer}")


def snapshot(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.policy.model.state_dict().items()}


def test_a_non_finite_step_leaves_weights_and_optimizer_alone(trainer):
    t = trainer
    batch = [group(t, 0, "honest"), group(t, 1, "liar", logprob=float("nan")), group(t, 2, "honest")]
    before, opt_state = snapshot(t), len(t.opt.state)
    result = train_step(t.policy, t.opt, batch, t.prompt_ids, 0, t.cfg)
    assert not result.applied
    after = snapshot(t)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(t.opt.state) == opt_state
    assert all(p.grad is None for p in t.policy.model.parameters())
    assert [g.volunteer_id for g in non_finite_groups(t.policy, batch, t.prompt_ids, 0, t.cfg)] == ["liar"]
    # the honest groups alone make a finite, applied step
    assert train_step(t.policy, t.opt, [batch[0], batch[2]], t.prompt_ids, 0, t.cfg).applied


def test_a_refused_step_rejects_the_guilty_shard_and_keeps_the_rest(trainer):
    t = trainer
    liar = group(t, 3, "liar2", logprob=float("nan"))
    same_shard = group(t, 4, "liar2")
    same_shard.key, same_shard.line = liar.key, 1
    honest = group(t, 5, "honest2")
    waiting = [liar, honest, same_shard]
    result = train_step(t.policy, t.opt, [liar, honest], t.prompt_ids, 0, t.cfg)
    stats = IngestStats()
    left = t.refuse_step(waiting, [liar, honest], result, stats)
    assert left == [honest]  # the liar's other group goes with its shard
    assert stats.rejected == {"non_finite": 1}
    record = json.loads(t.storage.read(layout.quarantine_key(liar.key)))
    assert record["reason"] == "non_finite"
    assert t.fleet.counts["liar2"].rejected == 1 and "honest2" not in t.fleet.counts
    assert t.ledger.finished(liar.key)
