"""How `vrl trainer` and `vrl volunteer` start: signal handlers first, then --threads, then the
seconds of heavy imports and set-up, all of it cut short by a stop (volunteer_rl/stopping.py).

Importing torch and transformers takes seconds, and a signal in those seconds must stop the
process too: so the handlers go in before anything heavy is imported, and the import and the
build run as an abortable phase (they write nothing to the bucket). --threads is applied
before any torch work, so the model build, a warm start and a volunteer's loading obey it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from volunteer_rl.stopping import StopSignal
from volunteer_rl_cli.options import log

Built = TypeVar("Built")


def start_stoppable(threads: int, last_words: Callable[[int], str],
                    build: Callable[[StopSignal], Built]) -> Built:
    """`build(stop)`, given the installed stop signal: handlers, then `threads` torch threads
    (0: torch's default), then `build`, which imports what it needs. A stop before `build`
    returns raises Stopped (or, inside an import, ends the process with `last_words`)."""
    stop = StopSignal(log, last_words=last_words).install()
    with stop.abortable():
        if threads > 0:
            from volunteer_rl.model.devices import set_process_threads

            set_process_threads(threads)
        return build(stop)
