"""Supervised warm start: a few hundred steps of next-token training on (prompt, reference
answer) pairs (the task's `reference`) so the first published policy already earns some reward. RL cannot learn from a policy
whose every sample scores 0: all its groups have zero variance and zero gradient.

Nor from one that has learnt the very rows it samples by heart. With 1,000 rows, 900 steps of
64 pass over each row 58 times: RL's groups then earned 0.84-0.87 from the first step while
held-out accuracy stayed at 28 %, and 6 groups of 64 had reward variance (issue 39). So when
the steps would pass over the rows more than --warm-start-max-passes times, `split_rows` keeps
RL_SHARE of the rows for RL alone and the warm start trains on the others; `summary` says
what it did. The demo's 20,000 rows are passed over 2.9 times: no split, the same warm start
as before.

It does not stop on a held-out loss: on a generated calculator dataset of 1,000 rows, split,
the loss on RL's rows was lowest at step 150 of 900 (2.51, then up to 3.56 by step 900) while
held-out accuracy went on rising past it (greedy 0.4 % at step 100, 4 % at 200, 6-7 % from
step 300 on): the lowest loss would have made a weaker v0 (docs/LIMITS.md, Warm start).
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.model.policy import Policy, encode_prompts
from volunteer_rl.model.scoring import right_pad
from volunteer_rl.progress import progress
from volunteer_rl.stopping import check_stop

BATCH_SIZE = 64
"""Rows per warm-start step."""
RL_SHARE = 0.5
"""Share of a split dataset's rows kept for RL alone (split_rows)."""
SOLVED_AT_V0 = 0.95
"""v0's sampled held-out accuracy from which the trainer warns that little is left to learn."""


@dataclass(frozen=True)
class Split:
    """Which rows of the training dataset (0-based row indices) the warm start trains on and
    which RL samples: the same rows, or two disjoint sets."""

    warm: list[int]
    rl: list[int]
    passes: float
    """How many times the warm start's steps would pass over all the rows."""

    @property
    def split(self) -> bool:
        """Whether the two are disjoint (split_rows gives the same rows or disjoint ones)."""
        return self.warm != self.rl


def split_rows(rows: int, steps: int, max_passes: float, seed: int,
               batch_size: int = BATCH_SIZE) -> Split:
    """All `rows` for both, unless `steps` batches would pass over them more than `max_passes`
    times (0: never split): then RL_SHARE of them, drawn with `seed`, for RL alone and the rest
    for the warm start. A resumed trainer given the same options draws the same rows."""
    every = list(range(rows))
    passes = steps * min(batch_size, rows) / rows if rows else 0.0
    if max_passes <= 0 or passes <= max_passes or rows < 2:
        return Split(every, every, passes)
    order = every[:]
    random.Random(f"warm-start-split-{seed}").shuffle(order)
    n_rl = min(rows - 1, max(1, round(rows * RL_SHARE)))
    return Split(sorted(order[n_rl:]), sorted(order[:n_rl]), passes)


def trainer_split(cfg: TrainerConfig, rows: int) -> Split:
    """The trainer's split of its `rows` training rows: split_rows for a warm-started `tiny`
    model, else all rows for RL (nothing is warm-started)."""
    if cfg.model != "tiny" or cfg.warm_start_steps <= 0:
        return split_rows(rows, 0, 0, cfg.seed)
    return split_rows(rows, cfg.warm_start_steps, cfg.warm_start_max_passes, cfg.seed)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to `threads` inside (0: left as they are), restored after."""
    if threads <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class WarmStart:
    """What a warm start did."""

    seconds: float
    steps: int
    loss: float
    """The last step's training loss."""


def summary(split: Split, done: WarmStart) -> str:
    """The warm start's one log line: the rows it trained on, its steps, its last loss."""
    took = f"{done.steps} steps in {done.seconds:.0f}s, last loss {done.loss:.3f}"
    if not split.split:
        return (f"warm start: trained on all {len(split.warm)} rows, which RL samples too "
                f"({split.passes:.1f} passes); {took}")
    rows = len(split.warm) + len(split.rl)
    return (f"warm start: trained on {len(split.warm)} of {rows} rows, RL samples only the other "
            f"{len(split.rl)} ({done.steps} steps would pass over all {rows} {split.passes:.1f} "
            f"times, more than --warm-start-max-passes); {took}")


