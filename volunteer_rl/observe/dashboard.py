"""A static dashboard in the bucket: `dashboard/index.html` and four PNG plots.

It opens straight from a folder bucket (relative links only, no server) and from any bucket
served as a static site. Plots: held-out accuracy (percent) and reward against version and
wall time, fleet throughput (trained groups per minute, per volunteer), and the staleness of
trained groups.

The page is a snapshot and says so: the time it was written, every time on it as a UTC clock
time, and one small inline script (AGES_SCRIPT, numbers only) that adds each one's age at the
time the page is viewed and, while the trainer has not said it stopped, warns once no version
was published for OLD_MANIFEST_SECONDS. Once fleet.json says the trainer stopped (its last
write), the page says when, and no longer reloads itself. Its reward is `vrl status`'s
(status.latest_step, with the publish's metrics that are not in the bucket yet), the step the
reward plot ends on. The fleet table is `vrl status`'s document rendered as HTML, under the
fleet's balance (the share of the groups received in the last minute that were trained, and
the quota asked of each volunteer), and above the credit leaderboard (observe.leaderboard:
the volunteers with the most groups trained, their tokens and share of the run).

Written by the trainer every `--dashboard-every` seconds (60 by default; the first that long
after it starts), but never sooner than COST_RATIO times the last write's duration after it,
and at its last publish (TrainerDashboard). It feeds each publish's metrics in, so it never
re-reads history; on its first write after a start it reads the run's metrics/ once. `vrl
dashboard` writes it by hand from all of metrics/. The plots go up first and index.html last;
every object under dashboard/ is overwritten each time. matplotlib is imported only here, with
its non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

import html
import io
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from volunteer_rl.observe.leaderboard import HEAD as CREDIT_HEAD
from volunteer_rl.observe.leaderboard import summary_line
from volunteer_rl.observe.status import READ_WORKERS, balance_line, ranks_text, read_status, utc_clock
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import OLD_MANIFEST_SECONDS
from volunteer_rl.protocol.metrics import EvalRecord, Record, StepRecord, read_metrics
from volunteer_rl.protocol.printable import printable
from volunteer_rl.storage.base import Storage

PLOTS = ("accuracy", "reward", "throughput", "staleness")
PAGE = "index.html"
REFRESH_SECONDS = 30
COST_RATIO = 50
"""A trainer's write starts no sooner than this many times the last one's duration after the
last one started: at most 1/50 = 2 % of the trainer's time, however slow rendering gets."""


def plot_file(plot: str) -> str:
    """`accuracy.png` for "accuracy": the plot's object name under dashboard/, and its link."""
    return f"{plot}.png"


@dataclass
class History:
    """The compact per-step and per-eval rows the plots need, accumulated over the run."""

    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    def add(self, records: list[Record]) -> None:
        """Keep what the plots use of each metrics record (a few numbers per step)."""
        for r in records:
            if isinstance(r, StepRecord):
                volunteers = Counter()
                for source in r.sources:
                    volunteers[source.volunteer] += source.groups
                self.steps.append({"step": r.step, "version": r.version, "time": r.time,
                                   "reward": r.reward_mean, "lags": dict(r.staleness),
                                   "received": r.received, "trained": r.groups,
                                   "volunteers": dict(volunteers)})
            elif isinstance(r, EvalRecord):
                self.evals.append({"version": r.version, "time": r.time,
                                   "greedy": r.accuracy_greedy, "sampled": r.accuracy_sampled})


def read_history(storage: Storage) -> History:
    """Every metrics object of the run (one listing of metrics/, reads in parallel)."""
    keys = [k for k in storage.list(layout.METRICS) if layout.parse_metrics_key(k) is not None]

    history = History()
    with ThreadPoolExecutor(READ_WORKERS) as pool:
        for records in pool.map(lambda key: read_metrics(storage, key), sorted(keys)):
            history.add(records)
    return history


