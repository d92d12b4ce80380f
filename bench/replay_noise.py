"""Replay noise: how far below zero the replay margin of an honest sample falls, and so which
tolerance the trainer can accept without ever rejecting an honest volunteer.

    python -m bench.replay_noise [--groups 10000] [--quick] [--model PATH] [--warm-steps 250]

A volunteer samples each completion with its committed Gumbel noise (protocol.draws,
`sampling.sample(..., draw_keys=...)`); the trainer replays the draw (`model.replay.replay`)
with its own forward and measures every token's margin in nats: the gap between the top two
perturbed scores for its own token, minus that gap for the runner-up. An honest token's
margin is >= 0 in exact arithmetic; float noise between the sampler's forward (token by
token over a KV cache, its own batch, thread count) and the replay's (all positions at once,
another batch, another thread count) can swap two scores that nearly tie. This measures that
noise; bench/replay_choice.py measures what the tolerance concedes on real vocabularies.

Setup: the trainer's tiny v0 for `--model tiny` (bench.generation.make_model: tokenizer from
data/train.csv, `build_tiny_model`, WARM_STEPS warm-start steps so distributions are a
trained model's, saved and loaded as a volunteer gets it), or `--model PATH` (any HF folder,
`load_policy`). GROUPS groups of K = 8 completions, temperature 1.0, 32 new tokens (the
trainer's defaults), prompts drawn at random from data/train.csv (mixed lengths), sampled as
a volunteer samples them: its round per `sample` call (32 prompts for the tiny model, 16 for
a model of 5 M parameters or more: `devices.sampling_prompts`), each completion with its committed
key (seq = the group's number). Every setting samples the same groups and replays them
REPLAY_GROUPS groups per call (a different batch composition from the sampler's):

- weights fp32, or rounded to bf16 and upcast (what `--weights-dtype bf16` publishes and a
  volunteer loads; both sides use the same rounded weights);
- torch threads 1 or 2 for the sampler, and independently 1 or 2 for the replay;
- on a CUDA or MPS device, if there is one (sampled there, replayed on the CPU and there).

Printed: per setting the completions replayed, how many have a margin < 0, the worst margin,
the worst |replayed logprob - sampled logprob|; the distribution of every completion's
smallest margin; the proposed tolerance (100x the worst negative margin seen, rounded up to a
power of ten, at least 1e-6) and the false rejections at it. The last line, `RESULT ...`,
is for tests/bench/test_bench_replay_noise.py.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.generation import make_model
from volunteer_rl.config import PACKAGE_DATA, TrainerConfig, VolunteerConfig
from volunteer_rl.model.devices import TORCH_DEFAULT_THREADS, sampling_prompts
from volunteer_rl.model.policy import Policy, bf16_rounded, encode_prompts, load_policy
from volunteer_rl.model.replay import replay
from volunteer_rl.model.sampling import Sample, sample
from volunteer_rl.protocol.draws import group_keys
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.task.dataset import load_csv

GROUPS, QUICK_GROUPS = 10_000, 500
WARM_STEPS, QUICK_WARM_STEPS = 250, 50
REPLAY_GROUPS = 32          # groups per replay call
RUN_ID, VERSION, VOLUNTEER = "bench-replay-noise", 0, "bench-volunteer"
MIN_TOLERANCE = 1e-6
BINS = [1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2]
"""Upper edges of the histogram of each completion's smallest margin (after a `< 0` bin)."""


@dataclass
class Groups:
    """The honest groups every setting samples: prompts, dataset rows, committed draw keys."""
    prompts: list[list[int]]
    prompt_ids: list[int]
    keys: list[list[bytes]]


@dataclass
class Setting:
    """One way of sampling and replaying, and what its replay found."""
    weights: str
    sampler: str             # "cpu, 1 thread" or the accelerator's name
    replayer: str
    margins: list[float] = field(default_factory=list)   # each completion's smallest margin
    logprob_gap: float = 0.0                              # worst |replayed - sampled| logprob
    tokens: int = 0
    sample_seconds: float = 0.0
    replay_seconds: float = 0.0

    @property
    def negative(self) -> int:
        return sum(m < 0 for m in self.margins)

    @property
    def worst(self) -> float:
        return min(self.margins, default=math.inf)