def solved_at_v0(sampled: float, greedy: float) -> str | None:
    """A warning line when v0's sampled held-out accuracy is SOLVED_AT_V0 or more, else None."""
    if sampled < SOLVED_AT_V0:
        return None
    return (f"warning: v0 already solves {sampled:.1%} of held-out prompts sampled ({greedy:.1%} "
            f"greedy), {SOLVED_AT_V0:.0%} or more: little is left for RL to learn; give a harder "
            f"--dataset, or with --model tiny fewer --warm-start-steps")


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10 % of the peak by the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def shuffled_batches(lengths: list[int], batch_size: int,
                     rng: random.Random) -> Iterator[list[int]]:
    """Endless batches of row indices: each epoch a fresh shuffle cut into batches, the last
    partial one dropped (unless the set is smaller than one batch). Within a batch rows are in
    length order, which keeps the published warm-start figures reproducible; the batches
    themselves are not grouped by length, because RL learned far less from a v0 trained on
    look-alike batches (bench/README.md)."""
    while True:
        order = list(range(len(lengths)))
        rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            batch = sorted(order[start:start + batch_size], key=lengths.__getitem__)
            if len(batch) == batch_size or len(order) < batch_size:
                yield batch


def target_nll(policy: Policy, prompts: list[list[int]], targets: list[list[int]]) -> torch.Tensor:
    """Mean next-token loss on the target tokens of prompt+target rows.

    Rows are right-padded and run with no attention mask: under causal attention a real token
    never sees the padding after it, and without a mask PyTorch's attention takes its fused
    causal path, several times faster on CPU (its backward above all) than a masked one."""
    ids, _ = right_pad([p + t for p, t in zip(prompts, targets)], policy.pad_id, policy.device)
    labels = torch.full_like(ids, -100)
    for i, (p, t) in enumerate(zip(prompts, targets)):
        labels[i, len(p): len(p) + len(t)] = torch.tensor(t)
    logits = policy.model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             labels[:, 1:].reshape(-1), ignore_index=-100)


def warm_start(policy: Policy, questions: list[str], answers: list[str], steps: int,
               batch_size: int = BATCH_SIZE, lr: float = 2e-3, warmup: int = 30, seed: int = 0,
               log: Callable[[str], None] = print, instruction: str = "{question}") -> WarmStart:
    """Train on `steps` batches of (question, answer) pairs, each answer followed by EOS."""
    rng = random.Random(seed)
    tok = policy.tokenizer
    prompts = encode_prompts(policy, questions, instruction)
    targets = [list(tok(a, add_special_tokens=False)["input_ids"]) + [policy.eos_id]
               for a in answers]
    opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
    policy.model.train()
    lengths = [len(p) + len(t) for p, t in zip(prompts, targets)]
    batches = shuffled_batches(lengths, min(batch_size, len(prompts)), rng)
    loss = math.nan
    start = time.time()
    # The first and the last step get a line of their own; between them progress() shows a
    # bar on a terminal, else a status line with the loss every STATUS_SECONDS.
    with progress("warm start", steps, log=log, unit="steps") as advance:
        for step in range(steps):
            check_stop()  # a stop signal whose Stopped was swallowed on the way ends it here
            idx = next(batches)
            loss = _step(policy, opt, [prompts[i] for i in idx], [targets[i] for i in idx],
                         lr_at(step, steps, lr, warmup))
            advance(1, f"loss {loss:.3f}")
            if step == 0 or step == steps - 1:
                log(f"warm start step {step + 1}/{steps} loss {loss:.3f} ({time.time() - start:.0f}s)")
    policy.model.eval()
    return WarmStart(time.time() - start, steps, loss)


def _step(policy: Policy, opt: torch.optim.Optimizer, prompts: list[list[int]],
          targets: list[list[int]], lr: float) -> float:
    """One supervised step on these rows at learning rate `lr`; its loss."""
    for group in opt.param_groups:
        group["lr"] = lr
    loss = target_nll(policy, prompts, targets)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
    opt.step()
    return loss.item()
