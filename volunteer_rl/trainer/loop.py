"""The central trainer: publish a version, learn from fresh shards, publish the next one.

One loop, no server: everything it says to volunteers it writes into the bucket (checkpoints,
then the manifest that commits them), and everything it hears comes from shards it lists
under the rollout prefixes of the versions inside the staleness window.

`Trainer` wires the rooms and runs the loop: the learner (policy, optimizer, step, its
saved state), the weights held besides it (held: the window's, the second model), the
publisher (where the run stands and what each publish does), the records (metrics, evals,
views, ledger records), how the trainer starts (startup) and the role it plays (roles: a
single process; under torchrun the writer or a follower, trainer.writer, trainer.follower).

SIGINT and SIGTERM (stopping.py) end it with exit 0 and nothing half-made: the loop finishes
the step in hand, publishes the steps not yet published (without the final evaluation) and
writes their metrics, fleet.json and dashboard/ one last time.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.model.devices import pick_device
from volunteer_rl.model.policy import Policy
from volunteer_rl.progress import Every
from volunteer_rl.protocol.manifest import Manifest, poll_manifest
from volunteer_rl.stopping import StopSignal
from volunteer_rl.storage import open_storage
from volunteer_rl.task.bounded import BoundedRewards
from volunteer_rl.task.curriculum import PromptPicker
from volunteer_rl.trainer.balance import Balance
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.follower import Follower
from volunteer_rl.trainer.held import HeldWeights
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup, Window
from volunteer_rl.trainer.learner import Learner
from volunteer_rl.trainer.preflight import Inputs, TrainerError, read_inputs
from volunteer_rl.trainer.publish import WeightsChain, published_or_started, signing_key
from volunteer_rl.trainer.publisher import Publisher
from volunteer_rl.trainer.ranks import announce, collective_errors, join, leave
from volunteer_rl.trainer.records import Records, record_groups, waiting_line
from volunteer_rl.trainer.reporters import Reporters
from volunteer_rl.trainer.retention import TrainerRetention
from volunteer_rl.trainer.roles import Single
from volunteer_rl.trainer.startup import resume, start_fresh
from volunteer_rl.trainer.step import StepResult, non_finite_groups
from volunteer_rl.trainer.warmstart import trainer_split
from volunteer_rl.trainer.withheld import GroupNumbers
from volunteer_rl.trainer.writer import Writer


RETENTION_STOP_WAIT = 5.0
"""Seconds a stopping trainer waits for its retention pass to reach its next request."""

DRAIN_STEPS = 16
"""Steps a due publish may wait while the version it pushes out of the window still has
groups on their way (Single.backlog): shards the intake listed and has not read yet, and
numbers granted under it that their volunteer has not reached yet. Either would leave the
window with it and count as missing though their volunteer sampled them in time. The steps go
on meanwhile. A shard is read at most MAX_SHARDS_PER_VOLUNTEER_POLL per volunteer per poll,
so 16 steps read a backlog of 256 shards of one volunteer, what a trainer down for a while
finds; a grant in flight is at most a batch of its volunteer's, sampled while the fleet's
other groups make steps (a volunteer at a quarter of a fleet of steps of 32 groups samples a
batch of 32 in about 4 steps). The bound keeps a volunteer that uploads without end, or late,
from holding publishes back for longer."""

SPILLED = "weights-last.safetensors"
"""In --work-dir: a `lean` writer's last published weights file, the base of the next patch."""


