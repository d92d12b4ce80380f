"""A volunteer as a login service (`vrl volunteer --print-service systemd|launchd`): the systemd
user unit or launchd agent that starts `vrl volunteer` with the flags it was given, at login,
and again after it crashes.

The service runs the same Python and the same CLI module as the command that printed it, from
the same working folder, so relative paths in the flags (a --config file, a --trust-key file)
mean what they meant. A restarted volunteer keeps its id, numbering and caches because they
live in its work dir, which is the same folder either way (the per-user default, or --work-dir).
Bucket credentials are never written into the unit: systemd reads an optional environment
file (CREDENTIALS_FILE, mode 600), and both read ~/.aws/credentials the way boto3 does anyway.

Restarts: after a non-zero exit only, RESTART_SECONDS apart; not after USAGE_EXIT (a flag the
command refuses, which no restart can fix) and not after a clean exit (Ctrl-C, SIGTERM,
--max-seconds).
"""

from __future__ import annotations

import plistlib
from pathlib import Path

from volunteer_rl.launch import vrl_command

KINDS = ("systemd", "launchd")
"""What --print-service can print."""

NAME = "vrl-volunteer"
"""The systemd unit's name (vrl-volunteer.service) and the launchd agent's log file name."""
LABEL = "org.volunteer-rl.volunteer"
"""The launchd agent's label (its plist: ~/Library/LaunchAgents/LABEL.plist)."""
RESTART_SECONDS = 30
USAGE_EXIT = 2
"""The exit status of a command line the CLI refuses (typer's usage error)."""
CREDENTIALS_FILE = "%h/.config/vrl/volunteer.env"
"""systemd's optional EnvironmentFile for credentials (%h: the user's home)."""


def service_command(args: list[str]) -> list[str]:
    """The volunteer's command as a service runs it: this Python running the CLI module with
    `args` (the volunteer's flags)."""
    return vrl_command("volunteer", *args)


def _systemd_quoted(arg: str) -> str:
    """One ExecStart word: double-quoted, with systemd's own escapes (backslash, quote, newline;
    % starts a specifier and $ a variable, so both are doubled)."""
    escaped = (arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
               .replace("%", "%%").replace("$", "$$"))
    return f'"{escaped}"'


def _systemd_path(path: Path) -> str:
    """A path setting's value: written as it is (systemd takes no quotes there), % doubled. A
    line break cannot be written in a unit at all."""
    text = str(path)
    if "\n" in text or "\r" in text:
        raise ValueError(f"{text!r}: a folder with a line break in its name cannot go in a unit")
    return text.replace("%", "%%")


def systemd_unit(command: list[str], cwd: Path) -> str:
    """A systemd user unit running `command` in `cwd` (install: docs, README)."""
    return "\n".join([
        "# vrl volunteer as a systemd user service. Install:",
        f"#   vrl volunteer ... --print-service systemd > ~/.config/systemd/user/{NAME}.service",
        f"#   systemctl --user daemon-reload && systemctl --user enable --now {NAME}",
        "#   loginctl enable-linger $USER   # optional: also run while you are logged out",
        f"# Credentials: ~/.aws/credentials, or {CREDENTIALS_FILE.replace('%h', '~')} (mode 600)",
        "[Unit]",
        "Description=volunteer_rl volunteer (vrl volunteer)",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=exec",
        f"WorkingDirectory={_systemd_path(cwd)}",
        f"EnvironmentFile=-{CREDENTIALS_FILE}",
        "ExecStart=" + " ".join(_systemd_quoted(a) for a in command),
        "Restart=on-failure",
        f"RestartSec={RESTART_SECONDS}",
        f"RestartPreventExitStatus={USAGE_EXIT}",
        "KillSignal=SIGTERM",
        "TimeoutStopSec=60",  # a stop uploads the partial shard first
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ])


def launchd_plist(command: list[str], cwd: Path, home: Path) -> str:
    """A launchd agent running `command` in `cwd` at login, again after a non-zero exit, its
    output in ~/Library/Logs/NAME.log."""
    log = str(home / "Library" / "Logs" / f"{NAME}.log")
    return plistlib.dumps({
        "Label": LABEL,
        "ProgramArguments": command,
        "WorkingDirectory": str(cwd),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_SECONDS,
        "ProcessType": "Background",
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }).decode()


def service(kind: str, args: list[str], cwd: Path, home: Path) -> str:
    """The unit of `kind` (KINDS) for a volunteer given `args`."""
    command = service_command(args)
    if kind == "systemd":
        return systemd_unit(command, cwd)
    if kind == "launchd":
        return launchd_plist(command, cwd, home)
    raise ValueError(f"{kind!r} is not one of {', '.join(KINDS)}")