# ---------------------------------------------------------------------------------------------
# Plots (pure: data in, PNG bytes out).

def _figure(title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), dpi=90)
    fig.suptitle(title)
    return fig


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _minutes(times: list[float], t0: float) -> list[float]:
    return [(t - t0) / 60 for t in times]


def _start(history: History) -> float:
    times = [r["time"] for r in history.steps + history.evals if r.get("time")]
    return min(times) if times else 0.0


def plotted(rows: list[dict], key: str) -> list[dict]:
    """The rows a plot of `key` draws, in order: those with a value and a time."""
    return [r for r in rows if r.get(key) is not None and r.get("time")]


def _pair(history_rows: list[dict], t0: float, series: dict[str, str], title: str, ylabel: str,
          scale: float = 1.0):
    """Two panels: the series (times `scale`) against version (left) and against wall time
    (right)."""
    fig = _figure(title)
    by_version, by_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for key, label in series.items():
        rows = plotted(history_rows, key)
        values = [r[key] * scale for r in rows]
        by_version.plot([r["version"] for r in rows], values, label=label, marker=".")
        by_time.plot(_minutes([r["time"] for r in rows], t0), values, label=label, marker=".")
    by_version.set_xlabel("version")
    by_time.set_xlabel("minutes since the first record")
    for ax in (by_version, by_time):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    return fig


def accuracy_figure(history: History):
    """Held-out accuracy in percent (0-100, ticks `40%`), as the page's text gives it."""
    from matplotlib.ticker import PercentFormatter

    fig = _pair(history.evals, _start(history), {"sampled": "sampled", "greedy": "greedy"},
                "held-out accuracy", "accuracy (%)", scale=100.0)
    for ax in fig.axes:
        ax.yaxis.set_major_formatter(PercentFormatter(100, decimals=0))
    return fig


def accuracy_plot(history: History) -> bytes:
    return _png(accuracy_figure(history))


def reward_plot(history: History) -> bytes:
    return _png(_pair(history.steps, _start(history), {"reward": "reward mean"},
                      "reward of the trained groups", "reward"))


def bin_seconds(history: History) -> float:
    """Width of a throughput bin: about 40 bins over the run, none under 10 s."""
    times = [s["time"] for s in history.steps if s.get("time")]
    return max(10.0, (max(times) - min(times)) / 40) if times else 60.0


