"""The writer rank under torchrun (rank 0): it decides every step and publishes, as a single
process would, and tells the other ranks (trainer.follower) what to do next, one small JSON
message at a time, so that every poll, step and gathering of the full weights is done by all
ranks together. It keeps one unsharded copy of the model (held.HeldWeights.second), filled
by each gather, to publish, evaluate and audit from (`lean`: a skeleton bound to the
published file instead), and before each manifest it hears every follower's ledger records
and counts, saved with its own.
"""

from __future__ import annotations

import json
from typing import Callable

from volunteer_rl.protocol.signing import private_key_pem, public_key_text
from volunteer_rl.trainer.groups import IngestStats
from volunteer_rl.trainer.ranks import barrier, broadcast_bytes, collective_errors, full_state_dict
from volunteer_rl.trainer.roles import Ranked
from volunteer_rl.trainer.state import prepare_sharded


class Writer(Ranked):
    """Rank 0 of several: the single process's loop, and the followers told what to do."""

    def start(self, lead: Callable[[], None]) -> None:
        """Start as a single process would (built or resumed, v0 out), then share the model."""
        lead()
        with collective_errors(self.ranks, "while starting"):
            self._share_model(public_key_text(self.publisher.key))

    def _share_model(self, trust_key: str) -> None:
        """Tell the followers whose manifests to trust and where the run stands (its step,
        its window, every volunteer's counts and numbers: each keeps its own volunteers', and
        so does the writer), keep an unsharded copy of the model, then shard the model with
        the followers and give them its weights."""
        p = self.publisher
        learner, held = p.learner, p.held
        # The followers grant numbers to their volunteers and check their draws: they sign
        # grant objects and derive the grant secret with the writer's key (protocol.grants).
        start = {"trust_key": trust_key, "key": private_key_pem(p.key).decode(),
                 "steps": learner.steps, "published": sorted(p.published),
                 "volunteers": p.fleet.to_json(), "group_numbers": p.numbers.to_json(),
                 "moments": learner.moments}
        broadcast_bytes(json.dumps(start).encode(), self.ranks)
        self.keep_own_volunteers(start)
        if learner.lean:  # the architecture without the weights (see Learner.lean)
            held.make_skeleton()
        else:
            held.second_model()
        held.chain.spill()  # v0's file, when this run just published it
        full = {k: v.detach().cpu() for k, v in learner.policy.model.state_dict().items()}
        learner.shard_and_load(full, learner.moments, p.version)

    def tell(self, do: str, **fields) -> None:
        """The followers' next action (follower.Follower.follow)."""
        broadcast_bytes(json.dumps({"do": do, **fields}).encode(), self.ranks)

    def tell_poll(self) -> None:
        """The window as the followers' intake needs it, for their poll."""
        p = self.publisher
        self.tell("poll", window={"version": p.version, "published": sorted(p.published),
                                  "pools": {str(v): list(pool) for v, pool in p.pools.items()}})

    def hear_polls(self, reports: list[dict], stats: IngestStats) -> int:
        stale = 0
        for report in reports[1:]:
            stats.add_json(report["stats"])
            stale += report["stale"]
            self.publisher.fleet.received.update(report["received"])
            for pid, rewards in report["observed"]:
                self.observe(pid, rewards)
        return stale

    def gather(self) -> None:
        """The current weights, gathered from every rank, into the second model (which then
        holds no published version: audits and evals load theirs back). With audits every
        follower gets them too, to keep the version it is about to save."""
        everyone = self.cfg.audit_tolerance > 0
        self.tell("gather", everyone=everyone)
        full = full_state_dict(self.publisher.learner.policy.model, self.ranks, everyone=everyone)
        self.publisher.held.take_gathered(full)

    def before_publish(self, version: int) -> None:
        """Every rank's optimizer shards and ledger records before the manifest of `version`."""
        learner, held = self.publisher.learner, self.publisher.held
        if learner.lean:
            held.unbind()  # whatever it held (a refused step's gather)
        else:
            self.gather()
        prepare_sharded(learner.state_root, version)
        self.tell("save", version=version)
        learner.save_shards(version)
        self._hear_followers()
        barrier(self.ranks)
        if learner.lean:
            self.tell("stream")  # the followers take part in each tensor's gather

    def _hear_followers(self) -> None:
        """Every follower's ledger records (written with the writer's own, so exactly-once
        holds across ranks), counts and numbers."""
        ledger = self.publisher.ledger
        for rank, report in enumerate(self.share.exchange({})):
            if rank == self.ranks.rank:
                continue
            for rec in report["ledger"]:
                ledger.apply(rec)
                ledger.pending.append(rec)
            self.publisher.peers[rank] = {"volunteers": report["volunteers"],
                                "group_numbers": report["group_numbers"]}

    def after_publish(self) -> None:
        """`lean`: between publishes the writer holds its shards and nothing whole."""
        if self.publisher.learner.lean:
            self.publisher.held.unbind()
            self.publisher.chain.spill()
