"""Scoring under the policy: the logits and logprobs of given completion tokens after their
prompts, with gradients, as the trainer's loss (and, without them, its replay) needs them."""

from __future__ import annotations

import torch

from volunteer_rl.model.policy import Policy
from volunteer_rl.model.sampling import left_pad
from volunteer_rl.model.token_logprob import chosen_logprobs


def right_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


def completion_logits(policy: Policy, prompts: list[list[int]],
                      completions: list[list[list[int]]]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict each completion token, given its prompt: the forward that
    scoring and the trainer's replay (model.replay) share.

    prompts: G prompts; completions: for each prompt its completions (any number, at least
    one token among all of them). Returns logits [rows, T, V] in the model's dtype, with
    grad unless the caller turned it off, and the completions right-padded to c_ids
    [rows, T] with c_mask [rows, T]; rows in group order, T the longest completion, each
    completion left-aligned at column 0.

    Each prompt is run once and its KV cache is repeated for its completions, instead of
    running the prompt once per completion: prompts are most of the tokens here, so this cuts
    the step's compute by about 2.5x at K = 8. Gradients flow through the shared prompt pass.
    Prompts are left-padded as in generation, so positions match what was sampled.
    """
    group = torch.tensor([g for g, cs in enumerate(completions) for _ in cs],
                         dtype=torch.long, device=policy.device)  # the prompt of each row
    p_ids, p_mask = left_pad(prompts, policy.pad_id, policy.device)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    out = policy.model(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True,
                       logits_to_keep=1)
    cache = out.past_key_values
    cache.batch_select_indices(group)
    c_ids, c_mask = right_pad([c for cs in completions for c in cs], policy.pad_id, policy.device)
    c_pos = p_pos[group, -1:] + 1 + torch.arange(c_ids.shape[1], device=policy.device)
    mask = torch.cat([p_mask[group], c_mask], dim=1)
    logits = policy.model(input_ids=c_ids, attention_mask=mask, position_ids=c_pos,
                          past_key_values=cache).logits
    # The first completion token is predicted by the prompt's last position, the rest by the
    # completion positions before them.
    return torch.cat([out.logits[group, -1:], logits[:, :-1]], dim=1), c_ids, c_mask


def token_logprobs(policy: Policy, prompts: list[list[int]], completions: list[list[list[int]]],
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each completion token given its prompt, under logits / temperature.

    prompts: G prompts; completions: for each prompt the same number K of completions.
    Returns logp [G*K, T] (with grad) and mask [G*K, T], T the longest completion, rows in
    group order, each completion left-aligned at column 0 (the forward: `completion_logits`).
    """
    k = len(completions[0])
    if any(len(c) != k for c in completions):
        raise ValueError("every prompt needs the same number of completions")
    logits, c_ids, c_mask = completion_logits(policy, prompts, completions)
    return logprobs_at(logits, c_ids, c_mask, temperature)


def logprobs_at(logits: torch.Tensor, c_ids: torch.Tensor, c_mask: torch.Tensor,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logits`' output as token_logprobs returns it: logp [rows, T] of each
    completion token under logits / temperature, and the mask [rows, T] in logp's dtype.

    sampling.logprobs_of's numbers (float32), through model.token_logprob, which keeps no
    vocabulary-wide tensor alive for the backward beyond the logits themselves."""
    logp = chosen_logprobs(logits, c_ids, max(temperature, 1e-6))
    return logp, c_mask.to(logp.dtype)
