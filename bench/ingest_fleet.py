"""Trainer ingest at fleet scale: shards of 1,000 volunteers on the S3 test server.

    python -m bench.ingest_fleet [--quick] [--json PATH]

Set-up (not measured). moto's S3 server (infra/s3_server.py) runs in its own process on
127.0.0.1. A tiny policy is built as the trainer builds it (byte-level BPE, Llama-shaped
model, a short supervised warm start) and samples real groups (`sampling.sample`, K = 8, T = 1)
for prompts of data/train.csv; each completion's reward is the task's `reward`. Those groups
are encoded with the product's `encode_shard` and written with the product's `S3Storage`
(`open_storage("s3://...")`, create-only PUTs, 16 threads) as the shards of VOLUNTEERS
simulated volunteers under `rollouts/vNNNNNN/<volunteer>/<shard>.jsonl.gz`, into two buckets
that differ only in history:

- `short`: H1 versions; `long`: H2 >> H1 versions. Every old version holds the shards of a
  fifth of the fleet; the three versions of the window (staleness 2, the trainer's default)
  hold one shard of every volunteer, the same groups in both buckets. Within a version no
  group repeats (the pool has a distinct prompt per group slot, the later arrivals below
  included), so the ledger's duplicate check neither thins the figures nor leaves a shard
  of nothing but repeats.

Measured, on the `long` bucket, same shards, same server, same process:

- vrl: the product's `Ingest.poll` as the trainer's loop calls it (roles.Single.intake_round), with a real `Rules` (tokenizer
  decode, reward recomputation and its cache), `Ledger` and `Fleet`, audit off (the audit is a
  forward pass of the policy, a cost of the model and not of ingest), one poll that finds
  the whole window new: LIST of the window's prefixes, parallel GETs (FETCH_WORKERS), every
  group checked and rescored on the calling thread.
- naive: what a first trainer would do: one LIST of the whole `rollouts/` prefix, keep the
  keys of the window's versions, then one GET and the full check of each shard in a plain
  loop (the product's own `fetch_shard` + `check_shard`, so both sides do the very same
  validation and the ratio is the cost of fetching and listing, not of a weaker check).

shards/s = shards accepted / seconds; groups/s = groups in the accepted shards / seconds.
Each side gets a fresh Rules (empty reward cache) and ledger, best of two rounds.

Requests per trainer step are counted at the HTTP level (a botocore `before-send` hook on
the client of the trainer's storage: LIST pages, GETs, PUTs, retries included). After a
first catch-up poll, STEPS trainer steps follow; before each, ARRIVALS volunteers upload one
new shard into the current version, then the trainer polls once. The figure is the mean per
step on the `long` bucket against the same on the `short` one: the ingest's requests depend
on the window and on what arrived, not on history, so the ratio should be 1. The naive loop's
own figures (its LIST pages grow with the whole history) are printed beside it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, cli
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.shards import Completion, Group, encode_shard, new_shard_name

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m bench.ingest_fleet"


@dataclass
class Sizes:
    volunteers: int
    groups_per_shard: int
    short_history: int  # H1: versions in the short bucket
    long_history: int  # H2
    steps: int  # trainer steps with arrivals, for the request count
    arrivals: int  # new shards before each of those steps
    warm_start_steps: int
    rounds: int


FULL = Sizes(volunteers=1000, groups_per_shard=2, short_history=6, long_history=60, steps=5,
             arrivals=20, warm_start_steps=120, rounds=2)
QUICK = Sizes(volunteers=60, groups_per_shard=2, short_history=4, long_history=12, steps=2,
              arrivals=5, warm_start_steps=0, rounds=1)
STALENESS = 2  # the trainer's default max_staleness
HISTORY_SHARE = 5  # an old version holds the shards of 1 in this many volunteers
NUMBERS_PER_VERSION = 1000
"""A volunteer's group numbers run across the versions of a run (schema 6), growing with
them: its groups of version v are numbered from v * NUMBERS_PER_VERSION on."""


# ---------------------------------------------------------------------------------------------
# Set-up: a real policy, real groups, real shards in the bucket.

def make_policy_and_pool(sizes: Sizes):
    """(rules, pool): the trainer's Rules for a freshly built tiny policy, and one list of
    Completions per prompt sampled from it, enough for every group slot of one version: one
    shard per volunteer, then the arrivals of every counted step."""
    import torch

    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.model.policy import encode_prompts
    from volunteer_rl.model.sampling import sample
    from volunteer_rl.task.base import completion_reward, in_process
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_rows
    from volunteer_rl.trainer.checks import Rules
    from volunteer_rl.trainer.startup import initial_policy
    from volunteer_rl.trainer.preflight import dataset_paths

    task = CalculatorTask()
    cfg = TrainerConfig(bucket="unused", warm_start_steps=sizes.warm_start_steps,
                        seed=0).with_task_defaults(task)
    problems = load_rows(dataset_paths(cfg, task)[0], task)
    torch.manual_seed(0)
    policy = initial_policy(cfg, task, problems, torch.device("cpu"), log=lambda m: None)
    picked = problems[: (sizes.volunteers + sizes.steps * sizes.arrivals) * sizes.groups_per_shard]
    torch.manual_seed(1)
    out = sample(policy, encode_prompts(policy, [task.prompt(p) for p in picked], task.instruction),
                 cfg.k, cfg.temperature, cfg.max_new_tokens)
    pool = [(p.id, [Completion(s.token_ids, s.logprobs, s.text,
                               completion_reward(task, p, s.token_ids, policy.decode_all,
                                                 policy.eos_id, policy.special_ids))
                    for s in samples]) for p, samples in zip(picked, out)]

    def rules() -> Rules:
        return Rules(problems, len(policy.tokenizer), cfg.k, cfg.max_new_tokens,
                     policy.decode_all, policy.eos_id, policy.special_ids,
                     rewards=in_process(task))
    return rules, pool


def shard_bytes(pool, version: int, volunteer: int, seq: int, per_shard: int,
                slot: int) -> tuple[str, bytes]:
    """(key, encoded shard) of volunteer number `volunteer`'s shard `seq` of `version`, made of
    the pool's groups from slot number `slot` on."""
    vid = f"vol-{volunteer:04d}"
    first = version * NUMBERS_PER_VERSION + seq * per_shard
    assert (seq + 1) * per_shard <= NUMBERS_PER_VERSION
    groups = [Group(pid, version, vid, first + j, comps)
              for j, (pid, comps) in enumerate(pool[slot * per_shard: (slot + 1) * per_shard])]
    return layout.shard_key(version, vid, new_shard_name(seq)), encode_shard(groups)


