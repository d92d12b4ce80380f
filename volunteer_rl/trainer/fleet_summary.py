"""The trainer's view of the fleet, for people: `fleet.json`, overwritten every few seconds.

Heartbeats (volunteers/<id>.json) say what volunteers claim; this object says what the
trainer made of their work: shards accepted and rejected (Fleet.counts), groups trained, the
newest policy version of theirs it trained on, whether they are denied, plus the trainer's own
version, step, last reward and recent held-out evaluations, a short timeline of
(time, version) points so a reader can tell which version was current when a heartbeat was
written, and the balance of the last minute (trainer.balance: groups received and trained,
the useful fraction, the quota asked), fleet-wide and per volunteer. `vrl status` joins the
two. It also says how many processes the trainer runs as (`ranks`: torchrun's world size, 1
for a single process) and, on the write after its final publish, that it stopped
(`stopped_at`), so that a page or a `vrl status` read after the run ended says so instead of
looking live.

The trainer calls `FleetSummary.after_publish` once per publish. Per-volunteer figures are
accumulated from the step metrics of every publish (in memory), but the object is written at
most every `interval` seconds (and on the final publish), so a trainer publishing several
versions a second does not add a write to each. A failed write is a warning, never fatal.
"""

from __future__ import annotations

import json
import time
from typing import Callable

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.fleet import MAX_SUMMARY_BYTES
from volunteer_rl.protocol.manifest import Manifest
from volunteer_rl.protocol.metrics import EvalRecord, Record, StepRecord
from volunteer_rl.storage.base import NotFound, Storage, StorageError
from volunteer_rl.trainer.balance import Balance
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.withheld import GroupNumbers

SUMMARY_SCHEMA = 6
SUMMARY_INTERVAL_SECONDS = 5.0
TIMELINE_POINTS = 256
TIMELINE_SECONDS = 900.0
"""The timeline keeps at most TIMELINE_POINTS (time, version) points spread over the last
TIMELINE_SECONDS: one point per TIMELINE_SECONDS / TIMELINE_POINTS (3.5 s) at most, the first
publish of each such slot, so a version read off it is never newer than the true one."""
EVALS_KEPT = 10


def absorb_steps(volunteers: dict[str, dict], records: list[Record]) -> None:
    """Add the groups of each step's sources to their volunteers' totals, and move each
    one's `last_version` (newest policy version of its groups trained on) up."""
    for r in records:
        if not isinstance(r, StepRecord):
            continue
        for source in r.sources:
            v = volunteers.setdefault(source.volunteer, {"groups_trained": 0, "last_version": None,
                                                         "last_trained_at": None})
            v["groups_trained"] += source.groups
            last = v["last_version"]
            v["last_version"] = source.version if last is None else max(last, source.version)
            v["last_trained_at"] = r.time


def add_point(timeline: list[list[float]], now: float, version: int) -> None:
    """Record that `version` was current at `now`, thinned as TIMELINE_POINTS says."""
    slot = TIMELINE_SECONDS / TIMELINE_POINTS
    if timeline and (now - timeline[-1][0] < slot or version <= timeline[-1][1]):
        return
    timeline.append([now, version])
    while timeline and (len(timeline) > TIMELINE_POINTS or now - timeline[0][0] > TIMELINE_SECONDS):
        timeline.pop(0)


def summary_payload(run_id: str, version: int, step: int, max_staleness: int,
                    volunteers: dict[str, dict], fleet: Fleet, last_step: dict | None,
                    evals: list[dict], timeline: list[list[float]], now: float,
                    numbers: GroupNumbers | None = None,
                    balance: tuple[dict, dict[str, dict]] | None = None,
                    ranks: int = 1, stopped: bool = False, missing_bound: float = 1.0) -> dict:
    """The JSON object of fleet.json (schema in docs/PROTOCOL.md). `numbers`: the group
    numbers received (withheld.GroupNumbers: where each volunteer got to, its recent missing
    share); `balance`: Balance.summary (None: a window with nothing in it); `ranks`: the
    processes the trainer runs as; `stopped`: this is the write after its final publish;
    `missing_bound`: --missing-bound, over which a volunteer's groups are held back."""
    numbers = numbers or GroupNumbers()
    fleet_balance, recent = balance or Balance(1).summary(now)
    ids = set(volunteers) | set(fleet.counts) | set(fleet.denied) | set(recent)
    rows = {}
    for vid in sorted(ids):
        c = fleet.counts.get(vid)
        v = volunteers.get(vid, {})
        last = v.get("last_version")
        missing, counted = numbers.missing_share(vid)
        rows[vid] = {"accepted_shards": c.accepted if c else 0,
                     "rejected_shards": c.rejected if c else 0,
                     "audited_shards": c.audited if c else 0,
                     "groups_numbered": c.numbered if c else 0,
                     "groups_missing": c.missing if c else 0,
                     "next_group_number": numbers.next_number(vid),
                     "numbers_recent": counted, "missing_recent": missing,
                     "held_back": numbers.held(vid, missing_bound),
                     "groups_trained": v.get("groups_trained", 0), "last_version": last,
                     "version_lag": None if last is None else version - last,
                     "last_trained_at": v.get("last_trained_at"), "denied": vid in fleet.denied,
                     **recent.get(vid, {"groups_received_recent": 0, "groups_trained_recent": 0,
                                        "useful_fraction": None})}
    return {"schema_version": SUMMARY_SCHEMA, "run_id": run_id, "updated_at": now,
            "trainer": {"version": version, "step": step, "max_staleness": max_staleness,
                        "ranks": ranks, "stopped_at": now if stopped else None,
                        "missing_bound": missing_bound},
            "last_step": last_step, "evals": evals[-EVALS_KEPT:], "timeline": timeline,
            "balance": fleet_balance, "volunteers": rows}


