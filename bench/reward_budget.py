"""The trainer's steps/s with one volunteer sending shards of worst-case rewards, against the
same run without it, as one process and as 2 torchrun ranks (issue 41, row (d); goal >= 0.9
of alone, no rank lost).

    python -m bench.reward_budget [--quick] [--json PATH]

Set-up (not measured): the task is tests/plugins/vrl-task-trap, pip-installed into a scratch
folder put on every process's PYTHONPATH: the calculator, whose reward of a completion
holding "burn" takes 80 % of its CPU bound (0.4 s of 0.5 s), the costliest reward that stays
within the per-completion bound. v0 is the tiny model `vrl trainer --model tiny` makes
(bench.trl_time_to_accuracy's shared start; 100 warm-start steps with --quick).

Each run is `vrl demo`'s processes (volunteer_rl.demo.start_processes: 1 trainer + 2 honest
volunteers, 1 torch thread each, a folder bucket) for S seconds of RL (150; 60 with --quick),
the trainer as one process or as 2 gloo ranks. With the hostile volunteer, a thread of this
bench writes, every HOSTILE_EVERY seconds, one shard of HOSTILE_GROUPS groups under the
current version as the volunteer `burner`: K = 8 "burn" completions per group, every one
distinct (no cache hit), each group numbered and for the prompt its number draws, claiming
its true reward (0): each shard would cost the trainer 512 x 0.4 s = 205 s of rewards
unbounded. The trainer's defaults hold: --shard-reward-seconds 2 (4 x 0.5 s; over it,
`reward_budget`), --poll-reward-seconds a quarter of --rank-timeout, and the denylist (5
rejected shards, half of them): the burner costs the trainer about 5 shard budgets and then
is denied. So the ratio says what that costs over S seconds; the note gives the burner's
shards written and rejected.

Row: optimizer steps/s of RL with the burner over steps/s alone, per trainer shape, read
from the metrics each run wrote; a run that loses a rank (RankLostError) fails the bench.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Row, cli
from bench.rank_steps import steps_of

ROOT = Path(__file__).resolve().parents[1]
TRAP_PACKAGE = ROOT / "tests" / "plugins" / "vrl-task-trap"
SECONDS, QUICK_SECONDS = 150.0, 60.0
WARM_START, QUICK_WARM_START = 900, 100
HOSTILE_EVERY = 1.0
"""Seconds between two of the burner's shards."""
HOSTILE_GROUPS = 64
"""Groups per burner shard (x K = 8 completions of 0.4 s of CPU each)."""
GOAL = 0.9


def log(msg: str) -> None:
    print(msg, flush=True)


def install_trap(dest: Path) -> Path:
    """The trap task pip-installed into `dest`/target (offline, no dependencies, built from a
    copy so that tests/plugins stays clean): a PYTHONPATH entry."""
    src, target = dest / "src", dest / "target"
    shutil.copytree(TRAP_PACKAGE, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--target", str(target),
                    str(src)], check=True, capture_output=True)
    return target


class Burner:
    """The hostile volunteer: a thread writing worst-case shards into a folder bucket."""

    def __init__(self, bucket: Path, model: Path):
        from transformers import AutoTokenizer

        from volunteer_rl.storage import open_storage

        self.storage = open_storage(str(bucket))
        self.bucket = bucket
        self.tok = AutoTokenizer.from_pretrained(model)
        self.stop = threading.Event()
        self.keys: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="burner")

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def _shard(self, manifest: dict, seq: int) -> bytes:
        from volunteer_rl.protocol.draws import pool_prompt
        from volunteer_rl.protocol.shards import Completion, Group, encode_shard

        v, k = manifest["version"], manifest["sampling"]["k"]
        groups = []
        for n in range(seq, seq + HOSTILE_GROUPS):
            ids = [self._ids(f"{n} burn {j}") for j in range(k)]
            groups.append(Group(pool_prompt(manifest["prompt_pool"], manifest["run_id"], v, "burner", n),
                                v, "burner", n, [Completion(c, [-1.0] * len(c), "", 0.0) for c in ids]))
        return encode_shard(groups)

    def _run(self) -> None:
        from volunteer_rl.protocol import layout

        seq = 0
        while not self.stop.wait(HOSTILE_EVERY):
            try:
                manifest = json.loads((self.bucket / layout.MANIFEST).read_text())
            except (OSError, ValueError):
                continue  # not published yet, or mid-write
            key = layout.shard_key(manifest["version"], "burner", f"b{len(self.keys):06d}")
            self.storage.write(key, self._shard(manifest, seq))
            self.keys.append(key)
            seq += HOSTILE_GROUPS

    def rejected(self) -> dict[str, int]:
        """Reason -> the burner's shards rejected (quarantine records)."""
        out: dict[str, int] = {}
        for path in (self.bucket / "quarantine").rglob("*"):
            if path.is_file() and "/burner/" in str(path):
                reason = json.loads(path.read_text())["reason"]
                out[reason] = out.get(reason, 0) + 1
        return out