def make_groups(policy: Policy, problems, n: int, k: int, max_new: int, seed: int = 0) -> Groups:
    rng = random.Random(seed)
    ids = [rng.randrange(len(problems)) for _ in range(n)]
    prompts = encode_prompts(policy, [problems[i].prompt for i in ids], CalculatorTask.instruction)
    keys = [group_keys(RUN_ID, VERSION, VOLUNTEER, g, pid, k, "bench") for g, pid in enumerate(ids)]
    return Groups(prompts, ids, keys)


def sample_all(policy: Policy, groups: Groups, k: int, temperature: float, max_new: int,
               per_call: int) -> list[list[Sample]]:
    """The volunteer's rounds: `per_call` prompts per `sample` call, committed draw keys."""
    out: list[list[Sample]] = []
    for a in range(0, len(groups.prompts), per_call):
        out += sample(policy, groups.prompts[a:a + per_call], k, temperature, max_new,
                      batch_size=max(256, per_call * k), draw_keys=groups.keys[a:a + per_call])
    return out


def replay_all(policy: Policy, groups: Groups, samples: list[list[Sample]], temperature: float,
               setting: Setting) -> None:
    """Replay every group, REPLAY_GROUPS per call, into `setting`."""
    for a in range(0, len(samples), REPLAY_GROUPS):
        batch = samples[a:a + REPLAY_GROUPS]
        rows = replay(policy, groups.prompts[a:a + REPLAY_GROUPS],
                      [[s.token_ids for s in g] for g in batch],
                      groups.keys[a:a + REPLAY_GROUPS], temperature)
        for row, s in zip(rows, (s for g in batch for s in g)):
            setting.margins.append(row.margin)
            setting.tokens += len(s.token_ids)
            setting.logprob_gap = max([setting.logprob_gap] + [
                abs(x - y) for x, y in zip(row.logprobs, s.logprobs)])



def on_device(policy: Policy, device: torch.device) -> Policy:
    return Policy(copy.deepcopy(policy.model).to(device), policy.tokenizer,
                  policy.prompt_format, device)


def accelerator() -> torch.device | None:
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return None


def proposed_tolerance(worst: float) -> float:
    """100x the worst negative margin, rounded up to a power of ten, at least MIN_TOLERANCE."""
    if worst >= 0:
        return MIN_TOLERANCE
    return max(MIN_TOLERANCE, 10.0 ** math.ceil(math.log10(100 * -worst)))


def histogram(margins: list[float]) -> list[int]:
    """Counts: < 0, then [0, BINS[0]), [BINS[0], BINS[1]), ..., >= BINS[-1]."""
    counts = [0] * (len(BINS) + 2)
    for m in margins:
        counts[0 if m < 0 else 1 + sum(m >= b for b in BINS)] += 1
    return counts


def run(policy: Policy, problems, n_groups: int, log=print) -> list[Setting]:
    tcfg = TrainerConfig(bucket="unused").with_task_defaults(CalculatorTask())
    vcfg = VolunteerConfig(bucket="unused")
    k, temperature, max_new = tcfg.k, tcfg.temperature, tcfg.max_new_tokens
    per_call = sampling_prompts(policy, vcfg.prompts_per_batch)  # the volunteer's round
    groups = make_groups(policy, problems, n_groups, k, max_new)
    settings: list[Setting] = []
    accel = accelerator()
    for weights, pol in (("fp32", policy), ("bf16", bf16_rounded(policy))):
        for s_threads in (1, 2):
            torch.set_num_threads(s_threads)
            start = time.perf_counter()
            samples = sample_all(pol, groups, k, temperature, max_new, per_call)
            sampled = time.perf_counter() - start
            for r_threads in (1, 2):
                setting = Setting(weights, f"cpu, {s_threads} thread{'s' * (s_threads > 1)}",
                                  f"cpu, {r_threads} thread{'s' * (r_threads > 1)}",
                                  sample_seconds=sampled)
                torch.set_num_threads(r_threads)
                start = time.perf_counter()
                replay_all(pol, groups, samples, temperature, setting)
                setting.replay_seconds = time.perf_counter() - start
                settings.append(setting)
                log(f"{weights} sampler {setting.sampler} / replay {setting.replayer}: "
                    f"{setting.negative} below 0, worst {setting.worst:.3g} "
                    f"({sampled:.0f} s sampling, {setting.replay_seconds:.0f} s replay)")
        if accel is not None:
            torch.set_num_threads(1)
            dev_pol = on_device(pol, accel)
            start = time.perf_counter()
            samples = sample_all(dev_pol, groups, k, temperature, max_new, per_call)
            sampled = time.perf_counter() - start
            for name, replayer in (("cpu, 1 thread", pol), (accel.type, dev_pol)):
                setting = Setting(weights, accel.type, name, sample_seconds=sampled)
                start = time.perf_counter()
                replay_all(replayer, groups, samples, temperature, setting)
                setting.replay_seconds = time.perf_counter() - start
                settings.append(setting)
    torch.set_num_threads(TORCH_DEFAULT_THREADS)
    if accel is None:
        log("no cuda or mps device here: CPU settings only")
    return settings