class FleetSummary:
    """Keeps the running totals and writes fleet.json when due."""

    def __init__(self, storage: Storage, log: Callable[[str], None],
                 interval: float = SUMMARY_INTERVAL_SECONDS, clock: Callable[[], float] = time.time,
                 ranks: int = 1):
        self.storage, self.log, self.interval, self.clock = storage, log, interval, clock
        self.ranks = ranks  # the processes the trainer runs as (torchrun's world size)
        self.volunteers: dict[str, dict] = {}
        self.evals: list[dict] = []
        self.timeline: list[list[float]] = []
        self.last_step: dict | None = None
        self.last_write = float("-inf")
        self.loaded = False
        self.failing = False

    def _load_previous(self, run_id: str) -> None:
        """Carry the totals of the fleet.json this run wrote before a restart."""
        self.loaded = True
        try:
            raw = json.loads(self.storage.read(layout.FLEET, max_bytes=MAX_SUMMARY_BYTES))
            if raw.get("run_id") != run_id:
                return
            self.volunteers = {vid: {k: row.get(k) for k in ("groups_trained", "last_version",
                                                              "last_trained_at")}
                               for vid, row in raw.get("volunteers", {}).items()}
            for row in self.volunteers.values():
                row["groups_trained"] = int(row["groups_trained"] or 0)
            self.evals = list(raw.get("evals", []))[-EVALS_KEPT:]
            self.timeline = [[float(t), int(v)] for t, v in raw.get("timeline", [])[-TIMELINE_POINTS:]]
        except NotFound:
            pass
        except (StorageError, ValueError, TypeError, AttributeError) as exc:
            self.log(f"warning: {layout.FLEET}: not carried over ({exc})")

    def after_publish(self, manifest: Manifest, step: int, records: list[Record], fleet: Fleet,
                      final: bool = False, numbers: GroupNumbers | None = None,
                      balance: Balance | None = None, missing_bound: float = 1.0) -> None:
        """Take in the metric records of the steps that led to `manifest`; write fleet.json if
        due. `final`: the trainer's last publish (or last write) before it exits: always
        written, saying it stopped."""
        if not self.loaded:
            self._load_previous(manifest.run_id)
        absorb_steps(self.volunteers, records)
        steps = [r for r in records if isinstance(r, StepRecord)]
        if steps:
            s = steps[-1]
            self.last_step = {"step": s.step, "version": s.version, "time": s.time,
                              "reward_mean": s.reward_mean}
        self.evals = (self.evals + [r.short() for r in records
                                    if isinstance(r, EvalRecord)])[-EVALS_KEPT:]
        now = self.clock()
        add_point(self.timeline, now, manifest.version)
        if final or now - self.last_write >= self.interval:
            self.last_write = now
            self.write(summary_payload(manifest.run_id, manifest.version, step,
                                       manifest.max_staleness, self.volunteers, fleet,
                                       self.last_step, self.evals, self.timeline, now,
                                       numbers, balance.summary(now) if balance else None,
                                       self.ranks, final, missing_bound))

    def write(self, payload: dict) -> None:
        try:
            self.storage.write(layout.FLEET, json.dumps(payload, sort_keys=True).encode())
        except StorageError as exc:
            if not self.failing:
                self.log(f"warning: {layout.FLEET} not written ({exc}); training goes on")
            self.failing = True
            return
        self.failing = False
