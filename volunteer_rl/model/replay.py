"""The trainer's replay of a volunteer's draws: were these tokens the ones their committed
noise selects under the policy?

A volunteer samples each completion with the committed noise of protocol.draws: the token at
position p is the argmax over the vocabulary of the perturbed scores z + g, z = logits / T
(model.sampling.perturbed, the one place that rule lives). The replay recomputes the scores
at every position with the trainer's own forward (model.replay_forward: all positions at
once, each distinct prefix of a prompt's completions once, not token by token as sampled) and
the same noise, and measures by how much the submitted token won (model.sampling.margins), in nats:

    the replay's own argmax:  top score - second score  (>= 0)
    the runner-up:            -(that gap)               (< 0: it lost, by the gap)
    any other token:          -inf

An honest token can come out as the runner-up only where the top two scores nearly tie and
float noise between the two forwards (another batch, thread count, device) swapped them; the
caller accepts margin >= -tolerance, the band bench/replay_noise.py measures. So at most two
tokens pass at a position, and two only at a near-tie (a share of positions about the
tolerance itself); a chosen token almost always sits below the top score by a sizeable gap,
or outside the top two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from volunteer_rl.model.policy import Policy
from volunteer_rl.model.sampling import gumbel_noise, key_words, logprobs_of, margins, perturbed
from volunteer_rl.model.replay_forward import replay_logits

CHUNK_BYTES = 64 << 20
"""Bound on a [rows, T, V] float64 tensor (and on the noise of any slice of positions, a few
int64 and float64 tensors of this size): rows are replayed a chunk at a time, so a
vocabulary of 150k stays within memory."""


@dataclass
class ReplayRow:
    margins: list[float]
    """The margin of each submitted token, in nats (model.sampling.margins; NaN logits give
    -inf, never accepted)."""
    logprobs: list[float]
    """The recomputed logprob of each submitted token under log_softmax(logits / T), float32
    as sampling computes it, to compare with the logprobs the volunteer claimed."""
    drawn: list[int]
    """The replay's own token (its argmax) at each position."""
    runner_up: list[int]
    """The token with the second score at each position."""

    @property
    def margin(self) -> float:
        """The smallest margin, math.inf for an empty completion."""
        return min(self.margins, default=math.inf)

    @property
    def position(self) -> int:
        """The position of the smallest margin (the first one if tied; -1 if empty)."""
        return min(range(len(self.margins)), key=self.margins.__getitem__, default=-1)

    def first_failure(self, tolerance: float) -> int:
        """The first position whose margin is below -tolerance, -1 if none."""
        return next((p for p, m in enumerate(self.margins) if not m >= -tolerance), -1)


@torch.inference_mode()
def replay(policy: Policy, prompts: list[list[int]], completions: list[list[list[int]]],
           draw_keys: list[list[bytes]], temperature: float) -> list[ReplayRow]:
    """Replay each completion's draw: one ReplayRow per completion, rows in group order.

    prompts: G prompts; completions: for each prompt its completions; draw_keys: for each of
    those its committed key (protocol.draws.draw_key)."""
    if temperature <= 0:
        raise ValueError("a greedy completion has no draw to replay (temperature <= 0)")
    if len(completions) != len(prompts) or len(draw_keys) != len(prompts):
        raise ValueError("need completions and draw keys for every prompt")
    rows = []  # (group, tokens, key) of each completion, in group order
    for g, (cs, ks) in enumerate(zip(completions, draw_keys)):
        if len(cs) != len(ks) or any(not isinstance(k, bytes) or len(k) < 8 for k in ks):
            raise ValueError(f"group {g}: every completion needs its draw key")
        rows += [(g, c, k) for c, k in zip(cs, ks)]
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    result = [ReplayRow([], [], [], []) for _ in rows]
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
                                              temperature)):
            result[i] = row
    return result


