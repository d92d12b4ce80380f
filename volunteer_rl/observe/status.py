"""`vrl status`: the fleet and the trainer at a glance, from what the bucket holds.

Three sources, all bounded: the volunteers' heartbeats (`volunteers/<id>.json`, one listing of
that prefix, at most MAX_VOLUNTEERS objects), the trainer's `fleet.json` and `manifest.json`,
and the metrics objects of the newest METRICS_VERSIONS versions (read by key, never listed).

The logic is pure: `classify` judges one heartbeat against a clock, `build_status` joins
everything into one JSON-able document, `render` turns that into rich tables. `read_status`
is the only function that touches the bucket.

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
- `idle`: alive and it made none (waiting for a version, at its quota, ...: its heartbeat's
  `waiting` says why);
- `unknown`: the trainer has shards from it but there is no heartbeat (an older build).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.fleet import MAX_SUMMARY_BYTES, read_denylist
from volunteer_rl.protocol.heartbeat import MAX_HEARTBEAT_BYTES
from volunteer_rl.protocol.manifest import MAX_MANIFEST_BYTES, Manifest, decode
from volunteer_rl.protocol.metrics import (
    EvalRecord,
    Record,
    StepRecord,
    json_int,
    json_number,
    read_metrics,
)
from volunteer_rl.protocol.printable import markup_safe, printable
from volunteer_rl.storage.base import NotFound, Storage, StorageError

STATUS_SCHEMA = 1
OFFLINE_PERIODS = 2
DEFAULT_PERIOD = 30.0
PERIOD_BOUNDS = (0.1, 3600.0)
"""A reported period is clamped to this: a heartbeat claiming an hour-long period is still
called offline after two hours."""
MAX_VOLUNTEERS = 1000
METRICS_VERSIONS = 10
READ_WORKERS = 8
STATES = ("producing", "idle", "stale-version", "offline", "unknown")


# ---------------------------------------------------------------------------------------------
# Pure: judging heartbeats and joining the sources.

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
    return "producing" if (json_number(hb.get("completions_per_minute")) or 0) > 0 else "idle"


def volunteer_row(vid: str, hb: dict | None, trained: dict | None, denied: bool, now: float,
                  version: int, max_staleness: int, run_id: str,
                  points: list[tuple[float, int]] = ()) -> dict:
    """One volunteer as `vrl status --json` shows it: its claims (heartbeat) next to the
    trainer's figures (fleet.json)."""
    hb_ok = hb if isinstance(hb, dict) and "unreadable" not in hb else None
    used = json_int(hb_ok.get("version")) if hb_ok else None
    t = trained if isinstance(trained, dict) else {}
    accepted = json_int(t.get("accepted_shards")) or 0
    rejected = json_int(t.get("rejected_shards")) or 0
    audited = max(0, json_int(t.get("audited_shards")) or 0)
    numbered = max(0, json_int(t.get("groups_numbered")) or 0)
    missing = max(0, json_int(t.get("groups_missing")) or 0)
    last = json_int(t.get("last_version"))
    lag = heartbeat_lag(hb_ok, now, list(points)) if hb_ok else None
    trained_lately = recently_trained(t, now, heartbeat_period(hb_ok) if hb_ok else DEFAULT_PERIOD)
    row = {"id": vid, "state": classify(hb_ok, now, run_id, max_staleness, lag, trained_lately),
           "reported_state": hb_ok.get("state") if hb_ok else None,
           "seconds_since_heartbeat": seconds_since(hb_ok, now) if hb_ok else None,
           "heartbeat_seconds": heartbeat_period(hb_ok) if hb_ok else None,
           "version": used, "version_lag": lag,
           "version_lag_now": None if used is None else version - used,
           "accepted_shards": accepted, "rejected_shards": rejected,
           "acceptance_rate": accepted / (accepted + rejected) if accepted + rejected else None,
           "audited_shards": audited,
           "audit_coverage": min(1.0, audited / (accepted + rejected)) if accepted + rejected else None,
           "groups_missing": missing,
           "groups_missing_rate": min(1.0, missing / numbered) if numbered else None,
           "groups_trained": json_int(t.get("groups_trained")) or 0,
           # the trainer's last minute (fleet.json schema 5; older files: 0 and None)
           "groups_received_recent": max(0, json_int(t.get("groups_received_recent")) or 0),
           "groups_trained_recent": max(0, json_int(t.get("groups_trained_recent")) or 0),
           "useful_fraction": fraction(t.get("useful_fraction")),
           "trainer_last_version": last,
           "trainer_version_lag": None if last is None else version - last,
           "denied": denied or bool(t.get("denied")),
           "heartbeat_error": hb.get("unreadable") if isinstance(hb, dict) else None}
    for k in ("completions_per_minute", "completions_total", "groups_total", "shards_uploaded",
              "groups_uploaded", "last_upload_at", "started_at"):
        row[k] = json_number(hb_ok.get(k)) if hb_ok else None
    host = hb_ok.get("host") if hb_ok else None
    row["host"] = host if isinstance(host, dict) else None
    waiting = hb_ok.get("waiting") if hb_ok else None
    row["waiting"] = printable(waiting, 120) if isinstance(waiting, str) else None
    return row


