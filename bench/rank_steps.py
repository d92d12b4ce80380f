"""The trainer as 2 torchrun ranks against one process, on the demo's setting (issue 28: a
figure to report, no goal).

    python -m bench.rank_steps [--quick] [--seconds S]

Runs `vrl demo`'s processes (1 trainer + 2 volunteers, 1 torch thread each, a folder bucket)
for S seconds of RL (150) from v0 as `vrl demo` makes it (bench.trl_time_to_accuracy's shared
start), twice: the trainer as one process, then as 2 gloo ranks under torchrun
(`volunteer_rl.demo.start_processes(..., trainer_ranks=2)`). Row: the trainer's optimizer
steps per second of RL, 2 ranks against 1 process, read from the metrics each run wrote.
--quick: 60 s each from a v0 of 100 warm-start steps (checks the code, not the figure).

What to expect here: the demo's tiny model is no work to split, two volunteers' shards are
little intake to share (each rank reads its own volunteers' shards, and the ranks meet four
times a poll to exchange digests, claims and the batch), and on this 2-core machine the
second rank takes CPU from the volunteers and the writer, so the ranks can only be slower;
the row says by how much the collectives and the extra process cost. It is no measure of a model
too big for one device, which is what the ranks are for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import Row, emit_rows

SECONDS, QUICK_SECONDS = 150.0, 60.0
WARM_START, QUICK_WARM_START = 900, 100
RANKS = 2


def log(msg: str) -> None:
    print(msg, flush=True)


def steps_of(bucket: Path) -> tuple[int, int]:
    """(optimizer steps, last version) a demo run left in its folder bucket."""
    steps = 0
    for path in (bucket / "metrics").glob("v*.jsonl"):
        steps += sum(json.loads(line).get("kind") == "step" for line in path.read_text().splitlines())
    return steps, int(json.loads((bucket / "manifest.json").read_text())["version"])


def run_demo(model: Path, seconds: float, root: Path, ranks: int) -> tuple[int, int]:
    """The demo's processes from `model` for `seconds` of RL, the trainer as `ranks` torchrun
    ranks (0: one process); (steps, last version)."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.demo import DemoSettings, start_processes
    from volunteer_rl.launch import stop

    bucket = root / "bucket"
    bucket.mkdir(parents=True)
    tiny_eval = root / "eval-4.csv"  # the trainer's own v0/final evaluations ~free
    tiny_eval.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(keepends=True)[:5]))
    settings = DemoSettings(bucket=str(bucket), rl_seconds=seconds, extra_trainer_args=(
        "--model", str(model), "--eval-every", "0", "--eval-dataset", str(tiny_eval)))
    trainer, volunteers = start_processes(settings, bucket, trainer_ranks=ranks)
    try:
        out, _ = trainer.communicate(timeout=seconds + 900)
    finally:
        stop([*volunteers, trainer])
    if trainer.returncode != 0:
        raise SystemExit("vrl trainer failed:\n" + "\n".join(out.splitlines()[-40:]))
    return steps_of(bucket)


def results(quick: bool, seconds: float | None = None) -> list[Row]:
    import tempfile

    from bench.trl_time_to_accuracy import shared_start

    seconds = seconds or (QUICK_SECONDS if quick else SECONDS)
    command = "python -m bench.rank_steps" + (" --quick" if quick else "") + (
        f" --seconds {seconds:g}" if seconds != (QUICK_SECONDS if quick else SECONDS) else "")
    model = shared_start(QUICK_WARM_START if quick else WARM_START)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrl-rank-steps-") as tmp:
        log(f"one process: `vrl demo`'s processes, {seconds:.0f}s of RL")
        one, one_v = run_demo(model, seconds, Path(tmp) / "one", 0)
        log(f"  {one} steps, v{one_v}")
        log(f"{RANKS} ranks: the same, the trainer under torchrun --nproc-per-node {RANKS}")
        two, two_v = run_demo(model, seconds, Path(tmp) / "ranks", RANKS)
        log(f"  {two} steps, v{two_v}")
    return [Row(benchmark=f"trainer as {RANKS} gloo ranks on the demo's setting",
                measure="optimizer steps/s of RL", vrl=two / seconds, baseline=one / seconds,
                ratio=two / one if one else float("nan"), goal="-", met=None, command=command,
                note=(f"1 trainer + 2 volunteers, 1 torch thread each, {seconds:.0f}s of RL from "
                      f"the demo's v0; {RANKS} ranks: {two} steps (v{two_v}), one process: {one} "
                      f"steps (v{one_v}); each rank reads its own volunteers' shards; both runs "
                      f"{time.time() - started:.0f}s on this {_cores()}-core machine"))]


def _cores() -> int:
    import os

    return os.cpu_count() or 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the code, not the figures")
    parser.add_argument("--seconds", type=float, help=f"seconds of RL per run ({SECONDS:g})")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args()
    if args.seconds is not None and not args.seconds > 0:
        parser.error(f"--seconds: must be more than 0, not {args.seconds:g}")
    return emit_rows(results(args.quick, args.seconds), args.json)


if __name__ == "__main__":
    sys.exit(main())
