"""One optimizer step on a batch of scored groups: advantages and the loss per micro-batch
(losses.py, pure), gradients accumulated over the step's rows, and no update at all if the
loss or a gradient is not finite (the step is refused and its groups blamed). Also the audit
of a shard's groups: every token replayed against its committed draw, every behavior logprob
recomputed (trainer.audit decides which shards, and with which version's weights).

train_step also runs as one of N ranks (trainer.ranks): each computes its share of the batch
and FSDP2 reduces the gradients (the trainer under torchrun: learner.Learner.step)."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.faults import crash_point
from volunteer_rl.model.policy import Policy
from volunteer_rl.model.replay import ReplayRow, replay, replay_scored
from volunteer_rl.model.scoring import completion_logits, logprobs_at
from volunteer_rl.protocol.draws import group_keys
from volunteer_rl.trainer.groups import ScoredGroup
from volunteer_rl.trainer.losses import (
    grpo_advantages,
    grpo_loss,
    reinforce_advantages,
    reinforce_loss,
)
from volunteer_rl.trainer.ranks import (
    Ranks,
    clip_grad_norm,
    gradient_scale,
    rank_share,
    single,
    sum_over_ranks,
)


SINGLE = single()
"""The plain trainer's Ranks: one process; the default of every function here."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    tokens: int
    stats: dict[str, float] = field(default_factory=dict)
    applied: bool = True
    """False when the loss or the gradient norm was not finite: the optimizer was not stepped."""


@dataclass
class StepReplay:
    """The step's own forward replaying the groups of `version` not verified yet, each
    micro-batch's before its backward (trainer.verify's cheaper path: the forward the loss
    needs anyway gives the logits the replay needs). Only valid while the weights in hand are
    `version`'s exactly as volunteers load them: fp32 weights, one process, no step since
    `version` was published, and a forward that training mode leaves as it is
    (model.replay.replays_in_training); roles.Single.step_replay decides.

    The first micro-batch with a failure ends the step unapplied: its backward never runs, and
    `problems` names the failures by index into the batch. Groups of the micro-batches before
    it that passed are marked verified."""

    version: int
    run_id: str
    problems: dict[int, tuple[str, str]] = field(default_factory=dict)
    replayed: int = 0
    seconds: float = 0.0

    def scan(self, groups: list[ScoredGroup], offset: int, logits: torch.Tensor,
             cfg: TrainerConfig) -> None:
        """Replay the groups of `groups` (the batch's from index `offset`) that are this
        one's to replay, from their micro-batch's `logits` [rows, T, V] (completion_logits)."""
        started = time.monotonic()
        row, todo = 0, []
        for i, g in enumerate(groups):
            if not g.verified and g.policy_version == self.version:
                todo.append((i, range(row, row + len(g.token_ids))))
            row += len(g.token_ids)
        if not todo:
            return
        mine = [groups[i] for i, _ in todo]
        keys = [k for g in mine for k in _draw_keys(self.run_id, g)]
        rows = replay_scored(logits, [r for _, rs in todo for r in rs],
                             [c for g in mine for c in g.token_ids], keys, cfg.temperature)
        found = group_problems(mine, iter(rows), cfg.replay_tolerance, cfg.audit_tolerance)
        for (i, _), g, problem in zip(todo, mine, found):
            if problem is None:
                g.verified = True
            else:
                self.problems[offset + i] = problem
        self.replayed += len(todo)
        self.seconds += time.monotonic() - started


def _behavior_tensor(rows: list[list[float]], width: int, device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), device=device)
    for i, lp in enumerate(rows):
        out[i, : len(lp)] = torch.tensor(lp)
    return out


