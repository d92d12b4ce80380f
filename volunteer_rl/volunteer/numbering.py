"""Group numbers: each group a volunteer makes in a run gets the next number, 0, 1, 2, ...
without gaps and across versions (a shard's `seq`).

The number draws the group's prompt from the version's pool and keys its sampling noise
(protocol.draws), so sampling one number twice under one version gives the same group, and
a number never uploaded shows on the trainer's side as missing (trainer.withheld), the tail
of a version included once later numbers arrive. Numbers are saved to
<work_dir>/<id>/group-numbers.json before the groups are sampled: a volunteer restarted goes
on where it stopped instead of reusing numbers (the trainer refuses a number it has seen,
and one below the numbers it received under older versions). A volunteer that lost the file
goes on past the number the trainer's fleet.json says it reached, plus RESUME_GAP.

So a number reserved is sampled and uploaded, or it counts as missing: a stop waits for the
batch in hand and uploads it (volunteer.loop). What an honest volunteer misses is what was in
flight when its version left the window, and what a crash (or a second signal) cut short.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

RESUME_GAP = 1024
"""Numbers skipped when a volunteer without its saved number goes on from fleet.json, which
lags what the trainer received by a few seconds: room for the groups uploaded meanwhile. The
trainer counts them missing, once."""


class GroupNumbers:
    """Hands out group numbers per run id, committed to a file before use."""

    def __init__(self, path: Path):
        self.path = path
        self.run_id, self.next = self._load()

    def _load(self) -> tuple[str | None, int]:
        try:
            raw = json.loads(self.path.read_text())
            return str(raw["run_id"]), max(0, int(raw["next"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None, 0  # none saved, or unreadable

    def take(self, run_id: str, n: int, reached: Callable[[], int] = lambda: 0) -> int:
        """Reserve `n` numbers of `run_id`; returns the first. A run without a saved number
        starts at `reached()` (where the trainer saw this volunteer get to: 0 for a new one),
        plus RESUME_GAP if that is not 0. The file is written (temp file, then rename)
        before this returns."""
        if run_id != self.run_id:
            start = max(0, reached())
            self.run_id, self.next = run_id, start + RESUME_GAP if start else 0
        first = self.next
        self.next += n
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"run_id": run_id, "next": self.next}))
        os.replace(tmp, self.path)
        return first
