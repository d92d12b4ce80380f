"""The trainer loss's logprob of each chosen token, log_softmax(logits / T)[id], as one autograd
step that keeps no vocabulary-wide tensor of its own alive.

The plain path (sampling.logprobs_of, then a gather) makes the scaled logits and the whole
log-softmax [R, T, V] and autograd keeps the log-softmax for the backward; with Qwen3's 151,936
tokens that is 155 MB a micro-batch of [8, 32] in float32, on top of the logits themselves.
Here the forward works through the positions a slice at a time and keeps only the logsumexp
[R, T]; the backward builds the gradient in one new [R, T, V] buffer, in place. The numbers are
logprobs_of's: the logits are taken to float32 and divided by T before anything else.

Only the training loss uses this: the replay of volunteers' sampling keeps logprobs_of, whose
numbers must be what the volunteers computed, bit for bit.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

# Elements of one slice of positions worked on at a time: about 16 MB of float32 scratch,
# whatever the vocabulary (V = 151,936 gives 27 positions a slice).
SLICE_ELEMENTS = 1 << 22


def _slices(n: int, v: int):
    step = max(1, SLICE_ELEMENTS // max(v, 1))
    return ((a, min(a + step, n)) for a in range(0, n, step))


def _work_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32, as logprobs_of; float64 logits (gradcheck's) stay float64."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _scaled(rows: torch.Tensor, temperature: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, V] in the work dtype, divided by T: logprobs_of's `logits.float() / T`, bit for
    bit, written into `out` [n, V] when given."""
    if out is None:
        return rows.to(_work_dtype(rows)) / temperature
    return torch.div(out.copy_(rows), temperature, out=out)


class _ChosenLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        v = logits.shape[-1]
        flat, flat_ids = logits.reshape(-1, v), ids.reshape(-1, 1)
        lse = torch.empty(flat.shape[0], dtype=_work_dtype(logits), device=logits.device)
        out = torch.empty_like(lse)
        for a, b in _slices(flat.shape[0], v):
            z = _scaled(flat[a:b], temperature)  # [n, V], dropped after the slice
            torch.logsumexp(z, -1, out=lse[a:b])
            torch.sub(z.gather(-1, flat_ids[a:b])[:, 0], lse[a:b], out=out[a:b])
        ctx.save_for_backward(logits, ids, lse)  # logits is the caller's, already alive
        ctx.temperature = temperature
        return out.view(ids.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, g: torch.Tensor):
        logits, ids, lse = ctx.saved_tensors
        t = ctx.temperature
        v = logits.shape[-1]
        flat, flat_ids = logits.reshape(-1, v), ids.reshape(-1, 1)
        g_t = g.reshape(-1, 1).to(lse.dtype) / t  # [N, 1]
        # d(z[id] - lse)/d logits = (onehot(id) - softmax(z)) / T, times g.
        grad = torch.empty(flat.shape, dtype=logits.dtype, device=logits.device)  # the one buffer
        in_place = grad.dtype == lse.dtype
        for a, b in _slices(flat.shape[0], v):
            p = _scaled(flat[a:b], t, grad[a:b] if in_place else None)
            p.sub_(lse[a:b, None]).exp_().mul_(-g_t[a:b])
            p.scatter_add_(-1, flat_ids[a:b], g_t[a:b])
            if not in_place:
                grad[a:b].copy_(p)  # bfloat16 / float16 logits: float32 scratch a slice at a time
        return grad.view(logits.shape), None, None


def chosen_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [R, T, V] (any float dtype, with or without grad), ids [R, T] (long, each < V):
    logp [R, T] float32 = log_softmax(logits.float() / temperature, -1) at ids, with its
    gradient to logits (float64 logits give float64, for gradcheck). `temperature` > 0 (the
    caller floors it)."""
    if ids.shape != logits.shape[:-1]:
        raise ValueError(f"ids {tuple(ids.shape)} do not match logits {tuple(logits.shape)}")
    return _ChosenLogprob.apply(logits, ids, float(temperature))
