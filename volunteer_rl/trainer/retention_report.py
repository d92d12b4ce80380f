"""`vrl gc`'s report: the kept range, then per prefix the objects and bytes removed and why.
The command (cli/admin.py) prints these lines; trainer.retention did the deleting."""

from __future__ import annotations

from typing import Iterable

from volunteer_rl.protocol import layout
from volunteer_rl.trainer.retention import Outcome, Tally, n_objects
from volunteer_rl.trainer.retention_plan import Plan


def human_bytes(n: int) -> str:
    """`999 B`, `1.2 kB`, ... in powers of 1000, up to GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def version_ranges(versions: Iterable[int]) -> str:
    """`v0-v10, v13` for 0..10 and 13."""
    spans: list[list[int]] = []
    for v in sorted(versions):
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"v{a}" if a == b else f"v{a}-v{b}" for a, b in spans)


def summary_lines(p: Plan, outcome: Outcome, dry_run: bool = False) -> list[str]:
    """The kept range, then one line per prefix: objects and bytes removed, and why."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"kept: v{p.kept_from}-v{p.current} and anything newer (manifest v{p.current}, "
             f"staleness window {p.max_staleness}, newest {p.keep_versions} versions); "
             f"{layout.MANIFEST}, {layout.MANIFESTS}/ and other prefixes untouched"]
    for prefix in p.prefixes:
        removals = [r for r in p.removals if r.prefix == prefix]
        tallies = [outcome.removed.get((r.prefix, r.reason), Tally()) for r in removals]
        count, size = sum(t.objects for t in tallies), sum(t.bytes for t in tallies)
        why = "; ".join(f"{t.objects} {r.reason}: {version_ranges(r.versions)}"
                        for r, t in zip(removals, tallies) if t.objects)
        lines.append(f"{prefix}/: {verb} {n_objects(count)}, {human_bytes(size)}"
                     + (f" ({why})" if why else ""))
    return lines

