"""The role this process plays in training, as the trainer's loop sees it: a single process
(`Single`, here), or under torchrun one rank of several (`Ranked`, here: the writer,
trainer.writer, or a follower, trainer.follower). The loop calls the same few things of
each: start, run, tell the followers, the intake's round and the ranks' agreement on its
batch, the groups that are this rank's own, the whole weights before a refused step's
culprits are found, and what a publish needs before and after its commit. For a single
process all but the intake's round are nothing.
"""

from __future__ import annotations

import functools
from typing import Callable

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import VrlError
from volunteer_rl.model.policy import encode_prompts
from volunteer_rl.model.replay import replays_in_training
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.grants import grant_secret
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage.base import StorageError
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.bounded import BoundedRewards
from volunteer_rl.task.curriculum import PromptPicker
from volunteer_rl.trainer.audit import Auditor, Budget
from volunteer_rl.trainer.checks import Rules
from volunteer_rl.trainer.granting import Granter
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup, Window, split_fresh
from volunteer_rl.trainer.ingest import Ingest
from volunteer_rl.trainer.publisher import Publisher
from volunteer_rl.trainer.ranks import Ranks, leave, rank_share
from volunteer_rl.trainer.records import record_groups
from volunteer_rl.trainer.reward_budget import RewardBudget, RewardShares
from volunteer_rl.trainer.shares import Share, agree_on_batch
from volunteer_rl.trainer.step import StepReplay
from volunteer_rl.trainer.verify import Verdict, verify
from volunteer_rl.trainer.withheld import GroupNumbers, hold_back

Round = tuple[list[ScoredGroup], list[ScoredGroup] | None, int, int]
"""An intake round's (groups left waiting, the batch or None, groups gone stale, fresh groups
held)."""


