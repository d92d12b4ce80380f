"""Sampling from the policy: K completions of each prompt, batched, with the logprob of every
token under the distribution it was drawn from."""

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


def draw(logp: torch.Tensor) -> torch.Tensor:
    """One token per row of `logp` [rows, V], drawn from softmax, i.e. from exp(logp).

    Inverse CDF: one uniform per row against the running sum of the row's probabilities,
    both in float64, so every token's interval is its probability to ~1e-16 and a token of
    probability 0 is never drawn. One random number per row instead of one per vocabulary
    entry (the exponential race, also how torch.multinomial draws one sample) made a
    128 x 640 draw about 8x cheaper here. MPS has no float64: float32 there."""
    cdf = logp.to(torch.float32 if logp.device.type == "mps" else torch.float64).exp().cumsum(-1)
    u = torch.rand((logp.shape[0], 1), dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=logp.shape[-1] - 1)


@torch.inference_mode()
def _generate_batch(policy: Policy, prompts: list[list[int]], k: int, temperature: float,
                    max_new_tokens: int) -> list[Sample]:
    """K completions for each prompt, rows in group order; temperature <= 0 means greedy.

    A plain sampling loop over the KV cache rather than `generate`: it shares the prompt
    pass across the K rows, drops rows from the batch as soon as they emit EOS, and samples
    from exactly softmax(logits / T) (no top-k / top-p), which is what the logprobs describe.
    Tokens and logprobs stay in tensors until the end: no per-token Python work.
    """
    logits, cache, mask, pos = _prefill(policy, prompts, k)
    rows, dev, eos = len(prompts) * k, policy.device, policy.eos_id
    tokens = torch.full((rows, max_new_tokens), eos, dtype=torch.long, device=dev)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=dev)
    live = torch.arange(rows, device=dev)  # original row of each batch row
    steps = 0
    for step in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), -1)
        nxt = logp.argmax(-1) if temperature <= 0 else draw(logp)
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
           max_new_tokens: int, batch_size: int = 256) -> list[list[Sample]]:
    """K samples for each prompt, many prompts per batched call.

    Prompts are sorted by length before batching so rows in one call pad little; results come
    back in the caller's order as one list of K samples per prompt.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    per_call = max(1, batch_size // k)
    result: list[list[Sample]] = [[] for _ in prompts]
    for start in range(0, len(order), per_call):
        chunk = order[start:start + per_call]
        samples = _generate_batch(policy, [prompts[i] for i in chunk], k, temperature,
                                  max_new_tokens)
        for j, i in enumerate(chunk):
            result[i] = samples[j * k:(j + 1) * k]
    return result
