"""Progress bars (rich) for the slow, countable things: the warm start and checkpoint
transfers. Shown only on an interactive terminal; in logs and pipes (the demo, CI, a
service) the concise log lines are the record, and a bar would only add noise."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


def interactive() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress(description: str, total: float, unit_bytes: bool = False,
             enabled: bool | None = None) -> Iterator[Callable[[float], None]]:
    """Yield `advance(n)`; a transient rich bar on stderr when interactive, else a no-op."""
    if not (interactive() if enabled is None else enabled) or total <= 0:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn(), TaskProgressColumn()]
    columns += [DownloadColumn(), TransferSpeedColumn()] if unit_bytes else []
    columns.append(TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)
