"""Volunteer generation: completions/s and generated tokens/s of the volunteer's sampler
against the naive loop, on the same model, prompts and CPU.

    python -m bench.generation [--quick] [--json PATH]

The model is the trainer's v0 for `--model tiny`, made the way `trainer.initial_policy` makes
it (a tokenizer trained on data/train.csv's prompts and expressions, `build_tiny_model`), then
warm-started for a short while (WARM_STEPS) so that completions end where a volunteer's do
(an untrained model babbles to max_new_tokens). It is written with `save_policy` and read
back with `load_policy`, as a volunteer gets it. Sampling settings are the trainer's
defaults: K = 8, temperature 1.0, max_new_tokens 32.

- vrl: the volunteer's own path (`Volunteer._generate`): its default prompts per round
  (`devices.sampling_prompts`: 32 for this model), encoded with `encode_prompts`, each
  group's committed draw keys computed (`protocol.draws.group_keys`), sampled with
  `sampling.sample`, under the thread count the volunteer sets (`set_sampling_threads` with
  its default `threads`).
- naive: what a plain script does: for each prompt one `model.generate(...,
  num_return_sequences=K, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
  output_scores=True)`, the behavior logprobs taken from the returned scores, completions cut
  after their first EOS and decoded, under `torch.no_grad` and torch's default threads.

Both sides get the same prompts, in rounds that alternate which side goes first; a figure is
the median of its per-round rates, so a burst of other work on the machine moves one round,
not the figure. The whole measurement runs RUNS (3) times in the same process; the rows are
those of the run whose completions/s ratio is the median, and their note lists every run's
ratio. Tokens are generated tokens up to and including EOS, counted alike on both sides. Extra rows: vrl with 1 and with PROMPTS_BIG prompts per call (how batching scales),
and vrl under torch's default threads (what the thread setting is worth on its own).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import Row, cli
from volunteer_rl.config import PACKAGE_DATA, TrainerConfig, VolunteerConfig
from volunteer_rl.model.devices import (TORCH_DEFAULT_THREADS, sampling_prompts,
                                        set_sampling_threads)
from volunteer_rl.model.policy import Policy, encode_prompts, load_policy
from volunteer_rl.model.sampling import sample
from volunteer_rl.model.scoring import token_logprobs
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.model.weights import save_policy
from volunteer_rl.protocol.draws import group_keys
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.task.dataset import Problem, load_csv
from volunteer_rl.trainer.warmstart import warm_start

BENCH = "volunteer generation"
COMMAND = "python -m bench.generation"
WARM_STEPS, QUICK_WARM_STEPS = 250, 10
PROMPTS, QUICK_PROMPTS = 64, 4            # prompts per round, the same on every side
ROUNDS, QUICK_ROUNDS = 4, 1
RUNS, QUICK_RUNS = 3, 1                    # whole measurements; the rows are the median run's
PROMPTS_BIG = 64                           # prompts per sample() call in the batching row


@dataclass
class Tally:
    """One side's output in one round."""
    completions: int
    tokens: int
    seconds: float


def make_model(problems: list[Problem], steps: int, folder: Path) -> Policy:
    """v0 as the trainer makes it for `--model tiny`, shortly warm-started, saved and loaded
    back as a volunteer loads a checkpoint."""
    cfg = TrainerConfig(bucket="unused")
    tokenizer = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems])
    model = build_tiny_model(tokenizer, seed=cfg.seed)
    policy = Policy(model, tokenizer, "plain", torch.device("cpu"))
    # One thread for this preparation only: on a shared 2-core machine it is the fast choice,
    # and it is not measured.
    torch.set_num_threads(1)
    try:
        warm_start(policy, [p.prompt for p in problems], [p.expression for p in problems], steps,
                   seed=cfg.seed, log=lambda m: None)
    finally:
        torch.set_num_threads(TORCH_DEFAULT_THREADS)
    save_policy(policy, folder)
    loaded = load_policy(folder, "cpu")
    loaded.model.eval()
    return loaded


def vrl_round(policy: Policy, questions: list[str], k: int, temperature: float,
              max_new_tokens: int, prompts_per_call: int, threads: int) -> Tally:
    """The volunteer's round (Volunteer._generate) over `questions`, `prompts_per_call` at a
    time, each group with its committed draw keys as a volunteer computes them."""
    set_sampling_threads(policy, threads)
    start = time.perf_counter()
    completions = tokens = 0
    for i in range(0, len(questions), prompts_per_call):
        prompts = encode_prompts(policy, questions[i:i + prompts_per_call])
        keys = [group_keys("bench-run", 0, "bench", i + j, i + j, k, "bench") for j in range(len(prompts))]
        groups = sample(policy, prompts, k, temperature, max_new_tokens,
                        batch_size=max(256, prompts_per_call * k), draw_keys=keys)
        completions += sum(len(g) for g in groups)
        tokens += sum(len(s.token_ids) for g in groups for s in g)
    return Tally(completions, tokens, time.perf_counter() - start)


