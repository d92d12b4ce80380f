"""Withheld groups: the group numbers (`seq`) each volunteer used in a version, the ones the
trainer received, and the gaps, counted when the version leaves the window.

A volunteer numbers its groups of a version 0, 1, 2, ... and the number keys the group's
sampling noise, so it cannot sample a group again under the same number. One that samples
many groups and uploads only those it likes leaves gaps: its share of missing numbers is
high. Honest volunteers miss few: the groups still in flight when their version leaves the
window, and those lost to a crash. The count cannot tell withheld from late; it is shown per
volunteer (fleet.json, `vrl status`) for people to judge, and decides nothing by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GroupNumbers:
    """Numbers seen per (volunteer, version) of the window."""

    seen: dict[tuple[str, int], set[int]] = field(default_factory=dict)

    def add(self, volunteer: str, version: int, seqs: list[int]) -> bool:
        """Record the numbers of one shard's groups; False (and nothing recorded) if any was
        seen before or repeats inside the shard: an honest volunteer never reuses one."""
        known = self.seen.setdefault((volunteer, version), set())
        if len(set(seqs)) != len(seqs) or not known.isdisjoint(seqs):
            return False
        known.update(seqs)
        return True

    def close_below(self, low: int) -> dict[str, tuple[int, int]]:
        """Forget the versions below `low`; per volunteer, (numbers used, numbers missing)
        in them: the highest number seen + 1, and how many below it never arrived."""
        out: dict[str, tuple[int, int]] = {}
        for (volunteer, version) in [k for k in self.seen if k[1] < low]:
            seqs = self.seen.pop((volunteer, version))
            if not seqs:
                continue
            used = max(seqs) + 1
            n, missing = out.get(volunteer, (0, 0))
            out[volunteer] = (n + used, missing + used - len(seqs))
        return out
