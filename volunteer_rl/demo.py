"""`vrl demo`: the whole system on one machine, as it runs on many.

The trainer and each volunteer are separate `vrl` processes that share nothing but a local
folder bucket, exactly as they would share an S3 bucket across the internet. At the end the
demo loads v0 and the last version from the bucket and prints their held-out accuracy.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from volunteer_rl.config import Checked, TrainerConfig, check, setting
from volunteer_rl.errors import VrlError
from volunteer_rl.launch import stop, vrl_command, vrl_env, vrl_ranks_command
from volunteer_rl.volunteer.host import usable_cores


class DemoError(VrlError):
    """A process of the demo failed; its own output, just printed, says why."""


@dataclass
class DemoSettings(Checked):
    bucket: str | None = None
    """Local folder for the bucket (default: a new folder under runs/)."""
    volunteers: int = setting(2, at_least=1)
    """Volunteer processes to start."""
    rl_seconds: float = setting(300.0, above=0)
    """Seconds of RL after v0 is published."""
    task: str = TrainerConfig.task
    """The trainer's --task."""
    warm_start_steps: int = TrainerConfig.warm_start_steps
    """The trainer's --warm-start-steps: supervised steps that make v0."""
    algo: str = TrainerConfig.algo
    """The trainer's --algo."""
    lr: float | None = TrainerConfig.lr
    """The trainer's --lr (default: the trainer's, which depends on --lora-rank)."""
    lora_rank: int = TrainerConfig.lora_rank
    """The trainer's --lora-rank: 0 trains every weight, R >= 1 rank-R LoRA adapters."""
    threads: int = setting(1, at_least=0)
    """torch threads per process during RL: 1 each leaves the cores to the processes."""
    warm_start_threads: int = setting(0, at_least=0)
    """torch threads of the trainer's warm start (0: one per core of this machine). Before v0
    the volunteers only poll for it, so the warm start takes the cores they leave idle: on 2
    idle cores 8.2 steps/s against 4.7-5.5 on one thread (docs/LIMITS.md, Threads)."""
    groups_per_step: int = TrainerConfig.groups_per_step
    """The trainer's --groups-per-step (16 made twice the steps, each noisier: same end point,
    slower start)."""
    groups_per_version: int = setting(0, at_least=0)
    """Each volunteer's own cap of groups per version (0: none; the trainer's manifest says
    how many it wants of each version, its `quota`)."""
    extra_trainer_args: tuple[str, ...] = ()
    """More `vrl trainer` flags (tests use this to shrink the run)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # its own rules
        for name in ("warm_start_steps", "algo", "lr", "lora_rank", "groups_per_step"):
            check(TrainerConfig, name, getattr(self, name))  # as the trainer would refuse it
        from volunteer_rl.task.registry import info

        info(self.task)  # a task not installed here: one line now, not after the processes start


def _pump(proc: subprocess.Popen, tag: str) -> threading.Thread:
    def run():
        for line in proc.stdout:
            print(f"[{tag}] {line.rstrip()}", flush=True)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def start_processes(s: DemoSettings, bucket: Path, trainer_ranks: int = 0,
                    volunteer_args: list[tuple[str, ...]] | None = None,
                    ) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
    """The demo's trainer and volunteers, started; with `trainer_ranks`, the trainer as that
    many torchrun ranks (bench.rank_steps); `volunteer_args`: more flags for each volunteer
    (bench.host_share)."""
    env = vrl_env({"OMP_NUM_THREADS": str(s.threads or 1)} if trainer_ranks else None)
    work = bucket.parent / "work"
    command = partial(vrl_ranks_command, trainer_ranks) if trainer_ranks else vrl_command
    trainer = subprocess.Popen(
        command("trainer", "--bucket", str(bucket), "--task", s.task, "--algo", s.algo,
                    *(("--lr", str(s.lr)) if s.lr is not None else ()),
                    "--lora-rank", str(s.lora_rank),
                    "--max-seconds", str(s.rl_seconds), "--warm-start-steps", str(s.warm_start_steps),
                    "--threads", str(s.threads), "--work-dir", str(work / "trainer"),
                    "--warm-start-threads", str(s.warm_start_threads or usable_cores()),
                    "--groups-per-step", str(s.groups_per_step), "--eval-every", "100",
                    "--poll-seconds", "0.05",  # listing a local folder costs next to nothing
                    *s.extra_trainer_args),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    vols = [subprocess.Popen(
        vrl_command("volunteer", "--bucket", str(bucket), "--id", f"demo-{i + 1}",
                    "--threads", str(s.threads), "--shard-seconds", "5",
                    # one shard per generate round: on one machine, latency beats fewer objects
                    "--prompts-per-batch", "16", "--shard-groups", "16",
                    "--max-groups-per-version", str(s.groups_per_version), "--poll-seconds", "0.1",
                    "--work-dir", str(work / "volunteers"),
                    *(volunteer_args[i] if volunteer_args else ())),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for i in range(s.volunteers)]
    return trainer, vols


def report(bucket: Path, work: Path) -> dict[int, dict[str, float]]:
    """Held-out accuracy of v0 and of the last version, read back from the bucket, on the
    held-out rows of the task the manifest names."""
    from volunteer_rl.protocol.manifest import read_manifest
    from volunteer_rl.protocol.signing import Trust, resolve_trust_key
    from volunteer_rl.storage import open_storage
    from volunteer_rl.trainer.evaluate import greedy_and_sampled, held_out, load_version

    storage = open_storage(str(bucket))
    trust = Trust(resolve_trust_key(str(work / "trainer" / "signing-key.pem.pub")))
    last = read_manifest(storage, trust=trust)
    task, problems = held_out(last, None)
    results = {}
    for version in sorted({0, last.version}):
        m, policy = load_version(storage, version, work / "eval", trust=trust)
        results[version] = greedy_and_sampled(policy, task, problems, m.sampling.temperature, 4,
                                              m.sampling.max_new_tokens)
    print(f"\nheld-out accuracy on {len(problems)} {task.name} prompts (sampled: T={last.sampling.temperature}, 4 samples each)")
    print(f"{'version':>8} {'greedy':>8} {'sampled':>8}")
    for version, r in results.items():
        print(f"{'v' + str(version):>8} {r['eval/accuracy_greedy']:>8.1%} {r['eval/accuracy_sampled']:>8.1%}")
    return results


def run_demo(s: DemoSettings) -> dict[int, dict[str, float]]:
    started = time.time()
    root = Path(s.bucket).parent if s.bucket else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    bucket = Path(s.bucket) if s.bucket else root / "bucket"
    bucket.mkdir(parents=True, exist_ok=True)
    print(f"demo: bucket {bucket}, 1 trainer + {s.volunteers} volunteers, {s.rl_seconds:.0f}s of RL", flush=True)
    trainer, vols = start_processes(s, bucket)
    pumps = [_pump(trainer, "trainer")] + [_pump(v, f"demo-{i + 1}") for i, v in enumerate(vols)]
    try:
        code = trainer.wait()
    finally:
        vol_codes = stop(vols)
        stop([trainer])
        for t in pumps:
            t.join(timeout=5)
    if code != 0:
        raise DemoError(f"the demo's trainer exited with code {code} (its last lines above say "
                        f"why); the bucket is left at {bucket}")
    print(f"volunteers exited with {vol_codes}", flush=True)
    results = report(bucket, root / "work")
    print(f"demo finished in {time.time() - started:.0f}s; bucket left at {bucket}", flush=True)
    return results
