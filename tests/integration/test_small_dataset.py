"""A small dataset of one's own leaves RL rows to learn (issue 39). With 1,000 rows, 900
warm-start steps of 64 pass over each row 58 times: before the split, the warm start memorised
the very rows RL then sampled, whose groups earned 0.84-0.87 from the first step, and the
trainer waited for groups with reward variance. Now the warm start trains on half the rows and
RL samples the other half (trainer/warmstart.py), so RL's first groups earn what a model that
has not seen them earns.

What this does not show is held-out accuracy rising: on a generated calculator dataset of
1,000 rows the tiny model's held-out accuracy stayed within noise of v0's through 300 steps,
while RL learnt its own 500 rows (docs/LIMITS.md, Warm start, has the runs). The bound is on
what the split fixes, and `WARM_START_MAX_PASSES=0` (no split) is how to see it fail.

The demo's processes (volunteer_rl.demo.start_processes: a trainer and two volunteers on a
folder bucket) on a generated calculator dataset of 1,000 rows and 250 held-out ones, until
the trainer has made MAX_STEPS steps: it waits for progress, however slow the machine is.
Slow (select with -m slow): about 5 minutes idle on 2 cores, most of it the warm start; 9
minutes beside another such run."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from volunteer_rl.demo import DemoSettings, start_processes
from volunteer_rl.launch import stop

TRAIN_ROWS, HELD_OUT_ROWS = 1000, 250
MAX_STEPS = 10
"""Optimizer steps of RL: the first ones are where a memorised warm start shows."""
FIRST_REWARD = 0.7
"""Bound on the mean reward of the first MAX_STEPS steps (each the mean over the batch's groups,
which have reward variance, so above the model's accuracy on those rows). Measured on this
dataset: split, 0.51 and 0.58 in two runs; not split (`WARM_START_MAX_PASSES=0`), 0.85, as
the issue's 0.84-0.87."""
STEP = re.compile(r"^step (\d+) v\d+ reward ([\d.]+) ", re.M)
EVAL = re.compile(r"eval v(\d+) on (\d+) held-out prompts: greedy ([\d.]+)%, "
                  r"sampled \(T=[\d.]+\) ([\d.]+)%")


def generated(root: Path) -> tuple[Path, Path]:
    """A calculator dataset of TRAIN_ROWS rows and its HELD_OUT_ROWS held-out rows."""
    subprocess.run([sys.executable, "-m", "volunteer_rl.task.generate", "--out", str(root),
                    "--n-train", str(TRAIN_ROWS), "--n-eval", str(HELD_OUT_ROWS)],
                   check=True, capture_output=True)
    return root / "train.csv", root / "eval.csv"


@pytest.mark.slow
def test_a_small_dataset_leaves_rl_rows_the_warm_start_has_not_learnt(tmp_path):
    train, held_out = generated(tmp_path)
    passes = os.environ.get("WARM_START_MAX_PASSES", "4")  # 0: the red check, no split
    settings = DemoSettings(rl_seconds=3600.0, extra_trainer_args=(
        "--dataset", str(train), "--eval-dataset", str(held_out), "--max-steps", str(MAX_STEPS),
        "--warm-start-max-passes", passes))
    bucket = tmp_path / "run" / "bucket"
    bucket.mkdir(parents=True)  # as run_demo does: a volunteer may look before the trainer made it
    trainer, volunteers = start_processes(settings, bucket)
    outputs: list[list[str]] = [[] for _ in [trainer, *volunteers]]
    readers = [threading.Thread(target=out.extend, args=(p.stdout,), daemon=True)
               for out, p in zip(outputs, [trainer, *volunteers])]  # no pipe left to fill up
    for r in readers:
        r.start()
    try:
        code = trainer.wait(timeout=3600)  # a hang guard, far above an idle run's 5 minutes
        alive = [p.poll() is None for p in volunteers]
    finally:
        stop(volunteers)
        stop([trainer])
        for r in readers:
            r.join(timeout=10)
    lines, text = outputs[0], "".join(outputs[0])
    assert code == 0, text[-3000:]
    assert all(alive), [("".join(out)[-2000:]) for out in outputs[1:]]  # both sampled to the end
    warm = next(line for line in lines if line.startswith("warm start: "))
    rewards = [float(r) for _, r in STEP.findall(text)]
    evals = [(int(v), float(g), float(s)) for v, _, g, s in EVAL.findall(text)]
    print(warm.strip())
    print(f"held-out v0: greedy {evals[0][1]}% sampled {evals[0][2]}%; first {len(rewards)} "
          f"steps' reward {rewards}")
    assert len(rewards) == MAX_STEPS and sum(rewards) / MAX_STEPS < FIRST_REWARD, rewards
    assert f"trained on {TRAIN_ROWS // 2} of {TRAIN_ROWS} rows" in warm, warm
