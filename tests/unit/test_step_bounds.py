"""Two of train_step's last lines (issue 26, point 9): the whole gradient is clipped to norm 1
before the update, and a step whose gradient norm is not finite is not applied even when its
loss is finite (test_step_safety covers a non-finite loss).

On a real tiny policy at random init, whose honest gradient norm is already several times 1."""
from __future__ import annotations

import math

import pytest
import torch

from helpers.trainers import started_trainer
from volunteer_rl.model.scoring import token_logprobs
from volunteer_rl.protocol import layout
from volunteer_rl.trainer.groups import ScoredGroup
from volunteer_rl.trainer.loop import Trainer
from volunteer_rl.trainer.step import train_step


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    root = tmp_path_factory.mktemp("step-bounds")
    # One thread: two wait for each other at every op on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t = started_trainer(root, k=4)
    yield t
    torch.set_num_threads(threads)


def group(t: Trainer, i: int, log_ratio: float) -> ScoredGroup:
    """A group whose behavior logprobs are the policy's own minus `log_ratio`: every token's
    ratio is e^log_ratio (under RATIO_CAP for log 9, so the loss weighs it in full)."""
    ids = [[5 + i, 6, 7], [8, 9 + i], [10, 11, 12], [13]]
    with torch.no_grad():
        logp, _ = token_logprobs(t.policy, [t.prompt_ids[i]], [ids], t.cfg.temperature)
    behavior = [[x - log_ratio for x in logp[j, :len(c)].tolist()] for j, c in enumerate(ids)]
    return ScoredGroup(prompt_id=i, policy_version=0, volunteer_id="v", token_ids=ids,
                       behavior_logprobs=behavior, rewards=[1.0, 0.0, 0.0, 1.0],
                       key=layout.shard_key(0, "v", f"s{i}"), line=0, digest=f"d{i}")


def snapshot(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.policy.model.state_dict().items()}


def norm(tensors) -> float:
    return math.sqrt(sum(float(x.double().pow(2).sum()) for x in tensors))


def test_the_update_is_made_from_the_gradient_clipped_to_norm_one(trainer):
    t = trainer
    before = snapshot(t)
    opt = torch.optim.AdamW(t.policy.model.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0)
    try:
        result = train_step(t.policy, opt, [group(t, i, math.log(9)) for i in range(4)],
                            t.prompt_ids, 0, t.cfg)
        assert result.applied
        assert result.grad_norm > 10  # the norm reported is the one before the clip
        params = [p for p in t.policy.model.parameters() if p.grad is not None]
        assert norm(p.grad for p in params) == pytest.approx(1.0, rel=1e-4)
        # Adam's first moment after its first step is (1 - beta1) x the gradient it was given
        assert norm(opt.state[p]["exp_avg"] for p in params) == pytest.approx(0.1, rel=1e-4)
    finally:
        t.policy.model.load_state_dict(before)
        t.policy.model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_finite_loss_with_a_non_finite_gradient_is_not_applied(trainer, bad):
    """A gradient turned non-finite on its way to one parameter (a hook registered here):
    the loss is finite, the gradient norm is not, and nothing changes."""
    t = trainer
    before, opt_state = snapshot(t), len(t.opt.state)
    weight = t.policy.model.get_input_embeddings().weight
    handle = weight.register_hook(lambda g: torch.full_like(g, bad))
    try:
        result = train_step(t.policy, t.opt, [group(t, i, 0.0) for i in range(4)], t.prompt_ids,
                            0, t.cfg)
    finally:
        handle.remove()
    assert math.isfinite(result.loss) and not math.isfinite(result.grad_norm)
    assert not result.applied
    after = snapshot(t)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(t.opt.state) == opt_state
    assert all(p.grad is None for p in t.policy.model.parameters())
