"""A volunteer's id: made once, kept in its work dir, so a restarted volunteer comes back as
the same volunteer (its heartbeat row in `vrl status`, its group numbers, its trust earned
with the trainer's audit) instead of leaving an offline ghost row behind.

Without --id a volunteer takes the first id listed in <work_dir>/volunteer-ids that no running
volunteer holds, or makes a new one (the sanitized hostname plus a random suffix) and adds
it there. A running volunteer holds its id by a lock on <work_dir>/<id>/running.lock, so two
volunteers sharing a work dir get two ids, and come back as the same two after a restart.

An explicit --id always wins: it is used as given, takes no lock and is not added to
volunteer-ids, so a later run without --id is again the volunteer saved there (the log says
so when the two differ). Running two volunteers with one id stays the operator's choice, as
before (they share group numbers, and the trainer refuses numbers used twice); so does an
--id that names an id saved for runs without one.

The locks are POSIX advisory locks (fcntl); where there is none (Windows) the first saved id
is taken whether or not another volunteer holds it.
"""

from __future__ import annotations

import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable

from volunteer_rl.errors import ConfigError
from volunteer_rl.protocol import layout

IDS_FILE = "volunteer-ids"
LOCK_FILE = "running.lock"


def default_volunteer_id() -> str:
    """Sanitized hostname plus a random suffix, so two processes on one host never collide."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40].strip("-.") or "volunteer"
    return f"{host}-{uuid.uuid4().hex[:6]}"


def _lock(f: IO, blocking: bool) -> bool:
    try:
        import fcntl
    except ImportError:  # no advisory locks here: see the module docstring
        return True
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


@dataclass
class Claim:
    id: str
    lock: IO | None
    """Open for as long as the volunteer runs: closing it (or the process ending) frees the id."""

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()
            self.lock = None


def _hold(work_dir: Path, vid: str) -> IO | None:
    """The lock of `vid` in `work_dir`, held; None if another running volunteer holds it."""
    folder = work_dir / vid
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / LOCK_FILE, "a")
    if _lock(f, blocking=False):
        return f
    f.close()
    return None


def saved_ids(work_dir: Path) -> list[str]:
    """The ids made in `work_dir` so far, oldest first (lines that are no id are skipped)."""
    try:
        lines = (work_dir / IDS_FILE).read_text().split()
    except OSError:
        return []
    return [line for line in lines if layout.is_safe_name(line)]


def claim_id(work_dir: Path, explicit: str | None, log: Callable[[str], None]) -> Claim:
    """The id this volunteer runs as, held until `Claim.release` or the process ends."""
    if explicit is not None:
        if not layout.is_safe_name(explicit):
            raise ConfigError(f"--id {explicit!r}: use 1-64 of A-Z a-z 0-9 _ . - "
                              "(not starting with . or -)")
        saved = saved_ids(work_dir)
        if saved and explicit not in saved:
            log(f"--id {explicit} given: running as it; {work_dir / IDS_FILE} keeps "
                f"{', '.join(saved)} for runs without --id")
        return Claim(explicit, None)
    work_dir.mkdir(parents=True, exist_ok=True)
    with open(work_dir / IDS_FILE, "a+") as ids:
        _lock(ids, blocking=True)  # one volunteer at a time picks or adds an id (freed on close)
        for vid in saved_ids(work_dir):
            lock = _hold(work_dir, vid)
            if lock is not None:
                return Claim(vid, lock)
        vid = default_volunteer_id()
        lock = _hold(work_dir, vid)
        ids.write(vid + "\n")
        ids.flush()
    log(f"new volunteer id {vid}, saved in {work_dir / IDS_FILE} for the next start")
    return Claim(vid, lock)
