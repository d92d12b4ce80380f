"""The trainer's steps/s with one volunteer sending shards of worst-case rewards, against the
same trainer run alone, as one process and as 2 torchrun ranks (issue 41, row (d); goal >= 0.9
of alone, no rank lost).

    python -m bench.reward_budget [--quick] [--phase S] [--no-denial] [--json PATH]

Set-up (not measured): the task is tests/plugins/vrl-task-trap, pip-installed into a scratch
folder put on every process's PYTHONPATH: the calculator, whose reward of a completion
holding "burn" takes 80 % of its CPU bound (0.4 s of 0.5 s), the costliest reward that stays
within the per-completion bound. v0 is the demo's (bench.trl_time_to_accuracy's shared start,
900 warm-start steps, built once and cached): a v0 that earns no reward makes no step to
count, so --quick uses it too.

Each trainer shape is one run of `vrl demo`'s processes (volunteer_rl.demo.start_processes:
1 trainer + 2 honest volunteers, 1 torch thread each, a folder bucket) in three phases of S
seconds (PHASE; QUICK_PHASE with --quick: on a loaded machine the burner's five shard budgets
take longer than 15 s of wall clock), timed from the trainer's first optimizer step:
alone, with the burner, alone again. During the middle phase a thread of this bench writes,
every HOSTILE_EVERY seconds, one shard of HOSTILE_GROUPS groups under the current version as
the volunteer `burner`: K = 8 "burn" completions per group, every one distinct (no cache
hit), each group numbered and for the prompt its number draws, claiming its true reward (0),
so each shard would cost the trainer 512 x 0.4 s = 205 s of rewards unbounded. The trainer's
defaults hold: --shard-reward-seconds 2 (4 x 0.5 s; over it, `reward_budget`),
--poll-reward-seconds a quarter of --rank-timeout, each volunteer an equal share of a poll,
--reward-share 0.03 of the trainer's time per volunteer, and the denylist (5 rejected shards,
half of them). So the burner costs the trainer about one shard budget (the shard that
overdraws its share) and then 3 % of its time, its other shards waiting unread; the row says
what that costs the steps of one phase. The trainer's loop waits for the poll's rewards, so
the ratio is about 1 - (the burner phase's reward seconds) / S. At the end of its phase the
bench denies the burner itself, as an operator would (`vrl volunteers deny`: an entry in
denylist.json by compare-and-swap), unless the trainer did already: the last phase is the
trainer alone again, not one still reading the burner's backlog at its share.

Row, per trainer shape: optimizer steps/s in the burner's phase over the mean of the two
phases alone (alone-burner-alone in one run cancels a steady drift of the step rate as the
policy learns), read from the step lines' times in the metrics the run wrote. The goal is met
only if that ratio is >= GOAL, the trainer exited 0 with no rank lost (RankLostError), the
trap really ran (the burner's phase charged at least half a shard budget of reward time more
than the first phase, ingest/reward_seconds: its rewards were computed until its share or a
budget stopped them), and the burner's whole cost fell in its phase (it was denied, by the
trainer or the bench, before the last phase began, by its denylist entry's time, give or take
DENY_MARGIN; a cost spilling into the last phase would lower the rate alone and flatter the
ratio). The note gives the burner's shards written, rejected by reason (quarantine/ records,
the trainer's own), the shards deferred, the most volunteers waiting for their share, who
denied the burner and when, and the reward seconds of each phase.

--no-denial runs the trainers with --deny-after 0, so the burner is never denied: what its
shards cost while only the reward budgets bound them, the cost a volunteer that keeps its
rejected share under --deny-rate (cheap honest shards between its burning ones) could impose.
Those rows have no goal, and compare the burner's phase with the first phase only: the
burner's unread shards are still read in the last.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Row, emit_rows

ROOT = Path(__file__).resolve().parents[1]
TRAP_PACKAGE = ROOT / "tests" / "plugins" / "vrl-task-trap"
PHASE, QUICK_PHASE = 50.0, 30.0
"""Seconds of each of a run's three phases (alone, burner, alone)."""
FIRST_STEP_WAIT = 40.0
"""Seconds of RL the trainer is given to make its first step (volunteers start, fetch v0 and
sample 32 usable groups); its --max-seconds is this plus the three phases. A first step
later than that leaves the last phase short, and the run fails."""
HOSTILE_EVERY = 1.0
"""Seconds between two of the burner's shards."""
HOSTILE_GROUPS = 64
"""Groups per burner shard (x K = 8 completions of 0.4 s of CPU each)."""
SHARD_REWARD_SECONDS = 4 * 0.5
"""The trainer's default --shard-reward-seconds for the trap task (SHARD_REWARD_BOUNDS x its
reward_seconds): the least reward time the burner's phase must have charged."""
GOAL = 0.9
DENY_MARGIN = 2.0
"""Seconds past the burner's phase its denial may be dated: the bench's own is written just
after the burner thread's last shard."""


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
    """The hostile volunteer: a thread writing worst-case shards into a folder bucket from
    start() until finish()."""

    def __init__(self, bucket: Path, model: Path):
        from transformers import AutoTokenizer

        from volunteer_rl.storage import open_storage

        self.storage = open_storage(str(bucket))
        self.bucket = bucket
        self.tok = AutoTokenizer.from_pretrained(model)
        self._stop = threading.Event()
        self.keys: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="burner")

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def _shard(self, manifest: dict, numbers: list[tuple[int, str]]) -> bytes:
        """Worst-case groups for `numbers` ((number, nonce) granted for the manifest's version),
        each for the prompt its number draws, so that the trainer computes their rewards."""
        from volunteer_rl.protocol.draws import pool_prompt
        from volunteer_rl.protocol.shards import Completion, Group, encode_shard

        v, k, run = manifest["version"], manifest["sampling"]["k"], manifest["run_id"]
        groups = []
        for n, nonce in numbers:
            ids = [self._ids(f"{n} burn {j}") for j in range(k)]
            groups.append(Group(pool_prompt(manifest["prompt_pool"], run, v, "burner", n, nonce),
                                v, "burner", n, [Completion(c, [-1.0] * len(c), "", 0.0) for c in ids]))
        return encode_shard(groups)

    def _numbers(self, book, manifest: dict) -> tuple[int, list[tuple[int, str]]] | None:
        """(version, HOSTILE_GROUPS numbers granted for it), asked for as a volunteer asks
        (volunteer.numbering): the trainer grants under its newest version when it answers,
        which may be past `manifest`'s; None if it has not granted them yet."""
        low = manifest["version"] - manifest["max_staleness"]
        book.refresh()  # the grant of the last tick's ask: a tick later it would have left the window
        batch = book.batch(HOSTILE_GROUPS)
        while batch is not None and batch.version < low:  # its version left the window
            book.skip(batch)
            batch = book.batch(HOSTILE_GROUPS)
        if batch is None:
            book.ask(manifest["version"], HOSTILE_GROUPS)
            return None
        book.sampled(batch)
        return batch.version, [(n, batch.nonce(n)) for n in range(batch.first, batch.first + batch.count)]

    def _run(self) -> None:
        from volunteer_rl.protocol import layout
        from volunteer_rl.protocol.signing import Trust
        from volunteer_rl.volunteer.numbering import GroupNumbers

        book = None
        while True:
            try:
                manifest = json.loads((self.bucket / layout.MANIFEST).read_text())
            except (OSError, ValueError):
                manifest = None  # mid-write: the next tick reads it
            if manifest is not None:
                if book is None:
                    book = GroupNumbers(Path(tempfile.mkdtemp()) / "numbers.json", self.storage,
                                        "burner", Trust(allow_unsigned=True), log=lambda m: None)
                    book.start_run(manifest["run_id"])
                granted = self._numbers(book, manifest)
                of_version = None
                if granted is not None:
                    version, numbers = granted
                    try:  # the manifest of the version the numbers were granted under
                        of_version = json.loads(
                            (self.bucket / layout.manifest_history_key(version)).read_text())
                    except (OSError, ValueError):
                        pass  # not readable yet: those numbers go unsent
                if of_version is not None:
                    key = layout.shard_key(version, "burner", f"b{len(self.keys):06d}")
                    self.storage.write(key, self._shard(of_version, numbers))
                    self.keys.append(key)
            if self._stop.wait(HOSTILE_EVERY):
                return

    def rejected(self) -> dict[str, int]:
        """Reason -> the burner's shards rejected (the trainer's quarantine records)."""
        out: dict[str, int] = {}
        for path in (self.bucket / "quarantine").rglob("*"):
            if path.is_file() and path.parent.name == "burner":
                reason = json.loads(path.read_text())["reason"]
                out[reason] = out.get(reason, 0) + 1
        return out

    def denied(self) -> tuple[float, str] | None:
        """When the burner went on the denylist (time.time()) and by whom, or None."""
        from volunteer_rl.protocol.fleet import read_denylist

        entry = read_denylist(self.storage)[0].get("burner")
        return None if entry is None else (float(entry["since"]), str(entry.get("by")))

    def deny(self) -> None:
        """Deny the burner as an operator would (`vrl volunteers deny`), unless it is already."""
        from volunteer_rl.protocol.fleet import update_denylist

        def change(entries: dict) -> bool:
            if "burner" in entries:
                return False
            entries["burner"] = {"since": time.time(), "by": "operator",
                                 "reason": "the bench: the end of the burner's phase"}
            return True

        update_denylist(self.storage, change)


