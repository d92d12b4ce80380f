"""`vrl`: the app, its command groups in the order `vrl --help` lists them, and main().

Each command lives in the module of its group and imports what it needs (torch,
transformers, fsspec, rich) only when it runs, so `vrl --help` is instant. How failures end
is cli/errors.py's business, for every command at once.
"""

from __future__ import annotations

import typer

from volunteer_rl_cli import admin, demo, observe, train, volunteer
from volunteer_rl_cli.errors import KnownErrorsAsOneLine

app = typer.Typer(
    cls=KnownErrorsAsOneLine,
    help="Reinforcement learning with volunteers' machines as generators and a bucket as the "
         "only rendezvous.\n\nQuick start: `vrl demo`.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
for group in (train, volunteer, observe, admin, demo):
    app.add_typer(group.app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
