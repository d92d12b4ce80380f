"""Withheld groups: the group numbers (`seq`) each volunteer used, the ones the trainer
received, and the gaps, counted as versions leave the window; kept across restarts.

A volunteer's groups of a run are numbered 0, 1, 2, ... across versions by the trainer's
grants (trainer.granting), each block of numbers bound to one version, and a number's nonce
draws the group's prompt from the version's pool and keys its sampling noise
(protocol.grants, protocol.draws), so it cannot be sampled again for a better outcome, under
that version or another. An honest volunteer samples its numbers in order and only ever moves
to newer versions, so every number it used under version u is below every number it used
under a later version w; the trainer holds volunteers to that (`seq_order`).

Missing numbers are counted when they are closed: once a version leaves the window, every
number from 0 up to the highest one received or granted under it can no longer arrive, and
those that never did are missing, the unsent tail of a grant included. Honest volunteers
miss few: those lost to a crash, and what the loop's hold cannot wait for. The loop holds a
publish back while the version it would push out has listed shards unread or numbers granted
and not reached yet (`outstanding`), for at most loop.DRAIN_STEPS steps, so groups an honest
volunteer samples in time are read before their version leaves; and a volunteer told to stop
samples and uploads the numbers granted to it, so neither a backlog after a trainer restart,
nor a grant that outlasts a fast trainer's versions, nor a stop is counted (docs/LIMITS.md).
These totals are shown per volunteer (fleet.json, `vrl status`, the dashboard).

Withholding has a price (`missing_share`, `hold_back`): a volunteer's groups are not trained
while more than --missing-bound of its last RECENT_NUMBERS numbers are missing, counted up to
its highest number received, open gaps of the window's versions included, so a volunteer that
keeps only the groups it likes never gets one trained. Its groups wait, untrained and
uncharged, until the share is back under the bound (a gap that was only late fills in) or they
leave the window. A number missing counts with the rest of its block of numbers (the unit of
a grant), so leaving out one group in eight costs as much as leaving out all eight. Honest
volunteers number without gaps and upload in order, so their share stays 0; one lost shard (a
crash) stays well under the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from volunteer_rl.protocol.grants import GRANT_BLOCK

if TYPE_CHECKING:
    from volunteer_rl.trainer.groups import ScoredGroup

RECENT_NUMBERS = 1024
"""How far back a volunteer's missing share looks: its last 1,024 group numbers below one
past its highest number received. Long enough that one lost shard is a small share, short
enough that a volunteer that lost numbers once (a crash, a lost number file) trains again
after about a thousand honest groups."""


@dataclass
class _Numbers:
    """One volunteer's numbers in the window."""

    frontier: int | None = None
    """Numbers below this are closed (counted); None until a version of it leaves the window."""
    got: dict[int, tuple[int, str]] = field(default_factory=dict)
    """Number -> (version, shard key) of every number received at or above the frontier."""
    span: dict[int, list[int]] = field(default_factory=dict)
    """Version -> [lowest, highest] number received under it."""
    gaps: list[list[int]] = field(default_factory=list)
    """[first, end) runs of closed numbers that never arrived, those reaching into the last
    RECENT_NUMBERS below the frontier: what missing_share needs of the closed past."""
    granted: dict[int, int] = field(default_factory=dict)
    """Version -> one past the highest number this trainer granted under it (protocol.grants),
    for the versions in the window: closing one closes its grants' tails too."""
    granted_top: int = 0
    """One past the highest number ever granted to it by this trainer."""

    def record(self, version: int, key: str, seqs: list[int]) -> None:
        """Note `seqs`, received under `version` in shard `key` (checked by the caller)."""
        for s in seqs:
            self.got[s] = (version, key)
        if seqs:
            lo, hi = self.span.get(version, (min(seqs), max(seqs)))
            self.span[version] = [min(lo, *seqs), max(hi, *seqs)]


