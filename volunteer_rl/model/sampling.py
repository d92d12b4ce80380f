"""Sampling from the policy: K completions of each prompt, batched, with the logprob of every
token under the distribution it was drawn from; and the inverse-CDF draw (`cdf_of`), which the
trainer's replay of committed uniforms (model.replay) shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from volunteer_rl.model.policy import Policy


@dataclass
class Sample:
    token_ids: list[int]   # generated tokens up to and including the first EOS
    logprobs: list[float]  # their logprobs under the sampling distribution (logits / T)
    text: str


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def _prefill(policy: Policy, prompts: list[list[int]], k: int):
    """Run each prompt once and repeat its KV cache K times: prompts are most of the tokens
    of a batch, and the K rows of a group share theirs. Returns (last-position logits [G*K, V],
    cache, attention mask [G*K, L], next position ids [G*K, 1])."""
    ids, mask = left_pad(prompts, policy.pad_id, policy.device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = policy.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                       logits_to_keep=1)
    out.past_key_values.batch_repeat_interleave(k)
    return (out.logits[:, -1].repeat_interleave(k, 0), out.past_key_values,
            mask.repeat_interleave(k, 0), pos[:, -1:].repeat_interleave(k, 0) + 1)


def logprobs_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The sampling distribution: log_softmax(logits / T) in float32, what tokens are drawn
    from and what their logprobs describe."""
    return torch.log_softmax(logits.float() / temperature, -1)


def cdf_dtype(device: torch.device) -> torch.dtype:
    """float64 for the running sum of probabilities; MPS has no float64: float32 there."""
    return torch.float32 if device.type == "mps" else torch.float64


def cdf_of(logp: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse-CDF rule, shared by `draw` and the trainer's replay (model.replay).

    For logp [rows, V] and one uniform per row u [rows] in [0, 1): the running sum of each
    row's probabilities cdf [rows, V] and the point target = u * cdf[:, -1] [rows]. The token
    drawn is the t with cdf[t-1] <= target < cdf[t] (cdf[-1] = 0 for t = 0): each token's
    interval is as wide as its probability (to ~1e-16 in float64), so a token of probability
    0 is never drawn."""
    cdf = logp.to(cdf_dtype(logp.device)).exp().cumsum(-1)
    return cdf, u.to(cdf.dtype) * cdf[:, -1]


def draw(logp: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `logp` [rows, V], drawn from softmax, i.e. from exp(logp).

    `u` [rows]: the row's committed uniform (protocol.draws), so that the trainer can replay
    the draw; None draws fresh ones with torch.rand (evaluation). Inverse CDF (`cdf_of`):
    one random number per row instead of one per vocabulary entry (the exponential race,
    also how torch.multinomial draws one sample) made a 128 x 640 draw about 8x cheaper
    here, and makes the token a function of one number the trainer can recompute."""
    if u is None:
        u = torch.rand(logp.shape[0], dtype=cdf_dtype(logp.device), device=logp.device)
    cdf, target = cdf_of(logp, u)
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=logp.shape[-1] - 1)


def committed_uniforms(uniforms: list[list[list[float]]], n_prompts: int, k: int,
                       max_new_tokens: int, device: torch.device) -> torch.Tensor:
    """The streams as one [n_prompts * K, max_new_tokens] tensor, rows in group order, in the
    dtype the CDF is summed in; ValueError if their shape does not fit the call."""
    if len(uniforms) != n_prompts or any(len(g) != k for g in uniforms):
        raise ValueError(f"uniforms: need {k} streams for each of {n_prompts} prompts")
    if any(len(s) < max_new_tokens for g in uniforms for s in g):
        raise ValueError(f"uniforms: every stream needs at least {max_new_tokens} values")
    rows = [s[:max_new_tokens] for g in uniforms for s in g]
    return (torch.tensor(rows, dtype=torch.float64).reshape(len(rows), max_new_tokens)
            .to(cdf_dtype(device)).to(device))