@dataclass
class Phases:
    """What one run's metrics say of each phase: [alone, burner, alone]."""

    starts: list[float]
    """time.time() at the start of each phase; the last ends at starts[2] + the phase."""
    steps: list[int] = field(default_factory=lambda: [0, 0, 0])
    reward_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    deferred: list[int] = field(default_factory=lambda: [0, 0, 0])
    waiting: list[int] = field(default_factory=lambda: [0, 0, 0])
    """The most volunteers waiting for their reward share at one step's polls."""


def phases_of(bucket: Path, starts: list[float], phase: float) -> Phases:
    """Step lines of the run's metrics sorted into the three phases by their times."""
    out = Phases(starts)
    for path in (bucket / "metrics").glob("v*.jsonl"):
        for line in path.read_text().splitlines():
            m = json.loads(line)
            if m.get("kind") != "step":
                continue
            for i, start in enumerate(starts):
                if start <= m["time"] < start + phase:
                    out.steps[i] += 1
                    out.reward_seconds[i] += m.get("ingest/reward_seconds", 0.0)
                    out.deferred[i] += m.get("ingest/reward_deferred", 0)
                    out.waiting[i] = max(out.waiting[i], m.get("ingest/reward_waiting", 0))
    return out


STEP_LINE = re.compile(r"(\[rank \d+\] )?step \d+ ")
"""The trainer's log line of an optimizer step (under torchrun, with its rank's prefix)."""


