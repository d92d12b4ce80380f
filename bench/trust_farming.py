"""Lying groups a volunteer gets trained by farming trust with small shards, then sending big
lying ones (issue 26, row b). A measurement of the audit policy alone: which shards are
audited, what a rejection re-audits, when the volunteer is denied.

    python -m bench.trust_farming [--quick] [--json PATH]

Each trial drives the trainer's own intake (`trainer.ingest.Ingest` with its `Auditor`,
`Fleet` and `Ledger`, every default of TrainerConfig: audit share, full-audit groups, floor,
--deny-after, --deny-rate) over an in-memory bucket, with a stand-in task (token t < 100 reads
as the digit string of t) and a stand-in replay that fails exactly the lying groups: the
real replay rejects a group that was not sampled with its committed noise (bench.replay_noise
and tests/unit/test_replay.py measure that part), so what is left to measure is the policy.
The audit budget is not the limit here (one volunteer, a replay that takes no time).

The volunteer:
1. farms trust: honest shards of FARM_SHARD_GROUPS groups, enough that its rate is at the
   floor (audit_full_groups / floor clean groups; 1,000 shards of 2 groups at the defaults,
   under the 1,024 objects per volunteer and version the trainer considers)
   all in version 0;
2. then sends LYING_SHARDS shards of SHARD_GROUPS_LIMIT (256) lying groups, one per poll, in
   version 1 (the window holds both).
Between polls the trainer trains every group it was handed (the worst case: nothing waits,
so a re-audit after a rejection finds nothing left to withdraw). Measured: the share of its
lying groups kept out of steps, and whether it ends on the denylist. Baseline: the same trials
with trust and audits counted per shard (the policy before issue 26: a shard audited at the
volunteer's rate whatever its size, denial by the share of shards), at that policy's floor (5 % of shards), with the same code otherwise. Goal: at least 99 % kept out (at most 1 % trained), and the volunteer denied.
"""

from __future__ import annotations

import random
import sys
from contextlib import contextmanager
from unittest import mock

from bench.common import Row, cli

COMMAND = "python -m bench.trust_farming"
LYING_SHARDS = 100
FARM_SHARD_GROUPS = 2
FLOOR_BEFORE = 0.05
"""The audit floor before issue 26, per shard (full audits for the first 10 shards then)."""
EOS = 100


def _rules():
    from volunteer_rl.task.base import in_process
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import Problem
    from volunteer_rl.trainer.checks import Rules

    problems = [Problem(0, "add 5 and 7", "5 + 7"), Problem(1, "double 4", "4 * 2")]
    return Rules([p.row for p in problems], vocab_size=EOS + 1, k=2, max_new_tokens=8,
                 decode=lambda ids: "".join(str(t) for t in ids), eos_id=EOS,
                 special_ids=frozenset({EOS}), rewards=in_process(CalculatorTask()))


