"""`--config FILE.toml`: a command's options read from a TOML file.

Each top-level key is a setting name, as in volunteer_rl/config.py (`max_staleness = 2`,
`volunteer_id = "laptop"`; the flag without its dashes, with underscores), and may set any
option of the command. Flags given on the command line, and environment variables, win over
the file. A key that is not an option of the command, a value of the wrong type or out of
the setting's range is one error line naming the file and the key, before anything runs.

How: the file's values become the default_map of the command's context (read by an eager
option, so before any other option is looked at), checked here first: their TOML type against
the option's, then the setting's own rule (config.check), so the message can name the file.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import fields
from typing import Any, Optional

import typer
from typer.models import OptionInfo

from volunteer_rl.config import check
from volunteer_rl.errors import ConfigError

CONFIG = "config"  # the option's own name, never a key of the file

_KINDS = {bool: ((bool,), "true or false"), int: ((int,), "an integer"),
          float: ((int, float), "a number"), str: ((str,), "a string")}
"""What a TOML value may be for an option of each type, and how a message names it: never
coerced (2.5 is not an integer, "2" not a number, 1 not true)."""


def _typed(where: str, param: Any, value: Any) -> Any:
    """`value` as the option `param` takes it from the command line; ConfigError naming
    `where` if it is of another type. Its range is the setting's (config_option)."""
    kind = bool if param.is_flag else param.type_descriptor.annotation
    accepted, wanted = _KINDS[kind]
    if not isinstance(value, accepted) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{where}: must be {wanted}, not {value!r}")
    return float(value) if kind is float else value


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def _suggestion(key: str, options: dict[str, Any]) -> str:
    """The setting name a mistaken key probably meant: its flag spelled as a key (`id`,
    `max-steps`) or a close spelling; else how keys are spelled."""
    key = key.replace("-", "_")
    by_flag = {o.lstrip("-").replace("-", "_"): name for name, p in options.items()
               for o in p.opts if o.startswith("--")}
    guess = by_flag.get(key) or next(iter(difflib.get_close_matches(key, options, 1)), None)
    return (f" (did you mean {guess}?)" if guess
            else "; keys are setting names, such as max_staleness")


def config_option(*settings: type) -> OptionInfo:
    """The --config option of a command whose options come from the dataclasses `settings`:
    their rules (config.setting) are checked on the file's values too."""

    def load(ctx: typer.Context, param: typer.CallbackParam, path: Optional[str]) -> None:
        if not path:
            return
        options = {p.name: p for p in ctx.command.params
                   if p.param_type_name == "option" and p.name != CONFIG}
        defaults = {}
        for key, value in _read(path).items():
            where = f"{path}: {key}"
            if key not in options:
                raise ConfigError(f"{where}: not an option of `vrl {ctx.info_name}`"
                                  + _suggestion(key, options))
            defaults[key] = _typed(where, options[key], value)
            for cls in settings:  # every option of these commands is a setting of one
                if key in {f.name for f in fields(cls)}:
                    check(cls, key, defaults[key], where)
        ctx.default_map = {**(ctx.default_map or {}), **defaults}

    return typer.Option(
        None, "--config", metavar="FILE", is_eager=True, expose_value=False, callback=load,
        help="A TOML file of settings by name (max_staleness = 2); flags on the command line "
             "win.")
