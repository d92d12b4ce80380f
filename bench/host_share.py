"""The demo's fleet with one of its two volunteers at `--cpu-share 0.5` against both at full
share, from the same v0 (issue 43: the fleet degrades gracefully, no stall).

    python -m bench.host_share [--quick] [--json PATH]

**Runs.** One after the other, each the demo's processes (volunteer_rl.demo.start_processes:
a trainer and two volunteers, one thread each, the demo's flags) on a fresh folder bucket for
`--max-seconds` 300 (90 with --quick) of RL, started from the calculator's warm-started tiny
model (bench.lora_accuracy.start_for, cached), so neither run pays for a warm start: both
volunteers at full share (baseline), then `demo-2` with `--cpu-share 0.5` (vrl).

**Rows.**
- The trainer's intake: groups trained in the run (fleet.json). Goal: at least 0.75 of the
  baseline's, the share of sampling capacity the fleet kept (1.5 volunteers of 2), and no
  stall: the longest wait between two steps under 30 s.
- Held-out accuracy of the last version (score as bench.lora_accuracy: 500 prompts, 100 with
  --quick, 4 samples at T 1). Goal: within 2 s.e. of the baseline's.
The note says how much each volunteer's groups were trained, and the process CPU time the
shared volunteer took per second of the run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Row, emit_rows
from bench.lora_accuracy import PROMPTS, score, start_for

COMMAND = "python -m bench.host_share"
SECONDS = {False: 300.0, True: 90.0}
SHARE = 0.5
TASK = "calculator"


def log(msg: str) -> None:
    print(msg, flush=True)


def run(model: Path, shared: bool, seconds: float, work: Path) -> dict:
    """The demo's fleet for `seconds` of RL; what it trained, and its bucket."""
    import psutil

    from volunteer_rl.config import DemoSettings
    from volunteer_rl.demo import start_processes
    from volunteer_rl.launch import stop
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.metrics import read_metrics
    from volunteer_rl.storage import open_storage

    bucket = work / "bucket"
    bucket.mkdir(parents=True)
    s = DemoSettings(rl_seconds=seconds, extra_trainer_args=("--model", str(model)))
    trainer, vols = start_processes(s, bucket, volunteer_args=[(), ("--cpu-share", str(SHARE))]
                                    if shared else None)
    cpu, started = 0.0, time.time()
    try:
        # The pipes are the demo's: drain them, or a chatty process blocks on a full one.
        out = {p: [] for p in [trainer, *vols]}

        def drain(p):
            for line in p.stdout:
                out[p].append(line)
        for p in out:
            threading.Thread(target=drain, args=(p,), daemon=True).start()
        watched = psutil.Process(vols[1].pid)
        while trainer.poll() is None:
            try:
                t = watched.cpu_times()
                cpu = t.user + t.system
            except psutil.Error:
                pass
            time.sleep(1)
        code = trainer.wait()
    finally:
        stop(vols)
        stop([trainer])
    if code != 0:
        raise SystemExit(f"vrl trainer exited {code}:\n{''.join(out[trainer])[-3000:]}")
    fleet = json.loads((bucket / layout.FLEET).read_text())
    storage = open_storage(str(bucket))
    times = sorted(r.time for key in storage.list(layout.METRICS + "/")
                   for r in read_metrics(storage, key) if getattr(r, "step", None) is not None and r.time)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"bucket": bucket, "trained": {v: row.get("groups_trained", 0) for v, row in fleet["volunteers"].items()},
            "steps": len(times), "longest_gap": max(gaps, default=math.inf),
            "cores": cpu / max(1.0, time.time() - started)}


def results(quick: bool) -> list[Row]:
    seconds, prompts = SECONDS[quick], PROMPTS[quick]
    command = COMMAND + (" --quick" if quick else "")
    model = start_for(TASK)
    got = {}
    for name, shared in (("full", False), ("shared", True)):
        with tempfile.TemporaryDirectory(prefix="vrl-host-share-") as tmp:
            t0 = time.time()
            r = run(model, shared, seconds, Path(tmp))
            r["version"], r["eval"] = score(TASK, r.pop("bucket"), Path(tmp) / "work", prompts)
            got[name] = r
            log(f"{name}: {sum(r['trained'].values())} groups trained {r['trained']}, "
                f"{r['steps']} steps, longest gap {r['longest_gap']:.1f}s, demo-2 used "
                f"{r['cores']:.2f} cores, v{r['version']} sampled "
                f"{r['eval']['eval/accuracy_sampled']:.3f} ({time.time() - t0:.0f}s)")
    full, shared = got["full"], got["shared"]
    n_full, n_shared = sum(full["trained"].values()), sum(shared["trained"].values())
    p, p_full = shared["eval"]["eval/accuracy_sampled"], full["eval"]["eval/accuracy_sampled"]
    se = math.sqrt(max(p * (1 - p) / prompts + p_full * (1 - p_full) / prompts, 1e-12))
    fleet_note = (f"groups trained by volunteer: {shared['trained']} (full share: {full['trained']}); "
                  f"steps {shared['steps']} vs {full['steps']}; longest wait between steps "
                  f"{shared['longest_gap']:.1f}s vs {full['longest_gap']:.1f}s; demo-2 took "
                  f"{shared['cores']:.2f} cores at --cpu-share {SHARE:g} ({full['cores']:.2f} at full "
                  f"share); {seconds:.0f}s of RL from the same v0, demo flags, 1 thread each")
    ratio = n_shared / n_full if n_full else math.inf
    return [
        Row(f"fleet intake, one of two volunteers at --cpu-share {SHARE:g}",
            "groups trained in the run: shared (vrl) vs both at full share (baseline)",
            n_shared, n_full, ratio, ">= 0.75, no wait between steps over 30 s",
            ratio >= 0.75 and shared["longest_gap"] < 30, command, fleet_note),
        Row(f"held-out accuracy after {seconds:.0f}s, one of two volunteers at --cpu-share {SHARE:g}",
            "sampled accuracy (T 1): shared (vrl) vs full share (baseline)", p, p_full,
            p / p_full if p_full else math.inf, "within 2 s.e.", abs(p - p_full) <= 2 * se, command,
            f"gap {(p - p_full) / se:+.2f} s.e.; v{shared['version']} vs v{full['version']}; "
            f"{prompts} prompts x 4 samples"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="90 s runs, 100 prompts")
    parser.add_argument("--json", help="write the rows here as JSON (for python -m bench)")
    args = parser.parse_args()
    return emit_rows(results(args.quick), args.json)


if __name__ == "__main__":
    sys.exit(main())
