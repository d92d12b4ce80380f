"""Trainer intake with replay audits, 2 torchrun ranks against one process, shards of 1,000
volunteers on the S3 test server (issue 28's intake split; goal >= 1.6x).

    python -m bench.intake_ranks [--quick] [--json PATH]

Set-up (not measured). moto's S3 server (infra/s3_server.py) runs in its own process on
127.0.0.1, as in bench.ingest_fleet, whose helpers this reuses. The policy is the trainer's
v0 for `--model tiny` (bench.trl_time_to_accuracy.shared_start: built and warm-started as
`vrl trainer` does, 900 steps, cached), loaded back as a volunteer loads a checkpoint.
v0's prompt pool is made by the trainer's own curriculum (`PromptPicker.pool`, the trainer's
seed and pool size). 1,000 simulated volunteers (`vol-0000`, ...; 40 with --quick, and v0
warm-started 100 steps) each sample one shard of 2 groups (Sizes) the way
`Volunteer._generate` samples: group number `seq` is for the prompt `pool_prompt` draws for
it, and its K completions are sampled with their committed noise (`group_keys` ->
`sampling.sample(..., draw_keys=...)`), rewards by the task's `completion_reward`. So every group is the volunteer's own and passes its replay; nothing is
reused across ids (the noise is keyed by the id: a copy would fail its replay and count as
a copy). The shards (`encode_shard`) go into one bucket, all under v0, written with the
product's `S3Storage` (bench.ingest_fleet.upload). The trainer's config defaults hold
throughout: K = 8, T = 1, max_new_tokens 32, staleness 2, audit share 10 %, full audits
below 10 clean groups, floor 0.005, the replay and logprob tolerances, fp32 weights.

Measured, same bucket, same server, one after the other, each side in fresh processes (a
fresh Ledger, Fleet, Rules with an empty reward cache, and Auditor with a fresh budget):

- baseline: one plain process (no torchrun), `Ingest(..., auditor=Auditor(...))` as
  `trainer.roles.Single.make_intake` wires it, its replay `trainer.step.audit_groups` with v0's
  weights held in a `WindowWeights` (as `trainer.held.HeldWeights.replay`).
- vrl: the same under `torchrun --standalone --nproc-per-node 2`: each rank joins with
  `ranks.join`, and its Ingest has its `Share` (lists, reads, checks, rescores and audits only
  the volunteers whose id hashes to it; every poll meets the other rank twice).

Each side polls (`Ingest.poll`) the window until every shard of its volunteers has an
outcome in its ledger, or for at most max_seconds (180 s; then the figure is over what was
taken by then, and the row says how many shards were left). Usable groups are recorded as
trained right away, as the trainer records them after its step (the step is not measured);
zero-variance and duplicate groups get theirs from the intake. Ranks decide "done" together
after every poll (one `Share.exchange` of what each has left and how long it has run, as the
trainer's ranks meet once more per poll to agree on a batch), so they poll equally often.
Every process runs with 1 torch thread (torch.set_num_threads(1) and OMP_NUM_THREADS=1), the
single process too: 2 ranks on 2 cores must not fight over cores, and a second intra-op
thread would do little for a replay of a group or two while the intake's own work (LIST,
parse, check, rescore) is Python on one thread; so the ratio is what splitting the intake
over processes is worth, not what torch's threads are worth.

groups/s = groups in the shards taken / seconds from the first poll to the last (ranks: the
sum over the ranks over the slowest rank's seconds, from a barrier just before the first
poll). The bench fails if any shard is rejected (an audit that fails on honest shards would
make the figure meaningless). Also printed, per rank: the shards it took and its GETs (its
split of the work), shards audited, deferred and taken unaudited, its share of time spent
replaying, polls, and its HTTP requests by operation (bench.ingest_fleet's counter).

Two rows, each from both sides: a new fleet (below) and a trusted one, the same shards read
by processes whose Fleet already counts every volunteer clean for 10^5 groups (a fleet the
trainer has known for long), so a shard is drawn for an audit at the floor's rate only and
the intake's own work (LIST, GET, parse, check, rescore) is what the ranks split.

How to read the new fleet's row. Every volunteer is new (fewer than 10 clean groups), so
every shard is due for an audit, and what limits the intake is not the CPU work the ranks
split:

- admission: a due shard is fetched only while its process's audit budget (a token bucket
  of 10 % of wall time, at most 10 s, starting at 1 s) has room, and until it is parsed its
  audit is costed at the manifest's max_shard_groups (256) x the last measured seconds per
  group. A 2-group shard replays in ~20 ms but reserves seconds, so a poll admits
  ceil(tokens / reservation) due shards (1 at first, a few once the bucket is full), and the
  replays use a fraction of the 10 % they may. Two ranks have two buckets: twice the
  admissions per poll.
- polls: each poll LISTs every volunteer folder of the window (one request per volunteer),
  and moto's server, one Python process, answers a bounded number of requests per second
  whoever asks; two ranks each list half the folders, but share that server and 2 cores.

So expect about 2x from the budgets, less what the shared server and cores take. What to
expect here: at 200 volunteers and 40 s per side (a trial run, not the row) one process
made 34 polls and 2 ranks 36, both at ~175 requests/s to moto; one process took 60 shards
(1 s replaying: 2.5 % of its time), the ranks 96; ratio 1.61.

The trusted fleet's row measures the split of the intake's work, on 2 cores that the two
ranks share with moto's server, which answers every LIST and GET: expect less than 2x here,
where the server, not the ranks, sets the pace of listing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, cli
from bench.ingest_fleet import counted_storage, fmt_ops, reset_and_make, server_version, upload

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m bench.intake_ranks"
WORKER = "--worker"
RANKS = 2
GOAL = 1.6
VERSION = 0  # every shard is v0's: one version of weights for the audits, as at a run's start
RUN_ID = "run-bench-intake-ranks"
SECRET = b""
"""The grant secret of the intake's Rules (its default): the honest volunteers' nonces."""
BUCKET = "vrl-intake-ranks"
SIDE_TIMEOUT = 3600.0  # seconds one side may take, start-up included, before the bench gives up


@dataclass
class Sizes:
    volunteers: int
    shards: int  # per volunteer
    groups: int  # per shard
    warm_start_steps: int
    max_polls: int  # per side: bounds, reported if reached (see the module's doc)
    max_seconds: float


FULL = Sizes(volunteers=1000, shards=1, groups=2, warm_start_steps=900, max_polls=5000,
             max_seconds=180.0)
QUICK = Sizes(volunteers=40, shards=1, groups=2, warm_start_steps=100, max_polls=500,
              max_seconds=300.0)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Set-up: honest shards, sampled as each volunteer samples them.

def v0_pool(cfg) -> tuple[int, ...]:
    """v0's prompt pool as the trainer makes it (PromptPicker.pool on a fresh run, as trainer.publisher commits v0)."""
    import random

    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.curriculum import PromptPicker
    from volunteer_rl.task.dataset import load_rows
    from volunteer_rl.trainer.preflight import dataset_paths

    task = CalculatorTask()
    problems = load_rows(dataset_paths(cfg, task)[0], task)
    return PromptPicker(problems, random.Random(cfg.seed), cfg.curriculum,
                        task.stratum).pool(cfg.prompt_pool)


