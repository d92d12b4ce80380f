"""Copies and claims: which content is whose, across volunteers and across ranks.

Committed noise is keyed by the volunteer, so the same tokens under two ids mean one of them
did not sample them. The intake finds such groups in each poll (Claims.contest) and has them
replayed (trainer.audit_desk), which fails the copy and passes the original. A group's content
is claimed in the ledger by the first volunteer whose group was taken with it.

Under ranks (trainer.shares) each rank reads only its own volunteers, so the ranks tell each
other, at two points of every poll, what they parsed (Claims.parsed_elsewhere) and what they
claimed, gave back and want re-audited (Claims.claimed_elsewhere). A single process has
nobody to tell: both are no-ops.
"""

from __future__ import annotations

from typing import Callable

from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup
from volunteer_rl.trainer.shares import FleetShare


class Claims:
    """The contest of copies in a poll, and this rank's claims report to the other ranks."""

    def __init__(self, ledger: Ledger, share: FleetShare | None = None):
        self.ledger = ledger
        self.share = share
        """None: a single process, which reads every volunteer and tells nobody."""
        self._claims: list[list] = []  # [digest, version, volunteer] claimed this poll
        self._released: list[str] = []  # claims given back this poll (a failed re-audit)
        self._rechecks: list[list] = []  # [volunteer, digests]: re-audits for other ranks

    def elsewhere(self, volunteer: str) -> bool:
        """True if `volunteer` is another rank's (under ranks), so its shards are re-audited
        there (ask_recheck), not here."""
        return self.share is not None and not self.share.owns(volunteer)

    def claim(self, g: ScoredGroup) -> None:
        """Tell the other ranks that `g`'s content was claimed here (it is in the ledger)."""
        if self.share is not None:
            self._claims.append([g.digest, g.policy_version, g.volunteer_id])

    def release(self, digests: list[str]) -> None:
        """Tell the other ranks that these claims were given back here (a failed re-audit)."""
        if self.share is not None:
            self._released += digests

    def ask_recheck(self, volunteer: str, digests: list[str]) -> None:
        """Ask `volunteer`'s rank to re-audit its unaudited shards holding `digests`."""
        self._rechecks.append([volunteer, digests])

    def parsed_elsewhere(self, parsed: list[tuple[str, list[ScoredGroup]]]) -> dict[str, set[str]]:
        """Under ranks (a collective): digest -> volunteers of the groups the other ranks
        parsed in this poll, for contest; each rank sends its own. A single process: {}."""
        if self.share is None:
            return {}
        mine = [[g.digest, g.volunteer_id] for _, groups in parsed for g in groups]
        others: dict[str, set[str]] = {}
        for rank, report in enumerate(self.share.exchange({"parsed": mine})):
            if rank != self.share.rank:
                for digest, volunteer in report.get("parsed", ()):
                    others.setdefault(digest, set()).add(volunteer)
        return others

    def contest(self, parsed: list[tuple[str, list[ScoredGroup]]],
                elsewhere: dict[str, set[str]] | None = None) -> dict[str, frozenset[str]]:
        """Key -> digests of its groups whose content is also in another volunteer's shard of
        this poll, or was taken from another volunteer before. Committed noise is keyed by the
        volunteer, so the same tokens under two ids mean one of them did not sample them:
        replaying those groups fails the copy and passes the original (AuditDesk.audit). Only
        those groups are replayed, not their whole shards: honest volunteers sampling one
        prompt from a confident policy send identical groups all the time (a 300 s demo had
        488 in 412 of its 2,568 shards), and whole-shard replays of them kept the audit budget
        spent for the whole run. Under ranks, `elsewhere` adds the other ranks' groups of this
        poll (parsed_elsewhere), and the ledger's owners include their earlier claims."""
        ids: dict[str, set[str]] = {d: set(v) for d, v in (elsewhere or {}).items()}
        for key, groups in parsed:
            for g in groups:
                ids.setdefault(g.digest, set()).add(g.volunteer_id)
        contested: dict[str, frozenset[str]] = {}
        for key, groups in parsed:
            mine = frozenset(g.digest for g in groups
                             if len(ids[g.digest]) > 1
                             or self.ledger.owner(g.digest) not in (None, g.volunteer_id))
            if mine:
                contested[key] = mine
        return contested

    def claimed_elsewhere(self, out: list[ScoredGroup], stats: IngestStats,
                          recheck: Callable[[str, frozenset[str], IngestStats], None]) -> list[ScoredGroup]:
        """Under ranks (a collective): tell the other ranks the contents this poll claimed,
        the claims given back and the re-audits asked of them; learn theirs. Their claims
        become owners in this rank's ledger (so a later copy of them here is contested);
        content claimed here and by a lower rank in the same poll is recorded a duplicate
        here and dropped from `out`; re-audits of this rank's volunteers run now (`recheck`:
        AuditDesk.recheck_holding). A single process: `out` as it is."""
        if self.share is None:
            return out
        report = {"claims": self._claims, "released": self._released, "recheck": self._rechecks}
        self._claims, self._released, self._rechecks = [], [], []
        reports = self.share.exchange(report)
        mine = {c[0] for c in reports[self.share.rank]["claims"]}
        lost: dict[str, tuple[int, str]] = {}
        for rank, other in enumerate(reports):
            if rank == self.share.rank:
                continue
            for digest, version, volunteer in other["claims"]:
                if digest in mine:
                    if rank < self.share.rank:
                        lost.setdefault(digest, (version, volunteer))
                    continue
                self.ledger.claim(digest, version, volunteer)
            for digest in other["released"]:
                owner = self.ledger.owner(digest)
                if owner is not None and not self.share.owns(owner):
                    self.ledger.release([digest])
        if lost:
            dup = [g for g in out if g.digest in lost]
            for key in sorted({g.key for g in dup}):
                gs = [g for g in dup if g.key == key]
                self.ledger.record(key, "duplicate", [g.line for g in gs], gs[0].shard_size)
            for digest, (version, volunteer) in lost.items():  # the lower rank's claim stands
                self.ledger.release([digest])
                self.ledger.claim(digest, version, volunteer)
            stats.duplicates += len(dup)
            out = [g for g in out if g.digest not in lost]
        for other in reports:
            for volunteer, digests in other["recheck"]:
                if self.share.owns(volunteer):
                    recheck(volunteer, frozenset(digests), stats)
        return out
