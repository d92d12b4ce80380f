"""The central trainer: publish a version, learn from fresh shards, publish the next one.

One loop, no server: everything it says to volunteers it writes into the bucket (checkpoints,
then the manifest that commits them), and everything it hears comes from shards it lists
under the rollout prefixes of the versions inside the staleness window.

SIGINT and SIGTERM (stopping.py) end it with exit 0 and nothing half-made: the loop finishes
the step in hand, publishes the steps not yet published (without the final evaluation) and
writes their metrics, fleet.json and dashboard/ one last time.

Under torchrun it is one of N ranks (trainer.ranks, docs/SCALE.md). Every rank reads and
audits the shards of its own share of the volunteers (trainer.shares); rank 0, the writer,
decides every step and publishes, as a single process would. The model, its gradients and
AdamW's moments are sharded over all ranks (FSDP2), so every poll, step and gathering of the
full weights is collective: the writer tells the other ranks (the followers, `_follow`) what
to do next through `_tell`, one small JSON message at a time, and they do it with it. The
writer keeps one unsharded copy of the model (`_second`), filled by each gather, to publish,
evaluate and audit from; with audits each follower keeps one too, for its own audits. With
fp32 weights and audits off the ranks are `lean` instead: no rank holds the weights whole
between publishes (the writer's `_second` is a skeleton it binds to the published file).
"""

from __future__ import annotations

import copy
import json
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import VrlError
from volunteer_rl.model.chain import fetch_weights
from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.devices import pick_device
from volunteer_rl.model.policy import Policy, encode_prompts, load_policy
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.model.weights import (
    WEIGHTS_DTYPES,
    bind_tensors,
    bind_weights,
    gather_along,
    load_weights,
    skeleton,
    unbind_weights,
)
from volunteer_rl.observe.dashboard import TrainerDashboard
from volunteer_rl.progress import Every
from volunteer_rl.protocol import layout, metrics
from volunteer_rl.protocol.ledger import Ledger, rebuild
from volunteer_rl.protocol.manifest import MAX_MANIFEST_BYTES, Manifest, poll_manifest, read_manifest
from volunteer_rl.protocol.signing import Trust, public_key_text
from volunteer_rl.stopping import Stopped, StopSignal
from volunteer_rl.storage import open_storage
from volunteer_rl.storage.base import AlreadyExists, StorageError
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.bounded import BoundedRewards
from volunteer_rl.task.curriculum import PromptPicker
from volunteer_rl.task.dataset import file_sha256
from volunteer_rl.trainer.audit import Auditor, Budget, Unavailable, WindowWeights
from volunteer_rl.trainer.balance import Balance
from volunteer_rl.trainer.evaluate import greedy_and_sampled
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.fleet_summary import FleetSummary
from volunteer_rl.trainer.ingest import Ingest, IngestStats, Rules, ScoredGroup, Window, split_fresh
from volunteer_rl.trainer.ranks import (
    announce,
    barrier,
    broadcast_bytes,
    collective_errors,
    full_state_dict,
    join,
    leave,
    load_full_optimizer_state,
    scatter_full_weights,
    shard_model,
)
from volunteer_rl.trainer.preflight import Inputs, TrainerError, read_inputs
from volunteer_rl.trainer.publish import (
    WeightsChain,
    publish,
    published_or_started,
    signing_key,
    upload_dataset,
)
from volunteer_rl.trainer.reporters import Reporters
from volunteer_rl.trainer.retention import TrainerRetention
from volunteer_rl.trainer.shares import Share, agree_on_batch
from volunteer_rl.trainer.state import (
    has_sharded_optimizer,
    load_sharded_optimizer,
    load_state,
    master_weights,
    named_optimizer_state,
    prepare_sharded,
    prune_states,
    save_sharded_optimizer,
    save_state,
)
from volunteer_rl.trainer.step import StepResult, audit_groups, non_finite_groups, train_step
from volunteer_rl.trainer.warmstart import (
    solved_at_v0,
    summary,
    torch_threads,
    trainer_split,
    warm_start,
)
from volunteer_rl.trainer.withheld import GroupNumbers


RETENTION_STOP_WAIT = 5.0
"""Seconds a stopping trainer waits for its retention pass to reach its next request."""


# ---------------------------------------------------------------------------------------------
# Model set-up and publishing.

def initial_policy(cfg: TrainerConfig, task: Task, rows: list[Row], device: torch.device,
                   log: Callable[[str], None]) -> Policy:
    """`tiny`: build tokenizer + model offline from the task's prompts and reference answers,
    and warm-start them on those. Else: load the folder."""
    if cfg.model != "tiny":
        return load_policy(cfg.model, device)
    questions = [task.prompt(r) for r in rows]
    answers = [task.reference(r) for r in rows]
    if not all(isinstance(a, str) and a for a in answers):
        raise TrainerError(f"--model tiny: task {task.name!r} gives no reference answer for "
                           "every row, which the tiny model's tokenizer and warm start need; "
                           "give a model folder")
    tokenizer = build_tokenizer(questions + answers)
    model = build_tiny_model(tokenizer, seed=cfg.seed).to(device)
    policy = Policy(model, tokenizer, "plain", device)
    n = sum(p.numel() for p in model.parameters())
    log(f"built tiny model: {n:,} parameters, vocab {len(tokenizer)}")
    if cfg.warm_start_steps > 0:
        split = trainer_split(cfg, len(rows))  # split.rl: the rows the Trainer's picker draws
        with torch_threads(cfg.warm_start_threads):  # then back to --threads for RL
            done = warm_start(policy, [questions[i] for i in split.warm],
                              [answers[i] for i in split.warm], cfg.warm_start_steps,
                              seed=cfg.seed, log=log, instruction=task.instruction)
        log(summary(split, done))
    return policy


SPILLED = "weights-last.safetensors"
"""In --work-dir: a `lean` writer's last published weights file, the base of the next patch."""


def waiting_line(usable: int, stats: IngestStats, wanted: int, step: int) -> str:
    """Why the trainer waits for rollouts before step `step` + 1 (most groups of a weak
    policy have one reward for all K, and those teach nothing)."""
    since = f"since step {step}" if step else "so far"
    return (f"{usable} usable group{'s' * (usable != 1)}, {stats.zero_variance} without reward "
            f"variance (of {stats.groups} received {since}), waiting for {wanted}")