def honest_shards(model_dir: Path, sizes: Sizes, pool: tuple[int, ...]) -> tuple[list, dict]:
    """[(key, encoded shard)] of every volunteer, and counts of what they hold.

    Volunteer.`_generate`'s steps, for all volunteers at once: numbers, drawn prompts,
    committed keys, `sample`, the task's `completion_reward`. `sample` batches prompts of several
    volunteers per call, as one volunteer batches its own: each completion's noise is keyed
    by its own (run, version, volunteer, number, prompt, index), so what a row is sampled
    beside does not change it."""
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.model.devices import set_sampling_threads
    from volunteer_rl.model.policy import encode_prompts, load_policy
    from volunteer_rl.model.sampling import sample
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.draws import group_keys, pool_prompt
    from volunteer_rl.protocol.grants import seq_nonce
    from volunteer_rl.protocol.shards import Completion, Group, encode_shard, new_shard_name
    from volunteer_rl.task.base import completion_reward
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_rows
    from volunteer_rl.trainer.preflight import dataset_paths

    task = CalculatorTask()
    cfg = TrainerConfig(bucket="unused").with_task_defaults(task)
    problems = load_rows(dataset_paths(cfg, task)[0], task)
    policy = load_policy(model_dir, "cpu")
    set_sampling_threads(policy)  # the volunteer's own thread setting
    per_volunteer = sizes.shards * sizes.groups
    slots = [(f"vol-{n:04d}", seq) for n in range(sizes.volunteers) for seq in range(per_volunteer)]
    # The intake below checks with no grant secret (Rules' default), so the nonces are those
    # it computes: the numbers as granted for VERSION.
    nonce = {slot: seq_nonce(SECRET, RUN_ID, slot[0], VERSION, slot[1]) for slot in slots}
    picked = [problems[pool_prompt(pool, RUN_ID, VERSION, vid, seq, nonce[vid, seq])]
              for vid, seq in slots]
    keys = [group_keys(RUN_ID, VERSION, vid, seq, p.id, cfg.k, nonce[vid, seq])
            for (vid, seq), p in zip(slots, picked)]
    out = sample(policy, encode_prompts(policy, [task.prompt(p) for p in picked], task.instruction),
                 cfg.k, cfg.temperature, cfg.max_new_tokens, draw_keys=keys)
    groups = [Group(p.id, VERSION, vid, seq,
                    [Completion(s.token_ids, s.logprobs, s.text,
                                completion_reward(task, p, s.token_ids, policy.decode_all,
                                                  policy.eos_id, policy.special_ids))
                     for s in samples])
              for (vid, seq), p, samples in zip(slots, picked, out)]
    items = []
    for n in range(sizes.volunteers):
        mine = groups[n * per_volunteer:(n + 1) * per_volunteer]
        for i in range(sizes.shards):
            shard = mine[i * sizes.groups:(i + 1) * sizes.groups]
            items.append((layout.shard_key(VERSION, mine[0].volunteer_id, new_shard_name(i)),
                          encode_shard(shard)))
    rewards = [[c.reward for c in g.completions] for g in groups]
    tokens = [len(c.token_ids) for g in groups for c in g.completions]
    return items, {"groups": len(groups), "varied": sum(max(r) != min(r) for r in rewards),
                   "mean_tokens": sum(tokens) / len(tokens)}