@torch.inference_mode()
def _generate_batch(policy: Policy, prompts: list[list[int]], k: int, temperature: float,
                    max_new_tokens: int,
                    uniforms: list[list[list[float]]] | None = None) -> list[Sample]:
    """K completions for each prompt, rows in group order; temperature <= 0 means greedy.

    `uniforms`: for each prompt, for each completion, its committed stream (at least
    max_new_tokens values); the token at step s of a row is drawn with its stream's value s.
    Each row's draw then depends only on its own distribution, not on the other rows of the
    batch (up to float noise). None: torch.rand. Greedy ignores them.

    A plain sampling loop over the KV cache rather than `generate`: it shares the prompt
    pass across the K rows, drops rows from the batch as soon as they emit EOS, and samples
    from exactly softmax(logits / T) (no top-k / top-p), which is what the logprobs describe.
    Tokens and logprobs stay in tensors until the end: no per-token Python work.
    """
    rows, dev, eos = len(prompts) * k, policy.device, policy.eos_id
    committed = (committed_uniforms(uniforms, len(prompts), k, max_new_tokens, dev)
                 if uniforms is not None and temperature > 0 else None)
    logits, cache, mask, pos = _prefill(policy, prompts, k)
    tokens = torch.full((rows, max_new_tokens), eos, dtype=torch.long, device=dev)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=dev)
    live = torch.arange(rows, device=dev)  # original row of each batch row
    steps = 0
    for step in range(max_new_tokens):
        logp = logprobs_of(logits, temperature if temperature > 0 else 1.0)
        if temperature <= 0:
            nxt = logp.argmax(-1)
        else:
            nxt = draw(logp, None if committed is None else committed[live, step])
        tokens[live, step] = nxt
        logps[live, step] = logp.gather(-1, nxt[:, None])[:, 0]
        steps = step + 1
        going = nxt != eos
        if step == max_new_tokens - 1 or not going.any():
            break
        if not going.all():  # finished rows leave the batch: no compute spent on padding
            keep = going.nonzero()[:, 0]
            cache.batch_select_indices(keep)
            live, nxt, mask, pos = live[keep], nxt[keep], mask[keep], pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        out = policy.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                           past_key_values=cache)
        logits, pos = out.logits[:, -1], pos + 1
    # A row's length runs to its first EOS, inclusive; a row that never emitted one ran
    # all `steps` (the loop stops early only once every row has ended).
    is_eos = tokens[:, :steps] == eos
    lengths = (torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, steps).tolist() if steps
               else [0] * rows)
    token_rows = [t[:n] for t, n in zip(tokens[:, :steps].tolist(), lengths)]
    logp_rows = [lp[:n] for lp, n in zip(logps[:, :steps].tolist(), lengths)]
    texts = policy.tokenizer.batch_decode(token_rows, skip_special_tokens=True)
    return [Sample(t, lp, text) for t, lp, text in zip(token_rows, logp_rows, texts)]


def sample(policy: Policy, prompts: list[list[int]], k: int, temperature: float,
           max_new_tokens: int, batch_size: int = 256,
           uniforms: list[list[list[float]]] | None = None) -> list[list[Sample]]:
    """K samples for each prompt, many prompts per batched call.

    Prompts are sorted by length before batching so rows in one call pad little; results come
    back in the caller's order as one list of K samples per prompt. `uniforms`, in the
    caller's prompt order: each completion's committed stream (see `_generate_batch`).
    """
    if uniforms is not None and len(uniforms) != len(prompts):
        raise ValueError(f"uniforms: need streams for {len(prompts)} prompts, got {len(uniforms)}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    per_call = max(1, batch_size // k)
    result: list[list[Sample]] = [[] for _ in prompts]
    for start in range(0, len(order), per_call):
        chunk = order[start:start + per_call]
        samples = _generate_batch(policy, [prompts[i] for i in chunk], k, temperature,
                                  max_new_tokens,
                                  None if uniforms is None else [uniforms[i] for i in chunk])
        for j, i in enumerate(chunk):
            result[i] = samples[j * k:(j + 1) * k]
    return result
