"""`vrl status`: the fleet and the trainer at a glance, from what the bucket holds.

Four sources, all bounded: the volunteers' heartbeats (`volunteers/<id>.json`, one listing of
that prefix, at most MAX_VOLUNTEERS objects), the trainer's `fleet.json` and `manifest.json`,
the metrics objects of the newest METRICS_VERSIONS versions (read by key, never listed), and
the credit object of the manifest's version (its leaderboard: observe.leaderboard).

The logic is pure: `classify` judges one heartbeat against a clock, `build_status` joins
everything into one JSON-able document, `render` turns that into rich tables fitted to the
width they are printed at (observe.fit). `read_status` is the only function that touches the
bucket.

States are judged in observe.states (its module doc says how).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from volunteer_rl.observe.fit import cells, fit_columns, newest_that_fit, pack
from volunteer_rl.observe.leaderboard import credit_table, leaderboard, read_leaderboard, summary_line
from volunteer_rl.observe.states import (  # noqa: F401 (version_at: re-exported)
    DEFAULT_PERIOD,
    STATES,
    classify,
    heartbeat_lag,
    heartbeat_period,
    recently_trained,
    seconds_since,
    timeline_points,
    version_at,
)
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
MAX_VOLUNTEERS = 1000
METRICS_VERSIONS = 10
READ_WORKERS = 8


# ---------------------------------------------------------------------------------------------
# Pure: joining the sources (observe.states judges each heartbeat).

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
    recent = max(0, json_int(t.get("numbers_recent")) or 0)
    recent_missing = max(0, json_int(t.get("missing_recent")) or 0)
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
           # its last numbers (fleet.json schema 6; older files: None and False), and whether
           # that share holds its groups back from training (trainer.withheld)
           "missing_recent_rate": min(1.0, recent_missing / recent) if recent else None,
           "numbers_recent": recent,
           "held_back": t.get("held_back") is True,
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
    for k in ("waiting", "paused"):  # why it is not sampling: the volunteer's word, escaped
        said = hb_ok.get(k) if hb_ok else None
        row[k] = printable(said, 120) if isinstance(said, str) else None
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
    by_step: dict = {}
    for r in records:
        if isinstance(r, StepRecord) and r.reward_mean is not None:
            row = {"step": r.step, "version": r.version, "time": r.time, "reward_mean": r.reward_mean}
            if r.step is None:
                steps.append(row)
            else:  # a step read twice (from the bucket and pending) counts once
                by_step[r.step] = row
        elif isinstance(r, EvalRecord):
            evals[r.version] = r.short()
    steps = [by_step[n] for n in sorted(by_step)] + steps
    return {"rewards": steps, "evals": [evals[v] for v in sorted(evals)]}


def latest_step(rewards: list[dict], summary_last: dict | None) -> dict:
    """The newest step with a reward: the highest step number of the metrics read and of
    fleet.json's `last_step` ({} when neither has one). `vrl status`'s reward and the
    dashboard's header come from here, so they name the step the reward plot ends on."""
    rows = [r for r in rewards if json_int(r.get("step")) is not None]
    if isinstance(summary_last, dict) and json_int(summary_last.get("step")) is not None \
            and json_number(summary_last.get("reward_mean")) is not None:
        rows.append(summary_last)
    if rows:
        return max(rows, key=lambda r: json_int(r["step"]))
    return rewards[-1] if rewards else {}


MAX_RANKS = 1 << 20


def trainer_ranks(trainer: dict) -> int | None:
    """fleet.json's `trainer.ranks`: the processes the trainer runs as (None: an older file
    or nonsense)."""
    n = json_int(trainer.get("ranks"))
    return n if n is not None and 1 <= n <= MAX_RANKS else None


def stopped_at(summary: dict, trainer: dict, run_id: str, version: int) -> float | None:
    """When the trainer stopped, if fleet.json says it did after publishing the current
    manifest of this run; None while it runs (or a newer publish came after the stop)."""
    at, last = json_number(trainer.get("stopped_at")), json_int(trainer.get("version"))
    if at is None or last is None or summary.get("run_id", run_id) != run_id or last < version:
        return None
    return at


