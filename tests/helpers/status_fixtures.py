"""A fixed clock, heartbeats and a manifest for the status, dashboard and printable tests."""
from __future__ import annotations

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import Dataset, Manifest, Sampling, TaskRef

NOW = 1_800_000_000.0


def beat(**over) -> dict:
    hb = {"state": "running", "updated_at": NOW - 1, "heartbeat_seconds": 10.0, "run_id": "r1",
          "version": 40, "completions_per_minute": 120.0}
    return {**hb, **over}


def manifest(version: int = 42, run_id: str = "r1") -> Manifest:
    return Manifest(task=TaskRef("calculator", "volunteer-rl", "0.1.0"), run_id=run_id, version=version, checkpoint=layout.checkpoint_prefix(version),
                    files={}, dataset=Dataset("train", "datasets/train-0.csv", "0" * 64, 1, 1),
                    sampling=Sampling(8, 1.0, 32), max_staleness=2, created_at=NOW - 3)
