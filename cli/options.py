"""Command-line options made from the settings dataclasses, and the options several commands
share.

`option(cls, name)` is the typer option of the field `name` of the dataclass `cls`: its flag is
config.flag(name), its default the field's default, its help the first sentence of the
docstring under the field, its range the field's bounds (config.setting). So a setting's
default, meaning and limits are written once, in volunteer_rl/config.py. Reading the
docstrings parses config.py with ast (a few milliseconds); nothing heavy is imported here.
Each option also goes into the help panel PANELS names for its setting, the same on every
command. A command's own help is its docstring, made into paragraphs by command_help (main.py
applies it to every command), and no flag's help shows a type (_flags_show_no_type).
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from dataclasses import MISSING, fields
from functools import cache

import typer
from typer.models import OptionInfo

from volunteer_rl.config import TrainerConfig, VolunteerConfig, flag, range_text, why_not
from volunteer_rl.progress import LOG

# Short flags and environment variables, by setting name, on every command that has them.
_SHORT = {"bucket": "-b", "k": "-k"}
_ENVVARS = {"endpoint_url": "VRL_ENDPOINT_URL", "trust_key": "VRL_TRUST_KEY"}

# The help panel of each setting, on every command that has it (`vrl trainer --help` groups
# its ~40 options by these). A setting in no panel is listed under typer's "Options".
PANELS = {
    "Storage": ("bucket", "endpoint_url", "work_dir"),
    "Model": ("model", "weights_dtype", "warm_start_steps", "warm_start_max_passes", "seed"),
    "LoRA": ("lora_rank", "lora_alpha", "lora_targets"),
    "Machine": ("device", "threads", "warm_start_threads", "nice", "rank_timeout", "cpu_share",
                "pause_when_busy", "run_on_battery", "max_download_rate", "max_upload_rate"),
    "Data": ("task", "dataset", "eval_dataset", "curriculum", "prompt_pool"),
    "RL": ("algo", "lr", "k", "temperature", "max_new_tokens", "max_staleness",
           "groups_per_step", "micro_batch", "gradient_checkpointing"),
    "Publishing": ("publish_every", "publish_min_seconds", "quota_headroom", "keyframe_every",
                   "patch_max_fraction", "keep_versions", "gc_every"),
    "Audits and denylist": ("audit_tolerance", "replay_tolerance", "audit_share",
                            "audit_full_groups", "audit_floor", "audit_cover_floor", "verify",
                            "deny_after", "deny_rate", "missing_bound"),
    "Reward time": ("shard_reward_seconds", "poll_reward_seconds", "reward_share"),
    "Trust": ("signing_key", "trust_key", "allow_unsigned"),
    "Volunteering": ("volunteer_id", "prompts_per_batch", "shard_groups", "shard_seconds",
                     "max_groups_per_version"),
    "Demo": ("volunteers", "rl_seconds", "groups_per_version"),
    "Run and reports": ("max_steps", "max_seconds", "poll_seconds", "eval_every",
                        "eval_samples", "dashboard_every", "heartbeat_seconds", "log_shards",
                        "log_level", "report_to", "logging_dir"),
}
_PANEL = {name: panel for panel, names in PANELS.items() for name in names}


def _trust_key_given(value: str | None) -> str | None:
    """`--trust-key ""` would mean no key, so the first key seen would be trusted: refused."""
    if value is not None and not value.strip():
        raise typer.BadParameter("is empty: give the trainer's public key (ed25519:... or a "
                                 "file holding it), or leave the flag out")
    return value


_CALLBACKS = {"trust_key": _trust_key_given}


@cache
def _module_docs(module: str) -> dict[str, dict[str, str]]:
    """{class name: {field: docstring}} of every class in `module`: the string literal right
    after an annotated field (PEP 257's attribute docstrings)."""
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    docs: dict[str, dict[str, str]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        docs[cls.name] = {
            field.target.id: inspect.cleandoc(doc.value.value)
            for field, doc in zip(cls.body, cls.body[1:])
            if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)}
    return docs


def field_doc(cls: type, name: str) -> str:
    """The docstring under the field `name` of the dataclass `cls`."""
    return _module_docs(cls.__module__)[cls.__name__][name]


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends the text or precedes a space, on one line: the
    help of an option."""
    text = " ".join(text.split())
    match = re.match(r".+?\.(?=\s|$)", text)
    return match.group(0) if match else text


def command_help(doc: str) -> tuple[str, str]:
    """(help, short help) of a command from its docstring, which opens with a one-line
    summary, then a blank line, then paragraphs. The short help (the line `vrl --help` lists)
    is the summary. In the help, each paragraph is one line that the terminal's width wraps:
    typer's rich help would print a docstring's line breaks as they are, cutting sentences at
    the source's 100 columns. A paragraph that opens with a line holding only `\\b` (click's
    mark for text not to rewrap, such as examples) keeps its lines, without the mark."""
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        lines = paragraph.splitlines()
        paragraphs.append("\n".join(lines[1:]) if lines[0].strip() == "\b"
                          else " ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs), paragraphs[0]


def _flags_show_no_type() -> None:
    """A flag takes no value, so its help shows no type. typer's rich help (0.2x) shows a
    flag's as `<bool>` (`--help <bool>`), unless the option has a metavar, which click's own
    --help cannot be given: so every flag's type, --help's included, is left out here, as
    click's plain help does. Typer versions without this method (older ones) show none."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "no_type_on_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag or self.count else shown(self, ctx)

    display_type_rich.no_type_on_flags = True
    TyperOption.display_type_rich = display_type_rich