def upload(storage, items: list[tuple[str, bytes]]) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kv: storage.create(*kv), items))


def fill_bucket(storage, pool, sizes: Sizes, history: int) -> int:
    """Versions 0..history-1: old ones with a fifth of the fleet, the window's with all of it.
    Returns the number of objects written."""
    top = history - 1
    items = []
    for v in range(history):
        everyone = v >= top - STALENESS
        for n in range(sizes.volunteers):
            if everyone or n % HISTORY_SHARE == v % HISTORY_SHARE:
                items.append(shard_bytes(pool, v, n, 0, sizes.groups_per_shard, slot=n))
    upload(storage, items)
    return len(items)


def new_arrivals(storage, pool, sizes: Sizes, version: int, step: int) -> None:
    """ARRIVALS volunteers upload one more shard each into `version` (set-up: not counted)."""
    first = sizes.volunteers + step * sizes.arrivals  # slots after the window's shards
    upload(storage, [shard_bytes(pool, version, (step * sizes.arrivals + i) % sizes.volunteers,
                                 step + 1, sizes.groups_per_shard, slot=first + i)
                     for i in range(sizes.arrivals)])


# ---------------------------------------------------------------------------------------------
# Counting what the trainer asks of the server.

class RequestCounter:
    """Counts every HTTP request a boto3 client sends (retries too), by S3 operation."""

    def __init__(self, client):
        self.by_op: Counter = Counter()
        self._lock = threading.Lock()
        client.meta.events.register("before-send.s3", self._count)

    def _count(self, event_name: str, **_) -> None:
        with self._lock:
            self.by_op[event_name.rsplit(".", 1)[-1]] += 1

    def total(self) -> int:
        return sum(self.by_op.values())

    def take(self) -> Counter:
        """The counts since the last take."""
        with self._lock:
            out, self.by_op = self.by_op, Counter()
        return out


def counted_storage(bucket: str, endpoint: str):
    """The trainer's storage (`open_storage`, Retrying over S3Storage) and its counter."""
    from volunteer_rl.storage import open_storage

    storage = open_storage(f"s3://{bucket}", endpoint)
    return storage, RequestCounter(storage.inner.client)


