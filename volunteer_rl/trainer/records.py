"""What the trainer writes down about its run: each step's metrics line and log line, the
evaluation of a published version on the held-out prompts (its eval line), the metrics of
the steps and evals that led to a version as one write-once object (and to --report-to),
fleet.json and dashboard/ for people, the ledger's records of the groups it took, and the
line that says why it waits for rollouts.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from typing import Callable

from volunteer_rl.config import TrainerConfig
from volunteer_rl.observe.dashboard import TrainerDashboard
from volunteer_rl.protocol import layout, metrics
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.stopping import Stopped, StopSignal
from volunteer_rl.storage.base import Storage
from volunteer_rl.task.base import Row, Task
from volunteer_rl.trainer.balance import Balance
from volunteer_rl.trainer.evaluate import greedy_and_sampled
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.fleet_summary import FleetSummary
from volunteer_rl.trainer.held import HeldWeights
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup
from volunteer_rl.trainer.reporters import Reporters
from volunteer_rl.trainer.step import StepResult
from volunteer_rl.trainer.warmstart import solved_at_v0
from volunteer_rl.trainer.withheld import GroupNumbers


def waiting_line(usable: int, stats: IngestStats, wanted: int, step: int) -> str:
    """Why the trainer waits for rollouts before step `step` + 1 (most groups of a weak
    policy have one reward for all K, and those teach nothing)."""
    since = f"since step {step}" if step else "so far"
    return (f"{usable} usable group{'s' * (usable != 1)}, {stats.zero_variance} without reward "
            f"variance (of {stats.groups} received {since}), waiting for {wanted}")


def record_groups(ledger: Ledger, groups: list[ScoredGroup], outcome: str,
                  step: int | None = None) -> None:
    """Ledger records for `groups`, one per shard; `trained` ones with the completion
    tokens of their groups and the time now (what credit counts, protocol.credit)."""
    by_key: dict[str, list[ScoredGroup]] = {}
    for g in groups:
        by_key.setdefault(g.key, []).append(g)
    trained = outcome == "trained"
    now = time.time()
    for key, gs in by_key.items():
        tokens = sum(len(c) for g in gs for c in g.token_ids) if trained else None
        ledger.record(key, outcome, [g.line for g in gs], gs[0].shard_size,
                      [g.digest for g in gs], step=step, tokens=tokens,
                      at=now if trained else None)


class Records:
    """The metrics of the next version (step and eval lines), its views and its flush."""

    def __init__(self, cfg: TrainerConfig, storage: Storage, log: Callable[[str], None],
                 stop: StopSignal, task: Task, held_out: list[Row], held: HeldWeights,
                 reporters: Reporters, world_size: int):
        self.cfg, self.storage, self.log, self.stop = cfg, storage, log, stop
        self.task, self.held_out, self.held, self.reporters = task, held_out, held, reporters
        self.buffer: list[dict] = []  # the metrics lines of the next version's object
        self.fleet_summary = FleetSummary(storage, log,  # fleet.json, for `vrl status`
                                          ranks=world_size)
        self.dashboard = TrainerDashboard(storage, cfg.dashboard_every, log)  # dashboard/

    def step(self, step: int, version: int, batch: list[ScoredGroup], result: StepResult,
             stats: IngestStats, stale_dropped: int, timing: dict[str, float],
             balance: Balance) -> None:
        """Step `step`'s metrics line, and its one log line."""
        rewards = [r for g in batch for r in g.rewards]
        lags = Counter(version - g.policy_version for g in batch)
        m = {
            metrics.KIND: metrics.STEP_LINE, metrics.STEP: step, metrics.VERSION: version,
            metrics.TIME: time.time(),
            metrics.REWARD_MEAN: sum(rewards) / len(rewards),
            # None when nothing new arrived since the last step (the batch came from the buffer)
            "rollout/frac_reward_zero_std": stats.zero_variance / stats.groups if stats.groups else None,
            metrics.STALENESS_HIST: {str(k): v for k, v in sorted(lags.items())},
            "rollout/stale_dropped": stale_dropped,
            metrics.GROUPS: len(batch), "rollout/tokens": result.tokens,
            metrics.SOURCES: dict(Counter(g.key for g in batch)),
            "ingest/shards": stats.shards, metrics.INGEST_GROUPS: stats.groups,
            "ingest/rejected": dict(stats.rejected),
            "ingest/duplicates": stats.duplicates, "ingest/denied_shards": stats.denied,
            "ingest/over_cap": stats.over_cap, "ingest/trainer_errors": stats.trainer_errors,
            "ingest/held_missing": stats.held_missing,
            "ingest/by_volunteer": stats.by_volunteer,
            "ingest/reward_seconds": stats.reward.seconds,
            "ingest/reward_poll_max": stats.reward.poll_max,
            "ingest/reward_deferred": stats.reward.deferred,
            "ingest/reward_waiting": stats.reward.waiting,
            metrics.USEFUL_FRACTION: balance.useful_fraction(time.time()),
            metrics.USABLE_FRACTION: balance.usable_fraction(time.time()),
            "audit/shards": stats.audit.audited, "audit/skipped": stats.audit.skipped,
            "audit/deferred": stats.audit.deferred, "audit/seconds": stats.audit.seconds,
            "audit/by_volunteer": stats.audit.by_volunteer,
            "verify/groups": stats.audit.verified, "verify/failed": stats.audit.verify_failed,
            "verify/seconds": stats.audit.verify_seconds,
            "train/loss": result.loss, "train/grad_norm": result.grad_norm,
            **timing,
            **{f"train/{k}": v for k, v in result.stats.items()},
        }
        self.buffer.append(m)
        zero = m["rollout/frac_reward_zero_std"]
        self.log(f"step {step} v{version} reward {m[metrics.REWARD_MEAN]:.3f} "
                 f"lag {dict(sorted(lags.items()))} zero-std {'-' if zero is None else f'{zero:.2f}'} "
                 f"dropped {stale_dropped} loss {result.loss:+.4f} ({timing['train/step_time']:.2f}s)")

    def evaluate(self, version: int, full: bool = False) -> dict[str, float]:
        """`version`'s accuracy on the held-out prompts (all of them if `full`, else the first
        --eval-prompts), with its weights as volunteers run them (held.HeldWeights.published):
        logged, and an eval line in the metrics."""
        problems = self.held_out if full else self.held_out[: self.cfg.eval_prompts]
        res = greedy_and_sampled(self.held.published(version), self.task, problems,
                                 self.cfg.temperature, self.cfg.eval_samples, self.cfg.max_new_tokens,
                                 log=self.log, label=f"eval v{version}")
        self.log(f"eval v{version} on {len(problems)} held-out prompts: greedy "
                 f"{res[metrics.ACCURACY_GREEDY]:.1%}, sampled (T={self.cfg.temperature}) "
                 f"{res[metrics.ACCURACY_SAMPLED]:.1%}")
        if version == 0 and (solved := solved_at_v0(res[metrics.ACCURACY_SAMPLED],
                                                    res[metrics.ACCURACY_GREEDY])):
            self.log(solved)
        self.buffer.append({metrics.KIND: metrics.EVAL_LINE, metrics.VERSION: version,
                            metrics.TIME: time.time(), metrics.EVAL_PROMPTS: len(problems),
                            **res})
        return res

    def evaluate_unless_stopping(self, version: int, full: bool = False) -> None:
        """`evaluate`, but a stop signal skips it or cuts it short: it only reads and
        computes, and a full one (500 prompts) takes far longer than the few seconds a stop
        may. The version's metrics then go out without it."""
        try:
            with self.stop.abortable():
                self.evaluate(version, full)
        except Stopped as exc:
            self.log(f"signal {exc.signum}: no eval of v{version}, stopping")

    def flush(self, version: int, run_id: str) -> None:
        """Metrics of the steps that led to `version`, as one write-once object."""
        body = "".join(json.dumps(m, sort_keys=True) + "\n" for m in self.buffer)
        self.storage.create(layout.metrics_key(version), body.encode())
        self.reporters.record(self.buffer, run_id)  # --report-to (the writer's)
        self.buffer = []

    def write_views(self, manifest: Manifest, steps: int, fleet: Fleet, numbers: GroupNumbers,
                    peers: dict[int, dict], balance: Balance, final: bool) -> None:
        """fleet.json and dashboard/, for people: each written when its cadence says so, and
        at the end. Neither can fail the trainer. `peers`: under ranks, the other ranks'
        volunteers' counts and numbers as of the last save, shown with this rank's."""
        records = metrics.parse_lines(self.buffer)  # once, for both
        if peers:
            fleet = copy.copy(fleet)
            fleet.counts = dict(fleet.counts)
            numbers = GroupNumbers(by=dict(numbers.by))
            for peer in peers.values():  # (our own ranks' JSON: a ValueError is a bug)
                theirs = Fleet()
                theirs.load_counts(peer["volunteers"])
                fleet.counts.update(theirs.counts)
                numbers.by.update(GroupNumbers.from_json(peer["group_numbers"]).by)
        self.fleet_summary.after_publish(manifest, steps, records, fleet, final, numbers,
                                         balance, self.cfg.missing_bound)
        self.dashboard.after_publish(records, final)