def _group(vol: str, version: int, seq: int, n: int):
    """A group of prompt 1 ("4 * 2"): one right completion, one wrong one made unique by `n`."""
    from volunteer_rl.protocol.shards import Completion, Group

    tokens = [[8, EOS], [n // 10_000 + 1, n // 100 % 100, n % 100, EOS]]
    return Group(1, version, vol, seq, [Completion(t, [-0.5] * len(t), "", r)
                                   for t, r in zip(tokens, (1.0, 0.0))])


@contextmanager
def per_shard_policy():
    """The policy before issue 26: a shard audited at its volunteer's rate whatever its size,
    and denial by the share of rejected shards only."""
    from volunteer_rl.trainer import audit, fleet

    note = fleet.Fleet.note

    def by_shards(self, volunteer, accepted, groups=1):
        return note(self, volunteer, accepted, 1)

    with mock.patch.object(audit, "shard_chance", lambda rate, groups: rate), \
            mock.patch.object(fleet.Fleet, "note", by_shards):
        yield


def trial(seed: int, floor: float | None = None) -> dict:
    """One volunteer's run: lying groups sent and trained, shards rejected, denied or not.
    `floor`: the audit floor (default: TrainerConfig's)."""
    from volunteer_rl.config import TrainerConfig
    from volunteer_rl.protocol import layout
    from volunteer_rl.protocol.ledger import Ledger
    from volunteer_rl.protocol.shards import SHARD_GROUPS_LIMIT, encode_shard
    from volunteer_rl.storage import open_storage
    from volunteer_rl.trainer.audit import Auditor, Budget
    from volunteer_rl.trainer.fleet import Fleet
    from volunteer_rl.trainer.groups import IngestStats, Window
    from volunteer_rl.trainer.ingest import Ingest

    cfg = TrainerConfig(bucket="")
    storage = open_storage(f"memory://trust-farming-{seed}-{random.random()}")
    lies: set[int] = set()

    def replay(version, groups):
        bad = [g for g in groups if g.seq in lies]
        return ("replay_mismatch", f"seq {bad[0].seq}") if bad else None

    fleet = Fleet(cfg.deny_after, cfg.deny_rate)
    ingest = Ingest(storage, _rules(), Ledger(), fleet,
                    Auditor(replay, Budget(cfg.audit_share), cfg.audit_full_groups,
                            floor or cfg.audit_floor, random.Random(seed)), log=lambda m: None)
    win, vol, seq = Window(1, 1, {0, 1}), "farmer", 0
    trained_lies = 0

    def poll():
        nonlocal trained_lies
        out = ingest.poll(win, IngestStats())
        for key in {g.key for g in out}:  # the trainer trains whatever it is handed
            gs = [g for g in out if g.key == key]
            ingest.ledger.record(key, "trained", [g.line for g in gs], gs[0].shard_size,
                                 [g.digest for g in gs], step=1)
        trained_lies += sum(g.seq in lies for g in out)

    farm = -(-int(cfg.audit_full_groups / cfg.audit_floor) // FARM_SHARD_GROUPS)
    for i in range(farm):
        groups = [_group(vol, 0, seq + j, seq + j) for j in range(FARM_SHARD_GROUPS)]
        storage.write(layout.shard_key(0, vol, f"a{i:06d}"), encode_shard(groups))
        seq += FARM_SHARD_GROUPS
    farmed = [layout.shard_key(0, vol, f"a{i:06d}") for i in range(farm)]
    while not all(ingest.ledger.finished(k) for k in farmed):
        poll()
    clean_after_farming = fleet.clean(vol)
    for i in range(LYING_SHARDS):
        if fleet.is_denied(vol):
            break
        groups = [_group(vol, 1, seq + j, seq + j) for j in range(SHARD_GROUPS_LIMIT)]
        lies.update(g.seq for g in groups)
        seq += SHARD_GROUPS_LIMIT
        storage.write(layout.shard_key(1, vol, f"b{i:06d}"), encode_shard(groups))
        poll()
    return {"sent": LYING_SHARDS * SHARD_GROUPS_LIMIT, "trained": trained_lies,
            "denied": fleet.is_denied(vol), "clean_after_farming": clean_after_farming,
            "rejected": fleet.counts[vol].rejected, "farm": farm}


def summary(trials: list[dict]) -> tuple[float, int]:
    sent = sum(t["sent"] for t in trials)
    return 1 - sum(t["trained"] for t in trials) / sent, sum(t["denied"] for t in trials)


def results(quick: bool) -> list[Row]:
    from volunteer_rl.config import TrainerConfig

    n = 2 if quick else 10
    now = [trial(seed) for seed in range(n)]
    with per_shard_policy():
        before = [trial(seed, FLOOR_BEFORE) for seed in range(n)]
    for name, ts in (("groups", now), ("shards", before)):
        for t in ts:
            print(f"{name}: {t}", flush=True)
    kept, denied = summary(now)
    kept_before, denied_before = summary(before)
    worst = max(t["trained"] for t in now)
    cfg = TrainerConfig(bucket="")
    goal = kept >= 0.99 and denied == n
    return [Row("trust farmed with small shards, then big lying ones",
                "share of its lying groups kept out of steps", kept, kept_before,
                kept / kept_before if kept_before else float("inf"), ">= 0.99, and denied", goal,
                COMMAND + (" --quick" if quick else ""),
                f"{n} trials; each farms {now[0]['farm']:,} honest shards of {FARM_SHARD_GROUPS} groups (rate at the floor "
                f"{cfg.audit_floor:g} per group), then sends up to {LYING_SHARDS} shards of 256 lying groups, "
                f"one per poll, every group handed out trained before the next poll; trainer defaults "
                f"(full audit below {cfg.audit_full_groups} clean groups, deny after {cfg.deny_after} at "
                f"{cfg.deny_rate:.0%}); stand-in replay failing exactly the lying groups. Denied in "
                f"{denied}/{n} (baseline {denied_before}/{n}); most lying groups trained in one trial "
                f"{worst:,} of {now[0]['sent']:,}; baseline: trust and audits per shard, floor {FLOOR_BEFORE:g} "
                f"per shard, as before issue 26")]


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
