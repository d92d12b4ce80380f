"""The demo's fleet with one of its two volunteers capped by `--cpu-share` against both at
full share, from the same v0 (issue 43: the fleet degrades gracefully, no stall).

    python -m bench.host_share [--quick] [--json PATH]

**Runs.** One after the other, each the demo's processes (volunteer_rl.demo.start_processes:
a trainer and two volunteers, one thread each, the demo's flags) on a fresh folder bucket for
`--max-seconds` 300 (90 with --quick) of RL, started from the calculator's warm-started tiny
model (bench.lora_accuracy.start_for, cached), so no run pays for a warm start: both
volunteers at full share (baseline), then `demo-2` with `--cpu-share` 0.5 and with 0.05
(SHARES; vrl).

**Rows, per share.**
- The trainer's intake: groups trained in the run (fleet.json). Goal: at least 0.75 of the
  baseline's (the fleet kept at least 1.5 volunteers' worth of 2) and no stall: the longest
  wait between two steps under 30 s.
- Held-out accuracy of the last version (score as bench.lora_accuracy: 500 prompts, 100 with
  --quick, 4 samples at T 1). Goal: within 2 s.e. of the baseline's.
The note says how many of each volunteer's groups were trained, and the cores (process CPU
time per second of the run) the capped volunteer took.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Row, cli
from bench.lora_accuracy import PROMPTS, score, start_for

COMMAND = "python -m bench.host_share"
SECONDS = {False: 300.0, True: 90.0}
SHARES = (0.5, 0.05)
"""The issue's 0.5 (on this 2-core machine a whole core, more than a demo volunteer takes: the
trainer is the slower side) and 0.05 (0.1 cores, well under what it takes: the cap binds)."""
TASK = "calculator"


def log(msg: str) -> None:
    print(msg, flush=True)


def run(model: Path, share: float | None, seconds: float, work: Path) -> dict:
    """The demo's fleet for `seconds` of RL; what it trained, and its bucket."""
    import psutil

    from volunteer_rl.demo import DemoSettings, start_processes
    from volunteer_rl.launch import stop
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.metrics import read_metrics
    from volunteer_rl.storage import open_storage

    bucket = work / "bucket"
    bucket.mkdir(parents=True)
    s = DemoSettings(rl_seconds=seconds, extra_trainer_args=("--model", str(model)))
    trainer, vols = start_processes(s, bucket, volunteer_args=[(), ("--cpu-share", f"{share:g}")]
                                    if share is not None else None)
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
    for share in (None, *SHARES):
        with tempfile.TemporaryDirectory(prefix="vrl-host-share-") as tmp:
            t0 = time.time()
            r = run(model, share, seconds, Path(tmp))
            r["version"], r["eval"] = score(TASK, r.pop("bucket"), Path(tmp) / "work", prompts)
            got[share] = r
            log(f"{'full' if share is None else f'--cpu-share {share:g}'}: "
                f"{sum(r['trained'].values())} groups trained {r['trained']}, {r['steps']} steps, "
                f"longest gap {r['longest_gap']:.1f}s, demo-2 used {r['cores']:.2f} cores, "
                f"v{r['version']} sampled {r['eval']['eval/accuracy_sampled']:.3f} "
                f"({time.time() - t0:.0f}s)")
    from volunteer_rl.volunteer.host import usable_cores

    machine = usable_cores()
    full = got[None]
    n_full = sum(full["trained"].values())
    p_full = full["eval"]["eval/accuracy_sampled"]
    rows = []
    for share in SHARES:
        r = got[share]
        n = sum(r["trained"].values())
        p = r["eval"]["eval/accuracy_sampled"]
        se = math.sqrt(max(p * (1 - p) / prompts + p_full * (1 - p_full) / prompts, 1e-12))
        note = (f"demo-2 capped at {share * machine:g} cores ({share:g} of {machine}), took "
                f"{r['cores']:.2f} (at full share {full['cores']:.2f}); groups trained by "
                f"volunteer {r['trained']} (full share {full['trained']}); steps {r['steps']} vs "
                f"{full['steps']}; longest wait between steps {r['longest_gap']:.1f}s vs "
                f"{full['longest_gap']:.1f}s; {seconds:.0f}s of RL from the same v0, demo flags, "
                "1 thread each")
        ratio = n / n_full if n_full else math.inf
        rows.append(Row(
            f"fleet intake, one of two volunteers at --cpu-share {share:g}",
            "groups trained in the run: capped (vrl) vs both at full share (baseline)", n, n_full,
            ratio, ">= 0.75, no wait between steps over 30 s",
            ratio >= 0.75 and r["longest_gap"] < 30, command, note))
        rows.append(Row(
            f"held-out accuracy after {seconds:.0f}s, one of two volunteers at --cpu-share {share:g}",
            "sampled accuracy (T 1): capped (vrl) vs full share (baseline)", p, p_full,
            p / p_full if p_full else math.inf, "within 2 s.e.", abs(p - p_full) <= 2 * se,
            command, f"gap {(p - p_full) / se:+.2f} s.e.; v{r['version']} vs v{full['version']}; "
                     f"{prompts} prompts x 4 samples"))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