class Single:
    """A single process: the whole fleet is its own, and it has no other rank to tell."""

    def __init__(self, cfg: TrainerConfig, ranks: Ranks, publisher: Publisher, task: Task,
                 picker: PromptPicker, problems: list[Row], rewards: BoundedRewards):
        self.cfg, self.ranks, self.publisher, self.task = cfg, ranks, publisher, task
        self.picker, self.problems, self.rewards = picker, problems, rewards
        self.log = publisher.log
        self.share: Share | None = None  # this rank's share of the fleet; None: all of it
        self.ingest: Ingest | None = None  # make_intake's
        self.prompt_ids: dict[int, list[int]] = {}  # every problem's prompt, as tokens
        self.backlog = 0
        """What the next publish would push out of the window before it arrives, as the last
        intake round saw it, of every rank: shards listed and left unread (Ingest.unread_low),
        and volunteers with numbers granted under those versions still in flight
        (`in_flight`). The loop holds the publish back for them (loop.DRAIN_STEPS)."""

    def start(self, lead: Callable[[], None]) -> None:
        """Start as the trainer: `lead` publishes v0 or resumes."""
        lead()

    def run(self, loop: Callable[[], Manifest]) -> Manifest:
        """Run `loop` to its end, then let the other ranks go (none here)."""
        try:
            manifest = loop()
        except (VrlError, StorageError):
            self.tell("stop")  # failed outside a collective (the bucket): let them go
            self.leave_together()
            raise
        self.tell("stop")
        self.leave_together()
        return manifest

    def leave_together(self) -> None:
        """End the reward worker, then leave the ranks after a barrier. The worker goes first
        so that nothing runs between the barrier and the exit: gloo's teardown aborts a rank
        that is still tearing down while another has gone (ranks.leave)."""
        self.rewards.close()
        leave(self.ranks, meet=True)

    def tell(self, do: str, **fields) -> None:
        """The followers' next action (writer.Writer.tell): none to tell here."""

    def tell_poll(self) -> None:
        """Before the loop's intake round: the followers poll their share (writer.Writer)."""

    def observe(self, pid: int, rewards: list[float]) -> None:
        """The curriculum learns each group taken (the intake's `observe`)."""
        self.picker.observe(self.problems[pid], rewards)

    def make_intake(self, trust: Trust) -> None:
        """The intake (trainer.ingest) of this process, or of this rank's share of the fleet,
        with its rules, and its auditor holding the window's weights if audits are on."""
        cfg, p, task = self.cfg, self.publisher, self.task
        policy = p.learner.policy
        rules = Rules(self.problems, len(policy.tokenizer), cfg.k, cfg.max_new_tokens,
                      policy.decode_all, policy.eos_id, policy.special_ids, run_id=p.run_id,
                      secret=grant_secret(p.key), rewards=self.rewards.rewards)
        self.prompt_ids = dict(enumerate(encode_prompts(
            policy, [task.prompt(row) for row in self.problems], task.instruction)))
        auditor = None
        if cfg.audit_tolerance > 0:
            replay = functools.partial(p.held.replay, prompt_ids=self.prompt_ids, run_id=p.run_id)
            auditor = Auditor(replay, Budget(cfg.audit_share), cfg.audit_full_groups,
                              cfg.audit_floor, trusted=cfg.verify == "sampled",
                              cover_floor=cfg.audit_cover_floor)
            p.held.recover(p.published, p.storage, trust, self.log,
                           None if p.lora_base is None else p.lora_base.whole.root)
        budget = RewardBudget(cfg.shard_reward_seconds, cfg.poll_reward_seconds,
                              p.records.stop.is_set, RewardShares(cfg.reward_share))
        self.ingest = Ingest(p.storage, rules, p.ledger, p.fleet, auditor, self.log,
                             cfg.log_shards, numbers=p.numbers, observe=self.observe,
                             share=self.share, budget=budget,
                             granter=Granter(p.storage, p.run_id, p.key, p.numbers, self.log))

    def intake_round(self, buffer: list[ScoredGroup], stats: IngestStats,
                     win: Window) -> Round:
        """One poll of the intake, stale groups recorded, and the step's batch if there are
        enough fresh groups (see Round). Under ranks every rank polls its share and they
        agree on the batch (Ranked.agree)."""
        buffer = self.ingest.poll(win, stats, buffer)
        self.backlog = self.ingest.unread_low + self.in_flight(win)
        fresh, stale = split_fresh(buffer, win.version, self.cfg.max_staleness)
        record_groups(self.publisher.ledger, stale, "stale")
        fresh, held = hold_back(fresh, self.publisher.numbers, self.cfg.missing_bound)
        stats.held_missing += len(held)
        batch, taken, stale_n, fresh_n = self.agree(fresh, len(stale), stats)
        return held + fresh[taken:], batch, stale_n, fresh_n

    def in_flight(self, win: Window) -> int:
        """Volunteers granted numbers under a version the next publish pushes out, none of
        them received yet (withheld.GroupNumbers.outstanding): sampled in order, as honest
        ones do, they are in flight, and a publish made now would count them missing. Not
        those a publish would not wait for anyway (Ingest.waits_for) nor those whose groups
        are held back for their missing share (a volunteer that leaves its grants unsampled
        is held after one)."""
        numbers, bound = self.publisher.numbers, self.cfg.missing_bound
        return numbers.outstanding(win.leaving, lambda v: not self.ingest.waits_for(v)
                                   or numbers.held(v, bound))

    def agree(self, fresh: list[ScoredGroup], stale: int,
              stats: IngestStats) -> tuple[list[ScoredGroup] | None, int, int, int]:
        """The step's batch of `fresh` or None, how many of `fresh` it took, the groups gone
        stale and the fresh groups held."""
        size = self.cfg.groups_per_step
        if len(fresh) < size:
            return None, 0, stale, len(fresh)
        return fresh[:size], size, stale, len(fresh)

    def verified(self, batch: list[ScoredGroup], stats: IngestStats, leave: int | None = None
                 ) -> tuple[list[ScoredGroup] | None, list[ScoredGroup]]:
        """(`batch`, []) if every group of it passed its replay (trainer.verify; with
        --verify every and audits on), else (None, the groups of this rank's volunteers that
        passed): no step this round, those wait in front of the buffer, the failures' shards
        are rejected (Ingest.failed_replay) and the groups that could not be replayed
        withdrawn. `leave`: the version whose groups the step's own forward replays
        (step_replay). Under ranks every rank calls it on the same batch (Ranked.settle)."""
        cfg, p = self.cfg, self.publisher
        if cfg.verify != "every" or cfg.audit_tolerance <= 0:
            return batch, []
        mine = verify(p.held, batch, self.verify_share(len(batch)), self.prompt_ids, p.run_id,
                      self.ingest.log_trace, leave)
        count_verified(stats, mine)
        verdict = self.settle(mine)
        if verdict.clean:
            return batch, []
        # `leave`'s groups were not replayed: they stay unverified for the step's forward
        return None, self.drop_failed(batch, verdict, stats, lambda g: g.policy_version != leave)

    def verify_waiting(self, waiting: list[ScoredGroup], stats: IngestStats,
                       leave: int | None) -> list[ScoredGroup]:
        """While the loop waits for rollouts: replay the groups in hand now (trainer.verify),
        as the batch that takes them would before its step, so that the wait's time is spent
        on them rather than the step's. Fewer than a batch are in hand (or a batch would have
        formed), and the next batch takes them unless newer groups arrive first (train_order)
        and the next publish then pushes them out of the window: about 10 % of the replays in
        the demo's setting were of such groups (bench.audit_cost). Left for later: `leave`'s
        groups (the step's own forward replays them for less) and those of volunteers held
        back for their missing share (hold_back: they may never be trained). A failure is
        handled as `verified` handles one: its shard rejected, a forgery denying its
        volunteer; the groups left are returned. Under ranks nothing is replayed here
        (Ranked: a batch's replays are shared out among the ranks)."""
        cfg, p = self.cfg, self.publisher
        if cfg.verify != "every" or cfg.audit_tolerance <= 0:
            return waiting
        trainable, held = hold_back(waiting, p.numbers, cfg.missing_bound)
        verdict = verify(p.held, trainable, range(len(trainable)), self.prompt_ids, p.run_id,
                         self.ingest.log_trace, leave)
        count_verified(stats, verdict)
        if verdict.clean:
            return waiting
        # verify marked the groups it replayed; the order does not matter, as the next intake
        # round sorts the fresh groups (split_fresh)
        return held + self.drop_failed(trainable, verdict, stats, lambda g: False)

    def step_replay(self, unpublished: int) -> StepReplay | None:
        """What the step's own forward replays (trainer.step.StepReplay): the groups of the
        version in hand, when its weights are exactly that version's as volunteers load them
        (fp32 weights, no step since its publish: `unpublished` is 0) and training mode
        leaves the forward as it is; None otherwise, and always under ranks (Ranked)."""
        cfg, p = self.cfg, self.publisher
        if (cfg.verify != "every" or cfg.audit_tolerance <= 0 or cfg.weights_dtype != "fp32"
                or unpublished or not self.replays_in_training):
            return None
        return StepReplay(p.version, p.run_id)

    @functools.cached_property
    def replays_in_training(self) -> bool:
        return replays_in_training(self.publisher.learner.policy.model)

    def replayed_in_step(self, batch: list[ScoredGroup], check: StepReplay,
                         stats: IngestStats) -> list[ScoredGroup]:
        """After the step's own forward replayed `check`'s groups: its figures counted, and
        if one failed (the step was not applied) the groups of `batch` to wait in front of
        the buffer, as `verified` leaves them; [] when none failed."""
        verdict = Verdict(problems=check.problems, replayed=check.replayed, seconds=check.seconds)
        count_verified(stats, verdict)
        if verdict.clean:
            return []
        # Not marked: the micro-batches after the failing one were never replayed (the scan
        # marked those it replayed).
        return self.drop_failed(batch, verdict, stats, lambda g: False)

    def drop_failed(self, batch: list[ScoredGroup], verdict: Verdict, stats: IngestStats,
                    replayed: Callable[[ScoredGroup], bool]) -> list[ScoredGroup]:
        """The failures' shards rejected and the unverifiable groups withdrawn; the groups of
        this rank's volunteers that did not fail, those the verdict replayed (by `replayed`,
        on any rank) marked verified. A group left unreplayed must stay unmarked: whatever
        replays it next skips a group marked verified."""
        for i, (reason, detail) in sorted(verdict.problems.items()):
            if self.owns_shard(batch[i].key):
                self.ingest.failed_replay(batch[i], reason, detail, stats)
        for i in sorted(verdict.unverifiable):
            if self.owns_shard(batch[i].key):
                self.ingest.unverifiable(batch[i].key)
        bad = set(verdict.problems) | verdict.unverifiable
        passed = [g for i, g in enumerate(batch) if i not in bad]
        for g in passed:
            if replayed(g):  # by some rank, or before
                g.verified = True
        return self.own(passed)

    def verify_share(self, n: int) -> range:
        """The indices of a batch of `n` groups this rank replays: all of them here."""
        return range(n)

    def settle(self, verdict: Verdict) -> Verdict:
        """Every rank's verdict on its share, merged: here the one."""
        return verdict

    def own(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        """The groups of this rank's volunteers (a single process: all of them)."""
        return list(groups)

    def owns_shard(self, key: str) -> bool:
        return True

    def reject(self, keys: list[str], waiting: list[ScoredGroup],
               stats: IngestStats) -> list[ScoredGroup]:
        """After a refused step: reject the shards `keys` of this rank's volunteers; the
        groups of `waiting` left."""
        for key in keys:
            if self.owns_shard(key):
                self.ingest.reject(key, "non_finite", "non_finite: its groups gave a non-finite "
                                   "loss or gradient (the step was not applied)", stats)
        return [g for g in waiting if g.key not in keys]

    def gather(self) -> None:
        """The whole current weights into held.HeldWeights.full_policy: here they are."""

    def before_publish(self, version: int) -> None:
        """What every rank saves before the manifest of `version`: nothing more here."""

    def after_publish(self) -> None:
        """After a publish and what follows it: nothing here."""


def count_verified(stats: IngestStats, verdict: Verdict) -> None:
    """A verification's figures into the step's metrics (`verify/...`)."""
    stats.audit.verified += verdict.replayed
    stats.audit.verify_failed += len(verdict.problems)
    stats.audit.verify_seconds += verdict.seconds


class Ranked(Single):
    """One rank of several: its own share of the fleet (trainer.shares), and the intake's
    batch agreed with the other ranks."""

    def __init__(self, *args):
        super().__init__(*args)
        self.share = Share(self.ranks)

    def agree(self, fresh: list[ScoredGroup], stale: int,
              stats: IngestStats) -> tuple[list[ScoredGroup] | None, int, int, int]:
        """Every rank polled its share; they agree on the batch (shares.agree_on_batch), and
        the writer's `stats`, staleness count and curriculum take in every rank's poll, and
        every rank's backlog is summed (the writer holds its publish back for any)."""
        batch, taken, reports = agree_on_batch(self.share, fresh, self.cfg.groups_per_step,
                                               {**self.poll_report(stats, stale),
                                                "backlog": self.backlog})
        self.backlog = sum(r["backlog"] for r in reports)
        stale += self.hear_polls(reports, stats)
        return batch, taken, stale, sum(r["fresh"] for r in reports)

    def poll_report(self, stats: IngestStats, stale: int) -> dict:
        """What this rank tells the writer of its poll."""
        return {}

    def hear_polls(self, reports: list[dict], stats: IngestStats) -> int:
        """The writer: the other ranks' polls taken in; the groups gone stale there."""
        return 0

    def verify_waiting(self, waiting: list[ScoredGroup], stats: IngestStats,
                       leave: int | None) -> list[ScoredGroup]:
        """Nothing: every rank replays its share of the batch together (verified)."""
        return waiting

    def step_replay(self, unpublished: int) -> StepReplay | None:
        """None: a rank's forward holds only its share of the rows, and the ranks' backward is
        collective, so every group is replayed before the step (verified)."""
        return None

    def verify_share(self, n: int) -> range:
        """This rank's contiguous 1/world_size of the batch, as for the loss (rank_share)."""
        s = rank_share(n, self.ranks)
        return range(s.start, s.stop)

    def settle(self, verdict: Verdict) -> Verdict:
        """Every rank's verdict on its share, exchanged (a collective of every rank), merged."""
        merged = Verdict()
        for r in self.share.exchange({"problems": [[i, *p] for i, p in verdict.problems.items()],
                                      "unverifiable": sorted(verdict.unverifiable)}):
            merged.problems.update({i: (reason, detail) for i, reason, detail in r["problems"]})
            merged.unverifiable.update(r["unverifiable"])
        return merged

    def own(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        return [g for g in groups if self.share.owns(g.volunteer_id)]

    def owns_shard(self, key: str) -> bool:
        author = layout.rollout_author(key)
        return author is not None and self.share.owns(author[1])

    def keep_own_volunteers(self, start: dict) -> None:
        """This rank's volunteers' counts and group numbers, of all the writer saved."""
        mine = self.share.owns
        self.publisher.fleet.load_counts({v: c for v, c in start["volunteers"].items() if mine(v)})
        try:
            self.publisher.numbers.by = GroupNumbers.from_json(
                {v: n for v, n in start["group_numbers"].items() if mine(v)}).by
        except ValueError as exc:
            self.log(f"warning: {exc}: group numbers start afresh")
