"""The publisher: where the run stands in the bucket (its id, dataset, signing key, the
manifest and its etag, the versions of the window with their prompt pools, the ledger, the
volunteers' credit) and the trainer's publishing of the next version: the version number, the
commit itself (trainer.publish: the learner's state, the ledger and the credit object saved
before the manifest that commits them), then what follows each publish: retention, pruning, the evaluation on its cadence,
fleet.json and dashboard/, and the metrics of the steps that led to it.
"""

from __future__ import annotations

import time
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from volunteer_rl.config import TrainerConfig
from volunteer_rl.protocol.credit import Credit, write_credit
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.protocol.manifest import Dataset, Manifest, TaskRef
from volunteer_rl.storage.base import Storage
from volunteer_rl.task.curriculum import PromptPicker
from volunteer_rl.trainer.balance import Balance
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.held import HeldWeights
from volunteer_rl.trainer.groups import ScoredGroup, Window
from volunteer_rl.trainer.learner import Learner
from volunteer_rl.trainer.publish import LoraBase, publish
from volunteer_rl.trainer.records import Records
from volunteer_rl.trainer.retention import TrainerRetention
from volunteer_rl.trainer.withheld import GroupNumbers


class Publisher:
    """Where the run stands in the bucket, and the publishing of each next version."""

    def __init__(self, cfg: TrainerConfig, storage: Storage, log: Callable[[str], None],
                 learner: Learner, held: HeldWeights, records: Records, balance: Balance,
                 retention: TrainerRetention, picker: PromptPicker, fleet: Fleet,
                 numbers: GroupNumbers, task: TaskRef):
        self.cfg, self.storage, self.log = cfg, storage, log
        self.learner, self.held, self.records = learner, held, records
        self.balance, self.retention, self.picker = balance, retention, picker
        self.fleet, self.numbers, self.task = fleet, numbers, task
        self.chain = held.chain
        # Where the run stands, set when the trainer starts (trainer.startup).
        self.key: Ed25519PrivateKey | None = None
        self.run_id = ""
        self.dataset: Dataset | None = None
        self.manifest: Manifest | None = None
        self.etag: str | None = None
        self.ledger = Ledger()
        self.credit = Credit()
        """Each volunteer's credit as of the manifest's version (protocol.credit)."""
        self._credit_next: Credit | None = None  # the version being published's, until committed
        self.published: set[int] = set()  # the window's committed versions
        self.pools: dict[int, tuple[int, ...]] = {}  # the window's published prompt pools
        self.last_used = 0  # the highest version published or started: the next goes above
        self.last_publish_start = 0.0
        # Under ranks (trainer.writer): the other ranks' volunteers' counts and numbers, as
        # they reported them before the last commit; saved and shown with this rank's.
        self.peers: dict[int, dict] = {}
        self.lora_base: LoraBase | None = None
        """With --lora-rank: the published weights the adapters apply to, set by the first
        publish (v0) or a resume; every version after it publishes only its adapter."""

    @property
    def version(self) -> int:
        """The published version the trainer is training from: the manifest's."""
        return self.manifest.version

    def window(self) -> Window:
        return Window(self.version, self.cfg.max_staleness, self.published, self.pools)

    def next_version(self) -> int:
        """The number of the version about to be published, its publish started now."""
        self.last_used += 1
        self.last_publish_start = time.time()
        return self.last_used

    def commit(self, version: int, fresh_after: int, source=None) -> None:
        """Publish the current weights as `version` (trainer.publish.publish: whole, or with
        --lora-rank once the base is out, the adapters), the
        learner's state and the ledger saved before its manifest. `fresh_after`: usable groups
        in hand that the version's quota need not ask for again; `source`: a `lean` writer's
        sharded model, gathered tensor by tensor."""
        self.manifest, self.etag = publish(self.storage, self.held.full_policy, version, self.cfg,
                                           self.run_id, self.dataset, self.etag, self.key,
                                           self.chain, lambda: self._save(version),
                                           self.picker.pool(self.cfg.prompt_pool),
                                           self.balance.quota(time.time(), fresh_after),
                                           source=source, task=self.task,
                                           base=self.lora_base)
        if self._credit_next is not None:  # committed: it counts now
            self.credit, self._credit_next = self._credit_next, None
        if self.learner.lora is not None and self.lora_base is None:
            self.lora_base = LoraBase.of(self.manifest)  # the base, published whole just now
            self.chain.drop_file()  # no version after it is a patch of it

    def _save(self, version: int) -> None:
        """Ledger and credit to the bucket and trainer state to disk, all before the manifest
        of `version`; under ranks the ledger and the state hold every rank's volunteers. The
        credit object adds this version's `trained` records to the last committed one's; it
        counts in memory once the manifest is written (commit)."""
        self._credit_next = self.credit.fold(self.ledger.pending, version, time.time())
        self.ledger.flush(self.storage, version)
        write_credit(self.storage, self._credit_next)
        master = self.held.full_policy.model if self.cfg.weights_dtype != "fp32" else None
        volunteers, numbers = self.fleet.to_json(), self.numbers.to_json()
        for peer in self.peers.values():
            volunteers.update(peer["volunteers"])
            numbers.update(peer["group_numbers"])
        self.learner.save(version, self.run_id, volunteers, numbers, master)

    def publish_next(self, version: int, final: bool, buffered: list[ScoredGroup]) -> None:
        """Publish the weights in hand as `version` (from next_version), then what follows
        each publish: retention, ledger and state pruning, evaluation on its cadence,
        fleet.json and dashboard/, and the metrics of the steps that led to it. `buffered`:
        the usable groups in hand, which the version's quota need not ask for again."""
        fresh_after = sum(g.policy_version > self.version - self.cfg.max_staleness for g in buffered)
        self.commit(version, fresh_after,
                    source=self.learner.policy.model if self.learner.lean else None)
        self.balance.after_publish(time.time())
        self.held.keep(self.version)
        self.retention.after_publish(self.manifest)
        self.published = {v for v in self.published | {version} if v >= self.window().low}
        self.pools = {v: p for v, p in {**self.pools, version: self.manifest.prompt_pool}.items()
                      if v in self.published}
        self.ledger.prune(self.window().low)
        self.learner.prune(version)
        every = self.cfg.eval_every
        if final or (every and self.version % every == 0):
            self.records.evaluate_unless_stopping(self.version, full=final)
        self.write_views(final)
        self.records.flush(self.version, self.run_id)

    def write_views(self, final: bool) -> None:
        """fleet.json and dashboard/ (records.Records.write_views) as the run stands."""
        self.records.write_views(self.manifest, self.learner.steps, self.fleet, self.numbers,
                                 self.peers, self.balance, final)
