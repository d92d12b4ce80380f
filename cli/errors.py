"""How a `vrl` command ends when something goes wrong; the only place errors become messages.

A known failure (volunteer_rl.errors.VrlError: its message names what is at fault) becomes one
line, `error: <message>`, on stderr and exit code 1; Ctrl-C becomes `interrupted` and exit
code 130. Anything else is a bug and keeps its traceback. A setting the config refuses while a
command builds it from its flags is a bad command line instead, reported as click reports a
flag value it refuses itself (usage, message, exit code 2); one a `--config` file holds is a
known error naming the file and key (config_file.py). Mistakes that third-party code would
report with a traceback (torch on an unknown --device, boto3 on an endpoint without its
scheme, fsspec without gcsfs) are caught where the flag is known and raised as VrlErrors.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from typer.core import TyperGroup

from volunteer_rl.errors import ConfigError, VrlError


class KnownErrorsAsOneLine(TyperGroup):
    """The `vrl` group: every command it runs, nested groups' too, ends as the module says."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except VrlError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None


@contextmanager
def usage_errors() -> Iterator[None]:
    """Around building settings from flags: a ConfigError is a bad command line (exit 2)."""
    try:
        yield
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
