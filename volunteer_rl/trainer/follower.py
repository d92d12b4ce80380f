"""A follower rank under torchrun (every rank but 0): it starts from what the writer
(trainer.writer) published and tells it, then does what the writer tells, one message at a
time, until it says stop: poll its share of the fleet and step on the agreed batch, reject a
refused step's shards of its volunteers, take part in each gather of the full weights, and
before each manifest save its optimizer shards and report its ledger records and counts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.policy import load_policy
from volunteer_rl.model.weights import gather_along
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.ledger import rebuild
from volunteer_rl.protocol.manifest import Manifest, poll_manifest
from volunteer_rl.protocol.signing import Trust, parse_private_key
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup, Window
from volunteer_rl.trainer.preflight import TrainerError
from volunteer_rl.trainer.ranks import barrier, broadcast_bytes, collective_errors, full_state_dict
from volunteer_rl.trainer.records import record_groups
from volunteer_rl.trainer.roles import Ranked


class Follower(Ranked):
    """A rank other than 0: it starts from the writer's start and does what it tells."""

    def __init__(self, *args):
        super().__init__(*args)
        self.trust: Trust | None = None  # the writer's key, once it told it
        self.observed: list[list] = []  # curriculum observations not yet sent to the writer
        self.gathered = None  # the last gather's full weights, with audits

    def start(self, lead: Callable[[], None]) -> None:
        """Not `lead`: the writer's trust key and where the run stands (once the writer has
        started), the model the manifest names as its skeleton (architecture and tokenizer;
        any weights), the window's ledger as committed and, with audits, the window's weights
        (both read from the bucket, as the writer reads them on a resume), its intake of its
        share of the fleet, then its shard of the writer's own weights (fp32 master
        included)."""
        with collective_errors(self.ranks, "while starting"):
            self._start()

    def _start(self) -> None:
        cfg, p, learner = self.cfg, self.publisher, self.publisher.learner
        start = json.loads(broadcast_bytes(None, self.ranks))
        self.trust = Trust(start["trust_key"], cfg.allow_unsigned, origin="the writer rank's key")
        p.key = parse_private_key(start["key"].encode(), "the writer rank's signing key")
        p.manifest, _ = poll_manifest(p.storage, None, trust=self.trust)
        if p.manifest is None:  # the writer told us it published: a bug, or a second trainer
            raise TrainerError(f"{layout.MANIFEST}: missing after the writer rank started")
        p.run_id = p.manifest.run_id
        scratch = Path(cfg.work_dir) / f"rank-{self.ranks.rank}"  # checkpoint downloads
        folder = fetch_checkpoint(p.storage, p.manifest, scratch / "model", require_model=True)
        learner.hold(load_policy(folder, self.ranks.device,
                                 weights=not learner.lean))  # lean: a skeleton
        learner.steps, p.published = int(start["steps"]), set(start["published"])
        self.keep_own_volunteers(start)
        p.ledger = rebuild(p.storage, sorted(p.published))
        p.ledger.prune(p.window().low)
        self.make_intake(self.trust)  # with audits its unsharded copy is made here, unsharded
        learner.shard_and_load({}, start["moments"], p.version)

    def run(self, loop: Callable[[], Manifest]) -> Manifest:
        """Not `loop`: follow the writer; leave with it when it says stop."""
        manifest = self.follow()
        self.leave_together()
        return manifest

    def observe(self, pid: int, rewards: list[float]) -> None:
        """The writer's curriculum learns them (poll_report)."""
        self.observed.append([pid, rewards])

    def poll_report(self, stats: IngestStats, stale: int) -> dict:
        report = {"stats": stats.to_json(), "stale": stale, "observed": self.observed,
                  "received": dict(self.publisher.fleet.take_received())}
        self.observed = []
        return report

    def follow(self) -> Manifest:
        """Do what the writer tells, until it says stop. Returns the manifest the writer
        left (as read from the bucket)."""
        cfg, p, learner = self.cfg, self.publisher, self.publisher.learner
        buffer: list[ScoredGroup] = []
        batch: list[ScoredGroup] = []
        stats = IngestStats()  # what this rank's intake did since it last reported to the writer
        while True:
            message = json.loads(broadcast_bytes(None, self.ranks))
            do = message["do"]
            if do == "poll":  # our share of the intake, then the step if the ranks have a batch
                w = message["window"]
                win = Window(w["version"], cfg.max_staleness, set(w["published"]),
                             {int(v): tuple(pool) for v, pool in w["pools"].items()})
                buffer, batch, _, _ = self.intake_round(buffer, stats, win)
                stats = IngestStats()  # reported with the batch exchange
                if batch is None:
                    continue
                batch, passed = self.verified(batch, stats)  # as the writer does, together
                if batch is None:
                    buffer = passed + buffer
                    continue
                result = learner.step(batch, self.prompt_ids, win.version)
                if result.applied:  # the same decision on every rank (ranks.sum_over_ranks)
                    learner.steps += 1
                    record_groups(p.ledger, self.own(batch), "trained", learner.steps)
            elif do == "reject":  # the step on `batch` was refused: the writer names the culprits
                buffer = self.reject(message["keys"], self.own(batch) + buffer, stats)
            elif do == "gather":
                self.gathered = full_state_dict(learner.policy.model, self.ranks,
                                                everyone=message["everyone"]) or None
            elif do == "stream":  # the writer publishes (`lean`), gathering tensor by tensor
                gather_along(learner.policy.model)
            elif do == "save":  # before the writer commits the version: our part of its state
                version = message["version"]
                learner.save_shards(version)
                self._report_to_writer(version)
                barrier(self.ranks)
            elif do == "stop":
                manifest, _ = poll_manifest(p.storage, None, trust=self.trust)
                return manifest or p.manifest

    def _report_to_writer(self, version: int) -> None:
        """Before the writer commits `version`: this rank's ledger records (the writer writes
        them with its own, before the manifest), its volunteers' counts and numbers (saved in
        the writer's state, shown in fleet.json); then, with audits, the version's weights as
        volunteers load them (from the gather before), for its share's audits."""
        p = self.publisher
        self.share.exchange({"ledger": p.ledger.pending, "volunteers": p.fleet.to_json(),
                             "group_numbers": p.numbers.to_json()})
        p.ledger.pending = []
        low = layout.window(version, self.cfg.max_staleness).start
        p.ledger.prune(low)
        if self.gathered is not None:
            p.held.keep_gathered(version, self.gathered, low)
            self.gathered = None
