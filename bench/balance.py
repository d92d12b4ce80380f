"""The demo's balance: what share of the groups its volunteers sample the trainer trains on.

    python -m bench.balance [--quick] [--seconds S] [--no-baseline] [--json PATH]

Runs `vrl demo`'s processes (`volunteer_rl.demo.start_processes`: 1 trainer + 2 volunteers, 1
torch thread each, on a folder bucket) for S seconds of RL (300), from v0 as `vrl demo` makes it
(900 warm-start steps, built once and cached: bench.trl_time_to_accuracy's shared start),
twice (--quick: from a v0 of 100 warm-start steps, until the trainer made 8 steps, at most S
seconds (900): it checks the code, at whatever pace the machine allows):

- vrl: the demo as it is, the trainer asking each volunteer for a quota of each version
  (the manifest's `quota`, trainer/balance.py);
- baseline: the demo before issue 27, no quota (`--quota-headroom 0`) and each volunteer's
  own cap of 48 groups per version (`--max-groups-per-version 48`, 2 s patience).

It reads the bucket after each run: groups sampled (the volunteers' last heartbeats,
`groups_total`, and never fewer than their shards in the bucket hold), received (`ingest/groups`) and trained (`rollout/groups`) over every step's
metrics, and fleet.json's `balance` (the trainer's last minute). Rows: the useful fraction,
groups trained / groups sampled over the whole run (goal >= 0.6, the issue's), and the
held-out accuracy of the last version, published S seconds into RL (500 prompts, greedy and
4 samples at T = 1, as `vrl demo` reports it; the goal: not lower than the baseline's by
more than 2 standard errors). The two runs share the machine with nothing else of ours, but
not with whatever else runs on it: say so when it was busy.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, emit_rows

ROOT = Path(__file__).resolve().parents[1]
SECONDS, QUICK_SECONDS = 300.0, 900.0
WARM_START, QUICK_WARM_START = 900, 100
QUICK_STEPS = 8
GOAL = 0.6
BASELINE_CAP = 48
"""The volunteers' own cap per version that `vrl demo` passed before the quota existed."""


@dataclass
class Balance:
    """What one demo run did with its groups, read from its bucket."""

    sampled: int
    received: int
    trained: int
    steps: int
    versions: int
    window: dict
    """fleet.json's `balance` at the end (the trainer's last minute)."""
    quota: dict | None
    """The last manifest's `quota`."""
    greedy: float
    sampled_accuracy: float
    prompts: int

    @property
    def useful(self) -> float:
        return self.trained / self.sampled if self.sampled else 0.0


def log(msg: str) -> None:
    print(msg, flush=True)


def read_balance(bucket: Path) -> tuple[int, int, int, int, dict, dict | None, int]:
    """(sampled, received, trained, steps, fleet.json balance, last quota, last version) from
    a demo's folder bucket after its processes stopped."""
    sampled = 0
    for path in (bucket / "volunteers").glob("*.json"):
        sampled += int(json.loads(path.read_text()).get("groups_total") or 0)
    # A volunteer killed before its last heartbeat under-reports: never count fewer groups
    # than its shards in the bucket hold.
    uploaded = sum(len(gzip.open(p).read().splitlines())
                   for p in (bucket / "rollouts").glob("v*/*/*.jsonl.gz"))
    sampled = max(sampled, uploaded)
    received = trained = steps = 0
    for path in (bucket / "metrics").glob("v*.jsonl"):
        for line in path.read_text().splitlines():
            m = json.loads(line)
            if m.get("kind") == "step":
                steps += 1
                received += int(m.get("ingest/groups") or 0)
                trained += int(m.get("rollout/groups") or 0)
    fleet = json.loads((bucket / "fleet.json").read_text())
    manifest = json.loads((bucket / "manifest.json").read_text())
    return (sampled, received, trained, steps, fleet.get("balance") or {}, manifest.get("quota"),
            int(manifest["version"]))


def accuracy(bucket: Path, work: Path, version: int) -> tuple[float, float, int]:
    """(greedy, sampled, prompts) of `version` on the held-out set, as `vrl demo` reports it."""
    from volunteer_rl.protocol.signing import Trust, resolve_trust_key
    from volunteer_rl.storage import open_storage
    from volunteer_rl.trainer.evaluate import greedy_and_sampled, held_out, load_version

    storage = open_storage(str(bucket))
    trust = Trust(resolve_trust_key(str(work / "trainer" / "signing-key.pem.pub")))
    m, policy = load_version(storage, version, work / "eval", trust=trust)
    task, problems = held_out(m, None)  # the manifest's task's own held-out rows: data/eval.csv
    r = greedy_and_sampled(policy, task, problems, m.sampling.temperature, 4,
                           m.sampling.max_new_tokens)
    return r["eval/accuracy_greedy"], r["eval/accuracy_sampled"], len(problems)