# ---------------------------------------------------------------------------------------------
# One side's intake: a worker process (the plain process, or one torchrun rank).

def worker(spec_path: str) -> int:
    """Poll the bucket's window until this process's shards all have an outcome; write its
    figures to the spec's out folder as rank-<r>.json."""
    import torch

    torch.set_num_threads(1)  # see the module's doc: one thread per process, on both sides
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.trainer.ranks import join, leave

    spec = json.loads(Path(spec_path).read_text())
    cfg = TrainerConfig(bucket=f"s3://{spec['bucket']}").with_task_defaults(CalculatorTask())
    ranks = join("cpu", cfg.rank_timeout)
    try:
        result = intake(spec, ranks, cfg)
    finally:
        leave(ranks)
    (Path(spec["out"]) / f"rank-{ranks.rank}.json").write_text(json.dumps(result))
    return 0


def intake(spec: dict, ranks, cfg) -> dict:
    from volunteer_rl.model.policy import encode_prompts, load_policy
    from volunteer_rl.model.weights import WEIGHTS_DTYPES
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.ledger import Ledger
    from volunteer_rl.task.base import in_process
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_rows
    from volunteer_rl.trainer.audit import Auditor, Budget, Unavailable, WindowWeights
    from volunteer_rl.trainer.fleet import Counts, Fleet
    from volunteer_rl.trainer.checks import Rules
    from volunteer_rl.trainer.groups import IngestStats, Window
    from volunteer_rl.trainer.ingest import Ingest
    from volunteer_rl.trainer.preflight import dataset_paths
    from volunteer_rl.trainer.ranks import barrier
    from volunteer_rl.trainer.shares import Share
    from volunteer_rl.trainer.step import audit_groups

    # As roles.Single.make_intake: the rules of the manifest, the prompts' tokens for replays,
    # the window's weights as volunteers load them, and the auditor with its budget.
    task = CalculatorTask()
    problems = load_rows(dataset_paths(cfg, task)[0], task)
    policy = load_policy(spec["model"], "cpu")
    policy.model.eval()
    rules = Rules(problems, len(policy.tokenizer), cfg.k, cfg.max_new_tokens, policy.decode_all,
                  policy.eos_id, policy.special_ids, run_id=RUN_ID, secret=SECRET,
                  rewards=in_process(task))
    prompt_ids = dict(enumerate(encode_prompts(policy, [task.prompt(p) for p in problems],
                                               task.instruction)))
    weights = WindowWeights()
    weights.add(VERSION, policy.model, WEIGHTS_DTYPES[cfg.weights_dtype])

    def replay(version: int, groups: list):  # held.HeldWeights.replay
        if not weights.load_into(version, policy.model):
            raise Unavailable(version)
        return audit_groups(policy, groups, prompt_ids, RUN_ID, cfg.temperature,
                            cfg.replay_tolerance, cfg.audit_tolerance)

    share = Share(ranks) if ranks.joined else None
    mine = [k for k in spec["keys"] if share is None or share.owns(layout.rollout_author(k)[1])]
    storage, counter = counted_storage(spec["bucket"], spec["endpoint"])
    lines: list[str] = []

    def keep(msg: str) -> None:  # the intake's warnings and rejections, for the parent
        lines.append(msg)
        print(f"[rank {ranks.rank}] {msg}", flush=True)

    fleet = Fleet(cfg.deny_after, cfg.deny_rate)
    if spec["trusted"]:  # a fleet the trainer has known for long: its audit rate is the floor's
        fleet.counts = {layout.rollout_author(k)[1]: Counts(accepted=1000, clean=10**5,
                                                             accepted_groups=10**5)
                        for k in spec["keys"]}
    ingest = Ingest(storage, rules, Ledger(), fleet,
                    Auditor(replay, Budget(cfg.audit_share), cfg.audit_full_groups,
                            cfg.audit_floor), log=keep, share=share)
    win = Window(VERSION, cfg.max_staleness, {VERSION}, {VERSION: tuple(spec["pool"])})
    stats = IngestStats()
    polls, usable, poll_seconds = 0, 0, []
    barrier(ranks)  # both ranks start their clocks together
    counter.take()
    started = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        out = ingest.poll(win, stats)
        polls += 1
        usable += len(out)
        # The trainer records its usable groups as trained after its step; here at once.
        by_key = defaultdict(list)
        for g in out:
            by_key[g.key].append(g)
        for key, gs in by_key.items():
            ingest.ledger.record(key, "trained", [g.line for g in gs], gs[0].shard_size,
                                 [g.digest for g in gs], step=polls)
        left = sum(not ingest.ledger.finished(k) for k in mine)
        now = time.perf_counter()
        poll_seconds.append(now - t0)
        # One decision for all ranks, from what every rank has left and how long it has run.
        mine_now = {"left": left, "elapsed": now - started}
        everyone = share.exchange(mine_now) if share else [mine_now]
        if (not any(r["left"] for r in everyone) or polls >= spec["max_polls"]
                or max(r["elapsed"] for r in everyone) >= spec["max_seconds"]):
            break
    seconds = time.perf_counter() - started
    a = stats.audit
    return {"rank": ranks.rank, "world": ranks.world_size, "seconds": seconds, "polls": polls,
            "owned": len(mine), "left": left, "shards": stats.shards, "groups": stats.groups,
            "usable": usable, "zero_variance": stats.zero_variance, "duplicates": stats.duplicates,
            "rejected": dict(stats.rejected), "audited": a.audited, "skipped": a.skipped,
            "deferred": a.deferred, "audit_seconds": a.seconds,
            "slowest_poll": max(poll_seconds), "requests": dict(counter.take()),
            "log": lines[:20]}


