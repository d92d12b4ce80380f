"""Group numbers from a live trainer, the way a volunteer gets them (volunteer.numbering): an
ask in the bucket, then the trainer's grant object. For tests that write shards by hand."""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from helpers.vrlproc import wait_for

from volunteer_rl.protocol.signing import Trust
from volunteer_rl.volunteer.numbering import GroupNumbers


class NoGrant(Exception):
    """Numbers.take gave up waiting for a grant."""


class Numbers:
    """A hand-made volunteer's numbers: `take(n)` asks the live trainer of `storage` for `n`
    numbers under `version` and returns (number, nonce) for each once they are granted."""

    def __init__(self, storage, volunteer: str, run_id: str, folder: Path | None = None):
        folder = folder or Path(tempfile.mkdtemp(prefix="numbers-"))
        self.book = GroupNumbers(folder / volunteer / "group-numbers.json", storage, volunteer,
                                 Trust(allow_unsigned=True), log=lambda m: None)
        self.book.start_run(run_id)

    def take(self, n: int, version: int, timeout: float = 300,
             give_up: Callable[[], bool] = lambda: False) -> list[tuple[int, str]]:
        """...; raises NoGrant if `give_up()` turns true first (the trainer exited)."""
        out: list[tuple[int, str]] = []
        while len(out) < n:
            batch = self.book.batch(n - len(out))
            if batch is None or batch.version != version:
                if batch is not None:  # granted for another version: left unsampled
                    self.book.skip(batch)
                    continue
                self.book.asked = None
                self.book.ask(version, n - len(out))
                wait_for(lambda: give_up() or (self.book.refresh() and self.book.batch(n - len(out)) is not None),
                         timeout, f"a grant of numbers under v{version}")
                if give_up():
                    raise NoGrant(f"no grant under v{version}")
                continue
            out += [(s, batch.nonce(s)) for s in range(batch.first, batch.first + batch.count)]
            self.book.sampled(batch)
        return out


def deal(bucket: Path, key_path: Path, run_id: str, volunteer: str, version: int,
         work_dir: Path | None, blocks: int = 64, first_block: int = 0) -> None:
    """Write `volunteer`'s grant object as the trainer of `key_path` would have: `blocks`
    blocks from block `first_block`, bound to `version`; and, in the volunteer's `work_dir`,
    its saved place (volunteer.numbering) at the grant's first number, as a volunteer that
    asked for them has it (one with no saved place goes on after the last grant). None: the
    volunteer runs already and knows its place (it takes a grant above it). For tests of a
    volunteer with no trainer running."""
    from volunteer_rl.protocol import grants
    from volunteer_rl.protocol.signing import parse_private_key, sign
    from volunteer_rl.storage import open_storage

    key = parse_private_key(Path(key_path).read_bytes(), str(key_path))
    grant = grants.make_grant(grants.grant_secret(key), run_id, volunteer, first_block, blocks, version)
    body = sign(grants.encode_grants(run_id, volunteer, [grant]), key)
    open_storage(str(bucket)).write(grants.grants_key(volunteer), grants.grants_bytes(body))
    if work_dir is not None:
        place = Path(work_dir) / volunteer / "group-numbers.json"
        place.parent.mkdir(parents=True, exist_ok=True)
        place.write_text(json.dumps({"run_id": run_id, "next": first_block * grants.GRANT_BLOCK}))


def wait_for_ask(bucket: Path, volunteer: str, version: int | None = None,
                 timeout: float = 240) -> None:
    """Wait until `volunteer` has asked for numbers (an ask object under `version`, or under
    any version): it has read its grant object then and knows its place, so a grant `deal`
    writes next is one it takes."""
    from volunteer_rl.protocol import layout

    folder = "v*" if version is None else layout.version_dir(version)
    asks = Path(bucket) / layout.ROLLOUTS
    wait_for(lambda: list(asks.glob(f"{folder}/{volunteer}/ask-*")), timeout,
             f"{volunteer}'s ask for numbers")


def assert_none_missing(bucket: Path, volunteers: set[str]) -> None:
    """fleet.json lists exactly `volunteers`, each with numbers closed (granted under versions
    that left the window), none of them missing, no shard rejected and nothing held back:
    what issue 41 (point 7) asks of honest volunteers in every mode."""
    from volunteer_rl.protocol import layout

    fleet = json.loads((Path(bucket) / layout.FLEET).read_text())["volunteers"]
    assert set(fleet) == volunteers, fleet
    for row in fleet.values():
        assert row["groups_numbered"] > 0 and row["groups_missing"] == 0, fleet
        assert row["rejected_shards"] == 0 and not row["held_back"], fleet
