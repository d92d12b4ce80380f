"""Bytes per version: a patch (protocol.patch) against the whole bf16 weights file.

    python -m bench.patch_size [--quick] [--steps 4] [--json PATH]

A model takes real AdamW steps (the trainer's optimizer: AdamW, weight decay 0, gradient
norm clipped at 1) on the calculator task, and after every step its weights are serialized
as `vrl trainer --weights-dtype bf16` publishes them (`model.weights.weights_bytes`); the
patch from the previous step's file to this one's is made with `protocol.patch.make_patch`,
exactly as `trainer.publish.WeightsChain` makes it, and applied back to check it rebuilds the
file bit for bit. The figure is the whole file's bytes over the patch's: how many times fewer
bytes a volunteer that follows along downloads per version.

Models:
- a Qwen3ForCausalLM of Qwen3-0.6B's shape (596 M parameters, 1.19 GB in bf16; random
  normal init, as bench/checkpoint_sync.py builds it) at lr 1e-6 and 1e-5, from the same
  start each; the steps are supervised (next-token loss on the gold expression of 16
  calculator prompts per step, the warm start's loss), because a random model earns no
  reward and an RL step on it would have no gradient. Adam scales every update to about lr
  whatever the loss, which is what decides how many bf16 values move.
- the demo's tiny model (0.6 M parameters) at the demo's lr (3e-4), after its 900-step warm
  start (bench.trl_time_to_accuracy.shared_start), taking the same kind of steps.

The first step after a fresh optimizer moves every weight with a gradient by exactly lr
(Adam's first update is lr times the sign of the gradient), so it is reported apart from the
mean of the steps after it, which is the steady state of a run. `--quick` uses a much
smaller Qwen3 shape. Peak memory at full size is about 10 GB (fp32 weights, gradients, two
Adam moments, two bf16 files).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time

import torch

from bench.common import Row, emit_rows

COMMAND = "python -m bench.patch_size"
GOAL = 50.0


def calculator_steps(policy, lr: float, seed: int = 0):
    """An endless run of AdamW steps on `policy` (changed in place): each `next()` takes one
    supervised step on 16 calculator prompts and yields (loss, seconds)."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.policy import encode_prompts
    from volunteer_rl.task.dataset import load_csv
    from volunteer_rl.trainer.warmstart import target_nll

    problems = load_csv(PACKAGE_DATA / "train.csv")
    rng = random.Random(seed)
    tok = policy.tokenizer
    opt = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
    policy.model.train()
    try:
        while True:
            batch = rng.sample(problems, 16)
            prompts = encode_prompts(policy, [p.prompt for p in batch])
            targets = [list(tok(p.expression, add_special_tokens=False)["input_ids"]) + [policy.eos_id]
                       for p in batch]
            t0 = time.perf_counter()
            loss = target_nll(policy, prompts, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.model.parameters(), 1.0)
            opt.step()
            yield loss.item(), time.perf_counter() - t0
    finally:
        policy.model.eval()


def step_sizes(policy, lr: float, steps: int, seed: int = 0) -> list[dict]:
    """Run `steps` AdamW steps on `policy` (changed in place); per step the bf16 file's size,
    the patch's size, the changed words and the seconds spent making the patch."""
    from volunteer_rl.model.hashing import sha256_bytes
    from volunteer_rl.model.weights import weights_bytes
    from volunteer_rl.protocol.patch import apply_patch, make_patch, read_header

    before = weights_bytes(policy.model, torch.bfloat16)
    before_sha = sha256_bytes(before)  # a patch names its files by any 32 bytes: their sha256 here
    out = []
    run = calculator_steps(policy, lr, seed)
    for _ in range(steps):
        loss, step_seconds = next(run)
        after = weights_bytes(policy.model, torch.bfloat16)
        after_sha = sha256_bytes(after)
        t0 = time.perf_counter()
        patch = make_patch(before, after, 2, before_sha, after_sha)
        made = time.perf_counter() - t0
        rebuilt = bytearray(before)
        apply_patch(rebuilt, patch, "bench patch", before_sha)
        if bytes(rebuilt) != bytes(after):
            raise SystemExit("a patch did not rebuild its target: a bug in protocol.patch")
        out.append({"file": len(after), "patch": len(patch), "changed": read_header(patch).changed,
                    "words": len(after) // 2, "loss": loss, "step_s": step_seconds,
                    "patch_s": made})
        print(f"  lr {lr:g}: loss {loss:.3f}, {out[-1]['changed'] / out[-1]['words']:.4%} of the "
              f"words changed, patch {len(patch):,} of {len(after):,} bytes "
              f"({len(after) / len(patch):.1f}x fewer); step {step_seconds:.0f} s, patch {made:.1f} s",
              flush=True)
        before, before_sha = after, after_sha
    run.close()
    return out


def summary(name: str, lr: float, sizes: list[dict], goal: float | None, command: str) -> Row:
    first, rest = sizes[0], sizes[1:] or sizes[:1]
    file = first["file"]
    patch = sum(s["patch"] for s in rest) / len(rest)
    changed = sum(s["changed"] / s["words"] for s in rest) / len(rest)
    ratio = file / patch
    note = (f"mean of steps 2-{len(sizes)}: {changed:.3%} of bf16 weights changed per step, patch "
            f"{patch:,.0f} of {file:,} bytes; first step after a fresh optimizer "
            f"{first['changed'] / first['words']:.2%} changed, {file / first['patch']:.1f}x; "
            f"patch made in {max(s['patch_s'] for s in sizes):.1f} s at most")
    return Row(f"bytes per version, {name}, lr {lr:g}", "bytes: patch (vrl) vs whole bf16 file",
               patch, file, ratio, f">= {goal:g}x" if goal else "-",
               (ratio >= goal) if goal else None, command, note)


def results(quick: bool, steps: int = 4) -> list[Row]:
    from bench.checkpoint_sync import policy_for, qwen3
    from bench.trl_time_to_accuracy import shared_start
    from volunteer_rl.model.policy import load_policy

    command = COMMAND + (" --quick" if quick else "") + (f" --steps {steps}" if steps != 4 else "")
    rows = []
    base = qwen3(quick)
    n = sum(p.numel() for p in base.parameters())
    print(f"Qwen3-shaped model: {n / 1e6:.0f} M parameters", flush=True)
    for lr in (1e-6, 1e-5):
        policy = policy_for(copy.deepcopy(base) if lr != 1e-5 else base)  # the last run may use it up
        rows.append(summary("Qwen3-0.6B shape" if not quick else "small Qwen3", lr,
                            step_sizes(policy, lr, steps), GOAL if lr == 1e-6 else None, command))
        del policy
    del base
    tiny = load_policy(shared_start(), torch.device("cpu"))
    rows.append(summary("demo tiny model", 3e-4, step_sizes(tiny, 3e-4, steps), None, command))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small Qwen3 shape (checks the code)")
    parser.add_argument("--steps", type=int, default=4, help="AdamW steps per model and lr")
    parser.add_argument("--json", help="write the rows here as JSON (for python -m bench)")
    args = parser.parse_args()
    return emit_rows(results(args.quick, args.steps), args.json)


if __name__ == "__main__":
    sys.exit(main())
