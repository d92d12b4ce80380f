"""bench/replay_choice.py at --quick size: rows for both vocabularies whose figures add up, no
honest completion rejected and every forgery caught."""
import math
import re

import pytest
import torch

from bench.replay_choice import T, TOL, expected_two, results


def test_the_expected_near_tie_share_is_what_gumbel_noise_gives():
    """expected_two against a Monte Carlo of the top-two gap of logits / T + Gumbel noise,
    at tolerances wide enough to count; and below exp(tol) - 1 whatever the distribution."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0] * 5, [2.0, 1.0, 0.0, -1.0, 0.5], [5.0, 0.0, 0.0, -3.0, -3.0]])
    n = 400_000
    for tol in (0.05, 0.3):
        exact = expected_two(logits, tol)
        u = torch.rand(len(logits), n, 5, generator=gen, dtype=torch.float64)
        top = (logits.double()[:, None, :] / T - torch.log(-torch.log(u))).topk(2, dim=-1).values
        seen = ((top[..., 0] - top[..., 1]) <= tol).double().mean(-1)
        assert torch.allclose(exact, seen, atol=4 * math.sqrt(0.25 / n)), (tol, exact, seen)
        assert (exact < math.expm1(tol)).all()
    assert expected_two(torch.zeros(1, 151_936), TOL).item() < math.expm1(TOL)


@pytest.mark.slow  # samples and replays 32k and 151k vocabularies: a check of bench code, ~5 min
def test_replay_choice_quick_rows_are_sane():
    two, caught, rejected, in_step, lora = results(quick=True)
    assert two.vrl <= 100 * math.expm1(TOL) and two.baseline > 1  # %; schema 4's band left a choice
    assert "expected share over the committed noise" in two.note and two.met
    assert caught.vrl == 100 and caught.met
    # every kind of forgery was tried and caught, the runner-up swap (the hardest) included
    for kind in ("runner-up", "likely", "neighbour"):
        got, forged = re.search(rf"{kind} (\d+(?:,\d{{3}})*)/(\d+(?:,\d{{3}})*)", caught.note).groups()
        assert forged == got and int(forged.replace(",", "")) > 0, caught.note
    assert rejected.vrl == 0 and rejected.met
    # the training step's forward (trainer.step.StepReplay) replays the fp32 samples alike
    assert in_step.vrl == 0 and in_step.met, in_step.note
    gap = float(re.search(r"margins differ by at most (\S+) nats", in_step.note).group(1))
    assert 0 <= gap < TOL, in_step.note
    # LoRA: merged (volunteers) and unmerged (the trainer) agree within the tolerance
    assert lora.vrl == 0 and lora.met, lora.note
    assert int(re.search(r"of (\d+(?:,\d{3})*)", lora.note).group(1).replace(",", "")) > 0
    gap = float(re.search(r"differ by at most (\S+) nats", lora.note).group(1))
    assert 0 <= gap < TOL, lora.note
