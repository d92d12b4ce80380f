"""Replay choice: on vocabularies of real models, how often the trainer's replay lets more than
one token pass at a position, how many forged completions it catches, and whether it ever
rejects an honest one (issue 26, row a).

    python -m bench.replay_choice [--quick] [--json PATH]

Models: random-init Llama-shaped causal LMs built from a config (no hub; 2 layers, hidden 64,
untied output layer) with vocabularies of 32,000 (Llama 2) and 151,936 (Qwen), in two shapes:
"peaked", the output layer scaled so that the mean top-1 probability is about 0.37 (a trained
model's on text), and "flat", as initialised (nearly uniform over the vocabulary). Prompts
are random token ids (4-12), K = 8 completions of NEW tokens at T = 1.0, each with its
committed draw key (protocol.draws.group_keys), EOS never reached (a random model).

Honest groups are sampled four ways: weights fp32 or rounded to bf16 and upcast (what a
`--weights-dtype bf16` volunteer holds), and either all groups in one `sample` call with 2
torch threads or one group per call with 1 thread. Every way is replayed (`model.replay.replay`,
GROUPS_PER_REPLAY groups per call, with the other thread count) and judged at the trainer's
default `--replay-tolerance` (TOL nats):
- rejected: honest completions with a position below -TOL (goal 0);
- two tokens pass: positions where the top two perturbed scores lie within TOL (the runner-up
  would pass too). The four ways sample with the same keys (the thread counts give the same
  tokens, fp32 and bf16 differ only by the weights' rounding), so at full size the count
  has 2,816 contexts, not 11,264: one near-tie found in all four ways moves it by 0.036 %,
  more than the goal.
  The row's figure is therefore the expected share over the committed noise, exact for each
  context: with p the sampling distribution at a position and c = exp(TOL) - 1, the top two
  Gumbel-perturbed scores lie within TOL with probability sum_i p_i c (1 - p_i) / (1 + c (1 -
  p_i)) (the max and the argmax of Gumbel-max are independent, and given them every other
  score is a Gumbel truncated below the max), which is below TOL whatever p. It is averaged
  over the fp32 samples' positions; the direct count stays in the notes as a check.
  Baseline: schema 4's rule on the same distributions (inverse CDF with a fresh uniform,
  tokens whose interval lies within 1e-4 of probability mass of the target), the share of
  positions where more than one token passes. The distribution of the gap is
  printed so the share at any tolerance can be read off.
The fp32 samples of both ways are replayed a second time as the trainer's step does for the
groups of the version it holds (trainer.step.StepReplay): the model in training mode, a
forward with gradients (`completion_logits`, GROUPS_PER_REPLAY groups a micro-batch), its
logits scored by `model.replay.replay_scored`. Counted: honest completions it rejects (goal 0),
and the largest difference of its margins and logprobs from the replay's at the same positions:
the float noise of the training forward, against the tolerance.
With LoRA (issue 42): a rank-LORA_RANK adapter on every linear layer of each model (B drawn so
that it moves the logits), published as the trainer publishes it in fp32 and in bf16. For each,
groups are sampled merged (the base rounded to the weights dtype, the adapter file's delta
added: what volunteers run) and replayed unmerged (the same base under PEFT's layers holding
the file's A and B: what the trainer's replay runs), and the other way round. Counted: honest
completions rejected (goal 0), and the largest difference between the two forms' margins on
the same completions.
Forged completions, from the fp32 honest samples: at a random position among the first
FORGE_SPAN, the token is replaced by (in turn) the runner-up of the committed draw (the
forger's best choice: it holds the weights and the key), a random one of the 10 most likely
other tokens, or the next token id (a neighbour in vocabulary order: what schema 4's band
let through in the tail); the completion ends there. Caught: its replay fails at the swap.
Baseline: the same neighbour swap under schema 4's rule on the same distributions.
"""

from __future__ import annotations

