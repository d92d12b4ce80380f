"""Group numbers: each group a volunteer makes with one version gets the next number, 0, 1, 2,
... without gaps (a shard's `seq`).

The number keys the group's sampling noise (protocol.draws), so sampling one number twice
gives the same draws, and a number never uploaded shows on the trainer's side as withheld.
Numbers are saved to <work_dir>/<id>/group-numbers.json before the groups are sampled: a
volunteer restarted inside a version goes on where it stopped instead of reusing numbers
(the trainer refuses a number it has already seen).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class GroupNumbers:
    """Hands out group numbers per (run id, version), committed to a file before use."""

    def __init__(self, path: Path):
        self.path = path
        self.run_id, self.version, self.next = self._load()

    def _load(self) -> tuple[str | None, int | None, int]:
        try:
            raw = json.loads(self.path.read_text())
            return str(raw["run_id"]), int(raw["version"]), max(0, int(raw["next"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None, None, 0  # none saved, or unreadable: numbering starts at 0

    def take(self, run_id: str, version: int, n: int) -> int:
        """Reserve `n` numbers for (run_id, version); returns the first. The file is written
        (temp file, then rename) before this returns."""
        if (run_id, version) != (self.run_id, self.version):
            self.run_id, self.version, self.next = run_id, version, 0
        first = self.next
        self.next += n
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"run_id": run_id, "version": version, "next": self.next}))
        os.replace(tmp, self.path)
        return first