# ---------------------------------------------------------------------------------------------
# The two sides.

def run_side(spec: dict, ranks: int, work: Path) -> list[dict]:
    """One side in fresh processes: a plain process (ranks 1) or `ranks` torchrun ranks; each
    process's figures, in rank order."""
    out = work / f"ranks-{ranks}"
    out.mkdir()
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    me = [sys.executable, "-m", "bench.intake_ranks", WORKER, str(spec_path)]
    if ranks > 1:
        me = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
              str(ranks), *me[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    code = subprocess.run(me, cwd=ROOT, env=env, timeout=SIDE_TIMEOUT).returncode
    if code != 0:
        raise SystemExit(f"{' '.join(me[1:])} exited with {code}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]


def rate(side: list[dict]) -> tuple[float, float, int]:
    """(groups/s, seconds of the slowest process, groups) of one side."""
    seconds = max(r["seconds"] for r in side)
    groups = sum(r["groups"] for r in side)
    return groups / seconds, seconds, groups


def describe(name: str, side: list[dict]) -> None:
    for r in side:
        ops = Counter(r["requests"])
        log(f"{name} rank {r['rank']}/{r['world']}: {r['owned']} shards its own, took {r['shards']} "
            f"({r['groups']} groups, {r['usable']} usable, {r['zero_variance']} zero-variance, "
            f"{r['duplicates']} duplicate), {r['left']} left, rejected {r['rejected'] or 'none'}; "
            f"audited {r['audited']} shards in {r['audit_seconds']:.1f}s "
            f"({r['audit_seconds'] / r['seconds']:.1%} of its time), deferred {r['deferred']} "
            f"times, {r['skipped']} unaudited; {r['polls']} polls in {r['seconds']:.1f}s "
            f"(slowest {r['slowest_poll']:.2f}s); requests {fmt_ops(ops)} = "
            f"{sum(ops.values()) / r['seconds']:.0f}/s")


def results(quick: bool = False) -> list[Row]:
    from bench.s3_checkpoint import start
    from bench.trl_time_to_accuracy import shared_start
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.storage import open_storage
    from volunteer_rl.task.calculator_task import CalculatorTask

    sizes = QUICK if quick else FULL
    cfg = TrainerConfig(bucket="unused").with_task_defaults(CalculatorTask())
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "testing"  # moto accepts any key; never send real ones to it
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    began = time.perf_counter()
    model = shared_start(sizes.warm_start_steps)
    pool = v0_pool(cfg)
    t0 = time.perf_counter()
    items, held = honest_shards(model, sizes, pool)
    log(f"{sizes.volunteers} volunteers sampled {held['groups']} groups honestly in "
        f"{time.perf_counter() - t0:.0f}s ({held['varied']} with reward variance, "
        f"{held['mean_tokens']:.1f} tokens per completion)")
    server, endpoint = start([str(ROOT / "infra" / "s3_server.py")], "the moto server")
    try:
        reset_and_make(endpoint, [BUCKET])
        t0 = time.perf_counter()
        upload(open_storage(f"s3://{BUCKET}", endpoint), items)
        log(f"{len(items)} shards written in {time.perf_counter() - t0:.0f}s; set-up "
            f"{time.perf_counter() - began:.0f}s in all")
        spec = {"endpoint": endpoint, "bucket": BUCKET, "model": str(model), "pool": list(pool),
                "keys": [k for k, _ in items], "max_polls": sizes.max_polls,
                "max_seconds": sizes.max_seconds}
        rows = []
        for trusted in (False, True):
            fleet = "trusted" if trusted else "new"
            with tempfile.TemporaryDirectory(prefix="vrl-intake-ranks-") as tmp:
                sides = {}
                for name, n in (("one process", 1), (f"{RANKS} ranks", RANKS)):
                    t0 = time.perf_counter()
                    sides[n] = run_side({**spec, "trusted": trusted}, n, Path(tmp))
                    log(f"{fleet} fleet, {name}: {time.perf_counter() - t0:.0f}s with start-up")
                    describe(f"{fleet} fleet, {name}", sides[n])
            rows.append(row(sides, sizes, cfg, quick, trusted))
    finally:
        server.terminate()
        server.wait(30)
    return rows


def row(sides: dict, sizes: Sizes, cfg, quick: bool, trusted: bool) -> Row:
    """The row of one fleet (new: every shard due for an audit; trusted: audits at the floor)."""
    one, two = sides[1], sides[RANKS]
    for name, side in (("one process", one), (f"{RANKS} ranks", two)):
        rejected = Counter()
        for r in side:
            rejected.update(r["rejected"])
        if rejected:  # honest shards must pass: a rejection makes the figure meaningless
            raise SystemExit(f"{name}: shards rejected {dict(rejected)}: " + " | ".join(
                line for r in side for line in r["log"][:3]))
        if len({r["polls"] for r in side}) != 1:
            raise SystemExit(f"{name}: ranks polled {[r['polls'] for r in side]} times")
    left = {n: sum(r["left"] for r in side) for n, side in sides.items()}
    one_rate, one_s, one_groups = rate(one)
    two_rate, two_s, two_groups = rate(two)
    if not any(left.values()) and one_groups != two_groups:
        raise SystemExit(f"one process took {one_groups} groups, {RANKS} ranks {two_groups}")
    ratio = two_rate / one_rate
    unfinished = "" if not any(left.values()) else (
        f"; stopped at the bound ({sizes.max_seconds:.0f}s or {sizes.max_polls} polls) with "
        f"shards left: one process {left[1]}, {RANKS} ranks {left[RANKS]}")
    # A rank's shard GETs: its GETs less the denylist's, one per poll (Ingest._refresh_denylist).
    split = ", ".join(f"rank {r['rank']} took {r['shards']} shards of {r['owned']} its own "
                      f"({r['requests'].get('GetObject', 0) - r['polls']} shard GETs), "
                      f"{r['audited']} audited, {r['audit_seconds']:.0f}s replaying" for r in two)
    o = one[0]
    per_s = {n: sum(sum(r["requests"].values()) for r in side) / max(r["seconds"] for r in side)
             for n, side in sides.items()}
    fleet = "trusted" if trusted else "new"
    bound = ("audits at the floor's rate: listing, fetching, parsing and rescoring bound both sides"
             if trusted else "every shard due (new ids): admission by each process's audit "
             "budget bounds both sides")
    note = (f"moto {server_version()} in its own process on 127.0.0.1; {sizes.volunteers} {fleet} "
            f"volunteers x {sizes.shards} shard(s) of {sizes.groups} groups x K={cfg.k}, all v0, "
            f"sampled with committed noise; trainer defaults (audit share {cfg.audit_share:.0%}, "
            f"full audits below {cfg.audit_full_groups} clean groups); 1 torch thread per "
            f"process; one process: {o['shards']} shards, {o['audited']} audited "
            f"({o['audit_seconds']:.0f}s replaying), {o['polls']} polls in {one_s:.0f}s, "
            f"{per_s[1]:.0f} requests/s; {RANKS} ranks: {two[0]['polls']} polls, slowest "
            f"{two_s:.0f}s, {per_s[RANKS]:.0f} requests/s, {split}; no shard rejected; {bound}; "
            f"{os.cpu_count()} cores shared by the ranks and moto{unfinished}")
    return Row(f"trainer intake + audits, {sizes.volunteers} {fleet} volunteers on moto, {RANKS} ranks",
               "groups/s taken, audits on", two_rate, one_rate, ratio, f">= {GOAL}x",
               ratio >= GOAL, COMMAND + (" --quick" if quick else ""), note)


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER]:
        sys.exit(worker(sys.argv[2]))
    sys.exit(cli(results, __doc__))
