"""The trainer's replay of a volunteer's draws: were these tokens the ones its committed uniforms
select under the policy?

A volunteer samples each completion with the committed stream of protocol.draws: the token at
position p is the one whose interval [cdf[t-1], cdf[t]) of the running sum of probabilities
holds target = u[p] * cdf[-1] (model.sampling.cdf_of, the one place that rule lives). The
replay recomputes the distribution at every position with the trainer's own forward
(model.scoring.completion_logits: all positions at once, not token by token as sampled) and
measures how far inside its interval the target fell:

    margin = min(target - cdf[t-1], cdf[t] - target)          (cdf[-1] = 0 for t = 0)

in probability mass. margin >= 0: the committed draw selects t. An honest sample can still
come out slightly negative, when its target lies within float noise of an interval's edge
(the sampler ran another batch, thread count or device than the replay); the caller accepts
margin >= -tolerance, the band bench/replay_noise.py measures. A chosen token lies anywhere
else: its margin is typically a sizeable negative probability mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from volunteer_rl.model.policy import Policy
from volunteer_rl.model.sampling import cdf_dtype, cdf_of, logprobs_of
from volunteer_rl.model.scoring import completion_logits

CHUNK_BYTES = 64 << 20
"""Bound on a [rows, T, V] float64 tensor (and the float64 CDF of any slice of positions):
rows are replayed a chunk at a time, so a vocabulary of 150k stays within memory."""


@dataclass
class ReplayRow:
    margin: float
    """The smallest margin over the completion's positions (math.inf for an empty completion;
    NaN logits count as -inf, so they are never accepted)."""
    position: int
    """The position of that smallest margin (the first one if tied; -1 if empty)."""
    logprobs: list[float]
    """The recomputed logprob of each submitted token under log_softmax(logits / T), float32
    as sampling computes it, to compare with the logprobs the volunteer claimed."""


@torch.inference_mode()
def replay(policy: Policy, prompts: list[list[int]], completions: list[list[list[int]]],
           uniforms: list[list[list[float]]], temperature: float) -> list[ReplayRow]:
    """Replay each completion's draw: one ReplayRow per completion, rows in group order.

    prompts: G prompts; completions: for each prompt its completions; uniforms: for each of
    those its committed stream (at least as many values as it has tokens)."""
    if temperature <= 0:
        raise ValueError("a greedy completion has no draw to replay (temperature <= 0)")
    if len(completions) != len(prompts) or len(uniforms) != len(prompts):
        raise ValueError("need completions and uniforms for every prompt")
    rows = []  # (group, tokens, stream) of each completion, in group order
    for g, (cs, us) in enumerate(zip(completions, uniforms)):
        if len(cs) != len(us) or any(len(u) < len(c) for c, u in zip(cs, us)):
            raise ValueError(f"group {g}: every completion needs a stream as long as it is")
        rows += [(g, c, u) for c, u in zip(cs, us)]
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    result = [ReplayRow(math.inf, -1, []) for _ in rows]
    todo = [i for i, (_, c, _) in enumerate(rows) if c]
    while todo:
        chunk, width = [], 0
        for i in todo:
            w = max(width, len(rows[i][1]))
            if chunk and (len(chunk) + 1) * w * vocab * 8 > CHUNK_BYTES:
                break
            chunk, width = chunk + [i], w
        todo = todo[len(chunk):]
        for i, row in zip(chunk, _replay_rows(policy, prompts, [rows[i] for i in chunk],
                                              temperature, vocab)):
            result[i] = row
    return result


def _replay_rows(policy: Policy, prompts: list[list[int]],
                 rows: list[tuple[int, list[int], list[float]]], temperature: float,
                 vocab: int) -> list[ReplayRow]:
    """Replay non-empty completions, in group order: one forward for all of them, then the
    CDF of their positions in slices of at most CHUNK_BYTES."""
    used: list[list[int]] = []
    groups: list[list[list[int]]] = []
    last = None
    for g, tokens, _ in rows:  # consecutive rows of one prompt share its prompt pass
        if g != last:
            used.append(prompts[g])
            groups.append([])
            last = g
        groups[-1].append(tokens)
    logits, ids, mask = completion_logits(policy, used, groups)
    keep = mask.bool()
    flat_logits, flat_tokens = logits[keep], ids[keep]  # positions in (row, position) order
    flat_u = torch.tensor([x for _, tokens, u in rows for x in u[:len(tokens)]],
                          dtype=torch.float64).to(cdf_dtype(policy.device)).to(policy.device)
    step = max(1, CHUNK_BYTES // (vocab * 8))
    margins, logps = [], []
    for a in range(0, len(flat_tokens), step):
        logp = logprobs_of(flat_logits[a:a + step], temperature)
        cdf, target = cdf_of(logp, flat_u[a:a + step])
        t = flat_tokens[a:a + step, None]
        hi = cdf.gather(1, t)[:, 0]
        lo = torch.where(t[:, 0] > 0, cdf.gather(1, (t - 1).clamp(min=0))[:, 0], 0.0)
        m = torch.minimum(target - lo, hi - target)
        margins.append(torch.where(m.isnan(), -math.inf, m))
        logps.append(logp.gather(1, t)[:, 0])
    margin_list = torch.cat(margins).tolist()
    logp_list = torch.cat(logps).tolist()
    out, start = [], 0
    for _, tokens, _ in rows:
        m = margin_list[start:start + len(tokens)]
        p = min(range(len(m)), key=m.__getitem__)
        out.append(ReplayRow(m[p], p, logp_list[start:start + len(tokens)]))
        start += len(tokens)
    return out