import copy
import math
import random
import sys
import time

import torch

from bench.common import Row, cli
from volunteer_rl.config import TrainerConfig
from volunteer_rl.model.policy import Policy, bf16_rounded
from volunteer_rl.model.replay import replay, replay_scored
from volunteer_rl.model.sampling import sample
from volunteer_rl.model.scoring import completion_logits
from volunteer_rl.model.tiny import build_tokenizer
from volunteer_rl.protocol.draws import group_keys

BENCH = "replay choice"
COMMAND = "python -m bench.replay_choice"
VOCABS = (32_000, 151_936)
K, NEW, T = 8, 16, 1.0
GROUPS, QUICK_GROUPS = {32_000: 8, 151_936: 3}, {32_000: 4, 151_936: 2}
FORGED, QUICK_FORGED = {32_000: 2_400, 151_936: 900}, {32_000: 300, 151_936: 150}
FORGE_SPAN = 6
GROUPS_PER_REPLAY = 8
TOP1_PEAKED = 0.37
OLD_BAND = 1e-4        # schema 4's tolerance, in probability mass
TOL = TrainerConfig(bucket="unused").replay_tolerance
GOAL_TWO, GOAL_CAUGHT = 1e-4, 0.999
GAP_BINS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
LORA_RANK, LORA_ALPHA = 1, 32.0


def build(vocab: int, tok, scale: float, seed: int = 0) -> Policy:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return Policy(model, tok, "plain", torch.device("cpu"))


def mean_top1(policy: Policy, prompts: list[list[int]]) -> float:
    with torch.no_grad():
        ids = torch.tensor([p[:4] for p in prompts])
        p = torch.softmax(policy.model(ids).logits.float() / T, -1).max(-1).values
    return p.mean().item()


def peaked_scale(vocab: int, tok, prompts: list[list[int]]) -> float:
    """The output-layer scale whose mean top-1 probability is about TOP1_PEAKED (bisection
    in log scale; the top-1 probability grows with the scale)."""
    lo, hi = 1.0, 1000.0
    for _ in range(8):
        mid = math.sqrt(lo * hi)
        if mean_top1(build(vocab, tok, mid), prompts) < TOP1_PEAKED:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)



def lora_forms(base: Policy, dtype: torch.dtype, prompts: list[list[int]]) -> tuple[Policy, Policy]:
    """(merged, unmerged): a trained-looking adapter of `base`, published in `dtype`, as a
    volunteer runs it (merged onto the base rounded to `dtype`) and as the trainer's replay
    runs it (PEFT's layers holding the file's A and B on that base)."""
    from safetensors.torch import load

    from volunteer_rl.model import lora

    spec = lora.LoraSpec(LORA_RANK, LORA_ALPHA)
    trained = lora.add_adapters(copy.deepcopy(base.model), spec)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in trained.named_parameters():
            if "lora_B" in name:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.02)
    data = lora.adapter_file(lora.adapter_tensors(trained), dtype)

    def on_base() -> torch.nn.Module:
        model = copy.deepcopy(base.model)
        with torch.no_grad():
            for t in model.parameters():
                t.copy_(t.to(dtype).float())
        return model

    merged = on_base()
    lora.add_into(merged, lora.read_adapter(data, "adapter.safetensors",
                                            lora.adaptable_layers(merged), spec, dtype))
    unmerged = lora.add_adapters(on_base(), spec)
    lora.set_adapter_tensors(unmerged, {n: t.float() for n, t in load(data).items()})
    forms = [Policy(m.eval(), base.tokenizer, "plain", base.device) for m in (merged, unmerged)]
    with torch.no_grad():
        ids = torch.tensor([p[:4] for p in prompts])
        moved = (forms[0].model(ids).logits - base.model(ids).logits).abs().max().item()
    if moved < 0.05:  # an adapter that changes nothing would make agreement meaningless
        raise SystemExit(f"the LoRA adapter moved the logits by only {moved:.3g}")
    return forms[0], forms[1]


