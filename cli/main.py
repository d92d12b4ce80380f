"""`vrl`: the app, its command groups in the order `vrl --help` lists them, and main().

Each command lives in the module of its group and imports what it needs (torch,
transformers, fsspec, rich) only when it runs, so `vrl --help` is instant. How failures end
is cli/errors.py's business, for every command at once.
"""

from __future__ import annotations

import inspect
import os
import sys

import typer

from volunteer_rl_cli import admin, demo, observe, tasks, train, volunteer
from volunteer_rl_cli.errors import KnownErrorsAsOneLine
from volunteer_rl_cli.options import command_help

DISTRIBUTION = "volunteer-rl"  # the name pip installs vrl under (pyproject.toml)

app = typer.Typer(
    cls=KnownErrorsAsOneLine,
    help="Reinforcement learning with volunteers' machines as generators and a bucket as the "
         "only rendezvous.\n\nQuick start: `vrl demo`.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
for group in (train, volunteer, observe, admin, tasks, demo):
    app.add_typer(group.app)


def _help_from_docstrings(commands: typer.Typer) -> None:
    """Every command's help and the line `vrl --help` lists for it, from its docstring
    (options.command_help), in `commands` and the groups below it."""
    for info in commands.registered_commands:
        info.help, info.short_help = command_help(info.help or inspect.getdoc(info.callback))
    for group in commands.registered_groups:
        _help_from_docstrings(group.typer_instance)


_help_from_docstrings(app)


def _print_version(value: bool) -> None:
    if value:
        from importlib import metadata  # deferred: 60 ms that `vrl --help` need not pay

        print(f"vrl {metadata.version(DISTRIBUTION)}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version,
        help="Print the installed version of vrl and exit.")) -> None:
    pass  # the app's help is Typer(help=...) above


def main() -> None:
    try:
        app()  # click's standalone mode: every ending, a good one too, is a SystemExit
    except SystemExit as end:
        if _torchrun_rank():
            _end_rank(end)
        raise


def _torchrun_rank() -> bool:
    """This process is one of the ranks torchrun started (`vrl trainer` as ranks)."""
    if "torch" not in sys.modules:  # no torch, no torch threads: nothing to guard against
        return False
    from volunteer_rl.trainer.ranks import TORCHRUN_ENV

    return all(k in os.environ for k in TORCHRUN_ENV)


def _end_rank(end: SystemExit) -> None:
    """End a rank with os._exit, after flushing its output: without the interpreter's teardown.

    Why: gloo's worker threads, and any other thread still inside a torch call, may reach for
    the GIL while the interpreter finalizes; CPython then ends that thread by unwinding it
    through a C++ destructor that may not throw, so the process aborts ("terminate called
    without an active exception", SIGABRT) after a run that succeeded. Seen once in a suite run
    beside a CPU hog, on a rank that had already logged "trainer stopped";
    test_ranks_same_weights makes the window certain with a thread busy in torch at exit.
    What os._exit skips (atexit handlers, finalizers) has nothing left to do by then: the
    command has closed what it opened (its reporters, the reward worker, the process group)
    and flushed each log line as it wrote it."""
    code = end.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"): print it, 1
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    main()