def _backward(policy: Policy, groups: list[ScoredGroup], prompt_ids: dict[int, list[int]],
              version: int, cfg: TrainerConfig, ranks: Ranks = SINGLE,
              check: StepReplay | None = None) -> tuple[float, int, Counter]:
    """Accumulate the step's gradient over micro-batches; (loss, tokens, GRPO statistics).

    With several ranks (trainer.ranks) every rank holds all of `groups` and computes only its
    share of the rows: the token count the loss is a mean over is the whole step's, so the
    ranks' parts sum to the single process's loss, and each part is scaled so that FSDP2's
    mean of the ranks' gradients is their sum. The loss and statistics returned are this
    rank's part (train_step sums them over the ranks).

    `check` (one process only): each micro-batch's forward replays its groups first, and the
    first micro-batch with a failure ends the pass before its backward."""
    total_tokens = sum(len(c) for g in groups for c in g.token_ids)
    groups = groups[rank_share(len(groups), ranks)]
    scale = gradient_scale(ranks)  # 1.0 in a single process
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    adv_fn = grpo_advantages if cfg.algo == "grpo" else reinforce_advantages
    adv = adv_fn(rewards).to(policy.device)  # [G, K]: each group's own, so a share's are the same
    per_micro = max(1, cfg.micro_batch // len(groups[0].token_ids))
    loss_sum, stats = 0.0, Counter()
    for s in range(0, len(groups), per_micro):
        chunk = groups[s:s + per_micro]
        logits, c_ids, c_mask = completion_logits(
            policy, [prompt_ids[g.prompt_id] for g in chunk], [g.token_ids for g in chunk])
        if check is not None:
            check.scan(chunk, s, logits, cfg)
            if check.problems:
                break
        logp, mask = logprobs_at(logits, c_ids, c_mask, cfg.temperature)
        a = adv[s:s + per_micro].flatten()
        # Token-level mean over the whole step: scale each micro-batch by its share of tokens.
        share = mask.sum().item() / total_tokens
        if cfg.algo == "grpo":
            behav = _behavior_tensor([lp for g in chunk for lp in g.behavior_logprobs],
                                     logp.shape[1], policy.device)
            stale = torch.tensor([g.policy_version < version for g in chunk for _ in g.token_ids],
                                 device=policy.device)
            loss, st = grpo_loss(logp, behav, mask, a, stale)
            stats.update({k: v.item() * share for k, v in st.items()})
        else:
            loss = reinforce_loss(logp, mask, a)
        (loss * (share * scale)).backward()
        loss_sum += loss.item() * share
    return loss_sum, total_tokens, stats


def train_step(policy: Policy, opt: torch.optim.Optimizer, groups: list[ScoredGroup],
               prompt_ids: dict[int, list[int]], version: int, cfg: TrainerConfig,
               ranks: Ranks = SINGLE, check: StepReplay | None = None) -> StepResult:
    """One update on `groups` (all with reward variance), accumulating over micro-batches.

    The update is not applied when the loss or the gradient norm is not finite: intake floors
    logprobs and the loss clamps every ratio, so that should never happen, and if it does
    (a bug, a shape nobody foresaw) one step's NaN must not reach the weights, the optimizer's
    moments or the next publish. The caller finds the groups to blame (`non_finite_groups`).

    One group's weight in an applied step is bounded by construction: every token's weight is
    |A| x min(ratio, RATIO_CAP) (GRPO) or |A| (REINFORCE), |A| <= (K-1)/sqrt(K) for rewards in
    [0, 1], the loss is a token mean over the step, and the whole gradient is clipped to norm 1.

    Several ranks (`ranks`, trainer.ranks; policy.model sharded by shard_model and `opt` built
    on its shards): every rank calls this with the same `groups` and computes its share; the
    loss, the statistics and the gradient norm are the whole step's on every rank, so all
    ranks apply the update or all refuse it.

    `check` (StepReplay, one process only): the forward replays the groups it names before
    their backward; with a failure the step is not applied and `check.problems` says why.
    """
    if check is not None and ranks.joined:
        raise ValueError("a step replays in its own forward only in one process")  # a bug
    policy.model.train()
    opt.zero_grad(set_to_none=True)
    loss_sum, total_tokens, stats = _backward(policy, groups, prompt_ids, version, cfg, ranks,
                                              check)
    if check is not None and check.problems:
        opt.zero_grad(set_to_none=True)
        policy.model.eval()
        return StepResult(math.nan, math.nan, total_tokens, {}, applied=False)
    if ranks.joined:
        names = sorted(stats)
        loss_sum, *summed = sum_over_ranks([loss_sum, *(stats[k] for k in names)], ranks)
        stats = Counter(dict(zip(names, summed)))
    grad_norm = clip_grad_norm(policy.model.parameters(), 1.0)
    if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
        opt.zero_grad(set_to_none=True)
        policy.model.eval()
        return StepResult(loss_sum, grad_norm, total_tokens, dict(stats), applied=False)
    crash_point("optimizer_step")
    opt.step()
    policy.model.eval()
    return StepResult(loss_sum, grad_norm, total_tokens, dict(stats))


def non_finite_groups(policy: Policy, groups: list[ScoredGroup], prompt_ids: dict[int, list[int]],
                      version: int, cfg: TrainerConfig) -> list[ScoredGroup]:
    """The groups whose own loss or gradient is not finite (one backward pass each; only run
    after a step was refused, so its cost does not matter). Leaves no gradient behind."""
    bad = []
    policy.model.train()
    for g in groups:
        policy.model.zero_grad(set_to_none=True)
        loss, _, _ = _backward(policy, [g], prompt_ids, version, cfg)
        grads = [p.grad for p in policy.model.parameters() if p.grad is not None]
        if not math.isfinite(loss) or not all(bool(torch.isfinite(x).all()) for x in grads):
            bad.append(g)
    policy.model.zero_grad(set_to_none=True)
    policy.model.eval()
    return bad


def audit_groups(policy: Policy, groups: list[ScoredGroup], prompt_ids: dict[int, list[int]],
                 run_id: str, temperature: float, replay_tolerance: float,
                 logprob_tolerance: float) -> tuple[str, str] | None:
    """The first failure of `groups`' replay (replay_problems), or None if every group passed."""
    return first_problem(replay_problems(policy, groups, prompt_ids, run_id, temperature,
                                         replay_tolerance, logprob_tolerance))


def first_problem(problems: list[tuple[str, str] | None]) -> tuple[str, str] | None:
    """The first group's failure of replay_problems' list, or None if every group passed."""
    return next((p for p in problems if p is not None), None)


def replay_problems(policy: Policy, groups: list[ScoredGroup], prompt_ids: dict[int, list[int]],
                    run_id: str, temperature: float, replay_tolerance: float,
                    logprob_tolerance: float) -> list[tuple[str, str] | None]:
    """Replay every completion of `groups` under `policy`, which must hold the weights of their
    version as volunteers ran them: for each group, (reason code, detail) of its first
    failing completion, or None. One replay call for all of them (model.replay batches it).

    `replay_mismatch`: a token is not the one its committed noise (protocol.draws) selects from
    the recomputed scores, the replay's own token, nor the runner-up of a near-tie within
    `replay_tolerance` (nats): it was not sampled. `logprob_mismatch`: a claimed behavior
    logprob is further than `logprob_tolerance` (nats) from the recomputed one: other weights
    or another temperature."""
    keys = [_draw_keys(run_id, g) for g in groups]
    rows = replay(policy, [prompt_ids[g.prompt_id] for g in groups],
                  [g.token_ids for g in groups], keys, temperature)
    return group_problems(groups, iter(rows), replay_tolerance, logprob_tolerance)


def _draw_keys(run_id: str, g: ScoredGroup) -> list[bytes]:
    return group_keys(run_id, g.policy_version, g.volunteer_id, g.seq, g.prompt_id,
                      len(g.token_ids), g.nonce)


def group_problems(groups: list[ScoredGroup], rows, replay_tolerance: float,
                   logprob_tolerance: float) -> list[tuple[str, str] | None]:
    """Each group's first failure (see replay_problems) from `rows`, an iterator over the
    ReplayRow of every completion of `groups` in order."""
    problems: list[tuple[str, str] | None] = []
    for g in groups:
        problem = None
        for j, claimed in enumerate(g.behavior_logprobs):
            row: ReplayRow = next(rows)  # every row is read, failed group or not
            if problem is not None:
                continue
            at = f"group {g.line} (seq {g.seq}) completion {j}"
            p = row.first_failure(replay_tolerance)
            if p >= 0:
                problem = ("replay_mismatch", f"{at}: token {p} is not the one its committed "
                           f"draw selects (margin {row.margins[p]:.2e} nats, tolerance "
                           f"{replay_tolerance:g})")
                continue
            gap = max((abs(a - b) for a, b in zip(claimed, row.logprobs)), default=0.0)
            if gap > logprob_tolerance:
                problem = ("logprob_mismatch", f"{at}: behavior logprobs differ from the "
                           f"trainer's by up to {gap:.3f} (tolerance {logprob_tolerance:g})")
        problems.append(problem)
    return problems