def lora_replays(base: Policy, prompts, keys, total: dict) -> None:
    """Sample honest groups merged and replay them unmerged, and the other way round, with
    an adapter published in fp32 and in bf16; add the counts to `total`."""
    for dtype in (torch.float32, torch.bfloat16):
        forms = dict(zip(("merged", "unmerged"), lora_forms(base, dtype, prompts)))
        for sampler, replayer in (("merged", "unmerged"), ("unmerged", "merged")):
            out = sample(forms[sampler], prompts, K, T, NEW, draw_keys=keys)
            comps = [[s.token_ids for s in g] for g in out]
            own = replay_all(forms[sampler], prompts, comps, keys, 2)
            tally(total, "lora_", replay_all(forms[replayer], prompts, comps, keys, 2), own)


def margin_gap(rows, ref) -> float:
    """The largest difference of two replays' margins at the same positions of the same
    completions (finite margins only; 0 for none)."""
    return max([0.0] + [abs(x - y) for r, e in zip(rows, ref) for x, y in zip(r.margins, e.margins)
                        if math.isfinite(x) and math.isfinite(y)])


def tally(total: dict, prefix: str, rows, ref) -> None:
    """Add `rows`, a replay of honest completions, to `total`'s counts under `prefix`: the
    completions, those rejected at TOL, the worst margin, and the largest margin gap from
    `ref`, the same completions replayed another way."""
    total[prefix + "completions"] += len(rows)
    total[prefix + "rejected"] += sum(r.first_failure(TOL) >= 0 for r in rows)
    total[prefix + "worst"] = min([total[prefix + "worst"]] + [r.margin for r in rows])
    total[prefix + "margin_gap"] = max(total[prefix + "margin_gap"], margin_gap(rows, ref))


def replay_all(policy, prompts, completions, keys, threads):
    torch.set_num_threads(threads)
    rows = []
    for a in range(0, len(prompts), GROUPS_PER_REPLAY):
        end = a + GROUPS_PER_REPLAY
        rows += replay(policy, prompts[a:end], completions[a:end], keys[a:end], T)
    return rows


def step_replay_all(policy, prompts, completions, keys, threads):
    """Replay from a training step's forward (see the module's docstring), in the rows' order
    of `replay_all`."""
    torch.set_num_threads(threads)
    rows = []
    policy.model.train()
    try:
        for a in range(0, len(prompts), GROUPS_PER_REPLAY):
            end = a + GROUPS_PER_REPLAY
            logits, _, _ = completion_logits(policy, prompts[a:end], completions[a:end])
            assert logits.requires_grad  # the step's forward, not an inference one
            flat = [c for cs in completions[a:end] for c in cs]
            rows += replay_scored(logits, list(range(len(flat))), flat,
                                  [k for ks in keys[a:end] for k in ks], T)
            del logits
    finally:
        policy.model.eval()
    return rows


def expected_two(logits: torch.Tensor, tol: float) -> torch.Tensor:
    """[rows] float64: the chance, over Gumbel noise, that the top two scores of
    logits / T + noise lie within `tol` (see the module's docstring)."""
    p = torch.softmax(logits.double() / T, -1)
    c = math.expm1(tol)
    return (p * c * (1 - p) / (1 + c * (1 - p))).sum(-1)