def throughput_series(history: History, t0: float, width: float) -> dict[str, dict[int, float]]:
    """{series: {bin index: groups per minute}}: groups received (accepted from shards) and
    trained by the whole fleet, and trained per volunteer."""
    out: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    scale = 60.0 / width
    for s in history.steps:
        if not s.get("time"):
            continue
        b = int((s["time"] - t0) // width)
        out["all: received"][b] += s["received"] * scale
        out["all: trained"][b] += s["trained"] * scale
        for vid, n in s["volunteers"].items():
            out[f"{vid}: trained"][b] += n * scale
    return out


def throughput_plot(history: History) -> bytes:
    fig = _figure("fleet throughput: groups per minute")
    ax = fig.add_subplot(1, 1, 1)
    width = bin_seconds(history)
    series = throughput_series(history, _start(history), width)
    for name in sorted(series, key=lambda n: (not n.startswith("all"), n)):
        bins = sorted(series[name])
        ax.plot([(b + 0.5) * width / 60 for b in bins], [series[name][b] for b in bins], label=name,
                marker=".", linewidth=2 if name.startswith("all") else 1)
    if series:
        ax.legend(fontsize="small", ncol=2)
    ax.set_xlabel(f"minutes since the first record ({width:.0f} s bins)")
    ax.set_ylabel("groups / minute")
    ax.grid(alpha=0.3)
    return _png(fig)


def staleness_counts(history: History) -> dict[int, int]:
    """{lag in versions: groups trained with it} over the whole run."""
    total: Counter = Counter()
    for s in history.steps:
        for lag, n in s["lags"].items():
            total[lag] += n
    return dict(sorted(total.items()))


def staleness_plot(history: History) -> bytes:
    fig = _figure("staleness of trained groups (trainer version - policy version)")
    ax = fig.add_subplot(1, 1, 1)
    counts = staleness_counts(history)
    ax.bar([str(k) for k in counts], list(counts.values()))
    ax.set_xlabel("lag (versions)")
    ax.set_ylabel("groups")
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


# ---------------------------------------------------------------------------------------------
# The page.

def _cell(x) -> str:
    """A table cell: volunteer-written values arrive here, so control characters are escaped
    (printable) and then the HTML."""
    return html.escape("-" if x is None else printable(x))


def _missing(row: dict) -> str | None:
    """Group numbers the trainer never received: the share of its last numbers (and whether
    that holds its groups back from training), then the share and count of all it closed."""
    recent, rate, n = row["missing_recent_rate"], row["groups_missing_rate"], row.get("groups_missing")
    parts = [] if recent is None else [f"{recent:.0%} of its last {row['numbers_recent']:,}"
                                       + (", held back" if row["held_back"] else "")]
    parts += [] if rate is None else [f"{rate:.0%} ({n:,}) of all"]
    return "; ".join(parts) or None


def _when(t: float, now: float, text: str | None = None) -> str:
    """A time on the page: its UTC clock time (or `text`), to which AGES_SCRIPT adds its age
    when the page is viewed. Numbers only go into the attribute."""
    return f'<time data-t="{t:.3f}">{html.escape(text or utc_clock(t, now))}</time>'


def fleet_rows_html(status: dict) -> str:
    rows = []
    for r in status["volunteers"]:
        rate = r["completions_per_minute"] if r["state"] != "offline" else None
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        seen = r["seconds_since_heartbeat"]
        state = r["state"] + (f": {r['paused']}" if r["state"] == "paused" and r["paused"] else "")
        cells = [_cell(c) for c in (r["id"], state + (" (denied)" if r["denied"] else ""))]
        cells.append("-" if seen is None else _when(status["time"] - seen, status["time"]))
        cells += [_cell(c) for c in (
            None if r["version"] is None else f"v{r['version']}", r["version_lag"],
            None if rate is None else f"{rate:,.0f}", r["completions_total"] and f"{r['completions_total']:,.0f}",
            f"{r['accepted_shards']}/{r['accepted_shards'] + r['rejected_shards']} ({acc})",
            _missing(r), r["groups_trained"],
            None if r["useful_fraction"] is None else f"{r['useful_fraction']:.0%}",
            (r["host"] or {}).get("device"))]
        rows.append(f'<tr class="{html.escape(r["state"])}">' +
                    "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


def credit_html(status: dict) -> str:
    """The credit leaderboard (observe.leaderboard): its summary line and its top rows, each
    volunteer's first and last trained group as a time on the page."""
    credit = status.get("credit")
    if not credit:
        return ""
    now = status["time"]
    rows = []
    for i, r in enumerate(credit["leaders"], 1):
        cells = [str(i), _cell(r["volunteer"]), f"{r['groups_trained']:,}", f"{r['tokens_trained']:,}",
                 f"{r['share']:.1%}"]
        cells += ["-" if t is None else _when(t, now) for t in (r["first_seen"], r["last_seen"])]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = (f"<table><tr>{''.join(f'<th>{h}</th>' for h in CREDIT_HEAD)}</tr>\n"
             + "\n".join(rows) + "\n</table>") if rows else ""
    return f'<h2>credit</h2>\n<p class="credit">{_cell(summary_line(credit))}.</p>\n{table}'


AGES_SCRIPT = """<script>
// Ages at the time the page is viewed: each <time data-t> gets "(N ago)" after its UTC clock
// time, and #old shows once the last publish is older than its data-after seconds.
(function () {
  var now = Date.now() / 1000;
  function ago(s) {
    s = Math.max(0, s);
    return s < 120 ? Math.round(s) + "s ago" : s < 7200 ? Math.round(s / 60) + "m ago"
      : (s / 3600).toFixed(1) + "h ago";
  }
  document.querySelectorAll("time[data-t]").forEach(function (e) {
    e.textContent += " (" + ago(now - Number(e.dataset.t)) + ")";
  });
  var old = document.getElementById("old");
  if (old && now - Number(old.dataset.published) > Number(old.dataset.after)) old.hidden = false;
})();
</script>"""


def when_html(status: dict, now: float) -> str:
    """What the page is a snapshot of: the run stopped at T (it no longer reloads), or the
    time it was written, reloading every REFRESH_SECONDS, with the warning AGES_SCRIPT shows
    once no version was published for OLD_MANIFEST_SECONDS."""
    t = status["trainer"]
    at = t.get("published_at")
    if at is None:
        return f'<p class="when">A snapshot written at {_when(now, now)}.</p>'
    published = _when(at, now)
    if t.get("stopped_at") is not None:
        return (f'<p class="when"><strong>The trainer stopped at {_when(t["stopped_at"], now)}'
                f"</strong>, after publishing version {t['version']} at {published}. This page "
                f"was written at {_when(now, now)} and no longer reloads.</p>")
    hidden = "" if t.get("manifest_old") else " hidden"
    return (f'<p class="when">A snapshot written at {_when(now, now)}; version {t["version"]} '
            f"published at {published}. It reloads every {REFRESH_SECONDS} s while the trainer "
            f'rewrites it. <strong id="old"{hidden} data-published="{at:.3f}" '
            f'data-after="{OLD_MANIFEST_SECONDS}">No version published for over '
            f"{OLD_MANIFEST_SECONDS / 60:.0f} min: is the trainer running?</strong></p>")


def index_html(status: dict, now: float) -> str:
    """The page: what it is a snapshot of, the trainer line, fleet table, credit leaderboard,
    the four plots (relative links)."""
    t = status["trainer"]
    evals = t["evals"]
    last_eval = (f"v{evals[-1]['version']}: sampled {evals[-1].get('accuracy_sampled') or 0:.1%}, "
                 f"greedy {evals[-1].get('accuracy_greedy') or 0:.1%}") if evals else "none yet"
    reward = "-" if t["reward_mean"] is None else f"{t['reward_mean']:.3f} (step {t['reward_step']})"
    ranks = f"; trained as {ranks_text(t)} (torchrun)" if ranks_text(t) else ""
    head = ("volunteer", "state", "seen (UTC)", "version", "lag", "compl/min", "completions",
            "accepted shards", "groups missing", "groups trained", "useful (last min)", "device")
    plots = "\n".join(f'<img src="{plot_file(p)}" alt="{p}">' for p in PLOTS)
    refresh = ("" if t.get("stopped_at") is not None
               else f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">')
    return f"""<!doctype html>
<html><head><meta charset="utf-8">{refresh}
<title>vrl {html.escape(printable(t['run_id']))} v{t['version']}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }} table {{ border-collapse: collapse; }}
td, th {{ padding: 0.2em 0.7em; text-align: right; border-bottom: 1px solid #ddd; }}
td:first-child, th:first-child {{ text-align: left; }} img {{ max-width: 100%; display: block; margin: 1em 0; }}
.producing td:nth-child(2) {{ color: green; }} .idle td:nth-child(2) {{ color: #b58900; }}
.paused td:nth-child(2) {{ color: #2aa198; }}
.stale-version td:nth-child(2) {{ color: purple; }} .offline td:nth-child(2) {{ color: #c00; }}
#old {{ color: #c00; }}
</style></head><body>
<h1>run {html.escape(printable(t['run_id']))}: version {t['version']}</h1>
{when_html(status, now)}
<p>step {t['step']}, staleness window {t['max_staleness']}, reward {reward}{ranks}; last held-out
evaluation {html.escape(last_eval)}.</p>
<p>{html.escape(balance_line(status["balance"]))}.</p>
<h2>fleet as of {html.escape(utc_clock(status["time"], now))}</h2>
<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>
{fleet_rows_html(status)}
</table>
{credit_html(status)}
<h2>plots</h2>
{plots}
{AGES_SCRIPT}
</body></html>
"""


def render_dashboard(history: History, status: dict, now: float) -> dict[str, bytes]:
    """{key: bytes} of every dashboard object, index.html last."""
    draw = {"accuracy": accuracy_plot, "reward": reward_plot, "throughput": throughput_plot,
            "staleness": staleness_plot}
    out = {layout.dashboard_key(plot_file(p)): draw[p](history) for p in PLOTS}
    out[layout.dashboard_key(PAGE)] = index_html(status, now).encode()
    return out


def write_dashboard(storage: Storage, history: History, pending: list[Record] = ()) -> list[str]:
    """Render and upload, plots first, the page last. Returns the keys written. `pending`:
    metric records in `history` but not in the bucket yet (the trainer's, at a publish)."""
    objects = render_dashboard(history, read_status(storage, pending=pending), time.time())
    for key, data in objects.items():
        storage.write(key, data)
    return list(objects)


class TrainerDashboard:
    """The trainer's side: history fed from each publish's metrics, a dashboard written at
    the first publish `every` seconds or more after the start, then at the first publish
    `every` seconds or more after the last write, and at the last publish (0: never).

    The unit is seconds, not publishes: a trainer may publish several versions a second, and
    rendering four plots takes a good fraction of one. However long a write takes, the next
    starts no sooner than COST_RATIO times that after it, so writing costs the trainer at
    most 2 % of its time, the final write aside. Not at the first publish: that write (the
    costliest, with matplotlib's import and the one read of metrics/) would then count
    against a run of any length. A failure is a warning, never fatal."""

    def __init__(self, storage: Storage, every: float, log: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.storage, self.every, self.log, self.clock = storage, every, log, clock
        self.history: History | None = None
        self.last_start = clock()  # when the last write began; the first counts from here
        self.last_duration = 0.0  # how long it took (render + upload, failed or not)
        self.seconds = 0.0  # spent here since take_seconds last ran (the trainer's time/dashboard)
        self.failing = False

    def due(self, now: float) -> bool:
        return now - self.last_start >= max(self.every, COST_RATIO * self.last_duration)

    def after_publish(self, records: list[Record], final: bool = False) -> None:
        """Take in one publish's metric records; write dashboard/ if due, or if `final`."""
        if self.every <= 0:
            return
        start = self.clock()
        try:
            if self.history is not None:
                self.history.add(records)
            if final or self.due(start):
                self._write(records, start)
        finally:
            self.seconds += self.clock() - start

    def _write(self, records: list[Record], start: float) -> None:
        self.last_start = start
        try:
            if self.history is None:
                # Once, at the first write: what earlier runs and publishes wrote. This
                # publish's metrics are not in the bucket yet; they come after.
                history = read_history(self.storage)
                history.add(records)
                self.history = history
            write_dashboard(self.storage, self.history, records)
        except Exception as exc:  # plots are for people: never stop training for them
            if not self.failing:
                self.log(f"warning: {layout.DASHBOARD}/ not written ({type(exc).__name__}: {exc})")
            self.failing = True
            return
        finally:
            self.last_duration = self.clock() - start
        self.failing = False
        self.log(f"wrote {layout.DASHBOARD}/ in {self.last_duration:.2f}s; next one in "
                 f"{max(self.every, COST_RATIO * self.last_duration):.0f}s at the earliest")

    def take_seconds(self) -> float:
        """Seconds spent here since the last call (the trainer's `time/dashboard`)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
