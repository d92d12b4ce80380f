"""How long phases show their progress: the one place for it.

A countable phase (the warm start, an evaluation, a checkpoint transfer) shows a rich bar
with its rate and time left on an interactive terminal; in logs and pipes (the demo, CI, a
service) it logs one status line per STATUS_SECONDS instead, with the same figures. An
endless loop (a volunteer's uploads, a trainer waiting for groups) says what it does at most
once per STATUS_SECONDS (`Every`). Callers keep their own logic and only call these.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, Protocol

STATUS_SECONDS = 10.0
"""Seconds between two status lines of one phase or loop: often enough that no minute passes
in silence, rarely enough that a log stays readable (a volunteer uploads about 7 shards a
second on the demo's machine; one line per shard buried everything else)."""


LOG_LEVELS = ("debug", "info", "warning", "error")
"""--log-level's values, least severe first. A line's level is how it starts (`level_of`):
every message of vrl that is a warning or an error says so in its first word."""


def level_of(line: str) -> str:
    """`error: ...` is an error, `warning: ...` a warning, `debug: ...` debug, the rest info
    (a step, a publish, a status line)."""
    for level in ("error", "warning", "debug"):
        if line.startswith(level + ":"):
            return level
    return "info"


class Log:
    """How a command logs (the `log` the library takes): stdout, flushed at once, so a parent
    process (the demo, a test) sees each line as it happens. Lines below `level` are dropped.
    Under torchrun every line of a rank starts with `[rank R] ` (`prefix`): torchrun merges
    the ranks' output into one stream, and a follower's lines (its share of the shards, its
    warnings) are its own, not repeats of the writer's, so they are kept and named."""

    def __init__(self, level: str = "info", prefix: str = ""):
        self.level, self.prefix = level, prefix

    def shows(self, level: str) -> bool:
        return LOG_LEVELS.index(level) >= LOG_LEVELS.index(self.level)

    def __call__(self, line: str) -> None:
        if self.shows(level_of(line)):
            # One write per line, its newline included: torchrun's ranks share one stdout,
            # and print's two writes (text, then newline) let another rank's line in between.
            sys.stdout.write("".join(self.prefix + part + "\n" for part in line.split("\n")))
            sys.stdout.flush()


LOG = Log()
"""This process's log: `vrl trainer` and `vrl volunteer` set its level from --log-level, a
trainer rank under torchrun its prefix (trainer.ranks.announce)."""


def interactive() -> bool:
    """A rich bar is drawn on a terminal, unless the log level hides info lines."""
    return sys.stderr.isatty() and LOG.shows("info")


class Every:
    """`due()` is True at its first call, then at most once per `seconds`."""

    def __init__(self, seconds: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.seconds = STATUS_SECONDS if seconds is None else seconds
        self.clock = clock
        self.last: float | None = None

    def due(self) -> bool:
        now = self.clock()
        if self.last is not None and now - self.last < self.seconds:
            return False
        self.last = now
        return True


def duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def status_line(description: str, done: float, total: float, seconds: float,
                unit: str = "", unit_bytes: bool = False, note: str = "") -> str:
    """`warm start 120/900 steps (13%), loss 1.234, 4.8 steps/s, about 2m43s left`."""
    rate = done / seconds if seconds > 0 else 0.0
    if unit_bytes:
        counts, speed = f"{done / 1e6:.1f}/{total / 1e6:.1f} MB", f"{rate / 1e6:.1f} MB/s"
    else:
        counts = f"{done:,.0f}/{total:,.0f}{' ' + unit if unit else ''}"
        speed = f"{rate:.1f} {unit or 'items'}/s"
    left = f"about {duration((total - done) / rate)} left" if rate > 0 and done < total else \
        f"{duration(seconds)} in all"
    return ", ".join(filter(None, [f"{description} {counts} ({done / total:.0%})", note, speed, left]))


class Advance(Protocol):
    def __call__(self, n: float, note: str = "") -> None: ...


@contextlib.contextmanager
def progress(description: str, total: float, unit_bytes: bool = False,
             enabled: bool | None = None, log: Callable[[str], None] | None = None,
             unit: str = "", every: float | None = None) -> Iterator[Advance]:
    """Yield `advance(n, note="")`. On an interactive terminal (or `enabled`): a transient rich
    bar on stderr, with `note` (say, the loss) after the description. Otherwise, given `log`:
    a `status_line` at most once per `every` seconds (default STATUS_SECONDS), the first one
    interval after the start and none once all is done (the caller says what it finished)."""
    if total <= 0:
        yield lambda n, note="": None
        return
    if not (interactive() if enabled is None else enabled):
        if log is None:
            yield lambda n, note="": None
            return
        started, done, tick = time.monotonic(), [0.0], Every(every)
        tick.due()  # the first line is due one interval after the start

        def advance(n: float, note: str = "") -> None:
            done[0] += n
            if done[0] < total and tick.due():
                log(status_line(description, done[0], total, time.monotonic() - started,
                                unit, unit_bytes, note))
        yield advance
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed or 0:.1f} {unit or 'items'}/s", style="progress.data.speed")

    columns = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()]
    columns += [DownloadColumn(), TransferSpeedColumn()] if unit_bytes else [MofNCompleteColumn(), Rate()]
    columns.append(TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance_bar(n: float, note: str = "") -> None:
            bar.update(task, advance=n,
                       description=f"{description} {note}" if note else description)
        yield advance_bar
