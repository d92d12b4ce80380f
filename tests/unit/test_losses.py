import math

import pytest
import torch

from volunteer_rl.trainer.losses import (
    grpo_advantages,
    grpo_loss,
    reinforce_advantages,
    reinforce_loss,
)


def test_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    assert reinforce_advantages(r).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]
    # group 1: mean .5, unbiased std sqrt(1/3); group 2: mean .75, std .5
    g = grpo_advantages(r)
    s1 = math.sqrt(1 / 3) + 1e-4
    assert g[0].tolist() == pytest.approx([0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1])
    assert g[1].tolist() == pytest.approx([0.25 / 0.5001, 0.25 / 0.5001, 0.25 / 0.5001, -0.75 / 0.5001])


def test_reinforce_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -3.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    loss = reinforce_loss(logp, mask, adv)
    # -(2*(-1) + 2*(-2) + -1*(-0.5) + -1*(-0.5) + -1*(-3)) / 5 = -(-6 + 4)/5 = 0.4
    assert loss.item() == pytest.approx(0.4)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.4, -0.4, 0.0, 0.2, 0.2, 0.2])


def test_grpo_loss_is_minus_advantage_on_policy():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, stats = grpo_loss(logp, logp.detach().clone(), torch.ones(1, 2), torch.tensor([1.5]),
                            torch.tensor([False]))
    assert loss.item() == pytest.approx(-1.5)  # ratio 1 everywhere: -mean(A)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.75, -0.75])  # d/dlogp of -r*A/2
    assert stats["ratio_mean"].item() == pytest.approx(1.0)


def test_grpo_clipping_by_hand():
    # token ratios: e^0.5=1.6487 (above 1+0.28), e^-0.5=0.6065 (below 1-0.2)
    logp = torch.tensor([[0.0, 0.0], [0.0, 0.0]], requires_grad=True)
    behav = torch.tensor([[-0.5, 0.5], [-0.5, 0.5]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = grpo_loss(logp, behav, torch.ones(2, 2), adv, torch.tensor([False, False]))
    hi, lo = math.exp(0.5), math.exp(-0.5)
    # A=+1: min(r, clip(r)) -> 1.28 (clipped), lo (unclipped, smaller); A=-1: min(-r, -clip(r))
    expected = -(1.28 + lo + -hi + -0.8) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    # gradient flows only through unclipped tokens: (0,1) with A=+1 and (1,0) with A=-1
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[1, 1].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-lo / 4)
    assert logp.grad[1, 0].item() == pytest.approx(hi / 4)
    assert stats["clip_high"].item() == pytest.approx(0.25)
    assert stats["clip_low"].item() == pytest.approx(0.25)


def test_grpo_truncates_the_weight_of_stale_rows():
    # ratio e^2 = 7.39 with a negative advantage: unbounded for fresh rows, capped at 2 if stale
    logp = torch.tensor([[0.0], [0.0]], requires_grad=True)
    behav = torch.tensor([[-2.0], [-2.0]])
    adv = torch.tensor([-1.0, -1.0])
    mask = torch.ones(2, 1)
    fresh, _ = grpo_loss(logp, behav, mask, adv, torch.tensor([False, False]), tis_cap=2.0)
    stale, _ = grpo_loss(logp, behav, mask, adv, torch.tensor([True, True]), tis_cap=2.0)
    assert fresh.item() == pytest.approx(math.exp(2.0))
    assert stale.item() == pytest.approx(2.0)
    stale.backward()
    assert logp.grad.abs().sum().item() == 0.0  # truncated: no gradient pushes it further


def test_a_lying_behavior_logprob_cannot_blow_up_the_loss():
    """A volunteer that claims a logprob of -100 for a token the policy gives ~0 asks for a
    ratio of e^100 (inf in fp32). The log-ratio is clamped before exp and the unclipped term
    capped, so loss and gradient stay finite and one token weighs at most RATIO_CAP x |A|."""
    from volunteer_rl.trainer.losses import RATIO_CAP

    logp = torch.tensor([[-0.01, -0.2], [-0.3, -0.1]], requires_grad=True)
    behav = torch.tensor([[-100.0, -0.2], [-0.3, -0.1]])  # row 0 lies on its first token
    adv = torch.tensor([-2.0, 2.0])
    loss, stats = grpo_loss(logp, behav, torch.ones(2, 2), adv, torch.tensor([False, False]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[0, 0].abs().item() <= RATIO_CAP * 2.0 / 4 + 1e-6
    assert stats["ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-4)


def test_padding_is_ignored():
    logp = torch.tensor([[-1.0, -50.0]])
    a = reinforce_loss(logp, torch.tensor([[1.0, 0.0]]), torch.tensor([1.0]))
    assert a.item() == pytest.approx(1.0)