_flags_show_no_type()


_METAVARS = {"int": "INT", "float": "FLOAT", "str": "TEXT"}


def _setting_check(cls: type, name: str):
    """The option's callback: the setting's rules (config.setting) refuse a value as a bad
    command line, in config.py's words; `setting` names what it checks (for the tests)."""
    extra = _CALLBACKS.get(name)

    def callback(value):
        why = why_not(cls, name, value)
        if why:
            raise typer.BadParameter(why)
        return extra(value) if extra else value

    callback.setting = (cls, name)
    return callback


def option(cls: type, name: str, *, flags: tuple[str, ...] = (), help: str | None = None
           ) -> OptionInfo:
    """The typer option of the field `name` of the dataclass `cls` (see the module docstring).
    `flags` replaces the flag for a command that spells it otherwise; `help` replaces the help
    where the command gives the setting another meaning. Its values are checked by the
    setting's rules and its metavar shows them (`INT [x>=1]`, `FLOAT [0<x<=1]`), so typer
    gets no min/max of its own."""
    field = next(f for f in fields(cls) if f.name == name)
    default = ... if field.default is MISSING else field.default
    long = flags[0] if flags else flag(name)
    decls = [*flags] or [long, *([_SHORT[name]] if name in _SHORT else [])]
    if default is True:  # a setting that is on by default can be turned off
        decls = [f"{long}/--no-{long[2:]}", *decls[1:]]
    kind = _METAVARS.get(str(field.type).split("|")[0].strip())  # None: a bool flag
    allowed = range_text(cls, name)
    metavar = (kind if not allowed else allowed if kind == "TEXT"  # grpo|reinforce
               else f"{kind} [{allowed}]") if kind else None
    return typer.Option(default, *decls, help=help or first_sentence(field_doc(cls, name)),
                        envvar=_ENVVARS.get(name), metavar=metavar,
                        callback=_setting_check(cls, name), rich_help_panel=_PANEL.get(name))


# How every command logs (the `log` the library takes): progress.Log, stdout, flushed at
# once; its level is --log-level's, a trainer rank's lines carry the rank.
log = LOG


# Options with the same flag, default and help on every command that has them.
BUCKET = option(TrainerConfig, "bucket")
ENDPOINT_URL = option(TrainerConfig, "endpoint_url")
DEVICE = option(TrainerConfig, "device")
SIGNING_KEY = option(TrainerConfig, "signing_key")
TRAINER_WORK_DIR = option(TrainerConfig, "work_dir")
KEEP_VERSIONS = option(TrainerConfig, "keep_versions")
# A reader of the bucket (volunteer, eval) and the key it trusts; gc trusts otherwise.
TRUST_KEY = option(VolunteerConfig, "trust_key")
ALLOW_UNSIGNED = option(VolunteerConfig, "allow_unsigned")
# `vrl volunteer --seed N` is accepted and ignored, and not shown in its help, so command lines
# written for builds before schema 6 still run: since then a volunteer makes no random choice
# (the manifest's pool gives each group number its prompt, and the sampling noise is
# committed), so no setting holds it.
IGNORED_VOLUNTEER_SEED = typer.Option(
    None, "--seed", min=0, hidden=True, expose_value=False,
    help="Ignored: a volunteer makes no random choice (accepted for older command lines).")