def old_rule(policy, prompts, completions, rng):
    """Schema 4's inverse-CDF rule on the distributions of these completions' positions:
    (positions, positions where more than one token lies within OLD_BAND of a fresh target,
    positions where the drawn token's vocabulary neighbour passes, the 11 most likely tokens
    of every position in (group, completion, position) order, the expected number of
    positions where two tokens pass the replay at TOL: `expected_two` summed)."""
    n = several = neighbour = 0
    expected = 0.0
    likely: list[list[int]] = []
    for a in range(0, len(prompts), GROUPS_PER_REPLAY):
        with torch.no_grad():
            logits, _, mask = completion_logits(policy, prompts[a:a + GROUPS_PER_REPLAY],
                                                completions[a:a + GROUPS_PER_REPLAY])
        flat = logits[mask.bool()]
        likely += flat.topk(11, dim=-1).indices.tolist()
        for b in range(0, len(flat), 256):
            cdf = torch.log_softmax(flat[b:b + 256].float() / T, -1).double().exp().cumsum(-1)
            target = torch.tensor([rng.random() for _ in range(len(cdf))],
                                  dtype=torch.float64) * cdf[:, -1]
            lo = torch.cat([torch.zeros_like(cdf[:, :1]), cdf[:, :-1]], 1)
            # distance of the target from each token's interval [lo, cdf)
            dist = torch.clamp(torch.maximum(lo - target[:, None], target[:, None] - cdf), min=0)
            passing = dist <= OLD_BAND
            drawn = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
            drawn = drawn.clamp(max=cdf.shape[1] - 2)
            n += len(cdf)
            several += int((passing.sum(-1) > 1).sum())
            neighbour += int(passing.gather(1, drawn[:, None] + 1).sum())
            expected += float(expected_two(flat[b:b + 256], TOL).sum())
    return n, several, neighbour, likely, expected


def forge(policy, prompts, completions, keys, rows, likely, n_forged, rng):
    """(forged, caught) per kind, each forgery a completion cut right after its swapped token."""
    vocab = policy.model.get_output_embeddings().weight.shape[0]
    where = [(g, j) for g in range(len(prompts)) for j in range(K)]
    row_of = {gj: i for i, gj in enumerate(where)}
    offset = [0]  # first flat position of each completion in `likely`
    for g, j in where:
        offset.append(offset[-1] + len(completions[g][j]))
    kinds = ("runner-up", "likely", "neighbour")
    made = {kind: [] for kind in kinds}  # (group, completion, tokens)
    for i in range(n_forged):
        kind = kinds[i % len(kinds)]
        g, j = rng.choice(where)
        honest, row = completions[g][j], rows[row_of[g, j]]
        p = rng.randrange(min(FORGE_SPAN, len(honest)))
        if kind == "runner-up":
            x = row.runner_up[p] if honest[p] == row.drawn[p] else row.drawn[p]
        elif kind == "neighbour":
            x = (honest[p] + 1) % vocab
        else:
            top = likely[offset[row_of[g, j]] + p]
            x = rng.choice([t for t in top if t != honest[p]][:10])
        made[kind].append((g, j, honest[:p] + [x]))
    out = {}
    torch.set_num_threads(2)
    for kind, forged in made.items():
        caught = 0
        for a in range(0, len(forged), 64):
            batch = forged[a:a + 64]
            got = replay(policy, [prompts[g] for g, _, _ in batch], [[t] for _, _, t in batch],
                         [[keys[g][j]] for g, j, _ in batch], T)
            caught += sum(r.first_failure(TOL) >= 0 for r in got)
        out[kind] = (len(forged), caught)
    return out