def fraction(x) -> float | None:
    """A share in 0..1 from fleet.json, else None."""
    n = json_number(x)
    return n if n is not None and 0 <= n <= 1 else None


def balance_doc(raw) -> dict:
    """fleet.json's `balance` (schema 5), every field checked; None for what is missing."""
    raw = raw if isinstance(raw, dict) else {}
    quota = raw.get("quota") if isinstance(raw.get("quota"), dict) else {}
    groups, wait = json_int(quota.get("groups")), json_number(quota.get("wait_seconds"))
    return {"window_seconds": json_number(raw.get("window_seconds")),
            "groups_received": json_int(raw.get("groups_received")),
            "groups_trained": json_int(raw.get("groups_trained")),
            "useful_fraction": fraction(raw.get("useful_fraction")),
            "usable_fraction": fraction(raw.get("usable_fraction")),
            "volunteers": json_number(raw.get("volunteers")),
            "quota": {"groups": groups, "wait_seconds": wait} if groups is not None else None}


def metric_trends(records: Iterable[Record], summary_evals: Iterable[dict]) -> dict:
    """Last step, reward per recent step, and held-out evaluations by version (metrics
    records of the newest versions, plus the evaluations fleet.json keeps)."""
    steps, evals = [], {}
    for e in summary_evals:
        if isinstance(e, dict) and json_int(e.get("version")) is not None:
            evals[json_int(e["version"])] = e
    for r in records:
        if isinstance(r, StepRecord) and r.reward_mean is not None:
            steps.append({"step": r.step, "version": r.version, "time": r.time,
                          "reward_mean": r.reward_mean})
        elif isinstance(r, EvalRecord):
            evals[r.version] = r.short()
    steps.sort(key=lambda s: (s["step"] is None, s["step"]))
    return {"rewards": steps, "evals": [evals[v] for v in sorted(evals)]}


def build_status(uri: str, manifest: Manifest, heartbeats: dict[str, dict | None],
                 summary: dict | None, denied: Iterable[str], metrics: list[Record],
                 now: float) -> dict:
    """The document `vrl status --json` prints (its fields are listed in README.md)."""
    summary = summary if isinstance(summary, dict) else {}
    trained = summary.get("volunteers") if isinstance(summary.get("volunteers"), dict) else {}
    denied = set(denied)
    version, window, run_id = manifest.version, manifest.max_staleness, manifest.run_id
    ids = sorted(set(heartbeats) | set(trained) | denied)
    points = timeline_points(summary.get("timeline"), manifest.created_at, version)
    rows = [volunteer_row(vid, heartbeats.get(vid), trained.get(vid), vid in denied, now,
                          version, window, run_id, points) for vid in ids]
    trends = metric_trends(metrics, summary.get("evals") or [])
    trainer = summary.get("trainer") if isinstance(summary.get("trainer"), dict) else {}
    steps = [s["step"] for s in trends["rewards"] if s["step"] is not None]
    last = trends["rewards"][-1] if trends["rewards"] else (summary.get("last_step") or {})
    counts = {s: sum(r["state"] == s for r in rows) for s in STATES}
    from volunteer_rl.protocol.manifest import OLD_MANIFEST_SECONDS
    age = now - manifest.created_at  # negative if the trainer's clock is ahead of ours
    return {"schema_version": STATUS_SCHEMA, "bucket": uri, "time": now,
            "trainer": {"run_id": run_id, "version": version, "max_staleness": window,
                        "published_at": manifest.created_at,
                        "manifest_age_seconds": age, "manifest_old": age > OLD_MANIFEST_SECONDS,
                        "manifest_old_after_seconds": OLD_MANIFEST_SECONDS,
                        "step": max(steps + [json_int(trainer.get("step")) or 0]),
                        "reward_mean": last.get("reward_mean"),
                        "summary_updated_at": json_number(summary.get("updated_at")),
                        "rewards": trends["rewards"], "evals": trends["evals"]},
            "balance": balance_doc(summary.get("balance")),
            "counts": counts, "volunteers": rows}


