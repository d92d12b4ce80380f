"""`vrl`: the app, its command groups in the order `vrl --help` lists them, and main().

Each command lives in the module of its group and imports what it needs (torch,
transformers, fsspec, rich) only when it runs, so `vrl --help` is instant. How failures end
is cli/errors.py's business, for every command at once.
"""

from __future__ import annotations

import inspect

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
    app()


if __name__ == "__main__":
    main()