@dataclass
class GroupNumbers:
    """Numbers seen per volunteer, for the versions of the window."""

    by: dict[str, _Numbers] = field(default_factory=dict)

    def add(self, volunteer: str, key: str, version: int, seqs: list[int]) -> str | None:
        """Record the numbers of one shard's groups (all of `version`). None if taken; else the
        reason it is refused, and nothing recorded: `seq_reused` (a number repeats in the
        shard, or came before in another shard) or `seq_order` (out of order with the
        numbers received under other versions, or below the closed frontier). The same shard
        read again (a restart that left it half taken) records nothing new and is fine."""
        n = self.by.setdefault(volunteer, _Numbers())
        if len(set(seqs)) != len(seqs):
            return "seq_reused"
        for s in seqs:
            had = n.got.get(s)
            if had is not None and had[1] != key:
                return "seq_reused"
            if n.frontier is not None and s < n.frontier:
                return "seq_order"
            for u, (lo, hi) in n.span.items():
                if (u < version and s <= hi) or (u > version and s >= lo):
                    return "seq_order"
        n.record(version, key, seqs)
        return None

    def grant(self, volunteer: str, first: int, end: int, version: int) -> None:
        """Numbers [first, end) were granted to `volunteer` under `version` (trainer.granting):
        once that version leaves the window, those not received are missing."""
        n = self.by.setdefault(volunteer, _Numbers())
        n.granted[version] = max(n.granted.get(version, 0), end)
        n.granted_top = max(n.granted_top, end)

    def granted_end(self, volunteer: str) -> int:
        """One past the highest number granted to or received from `volunteer`: where its next
        grant may start."""
        n = self.by.get(volunteer)
        return 0 if n is None else max(n.granted_top, self.next_number(volunteer))

    def close_below(self, low: int) -> dict[str, tuple[int, int]]:
        """Close the numbers of the versions below `low`; per volunteer, (numbers closed,
        numbers missing among them): from the last frontier (0 the first time) up to its
        highest number received or granted under those versions."""
        out: dict[str, tuple[int, int]] = {}
        for volunteer, n in self.by.items():
            old = [u for u in n.span if u < low]
            grants = [u for u in n.granted if u < low]
            if not old and not grants:
                continue
            top = max([n.span[u][1] + 1 for u in old] + [n.granted[u] for u in grants])
            start = n.frontier if n.frontier is not None else 0
            for u in old:
                del n.span[u]
            for u in grants:
                del n.granted[u]
            if top <= start:
                continue
            closed = sorted(s for s in n.got if start <= s < top)
            for s in closed:
                del n.got[s]
            n.gaps += _gaps(closed, start, top)
            n.gaps = [[max(a, top - RECENT_NUMBERS), b] for a, b in n.gaps if b > top - RECENT_NUMBERS]
            n.frontier = top
            out[volunteer] = (top - start, top - start - len(closed))
        return out

    def missing_share(self, volunteer: str) -> tuple[int, int]:
        """(missing, counted) over `volunteer`'s last RECENT_NUMBERS numbers below one past
        its highest number received: the closed ones that never arrived, and the open ones
        (versions still in the window) not received yet, each with the rest of its block of
        GRANT_BLOCK numbers (`_in_blocks`). Counted from number 0, so the numbers before the
        first one it sent count too. Arithmetic on the numbers received, never a loop over a
        range a volunteer chose: a number of 2**60 costs nothing more."""
        n = self.by.get(volunteer)
        if n is None:
            return 0, 0
        top = self.next_number(volunteer)
        lo = max(0, top - RECENT_NUMBERS)
        closed_end = n.frontier or 0
        open_lo = max(lo, closed_end)
        runs = [[max(a, lo), min(b, closed_end)] for a, b in n.gaps if min(b, closed_end) > max(a, lo)]
        if top > open_lo:
            runs += _gaps(sorted(s for s in n.got if open_lo <= s < top), open_lo, top)
        return _in_blocks(runs, lo, top), top - lo

    def held(self, volunteer: str, bound: float) -> bool:
        """True while more than `bound` of `volunteer`'s recent numbers are missing
        (missing_share): its groups are not trained (hold_back), and fleet.json says so."""
        missing, counted = self.missing_share(volunteer)
        return counted > 0 and missing > bound * counted

    def outstanding(self, below: int, skip: Callable[[str], bool]) -> int:
        """Volunteers, other than those `skip` names, granted numbers under a version below
        `below` that nothing received from them has reached yet: in flight, if they sample
        in order as honest ones do (a volunteer that sent a later number has gone past them).
        The loop holds the publish that would push those versions out (loop.DRAIN_STEPS)."""
        count = 0
        for volunteer, n in self.by.items():
            ends = [end for u, end in n.granted.items() if u < below]
            if ends and max(ends) > self.next_number(volunteer) and not skip(volunteer):
                count += 1
        return count

    def next_number(self, volunteer: str) -> int:
        """One past the highest number received from `volunteer` (0 if none): where a
        volunteer that lost its own record may go on (fleet.json)."""
        n = self.by.get(volunteer)
        if n is None:
            return 0
        return max([n.frontier or 0, *(hi + 1 for _, hi in n.span.values())])

    # -- kept with the trainer's state (trainer.state), so a restart forgets nothing ----------

    def to_json(self) -> dict:
        """{volunteer: {"frontier": f, "shards": [[key, version, [[first, last], ...]], ...]}}:
        received numbers as runs per shard, a few entries per shard of an honest volunteer."""
        out = {}
        for volunteer, n in self.by.items():
            shards: dict[tuple[str, int], list[int]] = {}
            for s, (version, key) in n.got.items():
                shards.setdefault((key, version), []).append(s)
            out[volunteer] = {"frontier": n.frontier, "gaps": n.gaps,
                              "granted": [[u, end] for u, end in n.granted.items()],
                              "granted_top": n.granted_top,
                              "shards": [[key, version, _runs(sorted(seqs))]
                                         for (key, version), seqs in shards.items()]}
        return out

    @staticmethod
    def from_json(raw) -> "GroupNumbers":
        """What to_json wrote (the trainer's own file); ValueError if it is not that."""
        numbers = GroupNumbers()
        try:
            for volunteer, entry in raw.items():
                n = numbers.by.setdefault(str(volunteer), _Numbers())
                f = entry["frontier"]
                n.frontier = None if f is None else int(f)
                n.gaps = [[int(a), int(b)] for a, b in entry.get("gaps", [])]  # older saves: none
                n.granted = {int(u): int(end) for u, end in entry.get("granted", [])}
                n.granted_top = int(entry.get("granted_top", 0))
                for key, version, runs in entry["shards"]:
                    n.record(int(version), str(key),
                             [s for a, b in runs for s in range(int(a), int(b) + 1)])
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"saved group numbers are malformed ({type(exc).__name__}: {exc})") from None
        return numbers


