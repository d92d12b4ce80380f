"""The intake's audits: which shards are replayed as they are taken, and the re-audits of
shards taken without one.

trainer.audit draws which shards are due (at their volunteer's rate) and holds the time
budget; the desk applies it to a poll. A shard known to be due is fetched only if the budget
has room (waits); a parsed shard is replayed whole if due, else only its contested groups
and those of the groups no step will replay that are drawn (Auditor.spot) (audit). The usable
groups of a shard taken without a replay are kept (`unaudited`) until they are trained, and
replayed after all if their volunteer is caught (caught) or their content shows up under
another id (audit_claimants, recheck_holding). A re-audit that fails
rejects its shard and withdraws its untrained groups.
"""

from __future__ import annotations

from typing import Callable

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.protocol.printable import printable
from volunteer_rl.protocol.shards import ShardError
from volunteer_rl.trainer.audit import Auditor
from volunteer_rl.trainer.claims import Claims
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup


class AuditDesk:
    """Schedules the intake's replays: before a fetch, as a shard is taken, and after."""

    def __init__(self, auditor: Auditor | None, fleet: Fleet, ledger: Ledger, claims: Claims,
                 max_groups: int, log: Callable[[str], None],
                 trace: Callable[[str, BaseException], None],
                 reject: Callable[[str, str, str, IngestStats, int], None],
                 withdraw: Callable[[str], None]):
        self.auditor = auditor
        """None: no shard is audited (--audit-tolerance 0)."""
        self.fleet = fleet
        self.ledger = ledger
        self.claims = claims
        self.max_groups = max_groups  # groups per shard (Rules.max_groups): an unparsed one's cost
        self.log = log
        self.trace = trace  # logs an error with its traceback
        self.reject = reject  # the intake's rejection of a shard (ledger, quarantine, counts)
        self.withdraw = withdraw  # drops a key's groups from those waiting to be trained
        self.unaudited: dict[str, dict[str, list[ScoredGroup]]] = {}
        """Volunteer -> key -> usable groups of its shards taken without being replayed (the
        whole shard, or all but its contested groups): replayed after all if the volunteer is
        caught, or their content shows up under another id, while some are not trained yet."""

    def waits(self, key: str, volunteer: str, stats: IngestStats) -> bool:
        """True if shard `key` is known to be due for an audit and the budget has no room for
        it: it is not even fetched this poll, so a shard waiting for its audit costs a
        listing, no GET and no parse. A shard admitted here has its audit's cost reserved."""
        if self.auditor is None or layout.parse_shard_key(key) is None:
            return False
        if not self.auditor.surely_due(key, self.fleet.clean(volunteer)):
            return False
        if self.auditor.admit(key, self.max_groups):
            return False
        stats.audit.deferred += 1
        return True

    def audit(self, key: str, volunteer: str, groups: list[ScoredGroup],
              contested: frozenset[str], stats: IngestStats) -> list[ScoredGroup] | None:
        """Replay the shard's groups if it is due, else its `contested` groups
        (Claims.contest) and those of its groups that no step will replay (never_stepped)
        that are drawn for it (Auditor.spot): the groups replayed and passed (ShardError
        if one fails; [] if none was due), or None if due but not auditable now (no room in
        the budget, weights not held). A fault of the replay's own propagates."""
        if self.auditor is None or not groups:
            return []
        clean = self.fleet.clean(volunteer)
        if self.auditor.due(key, clean, len(groups)):
            replay = groups
        else:
            spot = self.auditor.spot(key, clean, [g.line for g in groups if self.never_stepped(g)])
            replay = [g for g in groups if g.digest in contested or g.line in spot]
            if not replay:
                stats.audit.skipped += 1
                return []
        if not self.auditor.admit(key, len(groups), len(replay)):
            stats.audit.deferred += 1
            return None
        outcome, problem = self.auditor.run(key, volunteer, groups[0].policy_version, replay,
                                            stats.audit, chunked=not self.fleet.clean(volunteer))
        if outcome == "deferred":
            return None
        self.fleet.count_audit(volunteer)
        if problem:
            raise ShardError(*problem)
        for g in replay:
            g.verified = True
        return replay

    def never_stepped(self, g: ScoredGroup) -> bool:
        """Whether `g` will never reach a step, so that --verify every never replays it: all
        its rewards equal (zero variance), or content taken before (a repeat)."""
        return max(g.rewards) == min(g.rewards) or self.ledger.owner(g.digest) is not None

    def taken(self, key: str, volunteer: str, usable: list[ScoredGroup],
              replayed: list[ScoredGroup]) -> None:
        """Shard `key` was taken: keep those of its `usable` groups that were not replayed,
        for a re-audit while they wait to be trained."""
        passed = {g.line for g in replayed}
        unreplayed = [g for g in usable if g.line not in passed]
        if unreplayed and self.auditor is not None:
            self.unaudited.setdefault(volunteer, {})[key] = unreplayed

    def audit_claimants(self, volunteer: str, groups: list[ScoredGroup], stats: IngestStats) -> None:
        """`groups` of a shard passed their replay, and some hold content taken before from
        another volunteer's shard without an audit: replay those groups of that shard now, if
        they are not trained yet. A copy fails, is rejected (charged to the copier) and gives
        its claims back, so the original's groups are taken."""
        mine = frozenset(g.digest for g in groups)
        for other in {self.ledger.owner(d) for d in mine} - {None, volunteer}:
            if self.claims.elsewhere(other):  # its rank re-audits
                self.claims.ask_recheck(other, sorted(d for d in mine if self.ledger.owner(d) == other))
                continue
            self.recheck_holding(other, mine, stats)

    def recheck_holding(self, volunteer: str, digests: frozenset[str], stats: IngestStats) -> None:
        """recheck, on those groups only, every shard of `volunteer` taken unaudited that
        holds one of `digests` (asked by this rank's intake, or by another rank's)."""
        for key, gs in list(self.unaudited.get(volunteer, {}).items()):
            if any(g.digest in digests for g in gs):
                self.recheck(volunteer, key, stats, only=digests)

    def caught(self, key: str, volunteer: str, stats: IngestStats) -> None:
        """After a rejection of `volunteer`'s shard `key`: audit every other shard of its that
        was taken without an audit and is not all trained. (Its later shards are due anyway:
        its clean count is 0, so its rate is 1, and a draw is made from the rate of the
        moment.)"""
        self.unaudited.get(volunteer, {}).pop(key, None)
        for other in list(self.unaudited.get(volunteer, {})):
            self.recheck(volunteer, other, stats)

    def withdraw_all(self, volunteer: str) -> None:
        """`volunteer` is denied for a proven forgery: every shard of its taken without a
        replay is withdrawn (its untrained groups never trained), and their content freed
        for whoever else sent it. Its shards that were replayed are dropped from the groups
        waiting by the poll (a denied volunteer's groups are never handed out)."""
        for key, gs in self.unaudited.pop(volunteer, {}).items():
            untrained = [g.digest for g in gs if not self.ledger.is_done(key, g.line)]
            self.withdraw(key)
            self.ledger.release(untrained)
            self.claims.release(untrained)

    def recheck(self, volunteer: str, key: str, stats: IngestStats,
                only: frozenset[str] | None = None) -> None:
        """Audit now, whatever the budget, the untrained groups of `key`, taken without an
        audit (with `only`: those of its untrained groups whose digest is in it; the rest stay
        unaudited, as in `taken`). Failed: the shard is rejected and all its untrained groups
        withdrawn; not auditable (weights not held, a fault of the trainer): withdrawn,
        charged to nobody."""
        shards = self.unaudited.get(volunteer, {})
        untrained = [g for g in shards.pop(key, []) if not self.ledger.is_done(key, g.line)]
        groups = untrained if only is None else [g for g in untrained if g.digest in only]
        lines = {g.line for g in groups}
        rest = [g for g in untrained if g.line not in lines]
        if rest:
            shards[key] = rest
        if not groups or self.auditor is None:
            return
        try:
            outcome, problem = self.auditor.run(key, volunteer, groups[0].policy_version, groups,
                                                stats.audit, chunked=not self.fleet.clean(volunteer))
        except Exception as exc:  # the trainer's own fault: nobody is charged
            self.trace(f"{type(exc).__name__} of the trainer's own while re-auditing "
                       f"{printable(key)}", exc)
            outcome, problem = "deferred", None
        if outcome != "deferred":
            self.fleet.count_audit(volunteer)
        if outcome == "passed":
            for g in groups:
                g.verified = True
            return
        shards.pop(key, None)  # rejected or left whole: nothing of it stays unaudited
        self.withdraw(key)
        self.ledger.release([g.digest for g in untrained])
        self.claims.release([g.digest for g in untrained])
        if problem:
            self.fleet.revoke(volunteer, groups[0].shard_size)
            self.reject(key, problem[0], problem[1], stats, groups[0].shard_size)
        else:
            self.log(f"left {printable(key)}: its re-audit cannot run now; {len(untrained)} groups "
                     "withdrawn, charged to nobody")

    def settle(self) -> None:
        """End of a poll: give back the budget reserved for shards not audited."""
        if self.auditor is not None:
            self.auditor.settle()

    def drop_trained(self) -> None:
        """Forget the unaudited shards whose groups all have an outcome now (trained, stale):
        an audit of them could no longer keep anything out of a step."""
        for volunteer, shards in list(self.unaudited.items()):
            for key in [k for k, gs in shards.items()
                        if all(self.ledger.is_done(k, g.line) for g in gs)]:
                del shards[key]
            if not shards:
                del self.unaudited[volunteer]

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the draws and unaudited shards of keys that left the window."""
        if self.auditor is not None:
            self.auditor.forget(keep)
        for shards in self.unaudited.values():
            for key in [k for k in shards if not keep(k)]:
                del shards[key]