class Trainer:
    """The loop that wires the rooms: start (fresh or resumed), then poll, step, publish."""

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
        # a single process's, and its role (self.role) a Single.
        self.ranks = join(pick_device(cfg.device), cfg.rank_timeout)
        announce(self.ranks, log)  # `[rank R]` on this rank's lines from here on
        self.device = self.ranks.device
        if cfg.groups_per_step % self.ranks.world_size:
            leave(self.ranks)
            raise TrainerError(f"--groups-per-step {cfg.groups_per_step}: not a multiple of the "
                               f"{self.ranks.world_size} ranks (each computes an equal share)")
        if cfg.lora_rank and self.ranks.joined:
            leave(self.ranks)
            raise TrainerError(f"--lora-rank {cfg.lora_rank}: LoRA trains in one process "
                               "(its point is that the model fits one); run without torchrun")
        self.train_path, self.problems = inputs.train_path, inputs.problems
        # The rooms log through self.log, which a program may swap once it built the trainer.
        say = lambda line: self.log(line)  # noqa: E731
        self.learner = Learner(cfg, self.ranks)
        self.fleet = Fleet(cfg.deny_after, cfg.deny_rate)
        self.held = HeldWeights(cfg, self.learner, WeightsChain(
            cfg.keyframe_every, cfg.patch_max_fraction,
            spill_to=Path(cfg.work_dir) / SPILLED if self.learner.lean else None))
        self.records = Records(cfg, self.storage, say, self.stop, self.task, inputs.held_out,
                               self.held, self.reporters, self.ranks.world_size)
        # The curriculum: fed with every group taken, it fills each version's prompt pool.
        # Only the rows the warm start did not train on (warmstart.trainer_split).
        rl_rows = [self.problems[i] for i in trainer_split(cfg, len(self.problems)).rl]
        self.picker = PromptPicker(rl_rows, random.Random(cfg.seed), cfg.curriculum,
                                   self.task.stratum)
        # Every reward of a volunteer's completion runs in a worker process under the task's
        # bounds (task.bounded): a completion that makes it slow or huge is a rejection.
        self.rewards = BoundedRewards(self.task_info.value, self.task.reward_seconds,
                                      self.task.reward_memory_mb)
        self.numbers = GroupNumbers()  # group numbers received; restored on a resume
        self.waiting = Every()  # why the loop waits for groups: at most one line per interval
        # What each version asks of each volunteer (the manifest's quota) and the useful fraction.
        self.balance = Balance(cfg.groups_per_step, cfg.publish_every, cfg.quota_headroom)
        self.publisher = Publisher(cfg, self.storage, say, self.learner, self.held, self.records,
                                   self.balance, self.retention, self.picker, self.fleet,
                                   self.numbers, self.task_info.ref)
        role = Follower if self.ranks.is_follower else Writer if self.ranks.joined else Single
        self.role = role(cfg, self.ranks, self.publisher, self.task, self.picker, self.problems,
                         self.rewards)

    # What programs and tests read of the rooms.
    policy = property(lambda self: self.learner.policy, doc="The policy trained.")
    opt = property(lambda self: self.learner.opt, doc="Its AdamW.")
    steps = property(lambda self: self.learner.steps, doc="Optimizer steps of the whole run.")
    manifest = property(lambda self: self.publisher.manifest, doc="The last manifest published.")
    key = property(lambda self: self.publisher.key, doc="The key that signs the manifests.")
    run_id = property(lambda self: self.publisher.run_id)
    pools = property(lambda self: self.publisher.pools, doc="The window's prompt pools.")
    ledger = property(lambda self: self.publisher.ledger)
    window_weights = property(lambda self: self.held.window)
    audit_policy = property(lambda self: self.held.audit_policy, doc="None with audits off.")
    ingest = property(lambda self: self.role.ingest)
    prompt_ids = property(lambda self: self.role.prompt_ids, doc="Every problem's prompt tokens.")
    metrics_buffer = property(lambda self: self.records.buffer, doc="The next version's metrics.")

    @property
    def held_out(self) -> list:
        """The held-out rows evaluations run on (a program may cut them before `start`)."""
        return self.records.held_out

    @held_out.setter
    def held_out(self, rows: list) -> None:
        self.records.held_out = rows

    @property
    def version(self) -> int:
        """The published version the trainer is training from: the manifest's."""
        return self.publisher.version

    @property
    def published_policy(self) -> Policy:
        """The weights volunteers run, of the version just published (HeldWeights.published)."""
        return self.held.published(self.version)

    def window(self) -> Window:
        return self.publisher.window()

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

        Under ranks the writer then shares the model with the followers (writer.Writer); a
        follower instead starts from what the writer published (follower.Follower)."""
        self.role.start(self._lead)

    def _lead(self) -> None:
        cfg, p = self.cfg, self.publisher
        with self.stop.abortable():
            with self.stop.shielded():  # never a new key for a bucket another key signs
                p.key, trust = signing_key(cfg, self.storage, self.log, self.inputs.key_path)
            manifest, etag = poll_manifest(self.storage, None, trust=trust)
            if manifest is None:
                start_fresh(p, self.stop, self.task, self.problems, self.train_path, self.device)
            else:
                resume(p, self.stop, self.task, self.train_path, manifest, etag, self.device)
            # Versions left half-published by a crash are never reused: the next one goes above.
            p.last_used = max([self.version] + published_or_started(self.storage))
            self.role.make_intake(trust)

    def run(self) -> Manifest:
        """The loop (a follower rank follows the writer instead); every rank leaves the
        process group after it, together when the writer told the followers to stop
        (ranks.leave)."""
        if self.cfg.threads > 0:
            torch.set_num_threads(self.cfg.threads)
        try:
            with collective_errors(self.ranks, "while training"):
                return self.role.run(self._run)
        finally:
            self.rewards.close()
            self.reporters.close()
            leave(self.ranks)  # after a failed collective: the others may be gone

    def _run(self) -> Manifest:
        cfg, learner, role = self.cfg, self.learner, self.role
        started = time.time()
        buffer: list[ScoredGroup] = []
        steps, unpublished, stats = 0, 0, IngestStats()
        stale_dropped, waited, t_ingest, last_publish = 0, 0.0, 0.0, 0.0
        held = 0  # steps the next publish was held back for (DRAIN_STEPS)
        while not self._done(steps, started):
            t0 = time.time()
            role.tell_poll()  # the followers poll their share
            buffer, batch, stale, fresh = role.intake_round(buffer, stats, self.window())
            stale_dropped += stale
            t_ingest += time.time() - t0
            check = role.step_replay(unpublished)  # the version in hand's, replayed in the step
            if batch is not None:  # every group replayed before it is trained (trainer.verify)
                leave = None if check is None else check.version
                batch, passed = role.verified(batch, stats, leave)
                if batch is None:
                    buffer = passed + buffer
                    continue
            if batch is None:
                t0 = time.time()  # the groups in hand replayed in the wait, not the step
                buffer = role.verify_waiting(buffer, stats, None if check is None else check.version)
                if self.waiting.due():
                    self.log(waiting_line(fresh, stats, cfg.groups_per_step, learner.steps))
                pause = max(0.0, cfg.poll_seconds - (time.time() - t0))
                self.stop.wait(pause)  # a stop signal ends the wait at once
                waited += pause  # (followers wait in the next message's collective)
                continue
            t0 = time.time()
            result = learner.step(batch, self.prompt_ids, self.version, check)
            if check is not None:
                passed = role.replayed_in_step(batch, check, stats)
                if check.problems:
                    buffer = passed + buffer
                    continue
            if not result.applied:
                buffer = self.refuse_step(role.own(batch) + buffer, batch, result, stats)
                continue
            steps += 1
            unpublished += 1
            learner.steps += 1
            record_groups(self.ledger, role.own(batch), "trained", learner.steps)
            self.balance.after_step(time.time(), self.fleet.take_received(),
                                    Counter(g.volunteer_id for g in batch), stats.groups,
                                    stats.zero_variance + stats.duplicates, waited)
            timing = {"train/step_time": time.time() - t0, "time/ingest": t_ingest,
                      "time/waiting_for_rollouts": waited, "time/last_publish": last_publish,
                      "time/dashboard": self.records.dashboard.take_seconds()}
            self.records.step(learner.steps, self.version, batch, result, stats, stale_dropped,
                              timing, self.balance)
            stats, stale_dropped, waited, t_ingest = IngestStats(), 0, 0.0, 0.0
            due = time.time() - self.publisher.last_publish_start >= cfg.publish_min_seconds
            if unpublished >= cfg.publish_every and due and not self._done(steps, started):
                if role.backlog and held < DRAIN_STEPS:
                    held += 1  # the version it pushes out still holds unread shards
                else:
                    t0 = time.time()
                    self.publish_next(buffered=buffer)
                    last_publish = time.time() - t0
                    unpublished, held = 0, 0
        self._finish(unpublished)
        return self.manifest

    def refuse_step(self, waiting: list[ScoredGroup], batch: list[ScoredGroup],
                    result: StepResult, stats: IngestStats) -> list[ScoredGroup]:
        """After a step on `batch` with a non-finite loss or gradient was not applied: reject
        (quarantine, ledger, charge) the shards of the groups to blame, or of the whole batch
        if no single group is; return the groups of `waiting` from other shards. Under ranks
        the writer finds them and each rank rejects its own volunteers' (roles.Single.reject)."""
        self.role.gather()  # each group's own backward runs on the writer's whole copy
        bad = non_finite_groups(self.held.full_policy, batch, self.prompt_ids, self.version,
                                self.cfg) or batch
        keys = sorted({g.key for g in bad})
        self.log(f"warning: step not applied: loss {result.loss}, gradient norm {result.grad_norm}; "
                 f"rejecting {len(keys)} shard(s)")
        self.role.tell("reject", keys=keys)
        return self.role.reject(keys, waiting, stats)

    def _finish(self, unpublished: int) -> None:
        """After the loop: publish the steps not yet published as the final version, or, if
        there are none, give fleet.json and dashboard/ their last write.

        Stopped by a signal, that version goes out without its final evaluation
        (records.Records.evaluate_unless_stopping). With no step since the last publish no
        metrics are pending: step lines and evals go out with the publish that follows them,
        in its write-once metrics object, so the buffer is empty here."""
        if unpublished:
            self.publish_next(final=True)
        else:
            self.publisher.write_views(final=True)
        # The last retention pass: finished, or after a stop signal cut short and waited for
        # at most RETENTION_STOP_WAIT seconds (a request hanging then is abandoned).
        self.retention.close(RETENTION_STOP_WAIT if self.stop.is_set() else None)

    def _done(self, steps: int, started: float) -> bool:
        cfg = self.cfg
        return bool(self.stop.is_set() or (cfg.max_steps and steps >= cfg.max_steps)
                    or (cfg.max_seconds and time.time() - started >= cfg.max_seconds))

    def publish_next(self, final: bool = False, buffered: list[ScoredGroup] = ()) -> None:
        """Publish the weights in hand as the next version, and what follows each publish
        (publisher.Publisher.publish_next); under ranks every rank saves its part of the
        state before the manifest (writer.Writer.before_publish). `buffered`: the usable
        groups in hand, which the version's quota need not ask for again."""
        version = self.publisher.next_version()
        self.role.before_publish(version)
        self.publisher.publish_next(version, final, buffered)
        self.role.after_publish()


def train(cfg: TrainerConfig, log: Callable[[str], None] = print,
          stop: StopSignal | None = None) -> Manifest:
    """Start and run a trainer. A stop signal before the loop begins raises Stopped."""
    trainer = Trainer(cfg, log, stop)
    trainer.start()
    return trainer.run()