def hold_back(groups: list["ScoredGroup"], numbers: GroupNumbers,
              bound: float) -> tuple[list["ScoredGroup"], list["ScoredGroup"]]:
    """(trainable, held): `groups` split by whether their volunteer's missing share
    (GroupNumbers.missing_share) is over `bound`; order kept. A bound of 1 holds nothing."""
    over = {}
    for g in groups:
        if g.volunteer_id not in over:
            over[g.volunteer_id] = numbers.held(g.volunteer_id, bound)
    return ([g for g in groups if not over[g.volunteer_id]],
            [g for g in groups if over[g.volunteer_id]])


def _in_blocks(runs: list[list[int]], lo: int, top: int) -> int:
    """How many numbers of [lo, top) lie in a block of GRANT_BLOCK numbers that sorted,
    disjoint [first, end) `runs` reach into: a block with one number missing counts whole.

    Why whole blocks: a volunteer that leaves out, say, the worst group of each block it
    samples misses one number in eight; counted alone, it could do that to 5 % of its groups
    under a bound of 5 % and bias what is trained by the worst tail of all it sampled.
    Counted by block, the same bound lets it leave out a group of one block in twenty, an
    eighth of the bias. A crash or a version leaving the window loses whole batches, which
    grants and batches align to blocks: an honest loss counts about as before."""
    count, done = 0, lo  # numbers below `done` are counted already
    for a, b in runs:
        first = max(done, a // GRANT_BLOCK * GRANT_BLOCK)
        end = min(top, -(-b // GRANT_BLOCK) * GRANT_BLOCK)
        if end > first:
            count, done = count + end - first, end
    return count


def _gaps(closed: list[int], start: int, end: int) -> list[list[int]]:
    """[first, end) runs of the numbers in [start, end) missing from sorted `closed`."""
    out, at = [], start
    for s in closed:
        if s > at:
            out.append([at, s])
        at = s + 1
    if at < end:
        out.append([at, end])
    return out


def _runs(seqs: list[int]) -> list[list[int]]:
    """Sorted numbers as [first, last] runs of consecutive numbers."""
    runs: list[list[int]] = []
    for s in seqs:
        if runs and runs[-1][1] == s - 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return runs