def results(quick: bool) -> list[Row]:
    rng = random.Random(0)
    tok = build_tokenizer(["1 + 2 * 3 - 4 = 5"], vocab_size=40)
    groups, forged_n = (QUICK_GROUPS, QUICK_FORGED) if quick else (GROUPS, FORGED)
    total = {"positions": 0, "two": 0, "old_positions": 0, "old_several": 0, "old_neighbour": 0,
             "rejected": 0, "completions": 0, "forged": 0, "caught": 0, "worst": math.inf,
             "gap_counts": [0] * len(GAP_BINS), "logprob_gap": 0.0, "seconds": {},
             "expected_two": 0.0, "step_completions": 0, "step_rejected": 0,
             "step_worst": math.inf, "step_margin_gap": 0.0, "step_logprob_gap": 0.0,
             "lora_completions": 0, "lora_rejected": 0, "lora_worst": math.inf,
             "lora_margin_gap": 0.0}
    kinds_total: dict[str, list[int]] = {}
    start_all = time.perf_counter()
    for vocab in VOCABS:
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randrange(4, 13))]
                   for _ in range(groups[vocab])]
        keys = [group_keys("bench-replay-choice", 0, "v", g, g, K, "bench") for g in range(len(prompts))]
        for shape in ("peaked", "flat"):
            start = time.perf_counter()
            scale = peaked_scale(vocab, tok, prompts) if shape == "peaked" else 1.0
            base = build(vocab, tok, scale)
            top1 = mean_top1(base, prompts)
            fp32_rows = None
            for weights, pol in (("fp32", base), ("bf16", bf16_rounded(base))):
                for threads, per_call in ((2, len(prompts)), (1, 1)):
                    torch.set_num_threads(threads)
                    out = sample(pol, prompts, K, T, NEW, batch_size=per_call * K, draw_keys=keys)
                    comps = [[s.token_ids for s in g] for g in out]
                    rows = replay_all(pol, prompts, comps, keys, 3 - threads)
                    samples = [s for g in out for s in g]
                    for r, s in zip(rows, samples):
                        total["completions"] += 1
                        total["rejected"] += r.first_failure(TOL) >= 0
                        total["worst"] = min(total["worst"], r.margin)
                        total["logprob_gap"] = max([total["logprob_gap"]] + [
                            abs(x - y) for x, y in zip(r.logprobs, s.logprobs)])
                        for m in r.margins:
                            total["positions"] += 1
                            total["two"] += abs(m) <= TOL
                            for i, b in enumerate(GAP_BINS):
                                total["gap_counts"][i] += abs(m) <= b
                    if weights == "fp32":
                        in_step = step_replay_all(pol, prompts, comps, keys, 3 - threads)
                        tally(total, "step_", in_step, rows)
                        total["step_logprob_gap"] = max([total["step_logprob_gap"]] + [
                            abs(x - y) for r, e in zip(in_step, rows)
                            for x, y in zip(r.logprobs, e.logprobs)])
                    if weights == "fp32" and fp32_rows is None:
                        fp32_rows, fp32_comps = rows, comps
            n, several, neighbour, likely, expected = old_rule(base, prompts, fp32_comps, rng)
            total["expected_two"] += expected
            total["old_positions"] += n
            total["old_several"] += several
            total["old_neighbour"] += neighbour
            per_kind = forge(base, prompts, fp32_comps, keys, fp32_rows, likely, forged_n[vocab],
                             rng)
            lora_replays(base, prompts, keys, total)
            for kind, (f, c) in per_kind.items():
                kinds_total.setdefault(kind, [0, 0])
                kinds_total[kind][0] += f
                kinds_total[kind][1] += c
            seconds = time.perf_counter() - start
            print(f"vocab {vocab:,} {shape} (scale {scale:.3g}, mean top-1 p {top1:.3f}): "
                  f"two pass so far {total['two']} of {total['positions']:,} positions, rejected "
                  f"{total['rejected']} of {total['completions']:,}, forged caught "
                  + ", ".join(f"{k} {c}/{f}" for k, (f, c) in per_kind.items())
                  + f"; step forward rejected {total['step_rejected']} of "
                  f"{total['step_completions']:,}, margins off by {total['step_margin_gap']:.2g}"
                  + f"; LoRA rejected {total['lora_rejected']} of {total['lora_completions']:,}"
                  + f"; schema 4 several {several}/{n}, neighbour passes {neighbour}; "
                  f"{seconds:.0f} s", flush=True)
    torch.set_num_threads(2)
    forged = sum(f for f, _ in kinds_total.values())
    caught = sum(c for _, c in kinds_total.values())
    share = total["two"] / total["positions"]
    expected = total["expected_two"] / total["old_positions"]  # the fp32 samples' positions
    # P(gap <= x) grows linearly near 0: the share at TOL read off the widest bin
    estimate = total["gap_counts"][-1] / total["positions"] * TOL / GAP_BINS[-1]
    old_share = total["old_several"] / total["old_positions"]
    old_caught = 1 - total["old_neighbour"] / total["old_positions"]
    gaps = ", ".join(f"<= {b:.0e}: {c}" for b, c in zip(GAP_BINS, total["gap_counts"]))
    seconds = time.perf_counter() - start_all
    command = COMMAND + (" --quick" if quick else "")
    where = f"vocab 32,000 and 151,936, peaked (mean top-1 p {TOP1_PEAKED}) and flat"
    return [
        Row(BENCH, "% of positions where two tokens pass", 100 * expected, 100 * old_share,
            old_share / expected, f"<= {100 * GOAL_TWO:g}%", expected <= GOAL_TWO, command,
            f"{where}; expected share over the committed noise at --replay-tolerance {TOL:g} "
            f"nats, exact per context, over the {total['old_positions']:,} positions of the "
            f"fp32 samples (at most exp(tol) - 1 = {100 * math.expm1(TOL):.4f}% for any "
            f"distribution); counted: {total['two']} of {total['positions']:,} positions, the "
            f"same contexts replayed 4 ways ({100 * share:.4f}%; |gap| {gaps}: about "
            f"{100 * estimate:.4f}% at {TOL:g}, linear from the 1e-2 bin); baseline schema 4 "
            f"(inverse CDF, band 1e-4 of mass) on the same distributions; {seconds:.0f} s"),
        Row(BENCH, "% of forged completions caught", 100 * caught / forged, 100 * old_caught,
            (caught / forged) / old_caught, f">= {100 * GOAL_CAUGHT:g}%",
            caught / forged >= GOAL_CAUGHT, command,
            f"{where}; " + ", ".join(f"{k} {c:,}/{f:,}" for k, (f, c) in kinds_total.items())
            + "; baseline: the vocabulary-neighbour swap under schema 4's rule"),
        Row(BENCH, "honest completions rejected", total["rejected"], 0, 1.0, "0",
            total["rejected"] == 0, command,
            f"{where}; of {total['completions']:,}, fp32 and bf16 weights, sampled 2 threads "
            f"all groups per call or 1 thread 1 group per call, replayed with the other; worst "
            f"margin {total['worst']:.3g} nats, worst abs logprob diff {total['logprob_gap']:.2g}"),
        Row(BENCH, "honest completions rejected by a training step's forward",
            total["step_rejected"], 0, 1.0, "0", total["step_rejected"] == 0, command,
            f"{where}; of {total['step_completions']:,}, the fp32 samples of both ways replayed "
            f"from a forward in training mode with gradients (trainer.step.StepReplay's path), "
            f"the other thread count; worst margin {total['step_worst']:.3g} nats; against the "
            f"replay at the same positions, margins differ by at most "
            f"{total['step_margin_gap']:.2g} nats and logprobs by "
            f"{total['step_logprob_gap']:.2g} (tolerance {TOL:g}); baseline 0, the replay's"),
        Row(BENCH, f"honest LoRA completions rejected, merged and unmerged (rank {LORA_RANK})",
            total["lora_rejected"], 0, 1.0, "0", total["lora_rejected"] == 0, command,
            f"{where}; of {total['lora_completions']:,}, adapters published in fp32 and bf16, "
            f"sampled merged (as volunteers) and replayed unmerged (as the trainer), and the "
            f"other way round; worst margin {total['lora_worst']:.3g} nats; the two forms' "
            f"margins on the same completions differ by at most "
            f"{total['lora_margin_gap']:.2g} nats (tolerance {TOL:g})"),
    ]


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
