"""model.token_logprob: the loss's chosen-token logprob gives the numbers and gradients of
sampling.logprobs_of + gather, and keeps no vocabulary-wide tensor alive of its own."""

import pytest
import torch

from volunteer_rl.model import token_logprob
from volunteer_rl.model.sampling import logprobs_of
from volunteer_rl.model.scoring import logprobs_at
from volunteer_rl.model.token_logprob import chosen_logprobs


def reference(logits, ids, temperature):
    return logprobs_of(logits, temperature).gather(-1, ids[..., None])[..., 0]


def inputs(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=gen, dtype=torch.float32) * 4).to(dtype)
    ids = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return logits, ids


def value_and_grad(fn, logits, ids, temperature, weights):
    x = logits.clone().requires_grad_(True)
    out = fn(x, ids, temperature)
    (out * weights).sum().backward()
    return out.detach(), x.grad


def test_gradcheck_in_float64():
    logits, ids = inputs((2, 3, 7), torch.float64)
    x = logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: chosen_logprobs(z, ids, 0.7), (x,))


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_float32_values_and_grads_are_the_reference(temperature, monkeypatch):
    # Several slices of positions, and one that is cut short.
    monkeypatch.setattr(token_logprob, "SLICE_ELEMENTS", 3 * 1000)
    logits, ids = inputs((3, 5, 1000), torch.float32)
    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    v_new, g_new = value_and_grad(chosen_logprobs, logits, ids, temperature, w)
    v_ref, g_ref = value_and_grad(reference, logits, ids, temperature, w)
    assert v_new.dtype == torch.float32 and g_new.dtype == torch.float32
    torch.testing.assert_close(v_new, v_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_new, g_ref, atol=1e-6, rtol=1e-6)


def test_bfloat16_logits_give_float32_logprobs_and_bfloat16_grads_as_the_reference(monkeypatch):
    monkeypatch.setattr(token_logprob, "SLICE_ELEMENTS", 4 * 500)
    logits, ids = inputs((2, 7, 500), torch.bfloat16)
    w = torch.randn(2, 7, generator=torch.Generator().manual_seed(2))
    v_new, g_new = value_and_grad(chosen_logprobs, logits, ids, 0.8, w)
    v_ref, g_ref = value_and_grad(reference, logits, ids, 0.8, w)
    assert v_new.dtype == torch.float32 and g_new.dtype == torch.bfloat16
    torch.testing.assert_close(v_new, v_ref, atol=1e-5, rtol=1e-6)
    # The two differ only in float32 rounding before the gradient is rounded to bfloat16.
    torch.testing.assert_close(g_new.float(), g_ref.float(), atol=1e-4, rtol=8e-3)


def test_padded_rows_the_loss_masks_get_no_gradient_and_the_rest_match():
    logits, ids = inputs((3, 4, 50), torch.float32)
    ids[1, 2:] = 0  # a short completion, padded with id 0
    mask = torch.ones(3, 4)
    mask[1, 2:] = 0
    x = logits.clone().requires_grad_(True)
    logp, m = logprobs_at(x, ids, mask.long(), 0.9)
    (logp * m).sum().backward()
    xr = logits.clone().requires_grad_(True)
    ref = reference(xr, ids, 0.9)
    (ref * mask).sum().backward()
    assert m.dtype == logp.dtype and torch.equal(m, mask)
    torch.testing.assert_close(logp, ref.detach(), atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(x.grad[1, 2:]) == 0
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-6, rtol=1e-5)


def test_temperature_zero_is_floored_at_1e_6_as_before():
    logits, ids = inputs((2, 3, 40), torch.float32)
    logp, _ = logprobs_at(logits, ids, torch.ones_like(ids), 0.0)
    assert torch.isfinite(logp).all()
    torch.testing.assert_close(logp, reference(logits, ids, 1e-6), atol=1e-6, rtol=1e-6)


def test_ids_of_another_shape_are_refused():
    logits, ids = inputs((2, 3, 10), torch.float32)
    with pytest.raises(ValueError):
        chosen_logprobs(logits, ids[:, :2], 1.0)


def saved_vocab_wide_bytes(logits, ids, temperature=0.7):
    """Bytes of [R, T, V]-sized tensors autograd keeps for the backward of logprobs_at on
    `logits`, other than `logits` itself (which the forward before it keeps alive anyway)."""
    x = logits.clone().requires_grad_(True)
    wide = x.numel()
    seen = []

    def pack(t):
        if t.numel() >= wide and t.data_ptr() != x.data_ptr():
            seen.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, mask = logprobs_at(x, ids, torch.ones_like(ids), temperature)
    (logp * mask).sum().backward()
    assert x.grad is not None
    return sum(seen)


def test_autograd_keeps_no_vocabulary_wide_tensor_beyond_the_logits():
    # The log_softmax + gather path keeps the [4, 16, 50000] log-softmax (12.8 MB float32).
    logits, ids = inputs((4, 16, 50_000), torch.float32)
    assert saved_vocab_wide_bytes(logits, ids) == 0
    assert saved_vocab_wide_bytes(logits.bfloat16(), ids) == 0
