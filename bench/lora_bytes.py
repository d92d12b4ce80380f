"""Bytes per version with LoRA (`vrl trainer --lora-rank R`): an adapter file against the whole
bf16 weights file and against today's patch (issue 42, row (a); goal at rank 1: at least 500x
fewer bytes than the whole file).

    python -m bench.lora_bytes [--quick] [--json PATH]

The model is a Qwen3ForCausalLM of Qwen3-0.6B's shape (596 M parameters, 1.19 GB in bf16;
random normal init, bench.checkpoint_sync.qwen3), `--quick` a small Qwen3 shape. Measured in
one run, from the same start:

- the whole file: the bf16 weights file `vrl trainer --weights-dtype bf16` publishes for a
  version (model.weights.weights_size);
- today's patch: the mean patch of AdamW steps 2-3 at lr 1e-6 (bench.patch_size.step_sizes,
  supervised steps on the calculator task; step 1 after a fresh optimizer moves every weight
  and is left out, as in that bench's rows);
- each rank's adapter: the model wrapped as the trainer wraps it (model.lora.add_adapters,
  every linear layer but the output embedding), one AdamW step taken on the same task so B is
  not zero, and the adapter file serialized as the trainer publishes it
  (model.lora.adapter_file, bf16). An adapter is dense: its size is fixed by the rank and the
  shapes, whatever the step did.
"""

from __future__ import annotations

import copy
import sys

import torch

from bench.common import Row, cli

COMMAND = "python -m bench.lora_bytes"
RANKS = (1, 8, 32)
GOAL = 500.0
LR = 1e-6
ALPHA = 32.0


def adapter_bytes(base, rank: int) -> tuple[int, int]:
    """(adapter file bytes, adapter parameters) of `base` wrapped at `rank`, after one step."""
    from bench.checkpoint_sync import policy_for
    from bench.patch_size import calculator_steps
    from volunteer_rl.model.lora import LoraSpec, adapter_file, adapter_tensors, add_adapters

    policy = policy_for(copy.deepcopy(base))
    policy.model = add_adapters(policy.model, LoraSpec(rank, ALPHA))
    run = calculator_steps(policy, LR * 10)  # the LoRA default: ten times the full lr
    next(run)
    run.close()
    tensors = adapter_tensors(policy.model)
    if not any(t.abs().max() > 0 for n, t in tensors.items() if ".lora_B." in n):
        raise SystemExit("the adapter did not train: B is still zero")
    data = adapter_file(tensors, torch.bfloat16)
    return len(data), sum(t.numel() for t in tensors.values())


def results(quick: bool) -> list[Row]:
    from bench.checkpoint_sync import policy_for, qwen3
    from bench.patch_size import step_sizes
    from volunteer_rl.model.weights import weights_size

    command = COMMAND + (" --quick" if quick else "")
    name = "small Qwen3" if quick else "Qwen3-0.6B shape"
    base = qwen3(quick)
    params = sum(p.numel() for p in base.parameters())
    whole = weights_size(base, torch.bfloat16)
    print(f"{name}: {params / 1e6:.0f} M parameters, whole bf16 file {whole:,} bytes", flush=True)
    sizes = step_sizes(policy_for(copy.deepcopy(base)), LR, 3)
    patch = sum(s["patch"] for s in sizes[1:]) / len(sizes[1:])
    rows = []
    for rank in RANKS:
        size, n = adapter_bytes(base, rank)
        print(f"  rank {rank}: {n:,} adapter parameters, file {size:,} bytes", flush=True)
        ratio = whole / size
        goal = GOAL if rank == 1 else None
        rows.append(Row(
            f"bytes per version, {name}, LoRA rank {rank}",
            "bytes: adapter (vrl --lora-rank) vs whole bf16 file", size, whole, ratio,
            f">= {goal:g}x" if goal else "-", (ratio >= goal) if goal else None, command,
            f"{n:,} adapter parameters on every linear layer but the output embedding, bf16; "
            + (f"{patch / size:.1f}x fewer" if size <= patch else f"{size / patch:.1f}x more")
            + f" bytes than today's patch at lr {LR:g} ({patch:,.0f} bytes, mean of steps 2-3 "
            f"in this run); {params:,} parameters"))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