def naive_group(policy: Policy, question: str, k: int, temperature: float,
                max_new_tokens: int) -> list[tuple[list[int], list[float], str]]:
    """One `generate` call for one prompt: K (tokens up to EOS, behavior logprobs, text)."""
    ids = torch.tensor(encode_prompts(policy, [question]))
    out = policy.model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=True, num_return_sequences=k,
        temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
        output_scores=True, return_dict_in_generate=True,
        pad_token_id=policy.pad_id, eos_token_id=policy.eos_id)
    generated = out.sequences[:, ids.shape[1]:]
    # scores are the processed logits (here logits / T): their log_softmax is the behavior logprob
    logp = torch.stack(out.scores, 1).float().log_softmax(-1)
    chosen = logp.gather(-1, generated[..., None])[..., 0]
    result = []
    for row, lps in zip(generated.tolist(), chosen.tolist()):
        n = row.index(policy.eos_id) + 1 if policy.eos_id in row else len(row)
        result.append((row[:n], lps[:n], policy.tokenizer.decode(row[:n], skip_special_tokens=True)))
    return result


def naive_round(policy: Policy, questions: list[str], k: int, temperature: float,
                max_new_tokens: int) -> tuple[Tally, list[list[tuple[list[int], list[float], str]]]]:
    torch.set_num_threads(TORCH_DEFAULT_THREADS)
    start = time.perf_counter()
    with torch.no_grad():
        groups = [naive_group(policy, q, k, temperature, max_new_tokens) for q in questions]
    seconds = time.perf_counter() - start
    return Tally(sum(len(g) for g in groups), sum(len(c[0]) for g in groups for c in g), seconds), groups


def check_naive_logprobs(policy: Policy, questions: list[str], groups, temperature: float) -> float:
    """Largest gap between the naive loop's logprobs and the trainer's scoring of the same
    tokens: the baseline must produce what a volunteer has to upload."""
    prompts = encode_prompts(policy, questions)
    with torch.no_grad():
        logp, _ = token_logprobs(policy, prompts, [[c[0] for c in g] for g in groups], temperature)
    rows = [c for g in groups for c in g]
    return max(abs(logp[i, j].item() - lp) for i, c in enumerate(rows) for j, lp in enumerate(c[1]))


def median_rate(tallies: list[Tally], what: str) -> float:
    return statistics.median(getattr(t, what) / t.seconds for t in tallies)