def report(settings: list[Setting]) -> tuple[float, int, int]:
    """Print the tables; returns (proposed tolerance, false rejections at it, completions)."""
    worst = min(s.worst for s in settings)
    tol = proposed_tolerance(worst)
    print("\n| weights | sampler | replay | completions | tokens | margin < 0 | worst margin "
          f"| worst abs logprob diff | rejected at {tol:.0e} | sample s | replay s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in settings:
        print(f"| {s.weights} | {s.sampler} | {s.replayer} | {len(s.margins):,} | {s.tokens:,} "
              f"| {s.negative} | {s.worst:.3g} | {s.logprob_gap:.2g} "
              f"| {sum(m < -tol for m in s.margins)} | {s.sample_seconds:.0f} "
              f"| {s.replay_seconds:.0f} |")
    edges = ["< 0", f"[0, {BINS[0]:.0e})"] + [f"[{a:.0e}, {b:.0e})" for a, b in zip(BINS, BINS[1:])]
    edges.append(f">= {BINS[-1]:.0e}")
    print("\nEach completion's smallest margin (all settings):\n")
    print("| " + " | ".join(edges) + " |")
    print("|" + "---|" * len(edges))
    all_margins = [m for s in settings for m in s.margins]
    print("| " + " | ".join(f"{c:,}" for c in histogram(all_margins)) + " |")
    smallest = sorted(all_margins, key=abs)[:8]
    print("\nthe 8 margins nearest zero: " + ", ".join(f"{m:.3g}" for m in smallest))
    rejected = sum(m < -tol for m in all_margins)
    gap = max(s.logprob_gap for s in settings)
    print(f"\nworst margin {worst:.3g}; worst abs logprob diff {gap:.2g}")
    print(f"proposed tolerance {tol:.0e} (100x the worst negative margin, rounded up to a power "
          f"of ten, at least {MIN_TOLERANCE:.0e}): {rejected} false rejections of "
          f"{len(all_margins):,} honest completions")
    return tol, rejected, len(all_margins)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, help=f"groups per setting (default {GROUPS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_GROUPS} groups, {QUICK_WARM_STEPS} warm-start steps")
    parser.add_argument("--model", help="an HF model folder instead of the warm-started tiny v0")
    parser.add_argument("--warm-steps", type=int, help=f"warm-start steps (default {WARM_STEPS})")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    n_groups = args.groups or (QUICK_GROUPS if args.quick else GROUPS)
    steps = args.warm_steps if args.warm_steps is not None else (
        QUICK_WARM_STEPS if args.quick else WARM_STEPS)
    problems = load_csv(Path(PACKAGE_DATA) / "train.csv")
    start = time.perf_counter()
    if args.model:
        policy = load_policy(args.model, "cpu")
        what = args.model
    else:
        with tempfile.TemporaryDirectory() as tmp:
            policy = make_model(problems, steps, Path(tmp) / "v0")
        what = f"tiny v0, {steps} warm-start steps"
    policy.model.eval()
    n_params = sum(p.numel() for p in policy.model.parameters())
    print(f"model: {what} ({n_params / 1e6:.2f} M parameters, vocab {len(policy.tokenizer)}); "
          f"{n_groups:,} groups per setting; load avg {os.getloadavg()[0]:.1f}", flush=True)
    settings = run(policy, problems, n_groups, log=lambda m: print(m, flush=True))
    tol, rejected, completions = report(settings)
    seconds = time.perf_counter() - start
    print(f"took {seconds:.0f} s; load avg {os.getloadavg()[0]:.1f}")
    worst = min(s.worst for s in settings)
    print(f"RESULT tolerance={tol:.0e} rejections={rejected} completions={completions} "
          f"worst_margin={worst:.3g} seconds={seconds:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