def run_demo(model: Path, seconds: float, root: Path, baseline: bool, max_steps: int = 0) -> Balance:
    """`vrl demo`'s processes from `model` for `seconds` of RL (or until the trainer made
    `max_steps` steps); what they did, read back."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.demo import DemoSettings, start_processes
    from volunteer_rl.launch import stop

    bucket = root / "bucket"
    bucket.mkdir(parents=True)
    tiny_eval = root / "eval-4.csv"  # the trainer's own v0/final evaluations ~free
    tiny_eval.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(keepends=True)[:5]))
    extra = ("--model", str(model), "--eval-every", "0", "--eval-dataset", str(tiny_eval),
             "--max-steps", str(max_steps))
    settings = DemoSettings(bucket=str(bucket), rl_seconds=seconds,
                            groups_per_version=BASELINE_CAP if baseline else 0,
                            extra_trainer_args=extra + (("--quota-headroom", "0") if baseline else ()))
    trainer, volunteers = start_processes(settings, bucket)
    tail: list[str] = []

    def pump(proc):
        for line in proc.stdout:
            tail[:] = (tail + [line.rstrip()])[-40:]
    pumps = [threading.Thread(target=pump, args=(p,), daemon=True) for p in (trainer, *volunteers)]
    for t in pumps:
        t.start()
    try:
        code = trainer.wait(timeout=seconds + 900)
    finally:
        stop([*volunteers, trainer])  # volunteers write their last heartbeat, with totals
        for t in pumps:
            t.join(timeout=5)
    if code != 0:
        raise SystemExit("vrl trainer failed:\n" + "\n".join(tail))
    sampled, received, trained, steps, window, quota, version = read_balance(bucket)
    greedy, sampled_acc, prompts = accuracy(bucket, root / "work", version)
    return Balance(sampled, received, trained, steps, version, window, quota, greedy, sampled_acc,
                   prompts)


def describe(b: Balance) -> str:
    w = b.window
    last = ("-" if w.get("useful_fraction") is None else f"{w['useful_fraction']:.2f}")
    return (f"sampled {b.sampled:,}, received {b.received:,}, trained {b.trained:,} in {b.steps} "
            f"steps, v{b.versions}; last minute (fleet.json) useful {last} of "
            f"{w.get('groups_received', 0):,} received; last quota {b.quota}")


def _se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-9) / max(n, 1))


def results(quick: bool, seconds: float | None = None, baseline: bool = True) -> list[Row]:
    import tempfile

    from bench.trl_time_to_accuracy import shared_start

    seconds = seconds or (QUICK_SECONDS if quick else SECONDS)
    command = "python -m bench.balance" + (" --quick" if quick else "") + (
        f" --seconds {seconds:g}" if seconds != (QUICK_SECONDS if quick else SECONDS) else "")
    steps = QUICK_STEPS if quick else 0
    span = f"{steps} steps (at most {seconds:.0f}s)" if quick else f"{seconds:.0f}s of RL"
    model = shared_start(QUICK_WARM_START if quick else WARM_START)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrl-balance-") as tmp:
        log(f"vrl: `vrl demo`'s processes with the manifest's quota, {span}")
        mine = run_demo(model, seconds, Path(tmp) / "quota", baseline=False, max_steps=steps)
        log(f"  {describe(mine)}")
        base = None
        if baseline:
            log(f"baseline: no quota, the volunteers' own cap of {BASELINE_CAP}, {span}")
            base = run_demo(model, seconds, Path(tmp) / "baseline", baseline=True, max_steps=steps)
            log(f"  {describe(base)}")
    took = time.time() - started
    b_useful = base.useful if base else float("nan")
    b_acc = base.sampled_accuracy if base else float("nan")
    two_se = 2 * math.hypot(_se(mine.sampled_accuracy, mine.prompts * 4),
                            _se(b_acc if base else 0.0, mine.prompts * 4))
    note_base = describe(base) if base else "not run (--no-baseline)"
    return [
        Row(benchmark="demo balance (1 trainer + 2 volunteers)",
            measure="useful fraction: groups trained / groups sampled",
            vrl=mine.useful, baseline=b_useful,
            ratio=mine.useful / b_useful if base and b_useful else float("nan"),
            goal=f">= {GOAL}", met=mine.useful >= GOAL, command=command,
            note=(f"{span} from v0 as `vrl demo` makes it; vrl (manifest quota): "
                  f"{describe(mine)}; baseline (no quota, own cap {BASELINE_CAP}/version): "
                  f"{note_base}; both runs {took:.0f}s")),
        Row(benchmark=f"demo accuracy after {span} (1 trainer + 2 volunteers)",
            measure="held-out sampled accuracy",
            vrl=mine.sampled_accuracy, baseline=b_acc,
            ratio=mine.sampled_accuracy / b_acc if base and b_acc else float("nan"),
            goal="not lower by > 2 standard errors",
            met=(mine.sampled_accuracy >= b_acc - two_se) if base else None, command=command,
            note=(f"{mine.prompts} held-out prompts, 4 samples at T=1 and greedy; greedy vrl "
                  f"{mine.greedy:.1%} / baseline {base.greedy if base else float('nan'):.1%}; "
                  f"last version v{mine.versions} / v{base.versions if base else '-'}; "
                  f"2 s.e. = {two_se * 100:.1f} pts")),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes: checks the code, not the figures")
    parser.add_argument("--seconds", type=float,
                        help=f"seconds of RL per run ({SECONDS:g}; with --quick the most, {QUICK_SECONDS:g})")
    parser.add_argument("--no-baseline", action="store_true", help="only the run with the quota")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args()
    if args.seconds is not None and not args.seconds > 0:
        parser.error(f"--seconds: must be more than 0, not {args.seconds:g}")
    return emit_rows(results(args.quick, args.seconds, not args.no_baseline), args.json)


if __name__ == "__main__":
    sys.exit(main())
