"""A volunteer's heartbeat writer: counters the generation loop bumps (Tally), the payload of
`volunteers/<id>.json` built from them by pure functions (testable without a model or a
bucket), and the daemon thread that overwrites the object every few seconds. The object's
schema is protocol.heartbeat's."""

from __future__ import annotations

import os
import platform
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from volunteer_rl import __version__
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.heartbeat import HEARTBEAT_SCHEMA, encode_heartbeat
from volunteer_rl.storage.base import Storage

RATE_WINDOW_SECONDS = 60.0


def upload_summary(shards: int, groups: int, seconds: float, version: int, total: int) -> str:
    """The volunteer's status line: what it uploaded since the last one."""
    rate = groups / seconds if seconds > 0 else 0.0
    return (f"uploaded {shards} shard{'s' * (shards != 1)}, {groups} groups in {seconds:.0f}s "
            f"({rate:.1f} groups/s) on v{version}; {total} groups since start")


def host_facts(device: str) -> dict:
    """What the volunteer runs on: OS, Python, torch, device, CPU count."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - volunteers always have torch
        torch_version = None
    return {"os": platform.platform(terse=True), "python": platform.python_version(),
            "torch": torch_version, "device": device, "cpus": os.cpu_count(),
            "vrl": __version__}


@dataclass
class Tally:
    """Counters the generation loop bumps and the heartbeat thread reads (under a lock)."""

    started_at: float
    groups: int = 0
    completions: int = 0
    shards: int = 0
    groups_uploaded: int = 0
    last_upload_at: float | None = None
    recent: deque = field(default_factory=deque)
    """(time, completions) of each generated batch of the last RATE_WINDOW_SECONDS."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def generated(self, groups: int, completions: int, now: float) -> None:
        with self.lock:
            self.groups += groups
            self.completions += completions
            self.recent.append((now, completions))
            self._expire(now)

    def uploaded(self, groups: int, now: float) -> None:
        with self.lock:
            self.shards += 1
            self.groups_uploaded += groups
            self.last_upload_at = now

    def _expire(self, now: float) -> None:
        while self.recent and self.recent[0][0] <= now - RATE_WINDOW_SECONDS:
            self.recent.popleft()

    def per_minute(self, now: float) -> float:
        """Completions per minute over the last 60 s (over the time since start if shorter)."""
        with self.lock:
            self._expire(now)
            made = sum(n for _, n in self.recent)
        span = min(RATE_WINDOW_SECONDS, max(1.0, now - self.started_at))
        return made * 60.0 / span

    def snapshot(self, now: float) -> dict:
        """The counter fields of a heartbeat, consistent with each other."""
        rate = self.per_minute(now)
        with self.lock:
            return {"groups_total": self.groups, "completions_total": self.completions,
                    "completions_per_minute": round(rate, 2), "shards_uploaded": self.shards,
                    "groups_uploaded": self.groups_uploaded, "last_upload_at": self.last_upload_at}


def heartbeat_payload(volunteer_id: str, state: str, host: dict, tally: Tally, period: float,
                      run_id: str | None, version: int | None, now: float) -> dict:
    """The JSON object of `volunteers/<id>.json` (schema in docs/PROTOCOL.md)."""
    return {"schema_version": HEARTBEAT_SCHEMA, "volunteer_id": volunteer_id, "state": state,
            "host": host, "started_at": tally.started_at, "updated_at": now,
            "heartbeat_seconds": period, "run_id": run_id, "version": version,
            **tally.snapshot(now)}



class Heartbeat:
    """Writes the heartbeat every `period` seconds from a daemon thread, and a last one with
    state `stopped` when the volunteer stops (not after SIGKILL: readers judge that by age)."""

    def __init__(self, storage: Storage, volunteer_id: str, period: float,
                 payload: Callable[[str, float], dict], log: Callable[[str], None]):
        self.storage, self.key, self.period = storage, layout.heartbeat_key(volunteer_id), period
        self.payload, self.log = payload, log
        self.failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()

    def start(self) -> None:
        if self.period <= 0:
            return
        self._thread = threading.Thread(target=self._loop, name="vrl-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.beat("running")
            if self._stop.wait(self.period):
                return

    def beat(self, state: str) -> bool:
        """One write; True if it landed. A failure is logged once until a write succeeds."""
        with self._write_lock:
            try:
                self.storage.write(self.key, encode_heartbeat(self.payload(state, time.time())))
            except Exception as exc:  # never fatal: the heartbeat is for people, not training
                if not self.failing:
                    self.log(f"warning: heartbeat {self.key} not written ({exc}); generation "
                             "goes on, will keep trying")
                self.failing = True
                return False
            self.failing = False
            return True

    def stop(self) -> None:
        """Stop the thread and write the final `stopped` heartbeat."""
        if self.period <= 0:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.period + 30)
        self.beat("stopped")
