"""Verifying every group a step trains: before the backward pass, each group of the batch that
no intake audit replayed is replayed against its committed draws with its own version's
weights (held.HeldWeights.problems), so the trainer learns only from tokens the committed
noise gives, whatever share of shards the intake's sampled audits draw (trainer.audit).

The cost is one forward pass without gradients per trained group, once: it grows with what
the trainer trains, not with what the fleet sends, and a group an intake audit replayed
already (ScoredGroup.verified) costs nothing more. Groups are replayed one call per version
of the batch (model.replay batches the rows and shares the forward of identical completions).
A group sampled with the very weights the step is about to train (fp32 weights, one process,
no step since their publish) costs no forward at all: the step's own forward replays it
before its backward (trainer.step.StepReplay, roles.Single.step_replay), and a failure there
ends the step unapplied, as a failure here stops it before it starts. While the loop waits
for rollouts, the fewer-than-a-batch groups in hand are replayed then (roles.Single
.verify_waiting): the next batch takes them, and the wait's idle time pays for their replays
instead of the step's.

This module only finds the failures. What they cost is the intake's (Ingest.failed_replay: the
shard rejected and its untrained groups withdrawn; a forgery denies its volunteer), and what
the step does without them is the role's (roles.Single.verified: no step this round, the
groups that passed wait in front of the buffer). Under ranks each rank replays its share of
the batch and the ranks exchange what failed, so every rank drops the same groups.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from volunteer_rl.trainer.audit import Unavailable
from volunteer_rl.trainer.groups import ScoredGroup
from volunteer_rl.trainer.held import HeldWeights


@dataclass
class Verdict:
    """What the replays before a step found, by index into the batch."""

    problems: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Groups that failed: (reason code, detail) of their first failing completion."""
    unverifiable: set[int] = field(default_factory=set)
    """Groups that could not be replayed: their version's weights are not held (unreadable
    after a resume), or the replay failed by a fault of the trainer's own."""
    replayed: int = 0
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.problems and not self.unverifiable


def verify(held: HeldWeights, batch: list[ScoredGroup], indices: range,
           prompt_ids: dict[int, list[int]], run_id: str,
           trace: Callable[[str, BaseException], None], leave: int | None = None) -> Verdict:
    """Replay the groups of `batch` at `indices` that are not verified yet, one call per
    version; mark those that pass. `leave`: a version whose groups are left to the step's own
    forward (trainer.step.StepReplay). `trace` logs a fault of the trainer's own with its
    traceback (Ingest.log_trace)."""
    started = time.monotonic()
    todo: dict[int, list[int]] = {}
    for i in indices:
        if not batch[i].verified and batch[i].policy_version != leave:
            todo.setdefault(batch[i].policy_version, []).append(i)
    verdict = Verdict(replayed=sum(len(ix) for ix in todo.values()))
    for version, ix in sorted(todo.items()):
        groups = [batch[i] for i in ix]
        try:
            found = held.problems(version, groups, prompt_ids, run_id)
        except Unavailable:
            verdict.unverifiable.update(ix)
            continue
        except Exception as exc:  # checked input: a fault of the trainer's own, not charged
            trace(f"{type(exc).__name__} of the trainer's own while replaying v{version}'s "
                  "groups before a step", exc)
            verdict.unverifiable.update(ix)
            continue
        for i, g, problem in zip(ix, groups, found):
            if problem is None:
                g.verified = True
            else:
                verdict.problems[i] = problem
    verdict.seconds = time.monotonic() - started
    return verdict