# ---------------------------------------------------------------------------------------------
# The two ways to ingest.

def window_of(history: int):
    from volunteer_rl.trainer.groups import Window

    top = history - 1
    return Window(top, STALENESS, set(range(top - STALENESS, top + 1)))


def new_ingest(storage, rules):
    from volunteer_rl.protocol.ledger import Ledger
    from volunteer_rl.trainer.fleet import Fleet
    from volunteer_rl.trainer.ingest import Ingest

    return Ingest(storage, rules, Ledger(), Fleet(), auditor=None, log=lambda m: None)


def vrl_poll(ingest, win) -> tuple[int, int, int]:
    """(shards, groups, usable groups) of one Ingest.poll."""
    from volunteer_rl.trainer.groups import IngestStats

    stats = IngestStats()
    usable = ingest.poll(win, stats)
    if stats.rejected:
        raise SystemExit(f"the product rejected bench shards: {dict(stats.rejected)}")
    return stats.shards, stats.groups, len(usable)


class Naive:
    """LIST all of rollouts/, keep the window's keys, GET and check each new one in turn."""

    def __init__(self, storage, rules):
        self.storage, self.rules, self.seen = storage, rules, set()

    def poll(self, win) -> tuple[int, int, int]:
        from volunteer_rl.trainer.checks import check_shard, fetch_shard

        shards = groups = 0
        for key in self.storage.list(layout.ROLLOUTS):
            parsed = layout.parse_shard_key(key)
            if key in self.seen or parsed is None or parsed[0] not in win.versions():
                continue
            groups += len(check_shard(fetch_shard(self.storage, key), key, self.rules, win))
            shards += 1
            self.seen.add(key)
        return shards, groups, groups


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


# ---------------------------------------------------------------------------------------------
# The measurements.

def throughput(endpoint: str, bucket: str, history: int, rules, rounds: int) -> dict:
    """Best seconds of a whole-window poll, vrl and naive, alternating; and their counts."""
    win = window_of(history)
    best: dict[str, tuple[float, tuple]] = {}
    for _ in range(rounds):
        for name in ("naive", "vrl"):
            storage, _ = counted_storage(bucket, endpoint)
            if name == "naive":
                seconds, counts = timed(Naive(storage, rules()).poll, win)
            else:
                seconds, counts = timed(vrl_poll, new_ingest(storage, rules()), win)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, counts)
    return best


def requests_per_step(endpoint: str, bucket: str, history: int, rules, pool,
                      sizes: Sizes) -> dict:
    """Requests of the catch-up poll and mean requests per step after it, vrl and naive.

    Both pollers run side by side on the same arrivals; uploads go through a storage of
    their own, so only the pollers' requests are counted."""
    from volunteer_rl.storage import open_storage

    win = window_of(history)
    writer = open_storage(f"s3://{bucket}", endpoint)
    vrl_store, vrl_count = counted_storage(bucket, endpoint)
    naive_store, naive_count = counted_storage(bucket, endpoint)
    ingest, naive = new_ingest(vrl_store, rules()), Naive(naive_store, rules())
    vrl_poll(ingest, win)
    naive.poll(win)
    first = {"vrl": vrl_count.take(), "naive": naive_count.take()}
    for step in range(sizes.steps):
        new_arrivals(writer, pool, sizes, win.version, step)
        got, _, _ = vrl_poll(ingest, win)
        naive_got, _, _ = naive.poll(win)
        if got != sizes.arrivals or naive_got != sizes.arrivals:
            raise SystemExit(f"step {step}: took {got} (naive {naive_got}) of {sizes.arrivals} new shards")
    steady = {"vrl": vrl_count.take(), "naive": naive_count.take()}
    return {"first": first, "steady": steady,
            "per_step": {k: sum(c.values()) / sizes.steps for k, c in steady.items()}}


def reset_and_make(endpoint: str, buckets: list[str]) -> None:
    import boto3

    sys.path.insert(0, str(ROOT / "infra"))
    from s3_server import reset

    reset(endpoint)
    client = boto3.client("s3", endpoint_url=endpoint)
    for b in buckets:
        client.create_bucket(Bucket=b)


def fmt_ops(c: Counter) -> str:
    return " ".join(f"{op} {n}" for op, n in sorted(c.items()))