def run(model: Path, seconds: float, root: Path, ranks: int, hostile: bool) -> tuple[int, str]:
    """One demo run of the trap task; (optimizer steps, a note on the burner)."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.demo import DemoSettings, start_processes
    from volunteer_rl.launch import stop

    bucket = root / "bucket"
    bucket.mkdir(parents=True)
    tiny_eval = root / "eval-4.csv"
    tiny_eval.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(keepends=True)[:5]))
    settings = DemoSettings(bucket=str(bucket), rl_seconds=seconds, task="trap", extra_trainer_args=(
        "--model", str(model), "--eval-every", "0", "--eval-dataset", str(tiny_eval)))
    burner = Burner(bucket, model) if hostile else None
    trainer, volunteers = start_processes(settings, bucket, trainer_ranks=ranks)
    if burner:
        burner.thread.start()
    try:
        out, _ = trainer.communicate(timeout=seconds + 900)
    finally:
        if burner:
            burner.stop.set()
            burner.thread.join()
        stop([*volunteers, trainer])
    if trainer.returncode != 0 or "lost the other ranks" in out:
        raise SystemExit("vrl trainer failed:\n" + "\n".join(out.splitlines()[-40:]))
    steps, version = steps_of(bucket)
    note = "" if burner is None else (
        f"burner: {len(burner.keys)} shards written, rejected {burner.rejected() or 'none'}"
        + (", denied" if "denied volunteer burner" in out else ""))
    return steps, note


def results(quick: bool) -> list[Row]:
    import os

    from bench.trl_time_to_accuracy import shared_start

    seconds = QUICK_SECONDS if quick else SECONDS
    command = "python -m bench.reward_budget" + (" --quick" if quick else "")
    model = shared_start(QUICK_WARM_START if quick else WARM_START)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vrl-reward-budget-") as tmp:
        plugin = install_trap(Path(tmp) / "plugin")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)  # every process's
        sys.path.insert(0, str(plugin))  # and this one's: DemoSettings checks the task here
        for ranks in (0, 2):
            shape = f"{ranks} ranks" if ranks else "one process"
            log(f"{shape}: the trap task, `vrl demo`'s processes, {seconds:.0f}s of RL, alone")
            alone, _ = run(model, seconds, Path(tmp) / f"alone-{ranks}", ranks, False)
            log(f"  {alone} steps; again with the burner")
            attacked, note = run(model, seconds, Path(tmp) / f"burner-{ranks}", ranks, True)
            log(f"  {attacked} steps; {note}")
            ratio = attacked / alone if alone else float("nan")
            rows.append(Row(
                benchmark=f"trainer ({shape}) beside a volunteer sending worst-case rewards",
                measure="optimizer steps/s of RL", vrl=attacked / seconds, baseline=alone / seconds,
                ratio=ratio, goal=f">= {GOAL}x", met=ratio >= GOAL, command=command,
                note=(f"trap task (reward 0.4 s of CPU per 'burn' completion), 1 trainer + 2 "
                      f"honest volunteers, {seconds:.0f}s of RL each; with: {attacked} steps, "
                      f"alone: {alone}; {note}; no rank lost")))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
