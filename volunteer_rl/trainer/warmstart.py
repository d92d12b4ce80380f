"""Supervised warm start: a few hundred steps of next-token training on (prompt, reference
answer) pairs (the task's `reference`) so the first published policy already earns some reward. RL cannot learn from a policy
whose every sample scores 0: all its groups have zero variance and zero gradient."""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Iterator

import torch

from volunteer_rl.model.policy import Policy, encode_prompts
from volunteer_rl.model.scoring import right_pad
from volunteer_rl.progress import progress
from volunteer_rl.stopping import check_stop


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
               batch_size: int = 64, lr: float = 2e-3, warmup: int = 30, seed: int = 0,
               log: Callable[[str], None] = print, instruction: str = "{question}") -> float:
    """Train on `steps` batches of (question, answer) pairs, each answer followed by EOS;
    returns the seconds it took."""
    rng = random.Random(seed)
    tok = policy.tokenizer
    prompts = encode_prompts(policy, questions, instruction)
    targets = [list(tok(a, add_special_tokens=False)["input_ids"]) + [policy.eos_id]
               for a in answers]
    opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
    policy.model.train()
    lengths = [len(p) + len(t) for p, t in zip(prompts, targets)]
    batches = shuffled_batches(lengths, min(batch_size, len(prompts)), rng)
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
    return time.time() - start


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