def results(quick: bool = False) -> list[Row]:
    from bench.s3_checkpoint import start

    sizes = QUICK if quick else FULL
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ[name] = "testing"  # moto accepts any key; never send real ones to it
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    t0 = time.perf_counter()
    rules, pool = make_policy_and_pool(sizes)
    usable_share = sum(max(c.reward for c in comps) != min(c.reward for c in comps)
                       for _, comps in pool) / len(pool)
    print(f"policy and {len(pool)} groups sampled in {time.perf_counter() - t0:.0f}s "
          f"({usable_share:.0%} with reward variance)", flush=True)
    server, endpoint = start([str(ROOT / "infra" / "s3_server.py")], "the moto server")
    try:
        from volunteer_rl.storage import open_storage

        buckets = {"short": ("vrl-ingest-short", sizes.short_history),
                   "long": ("vrl-ingest-long", sizes.long_history)}
        reset_and_make(endpoint, [b for b, _ in buckets.values()])
        for label, (bucket, history) in buckets.items():
            t0 = time.perf_counter()
            n = fill_bucket(open_storage(f"s3://{bucket}", endpoint), pool, sizes, history)
            print(f"{label} bucket: {history} versions, {n} shards written in "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
        long_bucket, long_history = buckets["long"]
        best = throughput(endpoint, long_bucket, long_history, rules, sizes.rounds)
        for name, (seconds, (shards, groups, usable)) in best.items():
            sorted_out = f" ({usable} usable)" if name == "vrl" else ""
            print(f"{name:5}: whole window {shards} shards, {groups} groups{sorted_out} "
                  f"in {seconds:.2f}s: {shards / seconds:.0f} shards/s, "
                  f"{groups / seconds:.0f} groups/s", flush=True)
        counts = {label: requests_per_step(endpoint, bucket, history, rules, pool, sizes)
                  for label, (bucket, history) in buckets.items()}
        for label, c in counts.items():
            for who in ("vrl", "naive"):
                print(f"{label:5} ({buckets[label][1]:3} versions) {who:5}: catch-up poll "
                      f"{fmt_ops(c['first'][who])}; {sizes.steps} steps "
                      f"{fmt_ops(c['steady'][who])} = {c['per_step'][who]:g}/step", flush=True)
    finally:
        server.terminate()
        server.wait(30)

    (vs, (v_shards, v_groups, v_usable)), (ns, (n_shards, n_groups, _)) = best["vrl"], best["naive"]
    if (v_shards, v_groups) != (n_shards, n_groups):
        raise SystemExit(f"vrl took {v_shards}/{v_groups}, naive {n_shards}/{n_groups}")
    where = (f"moto {server_version()} in its own process on 127.0.0.1; {sizes.volunteers} "
             f"volunteers, window {STALENESS + 1} versions = {v_shards} shards of "
             f"{sizes.groups_per_shard} groups x K=8, history {long_history} versions")
    rows = []
    for measure, v, n in (("shards/s validated", v_shards / vs, n_shards / ns),
                          ("groups/s batched", v_groups / vs, n_groups / ns)):
        rows.append(Row("trainer ingest, whole window", measure, v, n, v / n,
                        "> 1 (faster than the naive loop)", v / n > 1, COMMAND,
                        f"naive: LIST all rollouts/ then sequential GET + fetch_shard + check_shard per "
                        f"shard; vrl: Ingest.poll, audit off, {v_usable} groups usable; {where}"))
    short_rq, long_rq = counts["short"]["per_step"], counts["long"]["per_step"]
    ratio = long_rq["vrl"] / short_rq["vrl"]
    rows.append(Row(
        "trainer ingest, storage requests", "HTTP requests per trainer step", long_rq["vrl"],
        short_rq["vrl"], ratio, "~1 (independent of history)", abs(ratio - 1) <= 0.05, COMMAND,
        f"vrl = history {sizes.long_history} versions, baseline = history "
        f"{sizes.short_history} versions, same window (staleness {STALENESS}); ratio is "
        f"H2/H1, not a speed-up; per step {sizes.arrivals} new shards arrive; the naive "
        f"LIST-everything loop needs {short_rq['naive']:g} -> {long_rq['naive']:g}/step"))
    return rows


def server_version() -> str:
    from importlib.metadata import version

    return version("moto")


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
