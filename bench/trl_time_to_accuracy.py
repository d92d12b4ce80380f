"""Time to accuracy: vrl (one trainer + one volunteer process) against TRL's GRPOTrainer.

    pip install -e '.[bench]'      # adds trl==1.16.0 (and accelerate, datasets); keeps the CPU torch
    python -m bench.trl_time_to_accuracy [--quick] [--json PATH]

Install the bench group into an environment that already has the CPU build of torch, pinning
the torch and transformers it has on the same line (`pip install -e '.[bench]' torch==2.13.0
transformers==5.23.0` here), so pip changes neither and never pulls a CUDA build; check
`pip list` afterwards.

The issue's bar: wall time until each reaches the same held-out accuracy, vrl <= 0.7x of
TRL's time (the row's ratio TRL / vrl >= 1.43).

**Shared start.** The tiny model and tokenizer are built exactly as `vrl trainer --model tiny`
builds them (`initial_policy`, the same warm-start steps and seed), once, and saved with
`save_policy` to a folder (cached under runs/bench/ by steps, seed, data and source hashes).
Both contenders start from that folder: `vrl trainer --model FOLDER` and GRPOTrainer on the
model and tokenizer `load_policy(FOLDER)` returns. Same train prompts (data/train.csv in the
plain "Q: ...\\nA: " template vrl.json names), same reward rule (`volunteer_rl.task.reward`: vrl
scores the sampled tokens with `completion_reward`, TRL the text its trainer decodes with
`reward`; that text has EOS and other special tokens dropped), K = 8, temperature 1.0 with
no top-k / top-p, 32 new tokens at most, AdamW at lr 3e-4 with constant schedule, no weight
decay, gradient clipping at 1.0, clip range 0.2 / 0.28, no KL term, token-level ("dapo") loss
normalisation and group-std-scaled advantages on both sides.

**Per step.** vrl: 16 prompt groups per optimizer step (`--groups-per-step 16`, as `vrl demo`);
the trainer steps only on groups whose rewards differ. TRL: 16 prompts x 8 completions per
step (per_device_train_batch_size 128, one generation per step, one gradient pass); TRL has no
filter, so its groups with one reward for all 8 cost compute and give no gradient.

**Threads: 2 cores for each.** vrl runs 2 processes with 1 thread each (`--threads 1` and
OMP_NUM_THREADS=1, so start-up too): trainer and volunteer each own one core, as `vrl demo`
runs them. TRL runs 1 process with 2 threads (OMP_NUM_THREADS=2, `torch.set_num_threads(2)`):
it generates and trains in turn, so each phase can use both cores. Each contender has 2 compute
threads on the 2 cores and never more; the two run one after the other, never together.

**Clocks.** Each clock starts when the contender is launched, as a person would time it from
the command: vrl's when the trainer and volunteer processes are started (together, as
`vrl demo` does), TRL's when its process is started (`GRPOTrainer` runs in a child process of
this one). Imports, model loading, dataset preparation, the volunteer's fetch of v0 and all
training are on the clock; only evaluation is not, on either side.

**Accuracy over time.** Held-out accuracy is not measured inside either run: an evaluation
inside vrl's trainer would stall it while the volunteer keeps sampling, which no in-loop
evaluation of TRL can mirror. Instead both runs keep their weights on one time grid (every
10 s, 5 s with --quick): vrl's newest version whose manifest was created at or before each grid
time (every version stays in the folder bucket: ~2.4 MB each, in a temporary folder), TRL's
weights after the last optimizer step that ended at or before it (copied and saved in a
callback, which takes its own time off TRL's clock). After both runs every kept snapshot is
scored by the evaluator vrl's trainer uses, `volunteer_rl.trainer.evaluate.greedy_and_sampled`, on the
same held-out prompts (all 500 of data/eval.csv, 100 with --quick; 4 samples each at T = 1),
with the same seed before each call, so all snapshots see the same random numbers.

**Target.** v0's sampled held-out accuracy + 10 points (+ 5 with --quick): fixed before
either run, the same for both, and reachable in minutes per the calibration in the field
notes. The time to reach it is interpolated linearly between the last grid point below and
the first at or above it. A contender that never reaches it within its budget (240 s each,
40 s with --quick) is reported with time = budget and "not reached".
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Row, cli, machine

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "bench" / "trl_time_to_accuracy"

# The shared settings of both contenders.
SEED = 0
WARM_START_STEPS = 900   # as `vrl demo`
K = 8
TEMPERATURE = 1.0
MAX_NEW_TOKENS = 32
LR = 3e-4
PROMPTS_PER_STEP = 16
EVAL_SAMPLES = 4         # the trainer's eval_samples
EVAL_SEED = 1234
THREADS = 2              # per contender, in all


@dataclass
class Plan:
    budget: float        # seconds of training per contender
    grid: float          # seconds between kept snapshots
    gain: float          # target = v0 sampled accuracy + gain
    eval_prompts: int    # held-out prompts scored per snapshot

    def times(self) -> list[float]:
        n = int(self.budget / self.grid + 1e-9)
        return [i * self.grid for i in range(n + 1)]


FULL = Plan(budget=240.0, grid=10.0, gain=0.10, eval_prompts=500)
QUICK = Plan(budget=40.0, grid=5.0, gain=0.05, eval_prompts=100)


@dataclass
class Run:
    name: str
    snapshots: dict[float, object] = field(default_factory=dict)
    """grid time -> weights: a checkpoint folder (vrl) or a state dict (TRL)."""
    steps: int = 0
    completions: int = 0
    first_step: float = math.inf
    """Seconds from launch to the end of the first optimizer step."""
    curve: dict[float, dict[str, float]] = field(default_factory=dict)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# The shared start.

def _sha(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def shared_start(steps: int = WARM_START_STEPS, seed: int = SEED) -> Path:
    """v0: the tiny model `vrl trainer --model tiny` would build and warm-start, saved once."""
    import torch

    from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
    from volunteer_rl.model.weights import save_policy
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_rows
    from volunteer_rl.trainer.startup import initial_policy

    train = PACKAGE_DATA / "train.csv"
    sources = [train] + [ROOT / "volunteer_rl" / f for f in (
        "model/tiny.py", "model/policy.py", "model/weights.py", "trainer/warmstart.py",
        "trainer/startup.py", "task/calculator_task.py")]
    folder = CACHE / f"v0-{steps}steps-seed{seed}-{_sha(sources)}"
    if (folder / "model.safetensors").is_file() and (folder / "vrl.json").is_file():
        log(f"shared start: cached {folder.relative_to(ROOT)}")
        return folder
    task = CalculatorTask()
    cfg = TrainerConfig(bucket="memory://unused", model="tiny", warm_start_steps=steps,
                        seed=seed).with_task_defaults(task)
    torch.manual_seed(cfg.seed)  # as trainer.startup.start_fresh does before initial_policy
    policy = initial_policy(cfg, task, load_rows(train, task), torch.device("cpu"), log)
    tmp = folder.with_name(folder.name + ".tmp")
    save_policy(policy, tmp)
    os.replace(tmp, folder)
    log(f"shared start: saved {folder.relative_to(ROOT)}")
    return folder


# ---------------------------------------------------------------------------------------------
# vrl: the real processes, as `vrl demo` starts them.

def _pump(proc: subprocess.Popen, tag: str, tail: list[str], show) -> threading.Thread:
    def run():
        for line in proc.stdout:
            tail[:] = (tail + [line.rstrip()])[-40:]
            if show(line):
                log(f"  [{tag}] {line.rstrip()}")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_vrl(model: Path, plan: Plan, work: Path) -> Run:
    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.launch import stop, vrl_command, vrl_env

    bucket = work / "bucket"
    bucket.mkdir(parents=True, exist_ok=True)  # a volunteer refuses a missing folder bucket
    tiny_eval = work / "eval-4.csv"  # makes the trainer's own v0/final evaluations ~free
    lines = (PACKAGE_DATA / "eval.csv").read_text().splitlines(keepends=True)
    tiny_eval.write_text("".join(lines[:5]))
    # One thread per process from the first instruction on, start-up included.
    env = vrl_env({"OMP_NUM_THREADS": "1"})
    commands = {
        "vrl trainer": vrl_command(
            "trainer", "--bucket", str(bucket), "--model", str(model), "--algo", "grpo",
            "--lr", str(LR), "-k", str(K), "--temperature", str(TEMPERATURE),
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--groups-per-step", str(PROMPTS_PER_STEP),
            # counted from the trainer's first step; the grid ends `budget` after launch
            "--max-seconds", str(plan.budget), "--threads", "1", "--seed", str(SEED),
            "--eval-every", "0", "--eval-dataset", str(tiny_eval),
            "--poll-seconds", "0.05", "--work-dir", str(work / "trainer")),
        "vrl volunteer": vrl_command(
            # the settings of `vrl demo`'s volunteers (volunteer_rl/demo.py explains each)
            "volunteer", "--bucket", str(bucket), "--id", "bench-1", "--threads", "1",
            "--seed", "1", "--shard-seconds", "5", "--prompts-per-batch", "16",
            "--shard-groups", "16", "--max-groups-per-version", "48",
            "--poll-seconds", "0.1", "--heartbeat-seconds", "0", "--work-dir", str(work / "volunteer")),
    }
    launched = time.time()
    procs, pumps, tails = [], [], {}
    for tag, cmd in commands.items():
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env, cwd=work))
        tails[tag] = []
        pumps.append(_pump(procs[-1], tag, tails[tag],
                           lambda line, tag=tag: tag == "vrl trainer" and not line.startswith("step ")))
    try:
        code = procs[0].wait(timeout=plan.budget + 600)
    finally:
        stop(procs[::-1])  # the volunteer first: it flushes its partial shard
        for t in pumps:
            t.join(timeout=5)
    if code != 0:
        raise SystemExit("vrl trainer failed:\n" + "\n".join(tails["vrl trainer"] + tails["vrl volunteer"]))
    return vrl_snapshots(bucket, plan, launched)


def vrl_snapshots(bucket: Path, plan: Plan, launched: float) -> Run:
    """The newest version whose manifest was created at or before each grid time after
    `launched` (v0 before any was)."""
    created = {}
    for path in (bucket / "manifests").glob("v*.json"):
        m = json.loads(path.read_text())
        created[int(m["version"])] = float(m["created_at"]) - launched
    run = Run("vrl")
    for g in plan.times():
        v = max((v for v, t in created.items() if t <= g + 1e-9), default=0)
        run.snapshots[g] = bucket / "checkpoints" / f"v{v:06d}"
    for path in sorted((bucket / "metrics").glob("v*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "step" and rec["time"] - launched <= plan.budget:
                run.steps += 1
                run.first_step = min(run.first_step, rec["time"] - launched)
    shards = [p for p in (bucket / "rollouts").rglob("*.jsonl.gz") if p.stat().st_mtime - launched <= plan.budget]
    run.completions = K * sum(sum(1 for _ in gzip.open(shard, "rt")) for shard in shards)
    return run


# ---------------------------------------------------------------------------------------------
# TRL: GRPOTrainer in a process of its own.

def run_child(module: str, flag: str, spec: dict, tag: str, show, plan: Plan, what: str) -> dict:
    """A contender in a process of its own: `python -m <module> <flag> <spec as JSON>` with
    THREADS OpenMP threads. Its clock starts now (spec["launched"]); returns the run.json it
    leaves in spec["out"] (snapshots by grid time, steps, first_step)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(THREADS)}
    spec = {**spec, "launched": time.time()}
    proc = subprocess.Popen([sys.executable, "-m", module, flag, json.dumps(spec)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    tail: list[str] = []
    pump = _pump(proc, tag, tail, show)
    try:
        code = proc.wait(timeout=plan.budget + 600)
    finally:
        if proc.poll() is None:
            proc.kill()
        pump.join(timeout=5)
    if code != 0:
        raise SystemExit(f"{what} failed:\n" + "\n".join(tail))
    return json.loads((Path(spec["out"]) / "run.json").read_text())


class GridKeeper:
    """The weights that stand for each grid time of a run in one process: those held when the
    grid time passed, each set saved once under `out` and named by its step count."""

    def __init__(self, out: Path, grid: list[float]):
        self.out, self.grid, self.next, self.names = out, grid, 0, {}

    def keep(self, state: dict, steps: int, until: float, inclusive: bool) -> None:
        """`state` (the weights after `steps` steps) for the grid times before `until`
        (or at it, if `inclusive`) that have none yet."""
        import torch

        name = f"step-{steps:06d}.pt"
        grid = self.grid
        while self.next < len(grid) and (grid[self.next] < until or inclusive and grid[self.next] <= until):
            if not (self.out / name).exists():
                torch.save(state, self.out / name)
            self.names[grid[self.next]] = name
            self.next += 1


def run_trl(model: Path, plan: Plan, work: Path) -> Run:
    out = work / "trl"
    out.mkdir()
    spec = {"model": str(model), "out": str(out), "budget": plan.budget, "grid": plan.times()}
    done = run_child("bench.trl_time_to_accuracy", TRL_CHILD, spec, "TRL",
                     lambda line: not line.startswith("{'train_runtime'"), plan, "TRL run")
    return Run("TRL", snapshots={float(g): out / name for g, name in done["snapshots"].items()},
               steps=done["steps"], completions=done["steps"] * PROMPTS_PER_STEP * K,
               first_step=done["first_step"])


TRL_CHILD = "--trl-child"


def trl_child(spec: dict) -> None:
    """The TRL run itself (in the process run_trl starts): snapshots and run.json to spec["out"]."""
    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise SystemExit("TRL is not installed: pip install -e '.[bench]' (see this module's docstring)")
    import torch

    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.policy import encode_prompts, format_prompt, load_policy
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_csv
    from volunteer_rl.task.reward import reward

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, from TRL
    torch.set_num_threads(THREADS)
    out, launched, budget, grid = Path(spec["out"]), spec["launched"], spec["budget"], spec["grid"]
    policy = load_policy(spec["model"], "cpu")
    problems = load_csv(PACKAGE_DATA / "train.csv")
    instruction = CalculatorTask.instruction
    prompts = [format_prompt(policy, p.prompt, instruction) for p in problems]
    # GRPOTrainer tokenizes plain-text prompts with the tokenizer's defaults; they must give
    # the very ids vrl's volunteers sample from.
    probe = policy.tokenizer(prompts[:64])["input_ids"]
    if probe != encode_prompts(policy, [p.prompt for p in problems[:64]], instruction):
        raise SystemExit("TRL would tokenize the prompts differently from vrl")
    data = Dataset.from_dict({"prompt": prompts, "expression": [p.expression for p in problems]})

    def calculator_reward(prompts, completions, expression, **_):
        # GRPOTrainer decodes each completion up to its EOS with skip_special_tokens=True:
        # the text `reward` needs, the expression alone.
        return [reward(c, e) for c, e in zip(completions, expression)]

    config = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False,
        activation_checkpointing=False, seed=SEED, report_to="none", logging_strategy="no",
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", max_grad_norm=1.0, max_steps=1_000_000,
        per_device_train_batch_size=PROMPTS_PER_STEP * K, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, num_generations=K,
        max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_k=0, top_p=1.0,
        min_p=None, repetition_penalty=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        use_vllm=False,
    )

    class Snapshots(TrainerCallback):
        """For each grid time, the weights after the last step that ended at or before it,
        saved once per step; copying and saving are taken off the clock."""

        def __init__(self):
            self.off_clock, self.keeper = 0.0, GridKeeper(out, grid)
            self.state, self.steps, self.first_step = None, 0, None

        def keep(self, until: float, inclusive: bool) -> None:
            """The weights held (those after step self.steps) for the grid times before `until`."""
            self.keeper.keep(self.state, self.steps, until, inclusive)

        def on_train_begin(self, args, state, control, model=None, **kw):
            paused = time.time()
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.off_clock += time.time() - paused

        def on_step_end(self, args, state, control, model=None, **kw):
            t = time.time() - launched - self.off_clock
            paused = time.time()
            self.first_step = t if self.first_step is None else self.first_step
            self.keep(t, inclusive=False)  # the grid times before this step ended
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            self.steps = state.global_step
            if t >= budget:
                self.keep(budget, inclusive=True)
                control.should_training_stop = True
            self.off_clock += time.time() - paused

    snaps = Snapshots()
    trainer = GRPOTrainer(model=policy.model, reward_funcs=calculator_reward, args=config,
                          train_dataset=data, processing_class=policy.tokenizer, callbacks=[snaps])
    check_trl_sampling(trainer)
    log(f"TRL {trl.__version__}: {PROMPTS_PER_STEP} prompts x {K} per step, {torch.get_num_threads()} threads")
    trainer.train()
    (out / "run.json").write_text(json.dumps({"snapshots": snaps.keeper.names, "steps": snaps.steps,
                                              "first_step": snaps.first_step}))


def check_trl_sampling(trainer) -> None:
    """TRL's sampler must be plain softmax(logits / T): no top-k, top-p, min-p or penalty."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    model = trainer.model
    try:  # what `generate` does with TRL's generation config (private helpers of transformers 5)
        gen = model._prepare_generation_config(trainer.generation_config)[0]
        procs = model._get_logits_processor(generation_config=gen, input_ids_seq_length=8,
                                            encoder_input_ids=None, prefix_allowed_tokens_fn=None,
                                            logits_processor=None, device="cpu")
    except (AttributeError, TypeError) as exc:
        log(f"warning: could not check TRL's sampling settings ({exc})")
        return
    kinds = {type(p) for p in procs}
    bad = kinds & {TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor}
    if bad or not gen.do_sample or (gen.temperature != 1.0 and TemperatureLogitsWarper not in kinds):
        raise SystemExit(f"TRL samples with {sorted(k.__name__ for k in kinds)}; expected plain sampling")


# ---------------------------------------------------------------------------------------------
# Scoring the snapshots, and the result.

def score(run: Run, model_dir: Path, plan: Plan, cache: dict) -> None:
    """greedy_and_sampled for every snapshot, the same seed before each call."""
    import torch

    from volunteer_rl.config import PACKAGE_DATA
    from volunteer_rl.model.policy import load_policy
    from volunteer_rl.model.weights import load_weights
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_rows
    from volunteer_rl.trainer.evaluate import greedy_and_sampled

    torch.set_num_threads(THREADS)
    task = CalculatorTask()
    problems = load_rows(PACKAGE_DATA / "eval.csv", task)[: plan.eval_prompts]
    policy = load_policy(model_dir, "cpu")
    policy.model.eval()
    for g, snap in sorted(run.snapshots.items()):
        key = str(snap)
        if key not in cache:
            if snap.is_dir():  # a vrl checkpoint
                load_weights(policy, snap / "model.safetensors")
            else:  # a TRL state dict
                policy.model.load_state_dict(torch.load(snap))
            torch.manual_seed(EVAL_SEED)
            cache[key] = greedy_and_sampled(policy, task, problems, TEMPERATURE, EVAL_SAMPLES,
                                            MAX_NEW_TOKENS)
        run.curve[g] = cache[key]


def time_to(curve: dict[float, dict[str, float]], target: float) -> float | None:
    """First time the sampled accuracy reaches `target`, linear between grid points."""
    prev = None
    for g in sorted(curve):
        acc = curve[g]["eval/accuracy_sampled"]
        if acc >= target:
            if prev is None:
                return g
            pg, pa = prev
            return pg + (g - pg) * (target - pa) / (acc - pa)
        prev = (g, acc)
    return None


def results(quick: bool) -> list[Row]:
    plan = QUICK if quick else FULL
    facts = machine()
    log(f"machine: {facts}")
    model_dir = shared_start()
    with tempfile.TemporaryDirectory(prefix="vrl-trl-bench-") as tmp:
        work = Path(tmp)
        (work / "vrl").mkdir()
        log(f"TRL: GRPOTrainer for {plan.budget:.0f}s")
        trl_run = run_trl(model_dir, plan, work)
        log(f"vrl: 1 trainer + 1 volunteer for {plan.budget:.0f}s")
        vrl_run = run_vrl(model_dir, plan, work / "vrl")
        for r in (trl_run, vrl_run):
            log(f"{r.name}: first optimizer step {r.first_step:.1f}s after launch, {r.steps} steps and "
                f"{r.completions} completions sampled in {plan.budget:.0f}s")
        log(f"scoring {len(set(vrl_run.snapshots.values()))} vrl versions and "
            f"{len(set(trl_run.snapshots.values()))} TRL snapshots on {plan.eval_prompts} held-out prompts")
        cache: dict = {}
        score(vrl_run, model_dir, plan, cache)
        score(trl_run, model_dir, plan, cache)

    v0 = vrl_run.curve[0.0]["eval/accuracy_sampled"]
    if abs(trl_run.curve[0.0]["eval/accuracy_sampled"] - v0) > 1e-9:
        raise SystemExit("the two runs did not start from the same weights")
    target = v0 + plan.gain
    log(f"\nheld-out accuracy, greedy / sampled (T={TEMPERATURE}, {EVAL_SAMPLES} samples), "
        f"{plan.eval_prompts} prompts")
    log(f"{'seconds':>8} {'vrl':>15} {'TRL':>15}")
    for g in plan.times():
        cells = [f"{r.curve[g]['eval/accuracy_greedy']:6.1%} / {r.curve[g]['eval/accuracy_sampled']:6.1%}"
                 for r in (vrl_run, trl_run)]
        log(f"{g:8.0f} {cells[0]:>15} {cells[1]:>15}")
    t_vrl, t_trl = time_to(vrl_run.curve, target), time_to(trl_run.curve, target)
    for name, t in (("vrl", t_vrl), ("TRL", t_trl)):
        log(f"{name}: {'not reached in %.0fs' % plan.budget if t is None else '%.1fs' % t} "
            f"to {target:.1%} sampled")
    vrl_s = plan.budget if t_vrl is None else t_vrl
    trl_s = plan.budget if t_trl is None else t_trl
    ratio = trl_s / max(vrl_s, 1e-9)
    if t_vrl is None and t_trl is None:
        met, verdict = None, "neither reached the target"
    elif t_vrl is None:
        met, verdict = False, "vrl did not reach the target"
    elif t_trl is None:  # vrl's time is known, TRL's is more than the budget
        met = True if ratio >= 1 / 0.7 else None
        verdict = "TRL did not reach the target: the ratio is a lower bound"
    else:
        met, verdict = ratio >= 1 / 0.7, ""
    note = (f"TRL {_trl_version()} GRPOTrainer (1 process, {THREADS} threads) vs vrl 1 trainer + "
            f"1 volunteer (1 thread each); K={K}, {PROMPTS_PER_STEP} prompts/step, lr {LR:g}, "
            f"T={TEMPERATURE:g}, {MAX_NEW_TOKENS} new tokens; {plan.budget:.0f}s each; "
            f"steps vrl {vrl_run.steps} / TRL {trl_run.steps}"
            + (f"; {verdict}" if verdict else ""))
    return [Row(benchmark="time to accuracy vs TRL GRPOTrainer",
                measure=f"s to {target:.1%} sampled held-out accuracy (v0 {v0:.1%} + {plan.gain * 100:.0f} pts)",
                vrl=vrl_s, baseline=trl_s, ratio=ratio,
                goal=">= 1.43 (vrl <= 0.7x TRL's time)", met=met,
                command="python -m bench.trl_time_to_accuracy" + (" --quick" if quick else ""),
                note=note)]


def _trl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    if sys.argv[1:2] == [TRL_CHILD]:
        sys.exit(trl_child(json.loads(sys.argv[2])))
    sys.exit(cli(results, __doc__))
