"""Group numbers, as the trainer grants them (protocol.grants): ask for blocks, read the grants,
and hand out the next numbers to sample, each with the version it is bound to and its nonce.

A volunteer numbers nothing itself. It asks for the blocks after the last one it knows was
granted, for the newest version it has seen, with an empty object the trainer lists
(`ask`); the trainer's grant object (`refresh`) says which blocks it got, for which version,
with the nonce that keys each block's prompt and noise. A volunteer at the manifest's quota
asks ahead, for the version after the newest: the trainer answers that ask at its first poll
after publishing that version, with no round trip once the volunteer sees the new manifest.
Numbers are sampled in order, each with its grant's version: the loop loads that version
first (volunteer.loop).

<work_dir>/<id>/group-numbers.json keeps the first number not yet sampled, written after each
batch, so a restarted volunteer goes on where it stopped: a batch cut short by a crash is
sampled again with the same draws. A volunteer that lost the file goes on after the last
grant its grant object lists: the grants it had not sampled count as missing, once.

What an honest volunteer misses is what was in flight when its version left the window, and
what a crash or a second signal cut short: a stop finishes the batches granted (volunteer.loop).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from volunteer_rl.protocol import grants as g
from volunteer_rl.protocol.printable import printable
from volunteer_rl.protocol.signing import SignatureError, Trust
from volunteer_rl.storage.base import AlreadyExists, Storage, StorageError, is_missing

ASK_AGAIN_SECONDS = 20.0
"""An ask not answered for this long is made again (for the newest version then): the
trainer may have been restarting, or the version asked for left the window first."""


@dataclass(frozen=True)
class Batch:
    """Numbers first .. first + count - 1, all of `grant` (so of one version)."""

    grant: g.Grant
    first: int
    count: int

    @property
    def version(self) -> int:
        return self.grant.version

    def nonce(self, seq: int) -> str:
        return self.grant.nonce(seq)


class GroupNumbers:
    """One volunteer's grants in one run, and how far it sampled them."""

    def __init__(self, path: Path, storage: Storage, volunteer_id: str, trust: Trust,
                 log: Callable[[str], None] = print):
        self.path = path
        self.storage = storage
        self.id = volunteer_id
        self.trust = trust
        self.log = log
        self.run_id: str | None = None
        self.next: int | None = None
        """The first number not sampled yet (None: not known for this run yet)."""
        self.grants: list[g.Grant] = []
        self.etag: str | None = None
        self.asked: tuple[int, float, int] | None = None
        """(first block, when, version) of the last ask not answered yet."""
        self.started: str | None = None
        """The run whose grants were read since this process started (start_run)."""
        saved = self._load()
        if saved is not None:
            self.run_id, self.next = saved

    def _load(self) -> tuple[str, int] | None:
        try:
            raw = json.loads(self.path.read_text())
            return str(raw["run_id"]), max(0, int(raw["next"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none saved, or unreadable

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "next": self.next}))
        os.replace(tmp, self.path)

    def start_run(self, run_id: str) -> None:
        """Follow `run_id` (a new run, or the first manifest read): its grants are read, and
        where to go on is decided once they are."""
        if run_id == self.started:
            return
        if run_id != self.run_id:
            self.run_id, self.next, self.grants, self.etag, self.asked = run_id, None, [], None, None
        if not self.refresh():
            return  # tried again at the next call
        self.started = run_id
        if self.next is None:
            # No number of this run saved here: after the last grant it lists (0 if none).
            self.next = self.grants[-1].end if self.grants else 0
            if self.grants:
                self.log(f"no group number of {run_id} saved here; going on after number "
                         f"{self.next - 1}, the last granted to this id")
            self._save()

    def refresh(self) -> bool:
        """Read the grant object if it changed; False if it could not be read (said once)."""
        where = g.grants_key(self.id)
        try:
            data, etag = self.storage.read_if_changed(where, self.etag, max_bytes=g.MAX_GRANTS_BYTES)
        except StorageError as exc:
            if is_missing(exc):
                return True  # nothing granted yet
            self.log(f"warning: {exc}")
            return False
        if data is None:
            return True
        try:
            obj, grants = g.decode_grants(data, where)
            self.trust.check(obj, where)
            if obj.get("run_id") != self.run_id or obj.get("volunteer_id") != self.id:
                return True  # another run's (the trainer has not granted in this one yet)
        except (g.GrantError, SignatureError) as exc:
            self.log(f"warning: {printable(str(exc))}; waiting for a valid one")
            return False
        self.etag = etag
        known = {x.first_block for x in self.grants}
        self.grants = sorted({x.first_block: x for x in [*self.grants, *grants]}.values(),
                             key=lambda x: x.first_block)[-4 * g.GRANTS_KEPT:]
        if self.asked is not None and any(x.first_block not in known for x in grants):
            self.asked = None
        return True

    def pending(self) -> int:
        """Numbers granted and not sampled yet."""
        at = self.next or 0
        return sum(max(0, x.end - max(x.first, at)) for x in self.grants)

    def oldest_owed(self) -> int | None:
        """The oldest version with numbers granted and not sampled yet (None: none)."""
        at = self.next or 0
        owed = [x.version for x in self.grants if x.end > at]
        return min(owed) if owed else None

    def batch(self, most: int) -> Batch | None:
        """The next numbers to sample (at most `most`, all of one grant, ending at the end of a
        block of numbers where `most` reaches one: the trainer counts a missing number with
        its block, so a crash between batches loses whole blocks); None if none is granted."""
        at = self.next
        if at is None:
            return None
        for x in self.grants:
            if x.end > at:
                first = max(at, x.first)
                count = min(most, x.end - first)
                if count < x.end - first and (first + count) % g.GRANT_BLOCK < count:
                    count -= (first + count) % g.GRANT_BLOCK  # end at a block's end
                return Batch(x, first, count)
        return None

    def sampled(self, batch: Batch) -> None:
        """`batch` was sampled (or will never be): go on after it."""
        self.next = batch.first + batch.count
        self._save()

    def skip(self, batch: Batch) -> None:
        """Leave the rest of `batch`'s grant unsampled (its version left the window)."""
        self.next = batch.grant.end
        self._save()

    def awaited(self, now: float | None = None, version: int | None = None) -> bool:
        """Is an ask made less than ASK_AGAIN_SECONDS ago unanswered? With `version`: an ask
        for `version` or an older one (an ask ahead, for a version not published yet, does
        not hold back an ask for the version in hand)."""
        now = time.time() if now is None else now
        if self.asked is None or now - self.asked[1] >= ASK_AGAIN_SECONDS:
            return False
        return version is None or self.asked[2] <= version

    def asked_ahead(self, version: int, now: float | None = None) -> bool:
        """Is an ask for a version after `version` unanswered (made less than
        ASK_AGAIN_SECONDS ago)?"""
        return self.awaited(now) and self.asked[2] > version

    def ask(self, version: int, numbers: int, now: float | None = None) -> None:
        """Ask for about `numbers` numbers to sample with `version`, unless an ask for it (or an
        older one) made less than ASK_AGAIN_SECONDS ago is unanswered. `version` may be the
        one after the newest published: the trainer holds that ask until it publishes it."""
        now = time.time() if now is None else now
        if self.awaited(now, version):
            return
        top = max([self.next or 0] + [x.end for x in self.grants])
        first_block = -(-top // g.GRANT_BLOCK)
        blocks = max(1, min(g.MAX_GRANT_BLOCKS, -(-numbers // g.GRANT_BLOCK)))
        try:
            self.storage.create(g.ask_key(version, self.id, first_block, blocks), b"")
        except AlreadyExists:
            pass  # asked so before: the trainer answers it once
        except StorageError as exc:
            self.log(f"warning: {exc}")
            return
        self.asked = (first_block, now, version)
