"""`vrl volunteer` (its flags made from VolunteerConfig) and `vrl volunteers`: the denylist,
and each volunteer's credit."""

from __future__ import annotations

import time
from functools import partial
from typing import Annotated, Optional

import typer

from volunteer_rl.config import VolunteerConfig
from volunteer_rl_cli.config_file import config_option
from volunteer_rl_cli.errors import usage_errors
from volunteer_rl_cli.options import (
    ALLOW_UNSIGNED,
    BUCKET,
    DEVICE,
    ENDPOINT_URL,
    IGNORED_VOLUNTEER_SEED,
    TRUST_KEY,
    log,
    option,
)
from volunteer_rl_cli.starting import start_stoppable

app = typer.Typer()
V = partial(option, VolunteerConfig)  # V("nice"): the --nice option, from VolunteerConfig.nice


@app.command()
def volunteer(
    ctx: typer.Context,
    config: Optional[str] = config_option(VolunteerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    volunteer_id: Optional[str] = V("volunteer_id"),
    prompts_per_batch: int = V("prompts_per_batch"),
    shard_groups: int = V("shard_groups"),
    shard_seconds: float = V("shard_seconds"),
    max_groups_per_version: int = V("max_groups_per_version"),
    poll_seconds: float = V("poll_seconds"),
    max_seconds: float = V("max_seconds"),
    heartbeat_seconds: float = V("heartbeat_seconds"),
    log_shards: bool = V("log_shards"),
    seed: Optional[int] = IGNORED_VOLUNTEER_SEED,
    threads: int = V("threads"),
    nice: int = V("nice"),
    cpu_share: float = V("cpu_share"),
    pause_when_busy: float = V("pause_when_busy"),
    run_on_battery: bool = V("run_on_battery"),
    max_download_rate: str = V("max_download_rate"),
    max_upload_rate: str = V("max_upload_rate"),
    device: str = DEVICE,
    work_dir: str = V("work_dir"),
    trust_key: Optional[str] = TRUST_KEY,
    allow_unsigned: bool = ALLOW_UNSIGNED,
    log_level: str = V("log_level"),
    print_service: Optional[str] = typer.Option(
        None, "--print-service", metavar="systemd|launchd", rich_help_panel="Run and reports",
        help="Print a unit that runs this volunteer, with the flags given, at login and again "
             "after a crash (a systemd user service or a launchd agent), and exit."),
):
    """Donate compute: sample rollouts and upload them.

    The volunteer follows the bucket's manifest, samples K completions per prompt of the task
    the manifest names (it must be installed here: `vrl tasks`) and uploads them as shards,
    with a heartbeat in volunteers/ID.json. Ctrl-C or SIGTERM uploads the partial shard and
    exits 0.

    \b
    Example:
      vrl volunteer --bucket s3://my-bucket/run1 --trust-key ed25519:...
      vrl volunteer --bucket s3://my-bucket/run1 --print-service systemd
    """
    from volunteer_rl.stopping import Stopped
    from volunteer_rl.storage.uri import check_bucket

    params = {k: v for k, v in ctx.params.items() if k != "print_service"}
    with usage_errors():
        cfg = VolunteerConfig(**params)
    if print_service is not None:
        _print_service(ctx, print_service)
        return
    log.level = cfg.log_level
    check_bucket(cfg.bucket, cfg.endpoint_url, create=False)  # before seconds of imports

    def stopped_early(signum: int) -> str:
        return f"volunteer stopped by signal {signum} before it started"

    def build(stop):
        from volunteer_rl.volunteer.loop import Volunteer

        return Volunteer(cfg, log=log, stop=stop)

    try:
        v = start_stoppable(cfg.threads, stopped_early, build)  # cli/starting.py
    except Stopped as exc:
        log(stopped_early(exc.signum))
        return
    groups = v.run()
    log(f"volunteer {v.id} stopped after uploading {groups} groups")


def _print_service(ctx: typer.Context, kind: str) -> None:
    """The unit of `kind` on stdout (volunteer_rl.volunteer.service), for the flags this
    command was given on its command line or by environment variable (a --config file's
    settings come with --config itself)."""
    import os
    from pathlib import Path

    from volunteer_rl.volunteer.service import service

    try:  # a kind not in service.KINDS, or a folder no unit can name
        unit = service(kind, given_flags(ctx), Path(os.getcwd()), Path.home())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--print-service") from None
    print(unit, end="")


def given_flags(ctx: typer.Context) -> list[str]:
    """The flags of this command line as given (on it or by environment variable), in a form
    the same command parses back to the same settings; --print-service left out."""
    out: list[str] = []
    for param in ctx.command.params:
        name = param.name
        if name == "print_service" or not param.expose_value:
            continue
        source = ctx.get_parameter_source(name)  # by name: typer ships its own click
        if getattr(source, "name", None) not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        value, longest = ctx.params[name], max(param.opts, key=len)
        if getattr(param, "is_flag", False) and isinstance(value, bool):
            off = max(param.secondary_opts, key=len) if param.secondary_opts else None
            if value or off:
                out.append(longest if value else off)
        elif value is not None:
            out += [longest, str(value)]
    return out


denylist = typer.Typer(help="The denylist (denylist.json) and each volunteer's credit.",
                       no_args_is_help=True)
app.add_typer(denylist, name="volunteers")
VolunteerId = Annotated[str, typer.Argument(metavar="ID")]


@denylist.command("list")
def volunteers_list(config: Optional[str] = config_option(VolunteerConfig), bucket: str = BUCKET,
                    endpoint_url: Optional[str] = ENDPOINT_URL):
    """Print the denied volunteers, why and since when.

    Example: vrl volunteers list --bucket s3://my-bucket/run1
    """
    from volunteer_rl.protocol.fleet import read_denylist
    from volunteer_rl.storage import open_storage

    entries, _ = read_denylist(open_storage(bucket, endpoint_url, create=False))
    if not entries:
        print("no volunteer is denied")
    for vid, e in sorted(entries.items()):
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.get("since", 0)))
        print(f"{vid}\tdenied {since} UTC by {e.get('by', '?')}: {e.get('reason', '')}")


