"""Ten optimizer steps of the trainer's real `train_step` on the project's tiny model, as one
process (`python ranks_train.py OUT`) or as one rank of `torchrun --nproc-per-node N
ranks_train.py OUT`; the same seed, model and batches either way. Writes the full weights after
the last step to OUT (torch.save, by the writer rank only). tests/integration/test_ranks.py runs
it both ways and compares.

The tiny model is built as `vrl trainer --model tiny` builds it (trainer.loop.initial_policy,
without its warm start): tokenizer trained on the shipped train.csv, build_tiny_model at the
config's seed. The optimizer is the trainer's (Trainer._make_optimizer: AdamW at cfg.lr, no
weight decay), made after sharding so it holds this rank's shards.

The batches are made up but shaped like intake's: GROUPS groups of K completions of 1-7
tokens after a real prompt, rewards of 0 and 1 with variance in every group, behavior logprobs
the initial policy's own (computed before sharding, identically on every rank) so ratios start
at 1, and from step 1 on the rows are one version stale (the truncated-ratio branch).

`--break scale|share` breaks the ranks on purpose, to check that the test can fail: `scale`
drops the world-size gradient scale (FSDP2's mean then halves every gradient), `share` gives
every rank the first share of the batch (the other rows are never trained).

OUT holds {"weights": the full state dict after the last step, "steps": [(loss, grad_norm)
per step], "initial": the state dict before the first}.
"""
from __future__ import annotations

import argparse
import random
import sys

import torch

from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
from volunteer_rl.model.policy import Policy, encode_prompts
from volunteer_rl.model.scoring import token_logprobs
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.task.dataset import load_csv
from volunteer_rl.trainer import step as step_module
from volunteer_rl.trainer.ingest import ScoredGroup
from volunteer_rl.trainer.ranks import full_state_dict, join, leave, shard_model
from volunteer_rl.trainer.step import train_step

STEPS = 10
GROUPS = 8
"""Groups per step: 4 per rank with 2 ranks."""
K = 4
MICRO_BATCH = 8
"""Rows per micro-batch: 2 groups, so each rank accumulates over 2 micro-batches and the single
process over 4."""
SEED = 0


def make_batches(policy: Policy, problems, rng: random.Random
                 ) -> tuple[list[list[ScoredGroup]], dict[int, list[int]]]:
    """STEPS batches of GROUPS groups (without behavior logprobs yet) and their prompts' ids."""
    ids = rng.sample(range(len(problems)), STEPS * GROUPS)
    prompt_ids = dict(zip(ids, encode_prompts(policy, [problems[i].prompt for i in ids])))
    vocab = len(policy.tokenizer)
    batches = []
    for step in range(STEPS):
        batch = []
        for g, pid in enumerate(ids[step * GROUPS:(step + 1) * GROUPS]):
            tokens = [[rng.randrange(2, vocab) for _ in range(rng.randint(1, 7))] for _ in range(K)]
            rewards = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(K - 2)]
            batch.append(ScoredGroup(prompt_id=pid, policy_version=0, volunteer_id=f"v{g % 3}",
                                     token_ids=tokens, behavior_logprobs=[], rewards=rewards,
                                     key=f"step{step}/group{g}", seq=g, line=g))
        batches.append(batch)
    return batches, prompt_ids


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--break", dest="broken", choices=["scale", "share"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per rank on a 2-core machine; the same for one process
    ranks = join("cpu", timeout_seconds=60)
    if args.broken == "scale":
        step_module.gradient_scale = lambda r: 1.0
    elif args.broken == "share":
        step_module.rank_share = lambda n, r: slice(0, n // r.world_size)
    cfg = TrainerConfig(bucket="memory://ranks-test", micro_batch=MICRO_BATCH)
    problems = load_csv(PACKAGE_DATA / "train.csv")
    tokenizer = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems])
    policy = Policy(build_tiny_model(tokenizer, seed=SEED), tokenizer, "plain",
                    torch.device("cpu"))
    batches, prompt_ids = make_batches(policy, problems, random.Random(SEED))
    with torch.no_grad():
        for batch in batches:
            logp, _ = token_logprobs(policy, [prompt_ids[g.prompt_id] for g in batch],
                                     [g.token_ids for g in batch], cfg.temperature)
            rows = iter(logp.tolist())
            for g in batch:
                g.behavior_logprobs = [next(rows)[:len(c)] for c in g.token_ids]
    initial = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    shard_model(policy.model, ranks)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps = []
    for step, batch in enumerate(batches):
        result = train_step(policy, opt, batch, prompt_ids, step, cfg, ranks)
        if not result.applied:
            print(f"rank {ranks.rank}: step {step} refused", file=sys.stderr)
            return 1
        steps.append((result.loss, result.grad_norm))
        if ranks.is_writer:
            print(f"step {step}: loss {result.loss:.6f} grad_norm {result.grad_norm:.6f}")
    weights = full_state_dict(policy.model, ranks)
    if ranks.is_writer:
        torch.save({"weights": weights, "steps": steps, "initial": initial}, args.out)
    leave(ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
