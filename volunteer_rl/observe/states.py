"""A volunteer's state, judged from its heartbeat against a clock: the one place the states
and their thresholds live (`vrl status`, its --json and the dashboard all show these).

A heartbeat names the version in use when it was written, up to a period ago; a trainer
publishing several versions a second has moved on since. So the lag is taken against the
trainer's version *at the heartbeat's time*, read off fleet.json's timeline (and the manifest),
never against the version now.

States, judged with the reader's clock (keep clocks NTP-synced):
- `offline`: no heartbeat for more than OFFLINE_PERIODS of the period the volunteer itself
  reports, or its last heartbeat says `stopped`;
- `stale-version`: alive, but the version it reports was out of the trainer's staleness window
  when the heartbeat was written (or of another run), and the trainer has not trained on its
  groups lately: what it makes would be dropped;
- `producing`: alive and it made completions in the last minute;
- `paused`: alive and its heartbeat says its owner's host controls paused it (a busy machine,
  on battery: its `paused` says why; volunteer.host). A heartbeat is the volunteer's word,
  believed for display only: the trainer counts numbers as it always does;
- `idle`: alive and it made none (waiting for a version, at its quota, ...: its heartbeat's
  `waiting` says why);
- `unknown`: the trainer has shards from it but there is no heartbeat (an older build).
"""

from __future__ import annotations

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.metrics import json_int, json_number

STATES = ("producing", "paused", "idle", "stale-version", "offline", "unknown")
OFFLINE_PERIODS = 2
DEFAULT_PERIOD = 30.0
PERIOD_BOUNDS = (0.1, 3600.0)
"""A reported period is clamped to this: a heartbeat claiming an hour-long period is still
called offline after two hours."""


def heartbeat_period(hb: dict) -> float:
    """The period the volunteer reports, clamped to PERIOD_BOUNDS (default 30 s)."""
    period = json_number(hb.get("heartbeat_seconds"))
    if period is None or period <= 0:
        period = DEFAULT_PERIOD
    return min(max(period, PERIOD_BOUNDS[0]), PERIOD_BOUNDS[1])


def seconds_since(hb: dict, now: float) -> float | None:
    """Age of the heartbeat by its `updated_at` (a clock ahead of ours counts as 0)."""
    updated = json_number(hb.get("updated_at"))
    return None if updated is None else max(0.0, now - updated)


def timeline_points(summary_timeline, published_at: float | None, version: int) -> list[tuple[float, int]]:
    """(time, version) points, oldest first: fleet.json's timeline (bad points dropped) and
    the manifest's own publish time."""
    points = []
    if isinstance(summary_timeline, list):
        for p in summary_timeline[:4 * 256]:
            if (isinstance(p, list) and len(p) == 2 and json_number(p[0]) is not None
                    and json_int(p[1]) is not None):
                points.append((json_number(p[0]), json_int(p[1])))
    if json_number(published_at) is not None:
        points.append((json_number(published_at), version))
    return sorted(points)


def version_at(points: list[tuple[float, int]], when: float) -> int | None:
    """The newest version known to be published at or before `when` (None: `when` is older
    than every point). Thinned points make this a lower bound, never an overestimate."""
    best = None
    for t, v in points:
        if t <= when:
            best = v if best is None else max(best, v)
    return best


def heartbeat_lag(hb: dict, now: float, points: list[tuple[float, int]]) -> int | None:
    """Versions the heartbeat's own version was behind the trainer's when it was written
    (clamped at 0; None when either is unknown)."""
    used, written = json_int(hb.get("version")), json_number(hb.get("updated_at"))
    if used is None or written is None:
        return None
    current = version_at(points, min(written, now))
    return None if current is None else max(0, current - used)


def recently_trained(trained: dict | None, now: float, period: float) -> bool:
    """The trainer stepped on this volunteer's groups within two of its heartbeat periods
    (at least a minute): hard evidence it makes usable work, whatever the heartbeat says."""
    at = json_number((trained or {}).get("last_trained_at"))
    return at is not None and now - at <= max(60.0, OFFLINE_PERIODS * period)


def classify(hb: dict | None, now: float, run_id: str, max_staleness: int,
             lag: int | None, trained_lately: bool = False) -> str:
    """One of STATES for a volunteer whose last heartbeat is `hb` (None: none found); `lag`
    is `heartbeat_lag` of it."""
    if hb is None:
        return "unknown"
    age = seconds_since(hb, now)
    if hb.get("state") == "stopped" or age is None or age > OFFLINE_PERIODS * heartbeat_period(hb):
        return "offline"
    if json_int(hb.get("version")) is not None and hb.get("run_id") != run_id:
        return "stale-version"
    if lag is not None and not layout.in_window(lag, max_staleness) and not trained_lately:
        return "stale-version"
    if isinstance(hb.get("paused"), str):
        return "paused"
    return "producing" if (json_number(hb.get("completions_per_minute")) or 0) > 0 else "idle"