def _edit_denylist(bucket: str, endpoint_url: str | None, volunteer_id: str, deny: bool,
                   reason: str = "") -> bool:
    """Add or remove one id with a compare-and-swap; True if the list changed."""
    from volunteer_rl.protocol.fleet import update_denylist
    from volunteer_rl.protocol.layout import is_safe_name
    from volunteer_rl.storage import open_storage

    if not is_safe_name(volunteer_id):
        raise typer.BadParameter(f"{volunteer_id!r} is not a volunteer id", param_hint="ID")
    changed = []

    def change(entries: dict) -> bool:
        if deny and volunteer_id not in entries:
            entries[volunteer_id] = {"since": time.time(), "by": "operator", "reason": reason}
        elif not deny and volunteer_id in entries:
            del entries[volunteer_id]
        else:
            return False
        changed.append(True)
        return True

    update_denylist(open_storage(bucket, endpoint_url, create=False), change)
    return bool(changed)


@denylist.command("allow")
def volunteers_allow(volunteer_id: VolunteerId, config: Optional[str] = config_option(VolunteerConfig),
                     bucket: str = BUCKET, endpoint_url: Optional[str] = ENDPOINT_URL):
    """Lift a denial: the trainer reads this volunteer's shards again.

    Its counts of accepted and rejected shards start again from zero.

    Example: vrl volunteers allow laptop-3f2a --bucket s3://my-bucket/run1
    """
    changed = _edit_denylist(bucket, endpoint_url, volunteer_id, deny=False)
    print(f"{volunteer_id}: {'allowed again' if changed else 'was not denied'}")


@denylist.command("deny")
def volunteers_deny(
    volunteer_id: VolunteerId,
    config: Optional[str] = config_option(VolunteerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    reason: str = typer.Option("denied by an operator", help="Why, for the record."),
):
    """Deny a volunteer: the trainer skips its shards from now on.

    The trainer no longer lists its folders, until `vrl volunteers allow` lifts the denial.

    Example: vrl volunteers deny laptop-3f2a --bucket s3://my-bucket/run1 --reason "spam"
    """
    changed = _edit_denylist(bucket, endpoint_url, volunteer_id, deny=True, reason=reason)
    print(f"{volunteer_id}: {'denied' if changed else 'was already denied'}")


@denylist.command("credit")
def volunteers_credit(
    config: Optional[str] = config_option(VolunteerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    as_csv: bool = typer.Option(
        False, "--csv", help="Print CSV (volunteer, groups_trained, tokens_trained, share, "
                             "first_seen, last_seen) instead of a table."),
):
    """Each volunteer's groups and tokens trained, its share of the run.

    As of the version manifest.json names, from the trainer's own count (credit/vN.json,
    summed from its ledger), never from what volunteers say; most groups first. Times are
    when the trainer first and last trained a group of theirs (UTC); share is of the groups
    trained.

    \b
    Examples:
      vrl volunteers credit --bucket s3://my-bucket/run1
      vrl volunteers credit --bucket s3://my-bucket/run1 --csv > credit.csv
    """
    from volunteer_rl.observe.leaderboard import credit_csv, credit_table, leaderboard, load_credit, rows
    from volunteer_rl.observe.leaderboard import summary_line
    from volunteer_rl.observe.status import read_manifest_unverified
    from volunteer_rl.storage import open_storage

    storage = open_storage(bucket, endpoint_url, create=False)
    version = read_manifest_unverified(storage).version
    credit = load_credit(storage, version)
    if as_csv:
        print(credit_csv(credit), end="")
        return
    from rich.console import Console

    console = Console()
    doc = leaderboard(credit, version, top=len(rows(credit)))
    console.print(summary_line(doc), markup=False, highlight=False)
    if doc["leaders"]:
        console.print(credit_table(doc["leaders"], time.time()))