class Watch:
    """The trainer's output, read as it comes: the time of its first step, and the tail."""

    def __init__(self, proc: subprocess.Popen):
        self.first_step: float | None = None
        self.settled = threading.Event()
        """Set at the first step, or when the trainer's output ends without one."""
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._run, args=(proc,), daemon=True)
        self.thread.start()

    def _run(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines = (self.lines + [line.rstrip()])[-400:]
            if self.first_step is None and STEP_LINE.match(line):
                self.first_step = time.time()
                self.settled.set()
        self.settled.set()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.lines[-n:])


def _drain(proc: subprocess.Popen) -> None:
    """Read a volunteer's output away, so that a full pipe never blocks it."""
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


@dataclass
class Result:
    phases: Phases
    lost: str
    """Why the trainer failed (a rank lost, a non-zero exit), or ""."""
    written: int
    rejected: dict[str, int]
    denied: tuple[float, str] | None
    """When the burner was denied and by whom (trainer, or operator: the bench), or None."""


def run(model: Path, phase: float, root: Path, ranks: int, denial: bool = True) -> Result:
    """One run of the trap task: alone, with the burner, alone (see the module doc); without
    `denial`, nobody denies the burner."""
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.demo import DemoSettings, start_processes
    from volunteer_rl.launch import stop

    bucket = root / "bucket"
    bucket.mkdir(parents=True)
    tiny_eval = root / "eval-4.csv"  # the trainer's own v0/final evaluations ~free
    tiny_eval.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(keepends=True)[:5]))
    settings = DemoSettings(bucket=str(bucket), rl_seconds=FIRST_STEP_WAIT + 3 * phase, task="trap",
                            extra_trainer_args=("--model", str(model), "--eval-every", "0",
                                                "--eval-dataset", str(tiny_eval),
                                                *(() if denial else ("--deny-after", "0"))))
    burner = Burner(bucket, model)
    launched = time.time()
    trainer, volunteers = start_processes(settings, bucket, trainer_ranks=ranks)
    watch = Watch(trainer)
    for v in volunteers:
        _drain(v)
    starts: list[float] = []
    try:
        watch.settled.wait(FIRST_STEP_WAIT + 600)  # + start-up: imports, load v0, publish
        if watch.first_step is not None:
            starts = [watch.first_step + i * phase for i in range(3)]
            time.sleep(max(0.0, starts[1] - time.time()))
            if trainer.poll() is None:
                log(f"  first step at {watch.first_step - launched:.0f}s from launch; "
                    f"burner on {phase:.0f}s after it")
                burner.start()
                time.sleep(max(0.0, starts[2] - time.time()))
                burner.finish()
                if denial:
                    burner.deny()
        trainer.wait(timeout=FIRST_STEP_WAIT + 3 * phase + 900)
        ended = time.time()
    finally:
        burner.finish()
        stop([*volunteers, trainer])
        watch.thread.join(timeout=10)
    lost = ""
    if trainer.returncode != 0 or "RankLostError" in watch.tail(400) or "lost the other ranks" in watch.tail(400):
        lost = f"vrl trainer exited with {trainer.returncode}:\n{watch.tail()}"
    elif not starts:
        raise SystemExit(f"vrl trainer made no step in {FIRST_STEP_WAIT:.0f}s of RL:\n{watch.tail()}")
    elif ended < starts[2] + phase:
        raise SystemExit(f"vrl trainer's first step came {FIRST_STEP_WAIT:.0f}s or more into RL, "
                         f"so the last phase was cut short: raise FIRST_STEP_WAIT")
    return Result(phases_of(bucket, starts, phase) if starts else Phases([]), lost,
                  len(burner.keys), burner.rejected(), burner.denied())


