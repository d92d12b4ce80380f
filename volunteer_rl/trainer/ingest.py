"""The trainer's intake: each poll, find the new shards inside the staleness window, read and
check them, and take their groups against the ledger, or reject them with a reason code.

A poll, in order: the denylist is refreshed; the window's folders are listed, the volunteers'
asks for group numbers answered (trainer.granting) and the keys to read admitted
(trainer.listing); each admitted shard is fetched, checked and rescored
(trainer.checks), its rewards within the poll's budgets (trainer.reward_budget: a shard with
no reward time left to it waits for a later poll, and a stop ends the reading); the groups
whose content is also under another id are found (trainer.claims); then each shard is
audited if due (trainer.audit_desk) and taken: its repeats, group numbers, zero-variance and
duplicate groups sorted out, the rest handed to the loop. Every shard ends in "accepted" or a reason code, counted per volunteer, and a volunteer
that keeps sending bad shards is denied.

Nothing a volunteer reports is believed that the trainer can recompute (trainer.checks), and
audited shards (trainer.audit decides which) have every token replayed against its committed
draw.
"""

from __future__ import annotations

import json
import time
import traceback
from collections import Counter
from concurrent.futures import Future
from typing import Callable

from volunteer_rl.faults import crash_point
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.grants import parse_ask_key
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.protocol.printable import printable
from volunteer_rl.protocol.shards import ShardError
from volunteer_rl.storage.base import AlreadyExists, NotFound, Storage, StorageError
from volunteer_rl.task.bounded import WorkerStartError
from volunteer_rl.trainer.audit import Auditor
from volunteer_rl.trainer.audit_desk import AuditDesk
from volunteer_rl.trainer.checks import Rules, RewardsCut, check_shard
from volunteer_rl.trainer.claims import Claims
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.granting import Granter
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup, Window
from volunteer_rl.trainer.listing import FETCH_WORKERS, Listing
from volunteer_rl.trainer.reward_budget import RewardBudget
from volunteer_rl.trainer.shares import FleetShare
from volunteer_rl.trainer.withheld import GroupNumbers

MAX_READ_ATTEMPTS = 3  # a shard that fails to download this often is reported and skipped
MAX_TRAINER_FAULTS = 3
"""Times the trainer's own fault (an exception of the replay: out of memory, a torch error)
may stop a shard's intake before the shard is left for this process, charged to nobody."""
NUMBERING_ERRORS = {
    "seq_reused": "a group number this volunteer used before",
    "seq_order": "group numbers out of order with the versions they were sampled under",
}
"""The messages of withheld.GroupNumbers' reason codes."""
FORGERY = "replay_mismatch"
"""The reason code that proves a forgery: a token the committed draw cannot give (beyond the
near-tie rule). One such shard denies its volunteer at once, with its untrained groups
withdrawn (unless --deny-after 0 turns automatic denial off); other rejections count towards
--deny-after and --deny-rate."""


def _key_version(key: str) -> int:
    """The version folder a key under rollouts/ sits in (-1 if none), shard or not."""
    parts = layout.split_versioned_key(key)
    return parts[1] if parts else -1


