"""The trainer's side of grants (protocol.grants): answer each volunteer's asks for group
numbers with blocks no one was granted before, bound to the newest version published when
it answers (whatever version the ask named: a grant sampled a poll later is then as fresh as
it can be, and the volunteer has no say in which version its numbers go with).

Each poll hands the ask keys it listed to `Granter.answer`. Per volunteer it grants at most
once a poll (what one id can cost a poll: one GET of its grant object the first time, one
signature and one PUT), the next blocks after the last one it granted, never one twice:
where that was is read back from the volunteer's grant object (the trainer's own, signed by
its key) the first time after a start, and never below the numbers already received from it
(trainer.withheld), so neither a restart nor a lost object grants a block again. An ask is
refused, silently and once, when its version is not a published one of the window; one for
the version after the newest (a volunteer at its quota asks ahead) is held, unanswered, until
that version is published, and granted at the first poll after it: no round trip once the
volunteer sees the new manifest. (Ingest.poll lists only the window's folders, so such an
ask is first seen then anyway; the hold keeps this class right whoever lists.) Nothing
here is charged to the volunteer: an ask costs it a round trip, and one it should not have
made wins it nothing.
"""

from __future__ import annotations

from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from volunteer_rl.protocol import grants as g
from volunteer_rl.protocol.printable import printable
from volunteer_rl.protocol.signing import SignatureError, Trust, public_key_text, sign
from volunteer_rl.storage.base import Storage, StorageError, is_missing
from volunteer_rl.trainer.groups import Window
from volunteer_rl.trainer.withheld import GroupNumbers


class Granter:
    """Grants blocks of group numbers to this process's (or rank's) volunteers."""

    def __init__(self, storage: Storage, run_id: str, key: Ed25519PrivateKey, numbers: GroupNumbers,
                 log: Callable[[str], None]):
        self.storage = storage
        self.run_id = run_id
        self.key = key
        self.secret = g.grant_secret(key)
        self.trust = Trust(public_key_text(key), origin="this trainer's key")
        self.numbers = numbers
        self.log = log
        self.next_block: dict[str, int] = {}
        """Volunteer -> the first block not granted yet (known once read back or granted)."""
        self.recent: dict[str, list[g.Grant]] = {}
        """Volunteer -> its last grants, what its grant object lists."""
        self.answered: set[str] = set()
        """Ask keys granted or refused: never answered twice in this process."""
        self.granted = 0
        """Grants written by this process (its log line's count)."""

    def answer(self, asks: list[str], win: Window) -> None:
        """Grant what the poll's `asks` ask for: per volunteer, its first unanswered ask (by
        block, then version) that it may have, the next blocks whatever block it asked for:
        an ask whose block was granted since is answered by that grant."""
        pending: dict[str, list[tuple[str, int, int]]] = {}
        for key in asks:
            parsed = g.parse_ask_key(key)
            if parsed is None or key in self.answered:
                continue
            version, volunteer, first_block, blocks = parsed
            pending.setdefault(volunteer, []).append((key, version, first_block, blocks))
        for volunteer, items in pending.items():
            for key, version, first_block, blocks in sorted(items, key=lambda a: (a[2], a[1])):
                done = self._answer(volunteer, key, version, first_block, blocks, win)
                if done == "granted":
                    break  # one grant a poll; the rest wait

    def _answer(self, volunteer: str, key: str, version: int, first_block: int, blocks: int,
                win: Window) -> str:
        """Answer one ask: "granted", "refused" (answered, nothing granted) or "later" (an ask
        ahead, for the version not published yet; or the grant object could not be read or
        written now: asked again next poll)."""
        if version == win.version + 1:
            return "later"
        if version < win.low or version > win.version or version not in win.published:
            self.answered.add(key)
            return "refused"
        start = self._next_block(volunteer)
        if start is None:
            return "later"
        if any(x.first_block <= first_block < x.first_block + x.blocks
               for x in self.recent.get(volunteer, [])):
            self.answered.add(key)  # granted since it was asked (a second ask of one batch)
            return "refused"
        grant = g.make_grant(self.secret, self.run_id, volunteer, start,
                             min(blocks, g.MAX_GRANT_BLOCKS), win.version)
        recent = [*self.recent.get(volunteer, []), grant][-g.GRANTS_KEPT:]
        body = sign(g.encode_grants(self.run_id, volunteer, recent), self.key)
        try:
            self.storage.write(g.grants_key(volunteer), g.grants_bytes(body))
        except StorageError as exc:
            self.log(f"warning: could not write {g.grants_key(volunteer)}: {exc}")
            return "later"
        self.answered.add(key)
        self.recent[volunteer] = recent
        self.next_block[volunteer] = grant.first_block + grant.blocks
        self.numbers.grant(volunteer, grant.first, grant.end, win.version)
        self.granted += 1
        return "granted"

    def _next_block(self, volunteer: str) -> int | None:
        """The first block `volunteer` may be granted; read back from its grant object the
        first time (None: it could not be read now)."""
        known = self.next_block.get(volunteer)
        if known is None:
            where = g.grants_key(volunteer)
            try:
                data = self.storage.read(where, max_bytes=g.MAX_GRANTS_BYTES)
            except StorageError as exc:
                if not is_missing(exc):
                    self.log(f"warning: {exc}")
                    return None
                data = None
            grants: list[g.Grant] = []
            if data is not None:
                try:
                    obj, grants = g.decode_grants(data, where)
                    self.trust.check(obj, where)
                    if obj.get("run_id") != self.run_id or obj.get("volunteer_id") != volunteer:
                        grants = []  # another run's: its numbers start again at 0
                except (g.GrantError, SignatureError) as exc:
                    # Not what this trainer wrote: what it granted before cannot be known from
                    # it, so go on above everything received (below) and say so.
                    self.log(f"warning: {printable(str(exc))}; granting {volunteer} above the "
                             "numbers received from it")
                    grants = []
            known = grants[-1].first_block + grants[-1].blocks if grants else 0
            self.recent[volunteer] = grants
        # never below a number received: a lost or replaced object must not grant one again
        floor = -(-self.numbers.granted_end(volunteer) // g.GRANT_BLOCK)
        known = max(known, floor)
        self.next_block[volunteer] = known
        return known

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop answered ask keys of versions that left the window."""
        self.answered = {k for k in self.answered if keep(k)}