def build_status(uri: str, manifest: Manifest, heartbeats: dict[str, dict | None],
                 summary: dict | None, denied: Iterable[str], metrics: list[Record],
                 now: float, credit: dict | None = None) -> dict:
    """The document `vrl status --json` prints (its fields are listed in README.md).
    `credit`: the leaderboard of the manifest's version (observe.leaderboard)."""
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
    last = latest_step(trends["rewards"], summary.get("last_step"))
    counts = {s: sum(r["state"] == s for r in rows) for s in STATES}
    from volunteer_rl.protocol.manifest import OLD_MANIFEST_SECONDS
    age = now - manifest.created_at  # negative if the trainer's clock is ahead of ours
    return {"schema_version": STATUS_SCHEMA, "bucket": uri, "time": now,
            "trainer": {"run_id": run_id, "version": version, "max_staleness": window,
                        "published_at": manifest.created_at,
                        "manifest_age_seconds": age, "manifest_old": age > OLD_MANIFEST_SECONDS,
                        "manifest_old_after_seconds": OLD_MANIFEST_SECONDS,
                        "step": max(steps + [json_int(trainer.get("step")) or 0]),
                        "reward_mean": json_number(last.get("reward_mean")),
                        "reward_step": json_int(last.get("step")),
                        "ranks": trainer_ranks(trainer),
                        "stopped_at": stopped_at(summary, trainer, run_id, version),
                        "summary_updated_at": json_number(summary.get("updated_at")),
                        "rewards": trends["rewards"], "evals": trends["evals"]},
            "balance": balance_doc(summary.get("balance")),
            "counts": counts, "volunteers": rows,
            "credit": credit if credit is not None else leaderboard(None, version)}


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
                metrics_versions: int = METRICS_VERSIONS, pending: Iterable[Record] = ()) -> dict:
    """Read the bucket (bounded, see the module doc) and build the status document.
    `pending`: metric records not in the bucket yet (the trainer's dashboard is written just
    before the publish's metrics object)."""
    manifest = read_manifest_unverified(storage)
    ids = [vid for vid in map(layout.parse_heartbeat_key, storage.list(layout.VOLUNTEERS)) if vid]
    ids = ids[:MAX_VOLUNTEERS]
    versions = range(manifest.version, max(-1, manifest.version - metrics_versions), -1)
    with ThreadPoolExecutor(READ_WORKERS) as pool:
        beats = pool.map(lambda v: _read_json(storage, layout.heartbeat_key(v), MAX_HEARTBEAT_BYTES), ids)
        chunks = pool.map(lambda v: read_metrics(storage, layout.metrics_key(v)), versions)
        heartbeats = dict(zip(ids, beats))
        records = [r for chunk in chunks for r in chunk] + list(pending)
    summary = _read_json(storage, layout.FLEET, MAX_SUMMARY_BYTES)
    try:
        denied, _ = read_denylist(storage)
    except Exception:  # a broken denylist is the trainer's warning to give, not ours
        denied = {}
    return build_status(storage.uri, manifest, heartbeats, summary, denied, records,
                        time.time() if now is None else now,
                        read_leaderboard(storage, manifest.version))


# ---------------------------------------------------------------------------------------------
# Rendering.

STATE_STYLE = {"producing": "green", "paused": "cyan", "idle": "yellow", "stale-version": "magenta",
               "offline": "red", "unknown": "dim"}


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def utc_clock(t: float, now: float) -> str:
    """`14:03:27 UTC` (the date too when `t` is not of `now`'s UTC day)."""
    same_day = time.gmtime(t)[:3] == time.gmtime(now)[:3]
    return time.strftime("%H:%M:%S UTC" if same_day else "%Y-%m-%d %H:%M UTC", time.gmtime(t))


def ranks_text(t: dict) -> str | None:
    """`2 ranks` when the trainer runs as several processes; None for one (or unknown)."""
    return f"{t['ranks']} ranks" if (t.get("ranks") or 1) > 1 else None


def _pct(x) -> str:
    return "-" if json_number(x) is None else f"{x:.1%}"