def row(shape: str, r: Result, phase: float, command: str, denial: bool = True) -> Row:
    p = r.phases
    if not p.starts:
        alone = 0.0
    else:  # without denial the burner's backlog is still read in the last phase
        alone = (p.steps[0] + p.steps[2]) / 2 if denial else p.steps[0]
    ratio = p.steps[1] / alone if alone else float("nan")
    trap_ran = bool(p.starts and p.reward_seconds[1] - p.reward_seconds[0] >= SHARD_REWARD_SECONDS / 2)
    contained = bool(p.starts and r.denied is not None and r.denied[0] < p.starts[2] + DENY_MARGIN)
    met = bool(ratio >= GOAL and not r.lost and trap_ran and contained) if denial else None
    denied = ("not denied" if r.denied is None or not p.starts
              else f"denied by the {'bench' if r.denied[1] == 'operator' else r.denied[1]} at "
                   f"{r.denied[0] - p.starts[1]:.1f}s of its phase")
    return Row(
        benchmark=f"trainer ({shape}) beside a volunteer sending worst-case rewards"
                  + ("" if denial else ", never denied (--deny-after 0)"),
        measure="optimizer steps/s of RL", vrl=p.steps[1] / phase if p.starts else 0.0,
        baseline=alone / phase, ratio=ratio,
        goal=f">= {GOAL}x, no rank lost" if denial else "-", met=met,
        command=command,
        note=(f"trap task (0.4 s of CPU per 'burn' completion), 1 trainer + 2 honest volunteers, "
              f"phases of {phase:.0f}s alone/burner/alone: {'/'.join(map(str, p.steps))} steps, "
              f"reward seconds {'/'.join(f'{s:.1f}' for s in p.reward_seconds)}, deferred "
              f"{'/'.join(map(str, p.deferred))}, volunteers waiting for their share at most "
              f"{'/'.join(map(str, p.waiting))}; burner: {r.written} shards written, rejected "
              f"{r.rejected or 'none'}, {denied}; "
              + ("RANK LOST or trainer failed" if r.lost else "no rank lost")
              + ("" if trap_ran else "; THE TRAP NEVER RAN (no reward time of the burner's): no result")
              + ("" if contained or not denial else
                 "; NOT DENIED WITHIN ITS PHASE, its cost not all in it: no result")))


def results(quick: bool, phase: float | None = None, denial: bool = True) -> list[Row]:
    import os

    from bench.trl_time_to_accuracy import shared_start

    phase = phase or (QUICK_PHASE if quick else PHASE)
    command = "python -m bench.reward_budget" + (" --quick" if quick else "") + (
        f" --phase {phase:g}" if phase != (QUICK_PHASE if quick else PHASE) else "") + (
        "" if denial else " --no-denial")
    model = shared_start()
    rows = []
    with tempfile.TemporaryDirectory(prefix="vrl-reward-budget-") as tmp:
        plugin = install_trap(Path(tmp) / "plugin")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)  # every process's
        sys.path.insert(0, str(plugin))  # and this one's: DemoSettings checks the task here
        for ranks in (0, 2):
            shape = f"{ranks} ranks" if ranks else "one process"
            log(f"{shape}: the trap task, `vrl demo`'s processes, {phase:.0f}s alone, "
                f"{phase:.0f}s with the burner, {phase:.0f}s alone")
            r = run(model, phase, Path(tmp) / f"run-{ranks}", ranks, denial)
            if r.lost:
                log(r.lost)
            rows.append(row(shape, r, phase, command, denial))
            log(f"  {rows[-1].note}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases: checks the code, not the figures")
    parser.add_argument("--phase", type=float, help=f"seconds of each of the three phases ({PHASE:g})")
    parser.add_argument("--no-denial", action="store_true",
                        help="trainers with --deny-after 0: the burner is never denied (no goal)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args()
    if args.phase is not None and not args.phase > 0:
        parser.error(f"--phase: must be more than 0, not {args.phase:g}")
    return emit_rows(results(args.quick, args.phase, not args.no_denial), args.json)


if __name__ == "__main__":
    sys.exit(main())
