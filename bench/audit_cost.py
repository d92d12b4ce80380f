"""What replaying costs the trainer: its step rate with every trained group verified
(`--verify every`, the default since issue 41) against audits off (`--audit-tolerance 0`) and
against the sampled audits alone (`--verify sampled`, the rule before), in the demo's setting.

    python -m bench.audit_cost [--quick] [--json PATH]

Each round is a small live run, the demo's processes on a folder bucket (volunteer_rl.demo:
one trainer and two volunteers, one torch thread each, 48 groups per volunteer and version):
each starts from the same v0 (the demo's warm start, built once and cached by
bench.trl_time_to_accuracy.shared_start) and trains for a fixed time. The step rate is the number of
optimizer steps over the time from the first step to the last, read back from the bucket's
metrics. Rounds take the three settings in turn, so a drift of the machine's speed (about 7 %
between runs of the same code here) hits each. The rows also report the share of the
trainer's time spent replaying, at intake (audits) and for steps (verification: in the
loop's waits, before steps or in their forward), and how many shards were audited, skipped
and deferred.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench.common import Row, cli

GOAL = 0.85
"""Issue 41: every trained group verified, at least this share of the step rate without audits."""
SETTINGS = {"off": ("--audit-tolerance", "0"), "sampled": ("--verify", "sampled"),
            "every": ("--verify", "every")}


def live_round(setting: str, rl_seconds: float, model: Path) -> dict[str, float]:
    """Run the demo's processes once; the step rate and audit figures from the metrics."""
    from bench.trl_time_to_accuracy import _pump
    from volunteer_rl.demo import DemoSettings, start_processes
    from volunteer_rl.launch import stop

    with tempfile.TemporaryDirectory() as tmp:
        bucket = Path(tmp) / "bucket"
        bucket.mkdir()
        extra = SETTINGS[setting]
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
            "skipped": total("audit/skipped"), "deferred": total("audit/deferred"),
            "verify_share": total("verify/seconds") / span, "verified": total("verify/groups"),
            "trained": total("rollout/groups")}


def results(quick: bool) -> list[Row]:
    from bench.trl_time_to_accuracy import shared_start

    rl, rounds = (25.0, 1) if quick else (90.0, 2)
    model = shared_start()  # the demo's v0 (900 warm-start steps), built once and cached
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name in SETTINGS:
            runs[name].append(live_round(name, rl, model))
            print(f"round: {name:8} {runs[name][-1]}", flush=True)
    rate = {name: sum(r["rate"] for r in rs) / rounds for name, rs in runs.items()}
    mean = lambda name, k: sum(r[k] for r in runs[name]) / rounds  # noqa: E731
    total = lambda name, k: sum(r[k] for r in runs[name])  # noqa: E731
    command = "python -m bench.audit_cost" + (" --quick" if quick else "")
    every = (f"{rounds} x {rl:.0f} s of RL per setting, demo setting; with every group verified "
             f"{mean('every', 'verify_share'):.1%} of the trainer's time replaying in its waits, "
             f"before steps or in them ({total('every', 'verified'):.0f} groups replayed there for "
             f"{total('every', 'trained'):.0f} trained: one replayed in a wait can be overtaken by "
             f"newer groups and leave the window untrained; the rest replayed by intake audits) "
             f"and {mean('every', 'audit_share'):.1%} at intake")
    sampled = (f"sampled audits: {mean('sampled', 'audit_share'):.1%} of the time replaying, "
               f"shards audited {total('sampled', 'audited'):.0f}, taken unaudited "
               f"{total('sampled', 'skipped'):.0f}, deferred {total('sampled', 'deferred'):.0f} times")
    off_ratio, sampled_ratio = rate["every"] / rate["off"], rate["every"] / rate["sampled"]
    return [Row("trainer step rate, every trained group verified", "steps/s", rate["every"],
                rate["off"], off_ratio, f">= {GOAL}", off_ratio >= GOAL, command,
                f"baseline: --audit-tolerance 0; {every}"),
            Row("trainer step rate, every trained group verified vs sampled audits", "steps/s",
                rate["every"], rate["sampled"], sampled_ratio, "-", None, command,
                f"baseline: --verify sampled; {sampled}")]


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
