"""Sampling from the policy: K completions of each prompt, batched, with the logprob of every
token under the distribution it was drawn from; and the Gumbel-max draw over committed noise
(protocol.draws: `gumbel_noise`, `perturbed`, `draw`, `margins`), which the trainer's replay
(model.replay) shares."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch

from volunteer_rl.model.policy import Policy
from volunteer_rl.protocol import draws


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


def noise_device(device: torch.device) -> torch.device:
    """Where the committed noise and the perturbed scores are computed: the device itself,
    or the CPU for MPS, which has no float64."""
    return torch.device("cpu") if device.type == "mps" else device


def mix32(x: torch.Tensor) -> torch.Tensor:
    """protocol.draws.mix32 of every element of an int64 tensor of 32-bit words. Products mod
    2**32 are taken in 16-bit halves of the multiplier, so no int64 product exceeds 2**48
    (an int64 overflow is undefined in torch's kernels)."""
    for c, shift in zip(draws.MIX32, (16, 15)):
        x = x ^ (x >> shift)
        x = (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & draws.MASK32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=8)
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """mix32(i) and mix32(0x10000 | i) ^ 2**31 for i < 2**16 (the tabulation of
    protocol.draws), as int32 holding the same 32 bits: gathers from 256 KB tables with
    index_select run about four times faster than int64 advanced indexing on CPU, and noise
    is most of a replay's time outside the forward. The second table's top bit is flipped
    so that the XOR of two entries, read as a signed int32, is the noise bits minus 2**31
    (`_signed_bits`), which float64 takes exactly with no int64 pass."""
    i = torch.arange(1 << 16, dtype=torch.int64, device=device)
    return mix32(i).to(torch.int32), (mix32(i | 0x10000) ^ (1 << 31)).to(torch.int32)


@functools.lru_cache(maxsize=8)
def _token_halves(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high 16 bits of mix32(t) for every token id t < vocab, int32 [vocab] each:
    a key's word is XORed into each half on its own, so no [rows, vocab] tensor is masked
    or shifted."""
    w = mix32(torch.arange(vocab, dtype=torch.int64, device=device))
    return (w & 0xFFFF).to(torch.int32), (w >> 16).to(torch.int32)


def key_words(keys: list[bytes], device: torch.device) -> torch.Tensor:
    """[rows, 2] int64: (k0, k1) of each completion's draw key (protocol.draws.key_words)."""
    return torch.tensor([draws.key_words(k) for k in keys], dtype=torch.int64,
                        device=noise_device(device)).reshape(len(keys), 2)


def _signed_bits(words: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] int32: `noise_bits` - 2**31 (see _tables)."""
    dev = words.device
    b = mix32(words[:, 0] ^ mix32(words[:, 1] ^ positions.to(dev)))  # [rows], < 2**32
    low_t, high_t = _token_halves(vocab, dev)
    low = ((b & 0xFFFF).to(torch.int32)[:, None] ^ low_t[None, :]).view(-1)
    high = ((b >> 16).to(torch.int32)[:, None] ^ high_t[None, :]).view(-1)
    t_low, t_high = _tables(dev)
    return (t_low.index_select(0, low) ^ t_high.index_select(0, high)).view(len(b), vocab)


def noise_bits(words: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] int64: protocol.draws.noise_bits of every token at `positions` [rows]
    (int64) of the completions whose key words are `words` [rows, 2] (`key_words`)."""
    return _signed_bits(words, positions, vocab).long() + (1 << 31)


def gumbel_noise(words: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float64: the committed noise g = -log(-log(u)) of `noise_bits`,
    u = (bits + 0.5) / 2**32 (equal to protocol.draws.gumbel up to the last bit of the
    device's log). bits - 2**31 + (2**31 + 0.5) is exact in float64, so u is exactly what
    the formula gives."""
    u = _signed_bits(words, positions, vocab).double().add_(2.0 ** 31 + 0.5).mul_(2.0 ** -32)
    return u.log_().neg_().log_().neg_()


def perturbed(logits: torch.Tensor, temperature: float, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max scores z + g in float64, z = logits / T computed in float32 (the draw's
    one formula, shared by `draw` and the trainer's replay, model.replay)."""
    return (logits.to(noise.device).float() / temperature).double() + noise


def draw(scores: torch.Tensor) -> torch.Tensor:
    """One token per row of the perturbed scores [rows, V]: the argmax, an exact sample of
    softmax(logits / T) when the noise is standard Gumbel."""
    return scores.argmax(-1)


def margins(scores: torch.Tensor, tokens: torch.Tensor,
            top: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The replay's acceptance rule: for perturbed scores [rows, V] and one submitted token
    per row, the margin by which that token won, in nats (float64 [rows]):

        the argmax:       top score - second score       (>= 0)
        the runner-up:    second score - top score       (<= 0: it lost, by that much)
        any other token:  -inf                           (never accepted)
        NaN scores:       -inf

    The caller accepts margin >= -tolerance: the replay's own token, or the runner-up when the
    top two nearly tie (float noise between sampler and replay can swap a near-tie, nothing
    else). So at most two tokens ever pass at a position, and two only at a near-tie.
    `top`: `scores.topk(2, dim=-1)` if the caller has it already (the replay keeps its indices)."""
    values, idx = scores.topk(2, dim=-1) if top is None else top
    gap = values[:, 0] - values[:, 1]
    t = tokens.to(scores.device)
    m = torch.where(t == idx[:, 0], gap, torch.where(t == idx[:, 1], -gap, -math.inf))
    return torch.where(m.isnan(), -math.inf, m)


def committed_words(draw_keys: list[list[bytes]], n_prompts: int, k: int,
                    device: torch.device) -> torch.Tensor:
    """The draw keys' words (`key_words`) as one [n_prompts * K, 2] tensor, rows in group
    order; ValueError if their shape does not fit the call."""
    if len(draw_keys) != n_prompts or any(len(g) != k for g in draw_keys):
        raise ValueError(f"draw_keys: need {k} keys for each of {n_prompts} prompts")
    if any(not isinstance(key, bytes) or len(key) < 8 for g in draw_keys for key in g):
        raise ValueError("draw_keys: every key is the bytes of protocol.draws.draw_key")
    return key_words([key for g in draw_keys for key in g], device)


COMPACT_SHARE = 4
"""Finished rows stay in a sampling batch until they are 1 / COMPACT_SHARE of it."""


@torch.inference_mode()
def _generate_batch(policy: Policy, prompts: list[list[int]], k: int, temperature: float,
                    max_new_tokens: int, draw_keys: list[list[bytes]] | None = None,
                    between_steps: Callable[[], None] | None = None) -> list[Sample]:
    """K completions for each prompt, rows in group order; temperature <= 0 means greedy.

    `draw_keys`: for each prompt, for each completion, its committed key
    (protocol.draws.draw_key); the token at step s of a row is the argmax of its perturbed
    scores with that key's noise at position s. Each row's draw then depends only on its own
    distribution, not on the other rows of the batch (up to float noise at a near-tie). None:
    keys drawn from torch's generator (evaluation). Greedy ignores them.

    `between_steps`, if given, is called after every forward (the prompt pass and each
    token's): a volunteer's host-control pause holds there (volunteer.host).

    A plain sampling loop over the KV cache rather than `generate`: it shares the prompt
    pass across the K rows, drops rows from the batch as soon as they emit EOS, and samples
    from exactly softmax(logits / T) (no top-k / top-p), which is what the logprobs describe.
    Tokens and logprobs stay in tensors until the end: no per-token Python work.
    """
    rows, dev, eos = len(prompts) * k, policy.device, policy.eos_id
    if temperature > 0:
        words = (committed_words(draw_keys, len(prompts), k, dev) if draw_keys is not None
                 else torch.randint(0, 1 << 32, (rows, 2), dtype=torch.int64)
                 .to(noise_device(dev)))
    logits, cache, mask, pos = _prefill(policy, prompts, k)
    if between_steps is not None:
        between_steps()
    vocab = logits.shape[-1]
    tokens = torch.full((rows, max_new_tokens), eos, dtype=torch.long, device=dev)
    logps = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=dev)
    live = torch.arange(rows, device=dev)  # original row of each batch row
    done = torch.zeros(rows, dtype=torch.bool, device=dev)  # batch rows that emitted EOS
    steps = 0
    for step in range(max_new_tokens):
        logp = logprobs_of(logits, temperature if temperature > 0 else 1.0)
        if temperature <= 0:
            nxt = logp.argmax(-1)
        else:
            at = live.to(words.device)
            noise = gumbel_noise(words[at], torch.full_like(at, step), vocab)
            nxt = draw(perturbed(logits, temperature, noise)).to(dev)
        # A finished row still in the batch writes past its EOS: cut off below, like padding.
        tokens[live, step] = nxt
        logps[live, step] = logp.gather(-1, nxt[:, None])[:, 0]
        steps = step + 1
        done |= nxt == eos
        if step == max_new_tokens - 1 or done.all():
            break
        # Finished rows leave the batch once they are 1 / COMPACT_SHARE of it: each compaction
        # copies the whole KV cache, and doing it whenever one row ends cost more than the
        # rows it saved.
        if done.sum() * COMPACT_SHARE >= len(live):
            keep = (~done).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            live, nxt, mask, pos, done = live[keep], nxt[keep], mask[keep], pos[keep], done[keep]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        out = policy.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                           past_key_values=cache)
        logits, pos = out.logits[:, -1], pos + 1
        if between_steps is not None:
            between_steps()
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
           draw_keys: list[list[bytes]] | None = None,
           between_steps: Callable[[], None] | None = None) -> list[list[Sample]]:
    """K samples for each prompt, many prompts per batched call.

    Prompts are sorted by length before batching so rows in one call pad little; results come
    back in the caller's order as one list of K samples per prompt. `draw_keys`, in the
    caller's prompt order: each completion's committed key (see `_generate_batch`); a group
    sampled honestly is `sample(policy, [prompt], K, T, n,
    draw_keys=[protocol.draws.group_keys(run_id, version, volunteer_id, seq, prompt_id, K)])`.
    """
    if draw_keys is not None and len(draw_keys) != len(prompts):
        raise ValueError(f"draw_keys: need keys for {len(prompts)} prompts, got {len(draw_keys)}")
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    per_call = max(1, batch_size // k)
    result: list[list[Sample]] = [[] for _ in prompts]
    for start in range(0, len(order), per_call):
        chunk = order[start:start + per_call]
        samples = _generate_batch(policy, [prompts[i] for i in chunk], k, temperature,
                                  max_new_tokens,
                                  None if draw_keys is None else [draw_keys[i] for i in chunk],
                                  between_steps)
        for j, i in enumerate(chunk):
            result[i] = samples[j * k:(j + 1) * k]
    return result
