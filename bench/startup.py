"""Two trainers starting side by side on one machine: `--threads 1` against torch's default.

    python -m bench.startup [--quick] [--json PATH]

Each run starts real `vrl trainer --model tiny` processes (vrl_command, as the demo does),
each on its own empty folder bucket, and times each from exec to its log line `published v0`:
the imports, the tokenizer and the model build, `--warm-start-steps` supervised steps and the
publish of v0. Three runs, one after the other:

- `alone`: one trainer with `--threads 1`;
- `pair --threads 1`: two at once, each with `--threads 1` (since issue 27 the setting holds
  from the process's start, so each keeps to one core);
- `pair unset`: two at once without `--threads`, torch's default of one thread per core in
  each: what `--threads 1` gave before issue 27, when it only reached the RL loop.

Rows: the pair's start-up with `--threads 1` against the pair unset (times: unset / threads 1,
> 1 means `--threads` wins), and the pair with `--threads 1` against one alone (alone / pair:
1 means the two did not slow each other). OMP_NUM_THREADS is removed from the children's
environment, so torch's default is its own. `--quick`: fewer warm-start steps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Row, cli
from volunteer_rl.launch import vrl_command, vrl_env

COMMAND = "python -m bench.startup"
WARM_START_STEPS = 60
QUICK_WARM_START_STEPS = 10
READY = "published v0 of "
TIMEOUT = 1800.0  # seconds one run may take before it is reported as failed


def start_trainer(root: Path, threads: int | None, steps: int) -> tuple[subprocess.Popen, dict]:
    """A `vrl trainer` on its own bucket; `seen['ready']` gets the time it logs READY."""
    args = ["trainer", "--bucket", str(root / "bucket"), "--work-dir", str(root / "work"),
            "--model", "tiny", "--warm-start-steps", str(steps)]
    args += ["--threads", str(threads)] if threads else []
    env = vrl_env()
    env.pop("OMP_NUM_THREADS", None)
    p = subprocess.Popen(vrl_command(*args), cwd=root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen: dict = {"lines": []}

    def read() -> None:
        for line in p.stdout:
            seen["lines"].append(line.rstrip())
            if READY in line and "ready" not in seen:
                seen["ready"] = time.monotonic()
    threading.Thread(target=read, daemon=True).start()
    return p, seen


def startup_seconds(count: int, threads: int | None, steps: int) -> list[float]:
    """Seconds from exec to READY of each of `count` trainers started at once."""
    with tempfile.TemporaryDirectory(prefix="vrl-bench-startup-") as tmp:
        roots = [Path(tmp) / f"t{i}" for i in range(count)]
        for r in roots:
            r.mkdir()
        began = time.monotonic()
        procs = [start_trainer(r, threads, steps) for r in roots]
        try:
            while not all("ready" in seen or p.poll() is not None for p, seen in procs):
                if time.monotonic() - began > TIMEOUT:
                    break
                time.sleep(0.2)
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p, _ in procs:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        missing = [seen["lines"][-5:] for _, seen in procs if "ready" not in seen]
        if missing:
            raise RuntimeError(f"a trainer never logged {READY!r}: {missing}")
        return [seen["ready"] - began for _, seen in procs]


def results(quick: bool) -> list[Row]:
    steps = QUICK_WARM_START_STEPS if quick else WARM_START_STEPS
    alone = startup_seconds(1, 1, steps)[0]
    pair_one = startup_seconds(2, 1, steps)
    pair_unset = startup_seconds(2, None, steps)
    one, unset = max(pair_one), max(pair_unset)  # the pair is ready when both are
    print(f"RESULT steps={steps} alone={alone:.1f} pair_threads1={pair_one[0]:.1f},"
          f"{pair_one[1]:.1f} pair_unset={pair_unset[0]:.1f},{pair_unset[1]:.1f} "
          f"cores={os.cpu_count()}", flush=True)
    sizes = f"tiny model, {steps} warm-start steps, {os.cpu_count()} cores"
    return [
        Row("trainer start-up, 2 side by side", "seconds to v0 (both)", one, unset, unset / one,
            ">= 1x", unset / one >= 1.0, COMMAND,
            f"--threads 1 vs unset (torch's default, and --threads before issue 27); {sizes}"),
        Row("trainer start-up, 2 side by side vs alone", "seconds to v0", one, alone, alone / one,
            "-", None, COMMAND, f"both --threads 1; 1.0 = no slow-down from sharing; {sizes}"),
    ]


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