def _replay_rows(policy: Policy, prompts: list[list[int]],
                 rows: list[tuple[int, list[int], bytes]], temperature: float
                 ) -> list[ReplayRow]:
    """Replay non-empty completions, in group order: one forward for them all, each distinct
    prefix of a prompt's completions computed once (model.replay_forward), then the noise and
    scores of every row's positions in slices of at most CHUNK_BYTES."""
    used: list[list[int]] = []
    groups: list[list[list[int]]] = []
    last = None
    for g, tokens, _ in rows:  # consecutive rows of one prompt share its prompt pass
        if g != last:
            used.append(prompts[g])
            groups.append([])
            last = g
        groups[-1].append(tokens)
    logits, at_rows = replay_logits(policy, used, groups)
    return score_rows(logits, at_rows, [(tokens, key) for _, tokens, key in rows], temperature)


@torch.no_grad()
def replay_scored(logits: torch.Tensor, rows: list[int], completions: list[list[int]],
                  draw_keys: list[bytes], temperature: float) -> list[ReplayRow]:
    """Replay completions whose logits a forward already computed, as model.scoring
    .completion_logits gives them (the trainer's step forward): `logits` [R, T, V], and for
    each completion its row of them (`rows`), which predicts its tokens from column 0, and its
    committed key. The noise and scores are those of `replay`; no gradient flows."""
    width = logits.shape[1]
    at = [[r * width + p for p in range(len(c))] for r, c in zip(rows, completions)]
    return score_rows(logits.detach().reshape(-1, logits.shape[-1]), at,
                      list(zip(completions, draw_keys)), temperature)


def score_rows(logits: torch.Tensor, at_rows: list[list[int]],
               rows: list[tuple[list[int], bytes]], temperature: float) -> list[ReplayRow]:
    """The ReplayRow of each (tokens, draw key) of `rows`, its token at position p predicted
    by logits[at_rows[i][p]] ([N, V]): the committed noise and the perturbed scores of every
    position, gathered and scored in slices of at most CHUNK_BYTES."""
    vocab = logits.shape[-1]
    if not any(tokens for tokens, _ in rows):
        return [ReplayRow([], [], [], []) for _ in rows]
    # Every row's positions, in (row, position) order, as indices into the forward's rows.
    words = key_words([key for _, key in rows], logits.device)
    lengths = torch.tensor([len(tokens) for tokens, _ in rows], device=words.device)
    flat_words = words.repeat_interleave(lengths, 0)
    flat_pos = torch.cat([torch.arange(len(tokens), device=words.device) for tokens, _ in rows])
    at = torch.tensor([i for row in at_rows for i in row], device=logits.device)
    flat_tokens = torch.tensor([t for tokens, _ in rows for t in tokens], device=logits.device)
    step = max(1, CHUNK_BYTES // (vocab * 8))
    margin, logps, drawn, second = [], [], [], []
    for a in range(0, len(flat_tokens), step):
        z = logits[at[a:a + step]]
        t = flat_tokens[a:a + step]
        scores = perturbed(z, temperature, gumbel_noise(flat_words[a:a + step],
                                                         flat_pos[a:a + step], vocab))
        top = scores.topk(2, dim=-1)  # one pass over the vocabulary for the rule and the tokens
        margin.append(margins(scores, t, top))
        drawn.append(top.indices[:, 0])
        second.append(top.indices[:, 1])
        logps.append(logprobs_of(z, temperature).gather(1, t[:, None])[:, 0])
    margin_list = torch.cat(margin).tolist()
    logp_list = torch.cat(logps).tolist()
    drawn_list, second_list = torch.cat(drawn).tolist(), torch.cat(second).tolist()
    out, start = [], 0
    for tokens, _ in rows:
        end = start + len(tokens)
        out.append(ReplayRow(margin_list[start:end], logp_list[start:end],
                             drawn_list[start:end], second_list[start:end]))
        start = end
    return out


def replays_in_training(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward in training mode computes what its inference forward does, so
    a training step's logits can be replayed (`replay_scored`): no dropout module with a rate
    above 0 and no dropout rate above 0 in its config (attention dropout is often a functional
    call that only the config's rate turns on)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return False

    def rates(d: dict):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from rates(v)
            elif (isinstance(k, str) and ("dropout" in k or "pdrop" in k)
                  and isinstance(v, (int, float))):
                yield v

    config = getattr(model, "config", None)
    return config is None or not any(r > 0 for r in rates(config.to_dict()))