class Trainer:
    def __init__(self, cfg: TrainerConfig, log: Callable[[str], None] = print,
                 stop: StopSignal | None = None, inputs: Inputs | None = None):
        self.cfg = cfg
        self.log = log
        self.stop = stop or StopSignal(log)  # set by SIGINT/SIGTERM once handlers are installed
        # The task, the datasets and the key's path first (`inputs`: read by the caller): any
        # of them wrong is one line before the bucket is touched, or a folder bucket made.
        self.inputs = inputs = inputs or read_inputs(cfg)
        self.task, self.task_info = inputs.task, inputs.task_info
        self.cfg = cfg = cfg.with_task_defaults(self.task)
        self.storage = open_storage(cfg.bucket, cfg.endpoint_url)
        # Passes run on their own thread (a stop signal cuts them short): never on the publish path.
        self.retention = TrainerRetention(self.storage, cfg.keep_versions, cfg.gc_every, log,
                                          stopping=self.stop.is_set)
        # --report-to's packages are checked before the join: no rank waits on one that stops.
        self.reporters = Reporters(cfg, log)
        # Under torchrun this process is one rank of several (trainer.ranks); else ranks is
        # a single process's and none of the rank code below runs.
        self.ranks = join(pick_device(cfg.device), cfg.rank_timeout)
        announce(self.ranks, log)  # `[rank R]` on this rank's lines from here on
        self.device = self.ranks.device
        self._sharded = False  # the policy sharded over the ranks (_share_model)
        if cfg.groups_per_step % self.ranks.world_size:
            leave(self.ranks)
            raise TrainerError(f"--groups-per-step {cfg.groups_per_step}: not a multiple of the "
                               f"{self.ranks.world_size} ranks (each computes an equal share)")
        self.train_path, self.problems, self.held_out = (inputs.train_path, inputs.problems,
                                                         inputs.held_out)
        self.metrics_buffer: list[dict] = []
        # Ranks share it: each writes its optimizer shards into a version's folder (state.py).
        self.state_root = Path(cfg.work_dir) / "state"
        self.scratch = Path(cfg.work_dir)  # checkpoint downloads
        if self.ranks.is_follower:
            self.scratch = Path(cfg.work_dir) / f"rank-{self.ranks.rank}"
        # How the ranks get the resumed version's moments: "sharded" (saved by ranks, loaded by
        # all together), "whole" (saved by one process, broadcast from the writer), or None.
        self._moments: str | None = None
        self.steps = 0  # optimizer steps of the whole run, restored on resume
        # This rank's share of the fleet's intake (trainer.shares); None: a single process.
        self.share = Share(self.ranks) if self.ranks.joined else None
        self._observed: list[list] = []  # a follower's curriculum observations, for the writer
        self._peers: dict[int, dict] = {}  # the followers' counts and numbers at the last save
        self._gathered: dict[str, torch.Tensor] | None = None  # a follower's copy of a gather
        self.fleet = Fleet(cfg.deny_after, cfg.deny_rate)
        self.fleet_summary = FleetSummary(self.storage, log,  # fleet.json, for `vrl status`
                                          ranks=self.ranks.world_size)
        self.dashboard = TrainerDashboard(self.storage, cfg.dashboard_every, log)  # dashboard/
        self.window_weights = WindowWeights()  # published weights of the window, for audits
        self._second: Policy | None = None  # _second_model's
        self._bound: int | None = None  # `lean`: the published version _second is bound to
        self.chain = WeightsChain(cfg.keyframe_every, cfg.patch_max_fraction,
                                  spill_to=Path(cfg.work_dir) / SPILLED if self.lean else None)
        self.last_publish_start = 0.0
        # The curriculum: fed with every group taken, it fills each version's prompt pool.
        # Only the rows the warm start did not train on (warmstart.trainer_split).
        rl_rows = [self.problems[i] for i in trainer_split(cfg, len(self.problems)).rl]
        self.picker = PromptPicker(rl_rows, random.Random(cfg.seed), cfg.curriculum,
                                   self.task.stratum)
        # Every reward of a volunteer's completion runs in a worker process under the task's
        # bounds (task.bounded): a completion that makes it slow or huge is a rejection.
        self.rewards = BoundedRewards(self.task_info.value, self.task.reward_seconds,
                                      self.task.reward_memory_mb)
        self.pools: dict[int, tuple[int, ...]] = {}  # the window's published prompt pools
        self.numbers = GroupNumbers()  # group numbers received; restored by _resume
        self.waiting = Every()  # why the loop waits for groups: at most one line per interval
        # What each version asks of each volunteer (the manifest's quota) and the useful fraction.
        self.balance = Balance(cfg.groups_per_step, cfg.publish_every, cfg.quota_headroom)

    @property
    def lean(self) -> bool:
        """Whether this rank holds no whole copy of the weights between publishes
        (docs/SCALE.md, memory): sharded, fp32 weights (the published file is the weights
        themselves, no master to keep) and audits off (no replay needs a version's weights
        mid-intake). The writer publishes each tensor as it gathers it, its `_second` is a
        skeleton bound to the weights only while it evaluates or finds a refused step's
        culprits, and the last weights file, a patch's base, waits on disk; a follower builds
        its model empty (no weights read from the checkpoint) before it takes its shards."""
        return (self.ranks.joined and self.cfg.weights_dtype == "fp32"
                and self.cfg.audit_tolerance <= 0)

    def install_signal_handlers(self) -> None:
        """SIGINT and SIGTERM stop the trainer cleanly (stopping.py); a second one at once.

        `vrl trainer` installs them itself before it imports torch, so a signal during the
        seconds that takes counts too; this is for programs that build a Trainer."""
        self.stop.install()

    def start(self) -> None:
        """Publish v0 on an empty bucket, or pick up where the manifest says the run is.

        A stop signal raises Stopped here: at once where start only reads or computes
        (loading, the warm start, v0's evaluation), after the write in hand where it writes
        (the signing key, the dataset, v0 and its metrics, a repaired manifest copy). What it
        leaves is whole: the bucket as it was, or v0 with its metrics.

        A follower rank reads what the writer published once it has started, and takes its
        shard of the writer's weights (_start_follower)."""
        cfg = self.cfg
        if self.ranks.is_follower:
            with collective_errors(self.ranks, "while starting"):
                return self._start_follower()
        with self.stop.abortable():
            with self.stop.shielded():  # never a new key for a bucket another key signs
                self.key, trust = signing_key(cfg, self.storage, self.log, self.inputs.key_path)
            manifest, etag = poll_manifest(self.storage, None, trust=trust)
            if manifest is None:
                self._start_fresh()
            else:
                self._resume(manifest, etag)
            # Versions left half-published by a crash are never reused: the next one goes above.
            self.last_used = max([self.version] + published_or_started(self.storage))
            self._build_ingest(trust)
        if self.ranks.joined:
            with collective_errors(self.ranks, "while starting"):
                self._share_model(public_key_text(self.key))

    def _build_ingest(self, trust: Trust) -> None:
        """The intake (trainer.ingest) of this process, or of this rank's share of the fleet,
        with its rules, and its auditor holding the window's weights if audits are on."""
        cfg, policy = self.cfg, self.policy
        rules = Rules(self.problems, len(policy.tokenizer), cfg.k, cfg.max_new_tokens,
                      policy.decode_all, policy.eos_id, policy.special_ids, run_id=self.run_id,
                      rewards=self.rewards.rewards)
        self.prompt_ids = dict(enumerate(encode_prompts(
            policy, [self.task.prompt(p) for p in self.problems], self.task.instruction)))
        auditor = None
        if cfg.audit_tolerance > 0:
            auditor = Auditor(self._replay, Budget(cfg.audit_share), cfg.audit_full_groups,
                              cfg.audit_floor)
            self._recover_window_weights(trust)
        if self.ranks.is_follower:  # the writer's curriculum learns them (_intake_round)
            observe = lambda pid, rewards: self._observed.append([pid, rewards])  # noqa: E731
        else:
            observe = lambda pid, rewards: self.picker.observe(self.problems[pid], rewards)  # noqa: E731
        self.ingest = Ingest(self.storage, rules, self.ledger, self.fleet, auditor,
                             self.log, cfg.log_shards, numbers=self.numbers, observe=observe,
                             share=self.share)

    # -----------------------------------------------------------------------------------------
    # Ranks (torchrun): how the model and the fleet are shared, and what the followers do.

    def _share_model(self, trust_key: str) -> None:
        """Writer, after it started as a single process would (built or resumed, v0 out):
        tell the followers whose manifests to trust and where the run stands (its step, its
        window, every volunteer's counts and numbers: each keeps its own volunteers', and so
        does the writer), keep an unsharded copy of the model (_second), then shard the model
        with the followers and give them its weights."""
        start = {"trust_key": trust_key, "steps": self.steps, "published": sorted(self.published),
                 "volunteers": self.fleet.to_json(), "group_numbers": self.numbers.to_json(),
                 "moments": self._moments}
        broadcast_bytes(json.dumps(start).encode(), self.ranks)
        self._keep_own_volunteers(start)
        if self.lean:  # the architecture without the weights (see `lean`)
            p = self.policy
            self._second = Policy(skeleton(p.model), p.tokenizer, p.prompt_format, p.device)
        else:
            self._second_model()
        self.chain.spill()  # v0's file, when this run just published it
        full = {k: v.detach().cpu() for k, v in self.policy.model.state_dict().items()}
        self._shard_and_load(full, self._moments)

    def _start_follower(self) -> None:
        """A follower: the writer's trust key and where the run stands (once the writer has
        started), the model the manifest names as its skeleton (architecture and tokenizer;
        any weights), the window's ledger as committed and, with audits, the window's weights
        (both read from the bucket, as the writer reads them on a resume), its intake of its
        share of the fleet, then its shard of the writer's own weights (fp32 master
        included)."""
        cfg = self.cfg
        start = json.loads(broadcast_bytes(None, self.ranks))
        self.trust = Trust(start["trust_key"], cfg.allow_unsigned, origin="the writer rank's key")
        self.manifest, _ = poll_manifest(self.storage, None, trust=self.trust)
        if self.manifest is None:  # the writer told us it published: a bug, or a second trainer
            raise TrainerError(f"{layout.MANIFEST}: missing after the writer rank started")
        self.run_id = self.manifest.run_id
        folder = fetch_checkpoint(self.storage, self.manifest, self.scratch / "model",
                                  require_model=True)
        self.policy = load_policy(folder, self.device, weights=not self.lean)  # lean: a skeleton
        self.steps, self.published = int(start["steps"]), set(start["published"])
        self._keep_own_volunteers(start)
        self.ledger = rebuild(self.storage, sorted(self.published))
        self.ledger.prune(self.window().low)
        self._build_ingest(self.trust)  # with audits its unsharded copy is made here, unsharded
        self._shard_and_load({}, start["moments"])

    def _keep_own_volunteers(self, start: dict) -> None:
        """This rank's volunteers' counts and group numbers, of all the writer saved."""
        mine = self.share.owns
        self.fleet.load_counts({v: c for v, c in start["volunteers"].items() if mine(v)})
        try:
            self.numbers.by = GroupNumbers.from_json(
                {v: n for v, n in start["group_numbers"].items() if mine(v)}).by
        except ValueError as exc:
            self.log(f"warning: {exc}: group numbers start afresh")

    def _shard_and_load(self, full: dict[str, torch.Tensor], moments: str | None) -> None:
        """Every rank: FSDP2 over the policy, the writer's `full` weights scattered into the
        shards, the optimizer built on them, and the manifest's version's moments as the writer
        found them (`moments`, see _moments): saved by ranks, resharded onto these ranks
        whatever number saved them (state.load_sharded_optimizer); saved by one process, the
        writer's copy broadcast (ranks.load_full_optimizer_state)."""
        whole = {}  # the writer's moments by name, taken before its optimizer is rebuilt
        if moments == "whole" and self.ranks.is_writer:
            whole = named_optimizer_state(self.policy.model, self.opt)
        shard_model(self.policy.model, self.ranks)
        if any(p.is_meta for p in self.policy.model.parameters()):  # a lean follower's, built empty
            self.policy.model.to_empty(device=self.device)
        scatter_full_weights(self.policy.model, full, self.ranks)
        self._sharded = True
        self._make_optimizer()
        if moments == "sharded":
            load_sharded_optimizer(self.state_root, self.manifest.version, self.policy.model,
                                   self.opt)
        elif moments == "whole":
            load_full_optimizer_state(self.policy.model, self.opt, whole, self.ranks)

    def _tell(self, do: str, **fields) -> None:
        """Writer: the followers' next action (see _follow). A single process: nothing."""
        if self.ranks.joined:
            broadcast_bytes(json.dumps({"do": do, **fields}).encode(), self.ranks)

    def _gather(self) -> None:
        """Writer: the current weights, gathered from every rank, into _second (which then
        holds no published version: audits and evals load theirs back). With audits every
        follower gets them too, to keep the version it is about to save (_follow)."""
        everyone = self.cfg.audit_tolerance > 0
        self._tell("gather", everyone=everyone)
        full = full_state_dict(self.policy.model, self.ranks, everyone=everyone)
        if self.lean:  # the skeleton takes the gathered tensors themselves
            bind_tensors(self._second.model, full)
            self._bound = None  # the current weights, maybe not a published version's
        else:
            self._second.model.load_state_dict(full)
        self.window_weights.loaded = None

    def _follow(self) -> Manifest:
        """A follower's loop: do what the writer tells, until it says stop. Returns the
        manifest the writer left (as read from the bucket)."""
        cfg = self.cfg
        buffer: list[ScoredGroup] = []
        batch: list[ScoredGroup] = []
        stats = IngestStats()  # what this rank's intake did since it last reported to the writer
        while True:
            message = json.loads(broadcast_bytes(None, self.ranks))
            do = message["do"]
            if do == "poll":  # our share of the intake, then the step if the ranks have a batch
                w = message["window"]
                win = Window(w["version"], cfg.max_staleness, set(w["published"]),
                             {int(v): tuple(p) for v, p in w["pools"].items()})
                buffer, batch, _, _ = self._intake_round(buffer, stats, win)
                stats = IngestStats()  # reported with the batch exchange
                if batch is None:
                    continue
                result = train_step(self.policy, self.opt, batch, self.prompt_ids, win.version,
                                    cfg, ranks=self.ranks)
                if result.applied:  # the same decision on every rank (ranks.sum_over_ranks)
                    self.steps += 1
                    self._record(self._own(batch), "trained", self.steps)
            elif do == "reject":  # the step on `batch` was refused: the writer names the culprits
                buffer = self._refused(message["keys"], self._own(batch) + buffer, stats)
            elif do == "gather":
                self._gathered = full_state_dict(self.policy.model, self.ranks,
                                                 everyone=message["everyone"]) or None
            elif do == "stream":  # the writer publishes (`lean`), gathering tensor by tensor
                gather_along(self.policy.model)
            elif do == "save":  # before the writer commits the version: our part of its state
                version = message["version"]
                save_sharded_optimizer(self.state_root, version, self.policy.model, self.opt)
                self._report_to_writer(version)
                barrier(self.ranks)
            elif do == "stop":
                manifest, _ = poll_manifest(self.storage, None, trust=self.trust)
                return manifest or self.manifest

    def _report_to_writer(self, version: int) -> None:
        """A follower, before the writer commits `version`: its ledger records (the writer
        writes them with its own, before the manifest), its volunteers' counts and numbers
        (saved in the writer's state, shown in fleet.json); then, with audits, the version's
        weights as volunteers load them (from the gather before), for its share's audits."""
        self.share.exchange({"ledger": self.ledger.pending, "volunteers": self.fleet.to_json(),
                             "group_numbers": self.numbers.to_json()})
        self.ledger.pending = []
        low = layout.window(version, self.cfg.max_staleness).start
        self.ledger.prune(low)
        if self._gathered is not None:
            self._second.model.load_state_dict(self._gathered)
            self._gathered = None
            self.window_weights.add(version, self._second.model,
                                    WEIGHTS_DTYPES[self.cfg.weights_dtype])
            self.window_weights.loaded = None
            self.window_weights.drop_below(low)

    def _hear_followers(self) -> None:
        """Writer, before it commits a version: every follower's ledger records (written
        with its own, so exactly-once holds across ranks), counts and numbers."""
        for rank, report in enumerate(self.share.exchange({})):
            if rank == self.ranks.rank:
                continue
            for rec in report["ledger"]:
                self.ledger.apply(rec)
                self.ledger.pending.append(rec)
            self._peers[rank] = {"volunteers": report["volunteers"],
                                 "group_numbers": report["group_numbers"]}

    def _own(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        """The groups of this rank's volunteers (a single process: all of them)."""
        if self.share is None:
            return list(groups)
        return [g for g in groups if self.share.owns(g.volunteer_id)]

    def _intake_round(self, buffer: list[ScoredGroup], stats: IngestStats,
                      win: Window) -> tuple[list[ScoredGroup], list[ScoredGroup] | None, int, int]:
        """One poll of the intake, stale groups recorded, and the step's batch if there are
        enough fresh groups: (groups left waiting, the batch or None, groups gone stale,
        fresh groups held). Under ranks every rank polls its share and they agree on the
        batch (shares.agree_on_batch); the writer's `stats`, staleness count and curriculum
        take in every rank's poll."""
        size = self.cfg.groups_per_step
        buffer = self.ingest.poll(win, stats, buffer)
        fresh, stale = split_fresh(buffer, win.version, self.cfg.max_staleness)
        self._record(stale, "stale")
        if self.share is None:
            if len(fresh) < size:
                return fresh, None, len(stale), len(fresh)
            return fresh[size:], fresh[:size], len(stale), len(fresh)
        report = {}
        if self.ranks.is_follower:
            report = {"stats": stats.to_json(), "stale": len(stale), "observed": self._observed,
                      "received": dict(self.fleet.take_received())}
            self._observed = []
        batch, taken, reports = agree_on_batch(self.share, fresh, size, report)
        stale_n = len(stale)
        if self.ranks.is_writer:
            for report in reports[1:]:
                stats.add_json(report["stats"])
                stale_n += report["stale"]
                self.fleet.received.update(report["received"])
                for pid, rewards in report["observed"]:
                    self.picker.observe(self.problems[pid], rewards)
        return fresh[taken:], batch, stale_n, sum(r["fresh"] for r in reports)

    def _window_message(self) -> dict:
        """The window as the followers' intake needs it (each poll's message)."""
        return {"version": self.version, "published": sorted(self.published),
                "pools": {str(v): list(p) for v, p in self.pools.items()}}

    # -----------------------------------------------------------------------------------------
    # Starting: a fresh run, or a resumed one.

    def _start_fresh(self) -> None:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.policy = initial_policy(cfg, self.task, self.problems, self.device, self.log)
        self._make_optimizer()
        self.run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        with self.stop.shielded():  # from here on v0 goes out whole, metrics included
            self.dataset = upload_dataset(self.storage, self.train_path)
            self.ledger = Ledger()
            self.manifest, self.etag = publish(self.storage, self.policy, 0, cfg, self.run_id,
                                               self.dataset, None, self.key, self.chain,
                                               lambda: self._save(0), self._next_pool(),
                                               self.balance.quota(time.time(), 0),
                                               task=self.task_info.ref)
            self._keep_window_weights()
            self.pools = {0: self.manifest.prompt_pool}
            self.log(f"published v0 of {self.run_id} to {self.storage.uri}")
            self.published = {0}
            self._evaluate_unless_stopping(0, full=True)
            self._flush_metrics(0)

    def _resume(self, manifest: Manifest, etag: str | None) -> None:
        """Weights from the manifest's checkpoint; optimizer, step and counts from the state
        saved for that version; the ledger from the committed ledger objects of the window."""
        cfg = self.cfg
        if manifest.task.name != self.task.name:
            raise TrainerError(f"manifest.json: the run trains task {manifest.task.name!r}; "
                               f"resume it with --task {manifest.task.name}")
        if manifest.dataset.sha256 != file_sha256(self.train_path):
            raise TrainerError(f"manifest.json: dataset {manifest.dataset.key} differs from "
                               f"{self.train_path}; resume with the same --dataset")
        folder = fetch_checkpoint(self.storage, manifest, Path(cfg.work_dir) / "resume",
                                  require_model=True)
        self.policy = load_policy(folder, self.device)
        self._make_optimizer()
        self.run_id, self.dataset, self.manifest = manifest.run_id, manifest.dataset, manifest
        self.etag = etag
        with self.stop.shielded():
            self._repair_history(manifest)
        win = Window(manifest.version, cfg.max_staleness, set())
        self.published = self._committed(win)
        self.ledger = rebuild(self.storage, sorted(self.published))
        self.ledger.prune(win.low)
        # Ranks load sharded moments together once sharded (_shard_and_load); the writer reads
        # the rest here. A single process loads either kind itself.
        sharded = self.ranks.joined and has_sharded_optimizer(self.state_root, manifest.version)
        meta = load_state(self.state_root, manifest.version, None if sharded else self.opt,
                          self.policy.model)
        if self.ranks.joined and meta is not None and meta.get("run_id") == self.run_id:
            self._moments = "sharded" if sharded else "whole"
        if meta is None or meta.get("run_id") != self.run_id:
            self.log(f"warning: no saved trainer state for v{manifest.version} in "
                     f"{self.state_root}: fresh optimizer moments")
        else:
            self.steps = int(meta["steps"])
            self.fleet.load_counts(meta.get("volunteers", {}))
            try:
                self.numbers = GroupNumbers.from_json(meta.get("group_numbers", {}))
            except ValueError as exc:
                self.log(f"warning: {exc}: group numbers start afresh")
            master = master_weights(self.state_root, manifest.version)
            if master is not None:  # bf16 checkpoint: the fp32 master lives in the state
                load_weights(self.policy, master)
        self._keep_window_weights()
        self._recover_pools(manifest)
        self.log(f"resuming {self.run_id} at v{manifest.version} (step {self.steps})")

    def _recover_pools(self, manifest: Manifest) -> None:
        """After a resume: the prompt pools of the window's versions, from their manifest
        copies (written by this trainer). A version whose copy cannot be read is dropped from
        the window: its groups are refused as of an unpublished version."""
        self.pools = {manifest.version: manifest.prompt_pool}
        for version in sorted(self.published - {manifest.version}):
            try:
                m = Manifest.from_json(self.storage.read(layout.manifest_history_key(version),
                                                         max_bytes=MAX_MANIFEST_BYTES))
                self.pools[version] = m.prompt_pool
            except (VrlError, StorageError) as exc:
                self.log(f"warning: v{version}'s prompt pool: {exc}; its groups are refused")
                self.published.discard(version)

    def _next_pool(self) -> tuple[int, ...]:
        """The prompt pool of the version about to be published (task.curriculum)."""
        return self.picker.pool(self.cfg.prompt_pool)

    def _repair_history(self, manifest: Manifest) -> None:
        """A crash between manifest.json and its manifests/ copy leaves the copy missing:
        write it as write_manifest would have, with manifest.json's bytes, signature included
        (an unsigned copy is refused by `vrl eval --version`, `vrl gc` and the window's
        recovery). Those bytes must still hold the manifest resumed from."""
        key = layout.manifest_history_key(manifest.version)
        if self.storage.exists(key):
            return  # the usual case: the copy is there
        data = self.storage.read(layout.MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
        if Manifest.from_json(data) != manifest:
            raise TrainerError(f"{layout.MANIFEST}: changed while this trainer resumed from it; "
                               "is a second trainer running on this bucket?")
        try:
            self.storage.create(key, data)
        except AlreadyExists:
            pass

    def _committed(self, win: Window) -> set[int]:
        """Versions of the window that were committed (have their manifest copy)."""
        return {v for v in win.versions()
                if v == win.version or self.storage.exists(layout.manifest_history_key(v))}

    @property
    def full_policy(self) -> Policy:
        """The whole current weights: the trainer's own model, or once it is sharded over
        ranks the writer's copy that the last _gather filled."""
        return self._second if self._sharded else self.policy

    def _make_optimizer(self) -> None:
        self.opt = torch.optim.AdamW(self.policy.model.parameters(), lr=self.cfg.lr, weight_decay=0.0)

    def _save(self, version: int) -> None:
        """Ledger to the bucket and trainer state to disk, both before the manifest of `version`."""
        self.ledger.flush(self.storage, version)
        master = self.full_policy.model if self.cfg.weights_dtype != "fp32" else None
        volunteers, numbers = self.fleet.to_json(), self.numbers.to_json()
        for peer in self._peers.values():  # under ranks: every rank's volunteers
            volunteers.update(peer["volunteers"])
            numbers.update(peer["group_numbers"])
        save_state(self.state_root, version, self.opt,
                   {"run_id": self.run_id, "steps": self.steps, "volunteers": volunteers,
                    "group_numbers": numbers},
                   master=master, sharded=self._sharded)

    @property
    def published_policy(self) -> Policy:
        """The weights volunteers run, of the version just published; evals and tests use it.

        fp32: the trainer's own model (evals run right after a publish, before the next step).
        bf16: an fp32 model holding that version's bf16 tensors upcast, exactly as
        volunteers upcast them, so an honest volunteer's logprobs match and `eval vN` measures
        what vN is (the fp32 master differs from its weights by up to ~0.4 % per weight). That
        model is also the audit model (_second_model; audits load other versions into it, this
        loads the current one back, a copy of the weights), so the trainer holds one such copy,
        not two. Under ranks with fp32 weights and no audits it is the writer's copy as the
        publish's gather left it, which are the published weights."""
        if self.cfg.weights_dtype == "fp32" and not self._sharded:
            return self.policy
        held = self._second_model()
        if self.lean:
            self._bind_published()
            return held
        if self.cfg.weights_dtype == "fp32" and self.cfg.audit_tolerance <= 0:
            return held
        if not self.window_weights.load_into(self.version, held.model):
            raise RuntimeError(f"v{self.version}'s published weights are not held")  # a bug
        return held

    def _unbind(self) -> None:
        """`lean`: the skeleton lets go of whatever weights it held."""
        unbind_weights(self._second.model)
        self._bound = None

    def _bind_published(self) -> None:
        """`lean`: bind the skeleton to the version just published, the file in memory (no
        copy) or read back from where it was spilled (one copy, until the next publish)."""
        if self._bound == self.version:
            return
        last = self.chain.last
        if last is None or last[0] != self.version:
            raise RuntimeError(f"v{self.version}'s weights file is not held")  # a bug
        bind_weights(self._second.model, last[2] if last[2] is not None else self.chain.spill_to)
        self._bound = self.version

    @property
    def audit_policy(self) -> Policy | None:
        """The model audits replay with (_second_model); None with audits off."""
        return self._second_model() if self.cfg.audit_tolerance > 0 else None

    def _second_model(self) -> Policy:
        """The trainer's one model besides its master, made on first use: audits replay with
        it (fp32 or bf16), and with bf16 weights evals run on it (published_policy)."""
        if self._second is None:
            p = self.policy
            self._second = Policy(copy.deepcopy(p.model).eval(), p.tokenizer, p.prompt_format, p.device)
        return self._second

    def _keep_window_weights(self) -> None:
        """Hold the version just published, as volunteers load it: for audits, every version
        of the window; without audits, that version only (published_policy's), and with fp32
        weights without audits none (published_policy is the trainer's own model, or under
        ranks the writer's gathered copy: a second copy of the same weights would only cost
        the writer memory)."""
        auditing = self.cfg.audit_tolerance > 0
        if not auditing and self.cfg.weights_dtype == "fp32":
            return
        self.window_weights.add(self.version, self.full_policy.model,
                                WEIGHTS_DTYPES[self.cfg.weights_dtype])
        low = (layout.window(self.version, self.cfg.max_staleness).start
               if auditing else self.version)
        self.window_weights.drop_below(low)

    def _recover_window_weights(self, trust: Trust) -> None:
        """After a resume: the published weights of the window's older versions, read back
        from their checkpoints (each verified against its signed manifest copy), so their
        groups can be audited. A version that cannot be read is logged and its audited
        shards wait until it leaves the window."""
        for version in sorted(self.published - set(self.window_weights.versions)):
            try:
                m = read_manifest(self.storage, version, trust=trust)
                if m is None:
                    raise TrainerError(f"{layout.manifest_history_key(version)} is missing")
                load_weights(self.audit_policy, fetch_weights(self.storage, m).buf)
            except (VrlError, StorageError) as exc:
                self.log(f"warning: v{version}'s weights for audits: {exc}")
                continue
            self.window_weights.add(version, self.audit_policy.model,
                                    WEIGHTS_DTYPES[self.cfg.weights_dtype])
        self.window_weights.loaded = None  # the audit model holds whatever was read last

    def _replay(self, version: int, groups: list[ScoredGroup]) -> tuple[str, str] | None:
        """Audit `groups` of `version` (trainer.step.audit_groups) with that version's weights."""
        if not self.window_weights.load_into(version, self.audit_policy.model):
            raise Unavailable(version)
        cfg = self.cfg
        return audit_groups(self.audit_policy, groups, self.prompt_ids, self.run_id,
                            cfg.temperature, cfg.replay_tolerance, cfg.audit_tolerance)

    @property
    def version(self) -> int:
        """The published version the trainer is training from: the manifest's."""
        return self.manifest.version

    def window(self) -> Window:
        return Window(self.version, self.cfg.max_staleness, self.published, self.pools)

    def _evaluate(self, version: int, full: bool = False) -> dict[str, float]:
        problems = self.held_out if full else self.held_out[: self.cfg.eval_prompts]
        res = greedy_and_sampled(self.published_policy, self.task, problems, self.cfg.temperature,
                                 self.cfg.eval_samples, self.cfg.max_new_tokens,
                                 log=self.log, label=f"eval v{version}")
        self.log(f"eval v{version} on {len(problems)} held-out prompts: greedy "
                 f"{res[metrics.ACCURACY_GREEDY]:.1%}, sampled (T={self.cfg.temperature}) "
                 f"{res[metrics.ACCURACY_SAMPLED]:.1%}")
        if version == 0 and (solved := solved_at_v0(res[metrics.ACCURACY_SAMPLED],
                                                    res[metrics.ACCURACY_GREEDY])):
            self.log(solved)
        self.metrics_buffer.append({metrics.KIND: metrics.EVAL_LINE, metrics.VERSION: version,
                                    metrics.TIME: time.time(), metrics.EVAL_PROMPTS: len(problems),
                                    **res})
        return res

    def _evaluate_unless_stopping(self, version: int, full: bool = False) -> None:
        """`_evaluate`, but a stop signal skips it or cuts it short: it only reads and
        computes, and a full one (500 prompts) takes far longer than the few seconds a stop
        may. The version's metrics then go out without it."""
        try:
            with self.stop.abortable():
                self._evaluate(version, full)
        except Stopped as exc:
            self.log(f"signal {exc.signum}: no eval of v{version}, stopping")

    def _flush_metrics(self, version: int) -> None:
        """Metrics of the steps that led to `version`, as one write-once object."""
        body = "".join(json.dumps(m, sort_keys=True) + "\n" for m in self.metrics_buffer)
        self.storage.create(layout.metrics_key(version), body.encode())
        self.reporters.record(self.metrics_buffer, self.run_id)  # --report-to (the writer's)
        self.metrics_buffer = []

    def run(self) -> Manifest:
        """The loop (a follower rank: _follow); every rank leaves the process group after it,
        together when the writer told the followers to stop (ranks.leave)."""
        if self.cfg.threads > 0:
            torch.set_num_threads(self.cfg.threads)
        try:
            with collective_errors(self.ranks, "while training"):
                if self.ranks.is_follower:
                    manifest = self._follow()
                    self._leave_together()
                    return manifest
                try:
                    manifest = self._run()
                except (VrlError, StorageError):
                    self._tell("stop")  # failed outside a collective (the bucket): let them go
                    self._leave_together()
                    raise
                self._tell("stop")
                self._leave_together()
                return manifest
        finally:
            self.rewards.close()
            self.reporters.close()
            leave(self.ranks)  # after a failed collective: the others may be gone

    def _leave_together(self) -> None:
        """End the reward worker, then leave the ranks after a barrier. The worker goes first
        so that nothing runs between the barrier and the exit: gloo's teardown aborts a rank
        that is still tearing down while another has gone (ranks.leave)."""
        self.rewards.close()
        leave(self.ranks, meet=True)

    def _run(self) -> Manifest:
        cfg = self.cfg
        started = time.time()
        buffer: list[ScoredGroup] = []
        steps, unpublished, stats = 0, 0, IngestStats()
        stale_dropped, waited, t_ingest, last_publish = 0, 0.0, 0.0, 0.0
        while not self._done(steps, started):
            t0 = time.time()
            self._tell("poll", window=self._window_message())  # the followers poll their share
            buffer, batch, stale, fresh = self._intake_round(buffer, stats, self.window())
            stale_dropped += stale
            t_ingest += time.time() - t0
            if batch is None:
                if self.waiting.due():
                    self.log(waiting_line(fresh, stats, cfg.groups_per_step, self.steps))
                self.stop.wait(cfg.poll_seconds)  # a stop signal ends the wait at once
                waited += cfg.poll_seconds  # (followers wait in the next message's collective)
                continue
            t0 = time.time()
            result = train_step(self.policy, self.opt, batch, self.prompt_ids, self.version, cfg,
                                ranks=self.ranks)
            if not result.applied:
                buffer = self.refuse_step(self._own(batch) + buffer, batch, result, stats)
                continue
            steps += 1
            unpublished += 1
            self.steps += 1
            self._record(self._own(batch), "trained", self.steps)
            self.balance.after_step(time.time(), self.fleet.take_received(),
                                    Counter(g.volunteer_id for g in batch), stats.groups,
                                    stats.zero_variance + stats.duplicates, waited)
            timing = {"train/step_time": time.time() - t0, "time/ingest": t_ingest,
                      "time/waiting_for_rollouts": waited, "time/last_publish": last_publish,
                      "time/dashboard": self.dashboard.take_seconds()}
            self._record_step(self.steps, batch, result, stats, stale_dropped, timing)
            stats, stale_dropped, waited, t_ingest = IngestStats(), 0, 0.0, 0.0
            due = time.time() - self.last_publish_start >= cfg.publish_min_seconds
            if unpublished >= cfg.publish_every and due and not self._done(steps, started):
                t0 = time.time()
                self.publish_next(buffered=buffer)
                last_publish = time.time() - t0
                unpublished = 0
        self._finish(unpublished)
        return self.manifest

    def refuse_step(self, waiting: list[ScoredGroup], batch: list[ScoredGroup],
                     result: StepResult, stats: IngestStats) -> list[ScoredGroup]:
        """After a step on `batch` with a non-finite loss or gradient was not applied: reject
        (quarantine, ledger, charge) the shards of the groups to blame, or of the whole batch
        if no single group is; return the groups of `waiting` from other shards. Under ranks
        the writer finds them and each rank rejects its own volunteers' (_refused)."""
        if self._sharded:
            self._gather()  # each group's own backward runs on the writer's whole copy
        bad = non_finite_groups(self.full_policy, batch, self.prompt_ids, self.version, self.cfg) or batch
        keys = sorted({g.key for g in bad})
        self.log(f"warning: step not applied: loss {result.loss}, gradient norm {result.grad_norm}; "
                 f"rejecting {len(keys)} shard(s)")
        self._tell("reject", keys=keys)
        return self._refused(keys, waiting, stats)

    def _refused(self, keys: list[str], waiting: list[ScoredGroup],
                 stats: IngestStats) -> list[ScoredGroup]:
        """Reject the shards `keys` of this rank's volunteers; the groups of `waiting` left."""
        for key in keys:
            author = layout.rollout_author(key)
            if self.share is None or (author is not None and self.share.owns(author[1])):
                self.ingest.reject(key, "non_finite", "non_finite: its groups gave a non-finite "
                                   "loss or gradient (the step was not applied)", stats)
        return [g for g in waiting if g.key not in keys]

    def _finish(self, unpublished: int) -> None:
        """After the loop: publish the steps not yet published as the final version, or, if
        there are none, give fleet.json and dashboard/ their last write.

        Stopped by a signal, that version goes out without its final evaluation
        (`_evaluate_unless_stopping`). With no step since the last publish no metrics are
        pending: step lines and evals go out with the publish that follows them, in its
        write-once metrics object, so the buffer is empty here."""
        if unpublished:
            self.publish_next(final=True)
        else:
            self._write_views(final=True)
        # The last retention pass: finished, or after a stop signal cut short and waited for
        # at most RETENTION_STOP_WAIT seconds (a request hanging then is abandoned).
        self.retention.close(RETENTION_STOP_WAIT if self.stop.is_set() else None)

    def _record(self, groups: list[ScoredGroup], outcome: str, step: int | None = None) -> None:
        """Ledger records for `groups`, one per shard."""
        by_key: dict[str, list[ScoredGroup]] = {}
        for g in groups:
            by_key.setdefault(g.key, []).append(g)
        for key, gs in by_key.items():
            self.ledger.record(key, outcome, [g.line for g in gs], gs[0].shard_size,
                               [g.digest for g in gs], step=step)

    def _done(self, steps: int, started: float) -> bool:
        cfg = self.cfg
        return bool(self.stop.is_set() or (cfg.max_steps and steps >= cfg.max_steps)
                    or (cfg.max_seconds and time.time() - started >= cfg.max_seconds))

    def publish_next(self, final: bool = False, buffered: list[ScoredGroup] = ()) -> None:
        """Publish the weights in hand as the next version (trainer.publish.publish), then what
        follows each publish: retention, ledger and state pruning, evaluation on its cadence,
        fleet.json and dashboard/, and the metrics of the steps that led to it. `buffered`:
        the usable groups in hand, which the version's quota need not ask for again."""
        self.last_used += 1
        version = self.last_used
        self.last_publish_start = time.time()
        fresh_after = sum(g.policy_version > self.version - self.cfg.max_staleness for g in buffered)
        if self._sharded:  # every rank's optimizer shards and ledger records before the manifest
            if self.lean:
                self._unbind()  # whatever it held (a refused step's gather)
            else:
                self._gather()
            prepare_sharded(self.state_root, version)
            self._tell("save", version=version)
            save_sharded_optimizer(self.state_root, version, self.policy.model, self.opt)
            self._hear_followers()
            barrier(self.ranks)
            if self.lean:
                self._tell("stream")  # the followers take part in each tensor's gather
        self.manifest, self.etag = publish(self.storage, self.full_policy, version, self.cfg,
                                           self.run_id, self.dataset, self.etag, self.key,
                                           self.chain, lambda: self._save(version),
                                           self._next_pool(),
                                           self.balance.quota(time.time(), fresh_after),
                                           source=self.policy.model if self.lean else None,
                                           task=self.task_info.ref)
        self.balance.after_publish(time.time())
        self._keep_window_weights()
        self.retention.after_publish(self.manifest)
        self.published = {v for v in self.published | {version} if v >= self.window().low}
        self.pools = {v: p for v, p in {**self.pools, version: self.manifest.prompt_pool}.items()
                      if v in self.published}
        self.ledger.prune(self.window().low)
        prune_states(self.state_root, {version})
        every = self.cfg.eval_every
        if final or (every and self.version % every == 0):
            self._evaluate_unless_stopping(self.version, full=final)
        self._write_views(final)
        self._flush_metrics(self.version)
        if self.lean:  # between publishes the writer holds its shards and nothing whole
            self._unbind()
            self.chain.spill()

    def _write_views(self, final: bool) -> None:
        """fleet.json and dashboard/, for people: each written when its cadence says so, and
        at the end. Neither can fail the trainer."""
        records = metrics.parse_lines(self.metrics_buffer)  # once, for both
        fleet, numbers = self.fleet, self.numbers
        if self._peers:  # under ranks: every rank's volunteers, as of the last save
            fleet = copy.copy(self.fleet)
            fleet.counts = dict(self.fleet.counts)
            numbers = GroupNumbers(by=dict(self.numbers.by))
            for peer in self._peers.values():  # (our own ranks' JSON: a ValueError is a bug)
                theirs = Fleet()
                theirs.load_counts(peer["volunteers"])
                fleet.counts.update(theirs.counts)
                numbers.by.update(GroupNumbers.from_json(peer["group_numbers"]).by)
        self.fleet_summary.after_publish(self.manifest, self.steps, records, fleet, final,
                                         numbers.next_number, self.balance)
        self.dashboard.after_publish(records, final)

    def _record_step(self, step: int, batch: list[ScoredGroup], result: StepResult,
                     stats: IngestStats, stale_dropped: int, timing: dict[str, float]) -> None:
        rewards = [r for g in batch for r in g.rewards]
        lags = Counter(self.version - g.policy_version for g in batch)
        m = {
            metrics.KIND: metrics.STEP_LINE, metrics.STEP: step, metrics.VERSION: self.version,
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
            "ingest/by_volunteer": stats.by_volunteer,
            metrics.USEFUL_FRACTION: self.balance.useful_fraction(time.time()),
            metrics.USABLE_FRACTION: self.balance.usable_fraction(time.time()),
            "audit/shards": stats.audit.audited, "audit/skipped": stats.audit.skipped,
            "audit/deferred": stats.audit.deferred, "audit/seconds": stats.audit.seconds,
            "audit/by_volunteer": stats.audit.by_volunteer,
            "train/loss": result.loss, "train/grad_norm": result.grad_norm,
            **timing,
            **{f"train/{k}": v for k, v in result.stats.items()},
        }
        self.metrics_buffer.append(m)
        zero = m["rollout/frac_reward_zero_std"]
        self.log(f"step {step} v{self.version} reward {m[metrics.REWARD_MEAN]:.3f} "
                 f"lag {dict(sorted(lags.items()))} zero-std {'-' if zero is None else f'{zero:.2f}'} "
                 f"dropped {stale_dropped} loss {result.loss:+.4f} ({timing['train/step_time']:.2f}s)")


def train(cfg: TrainerConfig, log: Callable[[str], None] = print,
          stop: StopSignal | None = None) -> Manifest:
    """Start and run a trainer. A stop signal before the loop begins raises Stopped."""
    trainer = Trainer(cfg, log, stop)
    trainer.start()
    return trainer.run()