class Ingest:
    """Pulls in the new shards of the window each poll, against the ledger.

    A shard is read once per process; one whose groups all have an outcome in the ledger is
    never read again, one left half-taken by a crash is read again and only its groups
    without an outcome are taken."""

    def __init__(self, storage: Storage, rules: Rules, ledger: Ledger, fleet: Fleet,
                 auditor: Auditor | None = None, log: Callable[[str], None] = print,
                 log_shards: bool = False, fetch_workers: int = FETCH_WORKERS,
                 numbers: GroupNumbers | None = None,
                 observe: Callable[[int, list[float]], None] | None = None,
                 share: FleetShare | None = None, budget: RewardBudget | None = None,
                 granter: Granter | None = None):
        self.storage = storage
        self.rules = rules
        self._ledger = ledger
        self.fleet = fleet
        self.numbers = numbers or GroupNumbers()
        """Group numbers received (withheld.GroupNumbers): saved with the trainer's state."""
        self.observe = observe
        """Called with (prompt id, rewards) of every group taken, duplicates aside: the
        curriculum's observations."""
        self._log = log
        self.log_shards = log_shards
        self.taken: set[str] = set()
        self.failures: Counter = Counter()
        """Key -> failed reads (MAX_READ_ATTEMPTS)."""
        self.faults: Counter = Counter()
        """Key -> faults of the trainer's own while taking it (MAX_TRAINER_FAULTS)."""
        self.withdrawn: set[str] = set()
        """Keys rejected or left after their groups were handed out: poll drops those groups
        from the ones waiting to be trained."""
        self._low = 0  # window's lowest version at the last poll (see _forget_below)
        self.unread_low = 0
        """Shards the last poll listed and left unread (the per-poll caps, the reward budget,
        an audit that must wait) of the version the next publish pushes out of the window:
        they would never be read. The loop holds
        the publish back while there are any (loop.DRAIN_STEPS), so an honest volunteer's
        groups uploaded in time are read, if only as stale, and not counted missing."""
        self.budget = budget or RewardBudget()
        """What each poll may spend on rewards, and the stop that ends its reading."""
        self.claims = Claims(ledger, share)
        """Copies and claims. Under torchrun (`share`: this rank's share of the fleet,
        trainer.shares) only its own volunteers are listed, and every poll meets the other
        ranks twice, there. None: a single process, which reads every volunteer."""
        self.audits = AuditDesk(auditor, fleet, ledger, self.claims, rules.max_groups, log,
                                self.log_trace, self._reject, self._withdraw)
        self.listing = Listing(storage, fleet, share, self._waits, log, fetch_workers)
        self.granter = granter
        """Answers the volunteers' asks for group numbers (trainer.granting); None: asks are
        passed over (unit tests of the rest of the intake)."""

    # The ledger and the log are the parts' too: one set after construction (a test's
    # ledger, a log that is captured) becomes theirs as well.
    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @ledger.setter
    def ledger(self, ledger: Ledger) -> None:
        self._ledger = self.claims.ledger = self.audits.ledger = ledger

    @property
    def log(self) -> Callable[[str], None]:
        return self._log

    @log.setter
    def log(self, log: Callable[[str], None]) -> None:
        self._log = self.listing.log = self.audits.log = log

    @property
    def unaudited(self) -> dict[str, dict[str, list[ScoredGroup]]]:
        """Volunteer -> key -> groups taken without a replay (AuditDesk.unaudited)."""
        return self.audits.unaudited

    def poll(self, win: Window, stats: IngestStats,
             waiting: list[ScoredGroup] = ()) -> list[ScoredGroup]:
        """New usable groups from shards of the window, after `waiting` (groups taken by
        earlier polls and not trained yet) less those of shards rejected since they were
        taken. Only the window's prefixes are
        listed and only keys not yet taken are read, so a poll costs one denylist GET, one
        LIST of each window version's folder names, a LIST of at most
        MAX_OBJECTS_PER_VOLUNTEER_VERSION + 1 keys per volunteer folder (none for a denied
        one or one already found over the cap), and one GET per new shard admitted
        (Listing.admit): bounded by the volunteers and the caps, however long the run's
        history and whatever a volunteer wrote.

        Admitted shards are fetched FETCH_WORKERS at a time and parsed on this thread in key
        order; then the groups whose content also appears under another volunteer are found
        (Claims.contest); then each shard is audited if due, or has its contested groups
        replayed, and is taken, in key order. So a
        poll holds the parsed groups of at most MAX_SHARDS_PER_VOLUNTEER_POLL shards per
        volunteer at once."""
        self._refresh_denylist()
        self._forget_below(win.low)
        self.audits.drop_trained()
        listed: list[str] = []
        asks: list[str] = []
        for v in win.versions():
            for key in self.listing.list_version(v, stats):
                if parse_ask_key(key) is not None:
                    asks.append(key)
                elif self._wanted(key):
                    listed.append(key)
        if self.granter is not None:
            self.granter.answer(asks, win)
        parsed: list[tuple[str, list[ScoredGroup]]] = []
        out: list[ScoredGroup] = []
        admitted = self.listing.admit(listed, stats)
        self.budget.begin(len({a[1] for a in map(layout.rollout_author, admitted) if a}), stats.reward)
        try:
            for key, fetched in self.listing.prefetch(admitted):
                if self.budget.stopping():  # the rest waits (for a restart)
                    break
                if self.listing.denied(key, stats):  # denied by an earlier shard of this very poll
                    continue
                groups = self._read(key, fetched, win, stats)
                if groups is not None:
                    parsed.append((key, groups))
            elsewhere = self.claims.parsed_elsewhere(parsed)
            # a contest is settled by replays: without audits there is none
            contested = self.claims.contest(parsed, elsewhere) if self.audits.auditor is not None else {}
            for key, groups in parsed:
                if not self.listing.denied(key, stats):
                    out.extend(self._take(key, groups, stats, contested.get(key, frozenset())))
            out = self.claims.claimed_elsewhere(out, stats, self.audits.recheck_holding)
        finally:
            self.audits.settle()
        for g in out:
            g.arrival = self.listing.polls
        self.unread_low = sum(1 for k in listed if _key_version(k) < win.leaving and self._unread(k))
        return [g for g in [*waiting, *out]
                if g.key not in self.withdrawn and not self.fleet.is_denied(g.volunteer_id)]

    def _wanted(self, key: str) -> bool:
        """True if `key` still has something to take."""
        return key not in self.taken and not self.ledger.finished(key)

    def _unread(self, key: str) -> bool:
        """True if a later poll would still read `key` soon: wanted, and its volunteer one a
        publish may wait for (`waits_for`)."""
        author = layout.rollout_author(key)
        return self._wanted(key) and not (author and not self.waits_for(author[1]))

    def waits_for(self, volunteer: str) -> bool:
        """May a publish wait for `volunteer`'s shards? Not for a denied one, nor for one
        waiting for its reward share (that would make its slowness the trainer's)."""
        return not (self.fleet.is_denied(volunteer) or self.budget.owes(volunteer))

    def _waits(self, key: str, volunteer: str, stats: IngestStats) -> bool:
        """True if `key` is not fetched this poll: its volunteer's reward share is spent
        (counted deferred), or it is due for an audit the budget has no room for."""
        if self.budget.owes(volunteer):
            stats.reward.deferred += 1
            return True
        return self.audits.waits(key, volunteer, stats)

    def _forget_below(self, low: int) -> None:
        """Drop what is remembered about keys of versions below the window: they are never
        listed again, so memory stays bounded by the window, not the history."""
        if low <= self._low:
            return
        self._low = low
        self.taken = {k for k in self.taken if _key_version(k) >= low}
        for volunteer, (used, missing) in self.numbers.close_below(low).items():
            self.fleet.count_numbers(volunteer, used, missing)
        self.audits.forget(lambda k: _key_version(k) >= low)
        self.listing.forget(lambda k: _key_version(k) >= low)
        self.budget.forget(lambda k: _key_version(k) >= low)
        if self.granter is not None:
            self.granter.forget(lambda k: _key_version(k) >= low)
        self.failures = Counter({k: n for k, n in self.failures.items() if _key_version(k) >= low})
        self.faults = Counter({k: n for k, n in self.faults.items() if _key_version(k) >= low})
        self.withdrawn = {k for k in self.withdrawn if _key_version(k) >= low}

    def _refresh_denylist(self) -> None:
        try:
            self.fleet.refresh(self.storage)
        except Exception as exc:  # a broken denylist must not stop training
            self.log(f"warning: {layout.DENYLIST}: {exc}")

    def _read(self, key: str, fetched: Future, win: Window,
              stats: IngestStats) -> list[ScoredGroup] | None:
        """The checked and rescored groups of `key`, or None: rejected, or not to be read now
        (among them, shards left for a later poll by the reward budget)."""
        author = layout.rollout_author(key)
        spend = None
        if author is not None:  # a volunteer's: its rewards within the poll's budgets
            spend = self.budget.spend(key, author[1])
            if spend is None:
                stats.reward.deferred += 1
                return None
        decided = False  # taken or rejected: what the budget carried for it goes
        try:
            groups = check_shard(fetched.result(), key, self.rules, win, spend)
            decided = True
            return groups
        except RewardsCut:
            stats.reward.deferred += 1
        except ShardError as exc:
            decided = True
            self._reject(key, exc.reason, str(exc), stats)
        except NotFound:
            self.taken.add(key)  # deleted between list and read (retention): nothing to take
        except StorageError as exc:
            self.failures[key] += 1
            if self.failures[key] >= MAX_READ_ATTEMPTS:
                self._reject(key, "unreadable", f"{MAX_READ_ATTEMPTS} failed reads: {exc}", stats)
        except MemoryError as exc:  # the bytes are bounded by the manifest: our machine's limit
            self._trainer_fault(key, exc, stats)
        except WorkerStartError as exc:  # before any completion: the trainer's fault
            self.log(f"warning: left {printable(key)} for a later poll: {exc}")
        except Exception as exc:
            # Reading one object ends in "accepted" or a reason code, never in a dead trainer:
            # an error nobody foresaw while reading a volunteer's bytes is a bug of ours that
            # those bytes found, so its traceback goes to the log, and the shard is recorded
            # (and so never read again after a restart) like any reject.
            self.log_trace(f"unexpected {type(exc).__name__} while checking {printable(key)}", exc)
            decided = True
            self._reject(key, "internal_error", type(exc).__name__, stats)
        finally:
            if spend is not None:
                self.budget.charge(key, author[1], spend, not decided, stats.reward)
        return None

    def _take(self, key: str, groups: list[ScoredGroup], stats: IngestStats,
              contested: frozenset[str] = frozenset()) -> list[ScoredGroup]:
        """Audit (if due, or only its `contested` groups) and take one parsed shard; its usable
        groups."""
        volunteer = layout.rollout_author(key)[1]  # a shard key: check_shard parsed it
        try:
            replayed = self.audits.audit(key, volunteer, groups, contested, stats)
        except ShardError as exc:
            self._reject(key, exc.reason, str(exc), stats, len(groups))
            return []
        except Exception as exc:  # raised by the trainer's own model on checked input
            self._trainer_fault(key, exc, stats)
            return []
        if replayed is None:
            return []  # due for an audit that cannot run now: read again later
        crash_point("ingest")
        repeats = self._only_repeats(key, volunteer, groups)
        refused = self._numbered(key, groups)
        if refused:
            self._reject(key, refused, f"{refused}: {NUMBERING_ERRORS[refused]}", stats, len(groups))
            return []
        if replayed:
            self.audits.audit_claimants(volunteer, replayed, stats)
        self.taken.add(key)
        stats.shards += 1
        if not repeats:
            # A shard of nothing but its own volunteer's earlier content under fresh numbers
            # (a confident policy samples the same completions again) counts neither way:
            # as accepted, repeats that cost nothing new would dilute its rejects below
            # --deny-rate; as rejected, they would deny an honest volunteer.
            self._count(key, True, stats, len(groups))
        usable = self._sort(key, groups, stats)
        self.audits.taken(key, volunteer, usable, replayed)
        return usable

    def _only_repeats(self, key: str, volunteer: str, groups: list[ScoredGroup]) -> bool:
        """True if every group of `key` is content its own volunteer had taken before, from
        other shards. A shard half taken before a restart (some of its lines already have
        outcomes) is not one, nor is a repeat of another volunteer's content: that one is
        audited (Claims.contest), and a copy fails its audit; an original that passes is never
        charged for a copy taken before it."""
        return (bool(groups) and not any(self.ledger.is_done(key, g.line) for g in groups)
                and all(self.ledger.owner(g.digest) == volunteer for g in groups))

    def _trainer_fault(self, key: str, exc: BaseException, stats: IngestStats) -> None:
        """A fault of the trainer's own while taking `key` (its replay raised, memory ran
        out): never charged to the volunteer. The shard is read again at later polls, and
        after MAX_TRAINER_FAULTS faults left for this process (`trainer_error`, no ledger
        record: a restarted trainer tries again)."""
        self.faults[key] += 1
        n = self.faults[key]
        self.log_trace(f"{type(exc).__name__} of the trainer's own while taking {printable(key)} "
                        f"({n} of {MAX_TRAINER_FAULTS}; not charged to its volunteer)", exc)
        if n >= MAX_TRAINER_FAULTS:
            self.taken.add(key)
            stats.trainer_errors += 1
            self.log(f"left {printable(key)}: trainer_error after {n} faults of the trainer's own")

    def log_trace(self, what: str, exc: BaseException) -> None:
        """An error line with its traceback, every line escaped (a fault may quote a shard)."""
        trace = "".join(traceback.format_exception(exc)).splitlines()  # may quote the shard
        self.log(f"error: {what}:\n" + "\n".join(printable(line, 1000) for line in trace))

    def _numbered(self, key: str, groups: list[ScoredGroup]) -> str | None:
        """Record the shard's group numbers (withheld.GroupNumbers); the reason code if they
        are refused. A shard re-read after a restart, half taken, is fine."""
        author = layout.rollout_author(key)
        if author is None or not groups:
            return None
        return self.numbers.add(author[1], key, groups[0].policy_version, [g.seq for g in groups])

    def _sort(self, key: str, groups: list[ScoredGroup], stats: IngestStats) -> list[ScoredGroup]:
        """Give zero-variance and duplicate groups their outcome now; return the rest."""
        usable, zero, dup = [], [], []
        for g in groups:
            g.shard_size = len(groups)
            if self.ledger.is_done(key, g.line):
                continue
            if not self.ledger.claim(g.digest, g.policy_version, g.volunteer_id):
                dup.append(g)
                continue
            self.claims.claim(g)
            if self.observe is not None:
                self.observe(g.prompt_id, g.rewards)
            if max(g.rewards) == min(g.rewards):
                zero.append(g)
            else:
                usable.append(g)
        n = len(groups)
        if zero:
            self.ledger.record(key, "zero_variance", [g.line for g in zero], n, [g.digest for g in zero])
        if dup:
            self.ledger.record(key, "duplicate", [g.line for g in dup], n)
        self.ledger.set_size(key, n)
        stats.groups += len(groups)
        stats.zero_variance += len(zero)
        stats.duplicates += len(dup)
        if self.log_shards:
            self.log(f"took {printable(key)}: {len(usable)} usable, {len(zero)} zero-variance, "
                     f"{len(dup)} duplicate")
        return usable

    def reject(self, key: str, reason: str, detail: str, stats: IngestStats) -> None:
        """Reject a shard after intake (the trainer found its groups poison a step)."""
        self._reject(key, reason, detail, stats)

    def failed_replay(self, g: ScoredGroup, reason: str, detail: str, stats: IngestStats) -> None:
        """Group `g` of a taken shard failed its replay before a step (trainer.verify): the
        shard's acceptance is taken back and it is rejected, its untrained groups withdrawn
        (a forgery denies its volunteer: _reject). Once per shard, whichever of its groups
        failed first."""
        if g.key in self.withdrawn:
            return
        self.fleet.revoke(g.volunteer_id, g.shard_size)
        self._reject(g.key, reason, f"{reason}: {detail}", stats, g.shard_size)

    def unverifiable(self, key: str) -> None:
        """Groups of `key` could not be replayed before a step (their version's weights are
        not held, or the replay failed by a fault of the trainer's own): withdrawn, charged to
        nobody, as an intake re-audit that cannot run."""
        if key not in self.withdrawn:
            self._withdraw(key)
            self.log(f"left {printable(key)}: its groups cannot be replayed now; withdrawn, "
                     "charged to nobody")

    def _reject(self, key: str, reason: str, detail: str, stats: IngestStats, groups: int = 1) -> None:
        """Record the rejection (ledger, quarantine/, counts) of a shard of `groups` groups
        (1 when they were not counted); deny a volunteer that keeps sending bad shards, and
        audit what was taken from it without an audit (AuditDesk.caught)."""
        self.taken.add(key)
        self.withdrawn.add(key)
        stats.rejected[reason] += 1
        self.ledger.record(key, "rejected", [], 0, reason=reason)
        self.log(f"rejected {printable(key)}: {printable(detail)}")
        record = {"key": key[:1024], "reason": reason, "detail": detail[:1000], "time": time.time()}
        try:
            self.storage.create(layout.quarantine_key(key), json.dumps(record).encode())
        except (AlreadyExists, ValueError):
            pass  # rejected before a restart: the first record stands
        except StorageError as exc:
            self.log(f"warning: {exc}")
        self._count(key, False, stats, groups)
        author = layout.rollout_author(key)
        if author is None:
            return
        if reason == FORGERY and self.fleet.deny_after > 0:  # 0: no automatic denial at all
            self._deny(author[1], f"forged tokens in {key}: {detail}")
            self.audits.withdraw_all(author[1])
        else:
            self.audits.caught(key, author[1], stats)

    def _withdraw(self, key: str) -> None:
        """Drop `key`'s groups from those handed out and waiting to be trained (poll)."""
        self.withdrawn.add(key)

    def _count(self, key: str, accepted: bool, stats: IngestStats, groups: int = 1) -> None:
        parsed = layout.rollout_author(key)
        if parsed is None:
            return
        volunteer = parsed[1]
        stats.by_volunteer.setdefault(volunteer, [0, 0])[0 if accepted else 1] += 1
        if self.fleet.note(volunteer, accepted, groups):
            c = self.fleet.counts[volunteer]
            self._deny(volunteer, f"{c.rejected} of {c.accepted + c.rejected} shards "
                       f"({c.rejected_groups} of {c.accepted_groups + c.rejected_groups} groups) rejected")

    def _deny(self, volunteer: str, reason: str) -> None:
        """Put `volunteer` on the denylist (once), and say so."""
        if self.fleet.is_denied(volunteer):
            return
        try:
            self.fleet.deny(self.storage, volunteer, reason[:1000])
            self.log(f"denied volunteer {volunteer}: {printable(reason)}; lift with "
                     f"`vrl volunteers allow {volunteer}`")
        except Exception as exc:
            self.log(f"warning: could not deny {volunteer}: {exc}")
