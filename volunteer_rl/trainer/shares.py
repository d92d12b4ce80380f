"""How the trainer's ranks split the fleet's intake (issue 28), and what their intakes tell
each other.

Each rank lists, reads, checks, rescores and audits the shards of its own volunteers: those
whose id hashes to it (ranks.owner_rank), so everything kept per volunteer (its counts and
trust, its group numbers, its audit draws) lives on one rank. Objects that are nobody's
(directly in a version folder) are the writer's to reject.

What one volunteer's shards cannot show alone is shared at two points of every poll, both
collectives of every rank (so each rank polls exactly when the others do):

1. after parsing, the content digest and volunteer of every group parsed: a group whose
   content another rank also parsed under another id is contested (claims.Claims.contest)
   on both ranks, so a copy is replayed and fails wherever the original is read;
2. after taking, the contents claimed, the claims given back, and the re-audits asked of
   other ranks (a shard that passed its replay holds content first taken from a volunteer
   of another rank without an audit). Two ranks that claimed the same content in one poll
   keep it where the lower rank took it; the other records it as a duplicate, as a single
   process records the second of two identical groups.

trainer.claims sends and reads both reports.

The reports are JSON of the trainer's own making, sent as bytes (ranks.all_gather_bytes):
nothing a rank receives is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Protocol

from volunteer_rl.trainer.groups import ScoredGroup, train_order
from volunteer_rl.trainer.ranks import Ranks, all_gather_bytes, owner_rank


class FleetShare(Protocol):
    """What the intake needs of a rank's share of the fleet: Share, or a stand-in for it."""

    rank: int
    owns_nobodys: bool

    def owns(self, volunteer: str) -> bool: ...

    def exchange(self, report: dict) -> list[dict]: ...


class Share:
    """This rank's share of the fleet: which volunteers are its own, and the exchange."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks

    @property
    def rank(self) -> int:
        return self.ranks.rank

    def owns(self, volunteer: str) -> bool:
        return owner_rank(volunteer, self.ranks.world_size) == self.ranks.rank

    @property
    def owns_nobodys(self) -> bool:
        """Objects directly in a version folder are no volunteer's: the writer rejects them."""
        return self.ranks.is_writer

    def exchange(self, report: dict) -> list[dict]:
        """Every rank's `report`, in rank order (this rank's own included)."""
        data = json.dumps(report, separators=(",", ":")).encode()
        return [json.loads(b) if b else {} for b in all_gather_bytes(data, self.ranks)]


def agree_on_batch(share: Share, fresh: list[ScoredGroup], size: int,
                   report: dict) -> tuple[list[ScoredGroup] | None, int, list[dict]]:
    """The ranks agree on a step's batch (a collective of every rank): each sends how many
    fresh groups it holds, the train_order of its first `size` of them (its `fresh` is
    sorted so), and `report` (its poll's counts, for the writer). If the ranks hold `size`
    groups between them, the batch is the first `size` of their merged lists, exactly the
    groups one process holding them all would take, and every rank gets all of them (a
    second exchange; each rank then computes the loss on its share, ranks.rank_share).

    Returns (the batch in that order, or None; how many of this rank's fresh groups it took,
    a prefix of `fresh`; every rank's report)."""
    top = [list(train_order(g)) for g in fresh[:size]]
    reports = share.exchange({"fresh": len(fresh), "top": top, **report})
    if sum(r["fresh"] for r in reports) < size:
        return None, 0, reports
    merged = sorted((tuple(order), rank, i) for rank, r in enumerate(reports)
                    for i, order in enumerate(r["top"]))[:size]
    taken = sum(1 for _, rank, _ in merged if rank == share.rank)
    # JSON floats round-trip exactly (repr), so every rank trains on the very same numbers.
    sent = share.exchange({"groups": [dataclasses.asdict(g) for g in fresh[:taken]]})
    batch = [ScoredGroup(**sent[rank]["groups"][i]) for _, rank, i in merged]
    return batch, taken, reports
