"""What the replay audit costs the trainer: its step rate with audits at the default rate
against audits off (`--audit-tolerance 0`), in the demo's setting.

    python -m bench.audit_cost [--quick] [--json PATH]

Each round is a small live run, the demo's processes on a folder bucket (volunteer_rl.demo:
one trainer and two volunteers, one torch thread each, 48 groups per volunteer and version):
each starts from the same v0 (the demo's warm start, built once and cached by
bench.trl_time_to_accuracy.shared_start) and trains for a fixed time. The step rate is the number of
optimizer steps over the time from the first step to the last, read back from the bucket's
metrics. Rounds alternate audits off and on, so a drift of the machine's speed (about 7 %
between runs of the same code here) hits both sides. The audited round also reports the share
of the trainer's time spent replaying and how many shards were audited, skipped and
deferred.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.common import Row, cli

GOAL = 0.9


def live_round(audit: bool, rl_seconds: float, model: Path) -> dict[str, float]:
    """Run the demo's processes once; the step rate and audit figures from the metrics."""
    from bench.trl_time_to_accuracy import _pump
    from volunteer_rl.demo import DemoSettings, start_processes
    from volunteer_rl.launch import stop

    with tempfile.TemporaryDirectory() as tmp:
        bucket = Path(tmp) / "bucket"
        bucket.mkdir()
        extra = () if audit else ("--audit-tolerance", "0")
        s = DemoSettings(bucket=str(bucket), rl_seconds=rl_seconds,
                         extra_trainer_args=("--model", str(model), "--eval-every", "0", *extra))
        trainer, volunteers = start_processes(s, bucket)
        # every pipe is drained: a volunteer whose output nobody reads blocks once it fills
        tail: list[str] = []
        pumps = [_pump(p, "vrl", tail, lambda line: False) for p in (trainer, *volunteers)]
        try:
            code = trainer.wait(timeout=rl_seconds + 600)
        finally:
            stop([*volunteers, trainer])
            for t in pumps:
                t.join(timeout=5)
        if code != 0:
            raise RuntimeError(f"trainer exited with {code}:\n" + "\n".join(tail))
        steps = [m for f in sorted((bucket / "metrics").glob("*.jsonl"))
                 for m in map(json.loads, f.read_text().splitlines()) if m.get("kind") == "step"]
    if len(steps) < 2:
        raise RuntimeError(f"the trainer took {len(steps)} optimizer steps in {rl_seconds:.0f} s of RL")
    span = steps[-1]["time"] - steps[0]["time"]
    total = lambda name: sum(m.get(name, 0) for m in steps)  # noqa: E731
    return {"steps": len(steps), "rate": (len(steps) - 1) / span, "span": span,
            "audit_share": total("audit/seconds") / span, "audited": total("audit/shards"),
            "skipped": total("audit/skipped"), "deferred": total("audit/deferred")}


def results(quick: bool) -> list[Row]:
    from bench.trl_time_to_accuracy import shared_start

    rl, rounds = (25.0, 1) if quick else (90.0, 2)
    model = shared_start()  # the demo's v0 (900 warm-start steps), built once and cached
    off, on = [], []
    for _ in range(rounds):
        off.append(live_round(False, rl, model))
        on.append(live_round(True, rl, model))
        print(f"round: off {off[-1]}\n       on  {on[-1]}", flush=True)
    rate_off = sum(r["rate"] for r in off) / rounds
    rate_on = sum(r["rate"] for r in on) / rounds
    a = {k: sum(r[k] for r in on) for k in ("audited", "skipped", "deferred")}
    share = sum(r["audit_share"] for r in on) / rounds
    ratio = rate_on / rate_off
    return [Row("trainer step rate, replay audits on", "steps/s", rate_on, rate_off, ratio,
                f">= {GOAL}", ratio >= GOAL, "python -m bench.audit_cost" + (" --quick" if quick else ""),
                f"baseline: --audit-tolerance 0; demo setting, {rounds} x {rl:.0f} s of RL per side; "
                f"{share:.1%} of the trainer's time replaying; shards audited {a['audited']:.0f}, "
                f"taken unaudited {a['skipped']:.0f} (the volunteer's rate), deferred "
                f"{a['deferred']:.0f} times (budget spent)")]


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