# ---------------------------------------------------------------------------------------------
# Reading the bucket.

def _read_json(storage: Storage, key: str, cap: int) -> dict | None:
    """The JSON object at `key`; None if it does not exist; {"unreadable": why} if broken."""
    try:
        raw = json.loads(storage.read(key, max_bytes=cap))
    except NotFound:
        return None
    except (StorageError, ValueError, RecursionError) as exc:  # a heartbeat is anyone's bytes
        return {"unreadable": printable(exc, 200)}
    return raw if isinstance(raw, dict) else {"unreadable": f"{key}: not a JSON object"}


def read_manifest_unverified(storage: Storage) -> Manifest:
    """The current manifest, signature not checked: status only displays it. Raises
    StorageError (not found: nothing published, or a wrong --bucket) or ManifestError."""
    return Manifest.from_raw(decode(storage.read(layout.MANIFEST, max_bytes=MAX_MANIFEST_BYTES)))


def read_status(storage: Storage, now: float | None = None,
                metrics_versions: int = METRICS_VERSIONS) -> dict:
    """Read the bucket (bounded, see the module doc) and build the status document."""
    manifest = read_manifest_unverified(storage)
    ids = [vid for vid in map(layout.parse_heartbeat_key, storage.list(layout.VOLUNTEERS)) if vid]
    ids = ids[:MAX_VOLUNTEERS]
    versions = range(manifest.version, max(-1, manifest.version - metrics_versions), -1)
    with ThreadPoolExecutor(READ_WORKERS) as pool:
        beats = pool.map(lambda v: _read_json(storage, layout.heartbeat_key(v), MAX_HEARTBEAT_BYTES), ids)
        chunks = pool.map(lambda v: read_metrics(storage, layout.metrics_key(v)), versions)
        heartbeats = dict(zip(ids, beats))
        records = [r for chunk in chunks for r in chunk]
    summary = _read_json(storage, layout.FLEET, MAX_SUMMARY_BYTES)
    try:
        denied, _ = read_denylist(storage)
    except Exception:  # a broken denylist is the trainer's warning to give, not ours
        denied = {}
    return build_status(storage.uri, manifest, heartbeats, summary, denied, records,
                        time.time() if now is None else now)


# ---------------------------------------------------------------------------------------------
# Rendering.

STATE_STYLE = {"producing": "green", "idle": "yellow", "stale-version": "magenta",
               "offline": "red", "unknown": "dim"}


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _pct(x) -> str:
    return "-" if json_number(x) is None else f"{x:.1%}"