def results(quick: bool) -> list[Row]:
    warnings.filterwarnings("ignore")  # generate() warns about its own config; not ours to fix here
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tcfg = TrainerConfig(bucket="unused").with_task_defaults(CalculatorTask())
    vcfg = VolunteerConfig(bucket="unused")
    k, temperature, max_new = tcfg.k, tcfg.temperature, tcfg.max_new_tokens
    n_prompts = QUICK_PROMPTS if quick else PROMPTS
    rounds = QUICK_ROUNDS if quick else ROUNDS
    problems = load_csv(Path(PACKAGE_DATA) / "train.csv")
    load_before = os.getloadavg()[0]

    with tempfile.TemporaryDirectory() as tmp:
        policy = make_model(problems, QUICK_WARM_STEPS if quick else WARM_STEPS, Path(tmp) / "v0")
    n_params = sum(p.numel() for p in policy.model.parameters())
    rng = random.Random(0)
    questions = [p.prompt for p in rng.sample(problems, n_prompts * rounds)]
    big = min(PROMPTS_BIG, n_prompts)
    threads = set_sampling_threads(policy, vcfg.threads)
    ppb = sampling_prompts(policy, vcfg.prompts_per_batch)
    torch.manual_seed(0)

    # Warm-up, not timed: first calls allocate and pick kernels.
    vrl_round(policy, questions[:ppb], k, temperature, max_new, ppb, vcfg.threads)
    naive_round(policy, questions[:1], k, temperature, max_new)

    # Each side is one way of making K completions for every prompt of a round.
    runs = {
        "naive": lambda qs: naive_round(policy, qs, k, temperature, max_new)[0],
        "vrl": lambda qs: vrl_round(policy, qs, k, temperature, max_new, ppb, vcfg.threads),
        "vrl 1 prompt per call": lambda qs: vrl_round(policy, qs, k, temperature, max_new, 1,
                                                      vcfg.threads),
        "vrl big": lambda qs: vrl_round(policy, qs, k, temperature, max_new, big, vcfg.threads),
        "vrl default threads": lambda qs: vrl_round(policy, qs, k, temperature, max_new, ppb,
                                                    TORCH_DEFAULT_THREADS),
    }

    def measured(run: int) -> dict[str, list[Tally]]:
        sides: dict[str, list[Tally]] = {side: [] for side in runs}
        for r in range(rounds):
            qs = questions[r * n_prompts:(r + 1) * n_prompts]
            for side in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                tally = runs[side](qs)
                sides[side].append(tally)
                print(f"run {run + 1} round {r + 1}/{rounds} {side}: "
                      f"{tally.completions / tally.seconds:.1f} completions/s, "
                      f"{tally.tokens / tally.seconds:.0f} tokens/s", file=sys.stderr, flush=True)
        return sides

    # RUNS whole measurements one after the other; the rows are the run whose completions/s
    # ratio is the median, and the note gives every run's, so no best run is picked.
    every = [measured(run) for run in range(QUICK_RUNS if quick else RUNS)]

    def ratio(sides: dict[str, list[Tally]]) -> float:
        return median_rate(sides["vrl"], "completions") / median_rate(sides["naive"], "completions")

    ratios = [ratio(sides) for sides in every]
    sides = sorted(every, key=ratio)[len(every) // 2]
    # The baseline must yield what a volunteer uploads: check its logprobs (outside the timing).
    torch.set_num_threads(TORCH_DEFAULT_THREADS)
    _, groups = naive_round(policy, questions[:4], k, temperature, max_new)
    gap = check_naive_logprobs(policy, questions[:4], groups, temperature)
    if gap > 1e-3:
        raise SystemExit(f"the naive loop's logprobs differ from token_logprobs by {gap:.2g}")
    load_after = os.getloadavg()[0]

    def mean_len(side: str) -> float:
        return sum(t.tokens for t in sides[side]) / sum(t.completions for t in sides[side])

    setting = (f"tiny model {n_params / 1e6:.2f} M params, {WARM_STEPS if not quick else QUICK_WARM_STEPS} "
               f"warm-start steps; K={k}, T={temperature}, max {max_new} new tokens; "
               f"{n_prompts} train.csv prompts x {rounds} rounds, median round; "
               f"completions/s ratio of each of {len(every)} runs "
               f"{', '.join(f'{x:.2f}' for x in ratios)} (the median run shown); "
               f"mean completion {mean_len('vrl'):.1f} tokens vrl / {mean_len('naive'):.1f} naive; "
               f"load avg {load_before:.1f} -> {load_after:.1f}")
    naive_note = (f"naive: one generate() per prompt, {TORCH_DEFAULT_THREADS} threads (torch default), "
                  f"logprobs from scores (max gap to token_logprobs {gap:.1g})")
    vrl_note = f"vrl: sample(), {ppb} prompts per call, {threads} thread{'s' * (threads != 1)} (volunteer default)"
    rows = []
    for measure, what in (("completions/s", "completions"), ("generated tokens/s", "tokens")):
        v, b = median_rate(sides["vrl"], what), median_rate(sides["naive"], what)
        rows.append(Row(BENCH, measure, v, b, v / b, ">= 4x", v / b >= 4, COMMAND,
                        f"{vrl_note}; {naive_note}; {setting}"))
    b = median_rate(sides["naive"], "completions")
    v = median_rate(sides["vrl 1 prompt per call"], "completions")
    rows.append(Row(f"{BENCH}, 1 prompt per call", "completions/s", v, b, v / b, "-", None, COMMAND,
                    f"vrl: sample() with 1 prompt ({k} rows) per call, as many rows as each naive "
                    f"generate() call, {threads} thread{'s' * (threads != 1)}"))
    v = median_rate(sides["vrl big"], "completions")
    rows.append(Row(f"{BENCH}, {big} prompts per call", "completions/s", v, b, v / b, "-", None, COMMAND,
                    f"vrl: sample() with {big} prompts ({big * k} rows) per call, {threads} "
                    f"thread{'s' * (threads != 1)}; baseline the naive loop above"))
    v = median_rate(sides["vrl default threads"], "completions")
    rows.append(Row(f"{BENCH}, torch's default threads", "completions/s", v, b, v / b, "-", None, COMMAND,
                    f"vrl: sample(), {ppb} prompts per call, {TORCH_DEFAULT_THREADS} threads like the "
                    "baseline: batching and the sampler alone, without the thread setting"))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
