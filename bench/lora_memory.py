"""Trainer peak memory with LoRA (`vrl trainer --lora-rank 1`) against full fine-tuning, one
process, for a Qwen3-0.6B-shaped model (issue 42, row (b); goal: LoRA at most 0.25x), both
sides with --gradient-checkpointing, and both without.

    python -m bench.lora_memory [--quick] [--json PATH]

The set-up and the measurement are bench.rank_memory's, one plain process each side: the
same random Qwen3 of Qwen3-0.6B's shape saved in bf16, the same groups written into the
bucket once v0 is out, 2 steps of 2 groups then v1, fp32 weights, audits off, one thread; the
peak is the trainer process's VmHWM. The LoRA side adds `--lora-rank 1` (alpha 32, every
linear layer but the output embedding). What to expect, in bytes a parameter: full
fine-tuning 25 and more (rank_memory's docstring counts them); LoRA the fp32 base 4 and the
adapters' share of the rest: v0, the base, is written from the model straight into its upload
(trainer.publish._stream_base), never held whole, and the model folder is read into the model
a piece at a time (model.safetensors_file.stream_into). On top of that, a step's activations:
about 100 KB a token a layer in fp32, 28 layers, which --gradient-checkpointing
(model.recompute) cuts to each layer's inputs, for a forward pass more per step.

Five sides, one after the other: full fine-tuning and LoRA rank 1 with --gradient-checkpointing
(the goal's row: the same flags on both sides but --lora-rank), the same two without it, and
LoRA publishing bf16 (without it, as before). Each row's note gives the median of each side's
two `train/step_time` (the steps, which the option slows).

Without --quick a last row trains the largest shape that fits this machine with LoRA (LARGEST,
Qwen3-4B's, publishing bf16) the same way, about 10 minutes more.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Row, cli
from bench.rank_memory import (
    FULL,
    GIB,
    QUICK,
    TIMEOUT,
    Shape,
    gib,
    log,
    prepare,
    run_side,
    train_problems,
)

COMMAND = "python -m bench.lora_memory"
GOAL = 0.25
LORA = ("--lora-rank", "1")
RECOMPUTE = ("--gradient-checkpointing",)
SIDES = {"full recomputed": RECOMPUTE, "lora recomputed": (*LORA, *RECOMPUTE), "full": (),
         "lora": LORA, "lora bf16": (*LORA, "--weights-dtype", "bf16")}
"""The full sides and the LoRA sides of the goal's row and the row without the option publish
fp32 weights, as rank_memory does; the last is LoRA as it would be run, publishing bf16 (the
base file then takes 2 bytes a parameter while v0 goes out, not 4)."""

LARGEST = Shape("Qwen3-4B shape", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
"""The largest Qwen3 size whose LoRA trainer fits this 24 GiB machine, run as the third side
is: its fp32 base alone is 15 GiB, Qwen3-8B's would be 30.5 GiB. Full fine-tuning's largest
is FULL itself: at its 28 bytes a parameter Qwen3-1.7B would need about 45 GiB."""


def results(quick: bool) -> list[Row]:
    shape = QUICK if quick else FULL
    command = COMMAND + (" --quick" if quick else "")
    problems = train_problems()
    started = time.time()
    peaks, steps = {}, {}
    with tempfile.TemporaryDirectory(prefix="vrl-lora-memory-") as tmp:
        tmp = Path(tmp)
        model, eval_csv, tokenizer, params = prepare(shape, tmp, problems)
        for name, extra in SIDES.items():
            side = run_side(tmp / name, 0, model, eval_csv, tokenizer, problems, shape.vocab_size,
                            TIMEOUT[quick], extra)
            peaks[name], steps[name] = side.peaks[0], statistics.median(side.step_seconds)
            log(f"  {name}: peak {gib(side.peaks[0]):.3f} GiB ({side.peaks[0] / params:.1f} B/param),"
                f" steps {', '.join(f'{x:.2f}' for x in side.step_seconds)}s, {side.seconds:.0f}s")
            shutil.rmtree(tmp / name)
    seconds = time.time() - started
    full_r, lora_r = peaks["full recomputed"], peaks["lora recomputed"]
    full, lora, half = peaks["full"], peaks["lora"], peaks["lora bf16"]
    step = lambda *names: ", ".join(f"{n} {steps[n]:.2f}" for n in names)  # noqa: E731
    largest = [] if quick else [largest_row(problems, full, params)]
    return [*largest, Row(
        f"trainer peak memory, {shape.label}, LoRA rank 1 vs full fine-tuning, both "
        "--gradient-checkpointing",
        "GiB peak resident (VmHWM): --lora-rank 1 (vrl) vs full fine-tuning, both "
        "--gradient-checkpointing, one process",
        gib(lora_r), gib(full_r), full_r / lora_r, f">= {1 / GOAL:g} (LoRA <= {GOAL:g}x full)",
        lora_r <= GOAL * full_r, command,
        f"LoRA/full {lora_r / full_r:.2f}; bytes a parameter: LoRA {lora_r / params:.1f}, full "
        f"{full_r / params:.1f}; without the option (the next row) LoRA {gib(lora):.2f}, full "
        f"{gib(full):.2f} GiB; median step seconds: {step('lora recomputed', 'lora')}, "
        f"{step('full recomputed', 'full')}; {params:,} parameters, fp32 weights, audits off, 2 "
        f"steps of 2 groups then v1, 1 thread; the five runs {seconds:.0f}s"),
        Row(f"trainer peak memory, {shape.label}, LoRA rank 1 vs full fine-tuning",
            "GiB peak resident (VmHWM): --lora-rank 1 (vrl) vs full fine-tuning, one process",
            gib(lora), gib(full), full / lora, "-", None, command,
            f"LoRA/full {lora / full:.2f}; bytes a parameter: LoRA {lora / params:.1f}, full "
            f"{full / params:.1f}; the same runs' sides without --gradient-checkpointing"),
        Row(f"trainer peak memory, {shape.label}, LoRA rank 1 bf16 vs full fine-tuning",
            "GiB peak resident (VmHWM): --lora-rank 1 --weights-dtype bf16 (vrl) vs full, fp32",
            gib(half), gib(full), full / half, "-", None, command,
            f"LoRA bf16/full {half / full:.2f}; bytes a parameter {half / params:.1f}; the same "
            "runs, this one publishing bf16 (a LoRA run's own choice), the full one fp32, "
            "neither with --gradient-checkpointing")]


def largest_row(problems, full: int, full_params: int) -> Row:
    """LARGEST trained with `--lora-rank 1 --weights-dtype bf16`, as the third side is: its
    peak against this machine's memory."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrl-lora-largest-") as tmp:
        tmp = Path(tmp)
        model, eval_csv, tokenizer, params = prepare(LARGEST, tmp, problems)
        side = run_side(tmp / "lora", 0, model, eval_csv, tokenizer, problems,
                        LARGEST.vocab_size, TIMEOUT[False], SIDES["lora bf16"])
    peak, total = side.peaks[0], machine_memory()
    log(f"  {LARGEST.label} lora bf16: peak {gib(peak):.3f} GiB ({peak / params:.1f} B/param), "
        f"{side.seconds:.0f}s")
    return Row(
        f"largest shape that trains here, LoRA rank 1: {LARGEST.label}",
        "GiB peak resident (VmHWM): --lora-rank 1 --weights-dtype bf16 (vrl) vs this machine's memory",
        gib(peak), gib(total), total / peak, "-", None, COMMAND,
        f"{params:,} parameters, {peak / params:.1f} B/param; Qwen3-8B's fp32 base alone would be "
        f"30.5 GiB. Full fine-tuning's largest is the {FULL.label} ({gib(full):.2f} GiB, "
        f"{full / full_params:.1f} B/param above): Qwen3-1.7B (1.72 B parameters) would need about "
        f"{1.72e9 * full / full_params / GIB:.0f} GiB. 2 steps of 2 groups then v1, audits off, "
        f"1 thread; {time.time() - started:.0f}s")


def machine_memory() -> int:
    """MemTotal of this machine, in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