def _count(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def eval_trend(evals: list[dict], last: int = 4) -> str:
    """`v0 20.2% → v10 31.0%` (sampled accuracy, greedy in brackets) of the newest evals."""
    parts = [f"v{e['version']} {_pct(e.get('accuracy_sampled'))} ({_pct(e.get('accuracy_greedy'))} greedy)"
             for e in evals[-last:]]
    return " → ".join(parts) if parts else "no evaluation yet"


def trainer_lines(status: dict) -> list[str]:
    t = status["trainer"]
    age = status["time"] - t["published_at"] if json_number(t.get("published_at")) else None
    reward = t.get("reward_mean")
    recent = [r["reward_mean"] for r in t["rewards"][-20:]]
    avg = f", mean of last {len(recent)} steps {sum(recent) / len(recent):.3f}" if recent else ""
    counts = ", ".join(f"{n} {s}" for s, n in status["counts"].items() if n)
    old = ""
    if t.get("manifest_old"):  # no publish for that long: the trainer stopped, or a put-back manifest
        old = (f", [bold red]OLD: over {t['manifest_old_after_seconds'] / 60:.0f} min, is the "
               "trainer running?[/bold red]")
    return [f"[bold]{markup_safe(status['bucket'])}[/bold]  run {markup_safe(t['run_id'])}",
            f"trainer: v{t['version']} (published {_ago(age)}{old}), step {t['step']}, window "
            f"{t['max_staleness']}, reward {'-' if reward is None else f'{reward:.3f}'}{avg}",
            f"held-out accuracy (sampled): {eval_trend(t['evals'])}",
            balance_line(status["balance"]),
            f"volunteers: {counts or 'none yet'}"]


def balance_line(b: dict) -> str:
    """`useful: 62% of 1,990 groups received in the last 60s trained (70% usable); quota 40
    groups per volunteer per version, 2s wait`: the fleet's balance from fleet.json."""
    if b["useful_fraction"] is None:
        text = "useful: no groups received lately"
    else:
        usable = "" if b["usable_fraction"] is None else f" ({b['usable_fraction']:.0%} usable)"
        text = (f"useful: {b['useful_fraction']:.0%} of {_count(b['groups_received'])} groups "
                f"received in the last {b['window_seconds'] or 0:.0f}s trained{usable}")
    q = b["quota"]
    wait = "" if q is None or q["wait_seconds"] is None else f", {q['wait_seconds']:g}s wait"
    quota = "no quota" if q is None else f"quota {q['groups']:,} groups per volunteer per version{wait}"
    return f"{text}; {quota}"


def _short_ago(seconds: float | None) -> str:
    return "-" if seconds is None else _ago(seconds).removesuffix(" ago")


def _version(r: dict) -> str:
    if r["version"] is None:
        return "-"
    return f"v{r['version']}" + (f" -{r['version_lag']}" if r["version_lag"] else "")


def _accepted(r: dict) -> str:
    n = r["accepted_shards"] + r["rejected_shards"]
    return f"{r['acceptance_rate']:.0%} of {n}" if n else "-"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def volunteer_table(status: dict):
    """One row per volunteer, narrow enough for an 80-column terminal."""
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    widest = max([len(r["id"]) for r in status["volunteers"]] + [9])
    table.add_column("volunteer", no_wrap=True, min_width=min(widest, 20), overflow="ellipsis")
    for col, justify in (("state", "left"), ("seen", "right"), ("version", "right"),
                         ("/min", "right"), ("made", "right"), ("accepted", "right"),
                         ("audited", "right"), ("missing", "right"),
                         ("trained", "right"), ("useful", "right"), ("device", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for r in status["volunteers"]:
        state = r["state"] + (" denied" if r["denied"] else "") + (
            " (waiting)" if r["state"] == "idle" and r["waiting"] else "")
        rate = r["completions_per_minute"] if r["state"] != "offline" else None
        table.add_row(markup_safe(r["id"], 64), f"[{STATE_STYLE[r['state']]}]{state}[/]",
                      _short_ago(r["seconds_since_heartbeat"]), _version(r),
                      "-" if rate is None else f"{rate:,.0f}", _count(r["completions_total"]),
                      _accepted(r), _share(r["audit_coverage"]),
                      _share(r["groups_missing_rate"]), _count(r["groups_trained"]),
                      _share(r["useful_fraction"]), markup_safe((r["host"] or {}).get("device", "-"), 20))
    return table


def render(status: dict):
    """A rich renderable: the trainer lines above the volunteer table."""
    from rich.console import Group
    from rich.text import Text

    return Group(*[Text.from_markup(line) for line in trainer_lines(status)], Text(""),
                 volunteer_table(status))


def watch(storage: Storage, interval: float, console) -> None:
    """Re-read and redraw in place every `interval` seconds until Ctrl-C. A read that fails
    after the first keeps the last table on screen with the error under it."""
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    view = render(read_status(storage))
    with Live(view, console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)
                try:
                    view = render(read_status(storage))
                    live.update(view, refresh=True)
                except Exception as exc:  # keep watching through a flaky bucket
                    live.update(Group(view, Text(f"error: {exc}", style="red")), refresh=True)
        except KeyboardInterrupt:
            return