def _count(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


EVAL_HEAD = "held-out accuracy (sampled): "
EVAL_SEP = " → "


def eval_trend(evals: list[dict], last: int = 4, width: int | None = None) -> str:
    """`v0 20.2% → v10 31.0%` (sampled accuracy, greedy in brackets) of the newest `last`
    evals, as many of them as fit in `width` after EVAL_HEAD."""
    parts = [f"v{e['version']} {_pct(e.get('accuracy_sampled'))} ({_pct(e.get('accuracy_greedy'))} greedy)"
             for e in evals[-last:]]
    if not parts:
        return "no evaluation yet"
    return newest_that_fit(EVAL_HEAD, parts, width, EVAL_SEP)[len(EVAL_HEAD):]


def trainer_lines(status: dict, width: int | None = None) -> list[str]:
    """The lines above the table (rich markup), each broken between its parts to fit in
    `width` (None: one line each)."""
    t = status["trainer"]
    age = status["time"] - t["published_at"] if json_number(t.get("published_at")) else None
    reward = t.get("reward_mean")
    recent = [r["reward_mean"] for r in t["rewards"][-20:]]
    counts = ", ".join(f"{n} {s}" for s, n in status["counts"].items() if n)
    head = [f"trainer: v{t['version']} (published {_ago(age)})"]
    if t.get("stopped_at") is not None:  # its last write said so: no guessing from the age
        head.append(f"[bold]stopped {utc_clock(t['stopped_at'], status['time'])} "
                    f"({_ago(max(0.0, status['time'] - t['stopped_at']))})[/bold]")
    elif t.get("manifest_old"):  # no publish for that long: the trainer died, or a put-back manifest
        head.append(f"[bold red]OLD: over {t['manifest_old_after_seconds'] / 60:.0f} min, is the "
                    "trainer running?[/bold red]")
    head += [f"step {t['step']}", f"window {t['max_staleness']}",
             f"reward {'-' if reward is None else f'{reward:.3f}'}"]
    if recent:
        head.append(f"mean of last {len(recent)} steps {sum(recent) / len(recent):.3f}")
    if ranks_text(t):
        head.append(ranks_text(t))
    return [*pack([f"[bold]{markup_safe(status['bucket'])}[/bold]", f"run {markup_safe(t['run_id'])}"],
                  width, sep="  "),
            *pack(head, width),
            EVAL_HEAD + eval_trend(t["evals"], width=width),
            *pack(balance_line(status["balance"]).split("; "), width, sep="; "),
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


COLUMNS = ("volunteer", "state", "seen", "version", "/min", "made", "accepted", "audited",
           "missing", "trained", "useful", "device")
LEFT = ("volunteer", "state", "device")
DROP_ORDER = ("device", "audited", "missing", "made", "useful", "accepted", "trained", "/min",
              "seen")
"""Too narrow for every column: these go first to last (the volunteer, its state and
version always stay; README's `vrl status` says so)."""
ID_MIN = 12
"""The volunteer column's least width: a longer id is folded over lines, never cut."""


def _cells(r: dict) -> list[str]:
    """One volunteer's cells in COLUMNS order (rich markup; its own strings escaped)."""
    state = r["state"] + (" denied" if r["denied"] else "") + (" held" if r["held_back"] else "") + (
        " (waiting)" if r["state"] == "idle" and r["waiting"] else "")
    rate = r["completions_per_minute"] if r["state"] != "offline" else None
    return [markup_safe(r["id"], 64), f"[{STATE_STYLE[r['state']]}]{state}[/]",
            _short_ago(r["seconds_since_heartbeat"]), _version(r),
            "-" if rate is None else f"{rate:,.0f}", _count(r["completions_total"]),
            _accepted(r), _share(r["audit_coverage"]),
            _share(r["missing_recent_rate"]), _count(r["groups_trained"]),
            _share(r["useful_fraction"]), markup_safe((r["host"] or {}).get("device", "-"), 20)]


def volunteer_table(status: dict, width: int | None = None):
    """(table, names of the columns left out): one row per volunteer, every value whole; at
    a `width` too narrow for all columns, columns go in DROP_ORDER until the rest fit."""
    from rich.table import Table

    rows = [_cells(r) for r in status["volunteers"]]
    widths = [max([len(name)] + [cells(row[i]) for row in rows]) for i, name in enumerate(COLUMNS)]
    widths[0] = min(widths[0], max(ID_MIN, len(COLUMNS[0])))  # a long id folds
    kept = fit_columns(widths, [COLUMNS.index(c) for c in DROP_ORDER], width)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for i in kept:
        if i == 0:  # the id: as wide as the others leave, folded over lines beyond that
            room = None if width is None else width - sum(widths[k] + 2 for k in kept[1:])
            table.add_column(COLUMNS[0], overflow="fold",
                             min_width=widths[0], max_width=None if room is None else max(widths[0], room))
        else:
            table.add_column(COLUMNS[i], justify="left" if COLUMNS[i] in LEFT else "right",
                             no_wrap=True, min_width=widths[i])
    for row in rows:
        table.add_row(*[row[i] for i in kept])
    return table, [COLUMNS[i] for i in range(len(COLUMNS)) if i not in kept]


class StatusView:
    """The rich renderable of `render`: laid out for the width it is drawn at (a terminal's,
    or 80 columns for a pipe), each time it is drawn (`--watch` too)."""

    def __init__(self, status: dict):
        self.status = status

    def __rich_console__(self, console, options):
        from rich.text import Text

        width = options.max_width
        for line in trainer_lines(self.status, width):
            yield Text.from_markup(line)
        yield Text("")
        table, dropped = volunteer_table(self.status, width)
        yield table
        if dropped and self.status["volunteers"]:
            yield Text(f"left out at {width} columns: {', '.join(dropped)} (--json has every field)",
                       style="dim")
        credit = self.status.get("credit")
        if credit:  # the leaderboard: the top volunteers by groups trained
            yield Text("")
            yield Text(summary_line(credit), style="bold")
            if credit["leaders"]:
                yield credit_table(credit["leaders"], self.status["time"])
            if credit["volunteers"] > len(credit["leaders"]):
                yield Text(f"the top {len(credit['leaders'])}; `vrl volunteers credit` lists "
                           "every volunteer", style="dim")


def render(status: dict) -> StatusView:
    """A rich renderable: the trainer lines above the volunteer table, then the credit
    leaderboard."""
    return StatusView(status)


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
