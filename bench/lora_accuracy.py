"""Held-out accuracy after 300 s of RL with LoRA adapters (`vrl trainer --lora-rank 1` and 8)
against full fine-tuning, from the same v0 (issue 42, row (c); goal: within 2 s.e. of full
fine-tuning, or the gap reported with the learning rates tried).

    python -m bench.lora_accuracy [--quick] [--tasks calculator,countdown] [--lrs 3e-3,1e-2]
                                  [--json PATH]

**Start.** Per task, the tiny model `vrl trainer --model tiny` builds and warm-starts (the
demo's 900 steps, seed 0), saved once (cached under runs/bench/lora_accuracy/ by task, steps
and source hashes). Every contender starts from that folder (`--model FOLDER`).

**Runs.** One after the other, each a real `vrl trainer` and one `vrl volunteer` on a fresh
folder bucket, one thread each (OMP_NUM_THREADS=1), the demo's settings otherwise (GRPO, K 8,
T 1, 16 groups a step), for `--max-seconds` 300 (60 with --quick) counted from the trainer's
first step: full fine-tuning at its default lr (3e-4), `--lora-rank 1` and `--lora-rank 8` at
each learning rate of `--lrs` (default: theirs, 3e-3, ten times; alpha 32).

**Score.** The last version each published, loaded as `vrl eval` loads it (its base and, for
LoRA, its adapter), scored by `trainer.evaluate.greedy_and_sampled` on the task's 500 held-out
prompts (100 with --quick), 4 samples each at T 1, the same seed for every run. The standard
error of a sampled accuracy p is sqrt(p (1 - p) / prompts): the prompts, not the 4 samples of
each, are what vary between runs. Row: LoRA's sampled accuracy (vrl) against full
fine-tuning's (baseline); met when the gap is within 2 s.e. of the difference,
sqrt(se_lora^2 + se_full^2).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import Row, emit_rows

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "bench" / "lora_accuracy"
COMMAND = "python -m bench.lora_accuracy"
WARM_START_STEPS = 900
SEED = 0
SECONDS = {False: 300.0, True: 60.0}
PROMPTS = {False: 500, True: 100}
SAMPLES = 4
EVAL_SEED = 1234
RANKS = (1, 8)
LORA_LR = 3e-3  # TrainerConfig's LR times LORA_LR_FACTOR: what `--lora-rank` takes by default


def variants(lrs: list[float]) -> dict[str, tuple[str, ...]]:
    """Full fine-tuning, then each rank at each learning rate: name -> vrl trainer flags."""
    out: dict[str, tuple[str, ...]] = {"full": ()}
    for lr in lrs:
        for rank in RANKS:
            out[f"LoRA rank {rank}, lr {lr:g}"] = ("--lora-rank", str(rank), "--lr", f"{lr:g}")
    return out


def log(msg: str) -> None:
    print(msg, flush=True)


def start_for(task_name: str) -> Path:
    """v0 of `task_name`: the tiny model the trainer builds and warm-starts, saved once."""
    import hashlib

    import torch

    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.model.weights import save_policy
    from volunteer_rl.trainer.preflight import read_inputs
    from volunteer_rl.trainer.startup import initial_policy

    sources = [ROOT / "volunteer_rl" / f for f in ("model/tiny.py", "trainer/warmstart.py",
                                                    "trainer/startup.py")]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    folder = CACHE / f"v0-{task_name}-{WARM_START_STEPS}steps-seed{SEED}-{digest}"
    if (folder / "model.safetensors").is_file():
        log(f"start: cached {folder.relative_to(ROOT)}")
        return folder
    cfg = TrainerConfig(bucket="memory://unused", model="tiny", task=task_name,
                        warm_start_steps=WARM_START_STEPS, seed=SEED)
    inputs = read_inputs(cfg)
    task = inputs.task
    cfg = cfg.with_task_defaults(task)
    torch.manual_seed(cfg.seed)
    policy = initial_policy(cfg, task, inputs.problems, torch.device("cpu"), log)
    tmp = folder.with_name(folder.name + ".tmp")
    save_policy(policy, tmp)
    os.replace(tmp, folder)
    return folder


def tiny_eval(task: str, work: Path) -> Path:
    """The first 4 rows of the task's held-out file: the trainer's own v0 and final
    evaluations then take a moment (the score below is the bench's)."""
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.trainer.preflight import read_inputs

    source = read_inputs(TrainerConfig(bucket="memory://unused", task=task)).eval_path
    path = work / "eval-4.csv"
    path.write_text("".join(Path(source).read_text().splitlines(keepends=True)[:5]))
    return path


def run(task: str, model: Path, flags: tuple[str, ...], seconds: float, work: Path) -> Path:
    """A trainer and a volunteer for `seconds` of RL; the folder bucket they used."""
    from volunteer_rl.launch import stop, vrl_command, vrl_env

    bucket = work / "bucket"
    bucket.mkdir(parents=True)
    env = vrl_env({"OMP_NUM_THREADS": "1"})
    trainer = subprocess.Popen(vrl_command(
        "trainer", "--bucket", str(bucket), "--model", str(model), "--task", task, *flags,
        "--max-seconds", str(seconds), "--threads", "1", "--seed", str(SEED),
        "--groups-per-step", "16", "--eval-every", "0", "--eval-dataset", str(tiny_eval(task, work)),
        "--poll-seconds", "0.05", "--work-dir", str(work / "trainer")),
        stdout=open(work / "trainer.log", "w"), stderr=subprocess.STDOUT, env=env, cwd=work)
    volunteer = subprocess.Popen(vrl_command(
        "volunteer", "--bucket", str(bucket), "--id", "bench-1", "--threads", "1", "--seed", "1",
        "--shard-seconds", "5", "--prompts-per-batch", "16", "--shard-groups", "16",
        "--poll-seconds", "0.1", "--heartbeat-seconds", "0", "--work-dir", str(work / "volunteer")),
        stdout=open(work / "volunteer.log", "w"), stderr=subprocess.STDOUT, env=env, cwd=work)
    try:
        code = trainer.wait(timeout=seconds + 900)
    finally:
        stop([volunteer, trainer])
    if code != 0:
        raise SystemExit(f"vrl trainer exited {code}:\n{(work / 'trainer.log').read_text()[-3000:]}")
    return bucket


def score(task_name: str, bucket: Path, work: Path, prompts: int) -> tuple[int, dict]:
    """(the last version, greedy_and_sampled of it) as `vrl eval` loads it."""
    import torch

    from volunteer_rl.protocol.signing import Trust, parse_private_key, public_key_text
    from volunteer_rl.storage import open_storage
    from volunteer_rl.trainer.evaluate import greedy_and_sampled, held_out, load_version

    key = parse_private_key((work / "trainer" / "signing-key.pem").read_bytes(), "the trainer's key")
    storage = open_storage(str(bucket))
    m, policy = load_version(storage, None, work / "eval", trust=Trust(public_key_text(key)))
    task, problems = held_out(m, None)
    torch.set_num_threads(2)
    torch.manual_seed(EVAL_SEED)
    return m.version, greedy_and_sampled(policy, task, problems[:prompts], m.sampling.temperature,
                                         SAMPLES, m.sampling.max_new_tokens)


def results(quick: bool, tasks: list[str], lrs: list[float] = (LORA_LR,)) -> list[Row]:
    import tempfile

    seconds, prompts = SECONDS[quick], PROMPTS[quick]
    command = COMMAND + (" --quick" if quick else "") + f" --tasks {','.join(tasks)}" + \
        ("" if list(lrs) == [LORA_LR] else f" --lrs {','.join(f'{lr:g}' for lr in lrs)}")
    rows = []
    runs = variants(list(lrs))
    for task in tasks:
        model = start_for(task)
        got = {}
        for name, flags in runs.items():
            with tempfile.TemporaryDirectory(prefix="vrl-lora-acc-") as tmp:
                t0 = time.time()
                bucket = run(task, model, flags, seconds, Path(tmp))
                version, res = score(task, bucket, Path(tmp), prompts)
                got[name] = (version, res)
                log(f"{task}, {name}: v{version} after {seconds:.0f}s of RL, sampled "
                    f"{res['eval/accuracy_sampled']:.3f}, greedy {res['eval/accuracy_greedy']:.3f} "
                    f"({time.time() - t0:.0f}s)")
        full_v, full = got["full"]
        p_full = full["eval/accuracy_sampled"]
        se_full = math.sqrt(p_full * (1 - p_full) / prompts)
        for name in [n for n in runs if n != "full"]:
            version, res = got[name]
            p = res["eval/accuracy_sampled"]
            se = math.sqrt(max(se_full ** 2 + p * (1 - p) / prompts, 1e-12))
            rows.append(Row(
                f"held-out accuracy after {seconds:.0f}s of RL, {task}, {name} vs full",
                "sampled accuracy (T 1): LoRA (vrl) vs full fine-tuning, same v0", p, p_full,
                p / p_full if p_full else math.inf, "within 2 s.e. of full",
                abs(p - p_full) <= 2 * se, command,
                f"gap {(p - p_full) / se:+.2f} s.e. (s.e. of the gap {se:.3f}); LoRA v{version}, "
                f"full v{full_v}; greedy {res['eval/accuracy_greedy']:.3f} vs "
                f"{full['eval/accuracy_greedy']:.3f}; alpha 32; full at lr 3e-4; "
                f"{prompts} prompts x {SAMPLES} samples; 1 trainer + 1 volunteer, 1 thread each"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 s runs, 100 prompts")
    parser.add_argument("--tasks", default="calculator,countdown")
    parser.add_argument("--lrs", default=f"{LORA_LR:g}", help="LoRA learning rates, comma-separated")
    parser.add_argument("--json", help="write the rows here as JSON (for python -m bench)")
    args = parser.parse_args()
    lrs = [float(x) for x in args.lrs.split(",")]
    return emit_rows(results(args.quick, args.tasks.split(","), lrs), args.json)


if __name__ == "__main__":
    sys.exit(main())
