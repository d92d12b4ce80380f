"""The ratio cap of the GRPO loss on fresh rows (trainer.losses.RATIO_CAP), between the PPO
clip and the log-ratio clamp (issue 26, point 9).

A volunteer's behavior logprobs set the ratio r = exp(logp - behavior). With a negative
advantage the clipped surrogate is -min(rA, clip(r)A) = |A| max(r, clip(r)): PPO's clip does
not bound it, the log-ratio clamp only at e^20 (and beyond the clamp the gradient is 0, which
is why test_losses' -100 lie could not tell the cap was there). Between 1.28 and e^20 the cap
is the bound: one token weighs at most RATIO_CAP x |A|."""
import math

import pytest
import torch

from volunteer_rl.trainer.losses import RATIO_CAP, grpo_loss

LOG_RATIOS = [0.5, 1.0, 2.0, 2.2, 3.0, 5.0, 10.0, 19.0]  # r from 1.6 to 1.8e8, all below the clamp


def test_a_fresh_tokens_weight_is_capped_at_ratio_cap_times_the_advantage():
    n = len(LOG_RATIOS)
    logp = torch.full((1, n), -0.7, requires_grad=True)
    behavior = logp.detach() - torch.tensor([LOG_RATIOS])  # claims: the tokens were unlikely
    adv = torch.tensor([-2.0])
    loss, stats = grpo_loss(logp, behavior, torch.ones(1, n), adv, torch.tensor([False]))
    loss.backward()
    weights = [min(math.exp(x), RATIO_CAP) for x in LOG_RATIOS]
    assert (logp.grad.abs() <= RATIO_CAP * 2.0 / n + 1e-6).all()
    assert loss.item() == pytest.approx(2.0 * sum(weights) / n, rel=1e-5)
    # below the cap a token's gradient is |A| r / n, as unclipped; above it, none: the capped
    # weight is a constant
    expected = [2.0 * math.exp(x) / n if math.exp(x) < RATIO_CAP else 0.0 for x in LOG_RATIOS]
    assert logp.grad[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(19.0), rel=1e-4)  # seen, not used
