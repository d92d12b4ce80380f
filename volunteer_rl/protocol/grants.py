"""Grants: which version each block of a volunteer's group numbers is sampled with, and the
nonce that keys its draws, dealt out by the trainer after the volunteer asked for it.

Without them a volunteer could sample one group number under every version of the window
(each gives a different prompt and noise) and upload the outcome it likes: nothing would be
missing. So numbers are bound to versions by the trainer, and the draw of a number is unknown
until it is bound:

1. The volunteer asks: an empty object `rollouts/<version>/<id>/ask-<first block>-<blocks>`
   (ask_key), in the folder of the newest version it has read (at its quota, of the next
   one, not published yet: an ask ahead). The trainer lists it with the shards of the window.
2. The trainer grants the next `blocks` blocks of GRANT_BLOCK numbers that it has not granted
   this id before (never the same block twice), bound to the newest version it published
   (an ask ahead is answered once its version is published), by writing
   `grants/<id>.json` (GrantBook, signed like a manifest): the id's last GRANTS_KEPT grants,
   each with the nonce of every block it grants.
3. The volunteer samples each number of a granted block with that version's weights, its
   prompt and noise keyed by the block's nonce (protocol.draws), and uploads it as today.

A block's nonce is an HMAC of (run id, id, version, block) under the trainer's secret
(`grant_secret`, derived from its signing key): the trainer recomputes it from what a group
says (its volunteer, version and number) and needs no record of its grants to check one. A
volunteer knows the nonce of a block only for the one version it was granted under, so a
number sampled under another version, or never granted, draws a prompt the trainer does not
(`prompt_mismatch`) and tokens its replay refuses. A number granted and not uploaded is
missing (trainer.withheld), the tail of a grant included once its version left the window.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from volunteer_rl.protocol import jsonbounds, layout

GRANT_BLOCK = 8
"""Group numbers per block: number n is in block n // GRANT_BLOCK. Small, so that a
volunteer's batch is a whole number of blocks and a stop or a crash leaves at most a batch
of granted numbers unsampled; large enough that grants stay a few per batch."""
MAX_GRANT_BLOCKS = 64
"""Blocks one ask may get (512 numbers): more than any sampling batch; an ask for more gets
this many."""
GRANTS_KEPT = 16
"""Grants a grant object keeps, newest last: a volunteer that polls it late still finds
every grant it has not sampled."""
MAX_GRANTS_BYTES = 256 * 1024
"""Largest grant object a volunteer or trainer reads: GRANTS_KEPT grants of
MAX_GRANT_BLOCKS nonces are about 40 KB."""
NONCE_HEX = 32
"""Hex digits of a block's nonce (128 bits)."""
SECRET_DOMAIN = b"vrl-grant-secret-v1"
NONCE_DOMAIN = b"vrl-grant-nonce-v1"

_ASK = re.compile(r"ask-([0-9]{10})-([0-9]{3})")


class GrantError(ValueError):
    """A grant object that is not what the trainer writes."""


@dataclass(frozen=True)
class Grant:
    """Blocks first_block .. first_block + blocks - 1 of one volunteer, bound to `version`."""

    first_block: int
    blocks: int
    version: int
    nonces: tuple[str, ...]
    """The nonce of each block, in order."""

    @property
    def first(self) -> int:
        """Its first group number."""
        return self.first_block * GRANT_BLOCK

    @property
    def end(self) -> int:
        """One past its last group number."""
        return (self.first_block + self.blocks) * GRANT_BLOCK

    def nonce(self, seq: int) -> str:
        """The nonce of group number `seq` (one of this grant's)."""
        return self.nonces[seq // GRANT_BLOCK - self.first_block]


def grant_secret(key: Ed25519PrivateKey) -> bytes:
    """The trainer's secret for block nonces, derived from its signing key: every rank and
    every restart of the trainer derives the same, and no one without the key can."""
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    return hashlib.sha256(SECRET_DOMAIN + raw).digest()


def block_nonce(secret: bytes, run_id: str, volunteer_id: str, version: int, block: int) -> str:
    """The nonce of `block` of `volunteer_id`'s numbers in `run_id`, under `version`."""
    msg = NONCE_DOMAIN + b"".join(b"\x00" + str(f).encode("utf-8")
                                  for f in (run_id, volunteer_id, version, block))
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()[:NONCE_HEX]


def seq_nonce(secret: bytes, run_id: str, volunteer_id: str, version: int, seq: int) -> str:
    """The nonce group number `seq` is drawn with, if it was granted under `version`."""
    return block_nonce(secret, run_id, volunteer_id, version, seq // GRANT_BLOCK)


def make_grant(secret: bytes, run_id: str, volunteer_id: str, first_block: int, blocks: int,
               version: int) -> Grant:
    """The grant of `blocks` blocks from `first_block` under `version`, with their nonces."""
    return Grant(first_block, blocks, version,
                 tuple(block_nonce(secret, run_id, volunteer_id, version, b)
                       for b in range(first_block, first_block + blocks)))


# -- asks ---------------------------------------------------------------------------------------

def ask_key(version: int, volunteer_id: str, first_block: int, blocks: int) -> str:
    """`rollouts/v000042/<id>/ask-0000000012-004`: `volunteer_id` asks for `blocks` blocks,
    its next ungranted being `first_block`, to be sampled with `version`."""
    if not 0 <= first_block < 10 ** 10 or not 1 <= blocks <= 999:
        raise ValueError(f"ask out of range: block {first_block}, {blocks} blocks")
    return f"{layout.rollout_volunteer_prefix(version, volunteer_id)}/ask-{first_block:010d}-{blocks:03d}"


def parse_ask_key(key: str) -> tuple[int, str, int, int] | None:
    """(version, volunteer id, first block, blocks) of a well-formed ask key, else None."""
    parts = key.strip("/").split("/")
    if len(parts) != 4:
        return None
    author = layout.rollout_author(key)
    m = _ASK.fullmatch(parts[3])
    if author is None or m is None or int(m.group(2)) < 1:
        return None
    return author[0], author[1], int(m.group(1)), int(m.group(2))


# -- the grant object ---------------------------------------------------------------------------

def grants_key(volunteer_id: str) -> str:
    """`grants/<id>.json`: the trainer's grants to one volunteer (overwritten by it)."""
    if not layout.is_safe_name(volunteer_id):
        raise ValueError(f"unsafe volunteer id: {volunteer_id!r}")
    return f"{layout.GRANTS}/{volunteer_id}.json"


def encode_grants(run_id: str, volunteer_id: str, grants: list[Grant]) -> dict:
    """The grant object's body (to be signed): its last GRANTS_KEPT grants."""
    return {"schema": layout.SCHEMA_VERSION, "run_id": run_id, "volunteer_id": volunteer_id,
            "grants": [{"first_block": g.first_block, "blocks": g.blocks, "version": g.version,
                        "nonces": list(g.nonces)} for g in grants[-GRANTS_KEPT:]]}


def decode_grants(data: bytes, where: str) -> tuple[dict, list[Grant]]:
    """(the object, its grants in block order) of a grant object's bytes; GrantError if it is
    not one (its signature is the caller's to check)."""
    try:
        obj = jsonbounds.loads(data, 6)
        if not isinstance(obj, dict) or obj.get("schema") != layout.SCHEMA_VERSION:
            raise GrantError(f"{where}: not a grant object of schema {layout.SCHEMA_VERSION}")
        raw = obj["grants"]
        if not isinstance(raw, list) or len(raw) > GRANTS_KEPT:
            raise GrantError(f"{where}: `grants` is not a list of at most {GRANTS_KEPT}")
        grants = [_grant(g) for g in raw]
    except GrantError:
        raise
    except (jsonbounds.JsonError, KeyError, TypeError, ValueError) as exc:
        raise GrantError(f"{where}: malformed ({type(exc).__name__})") from None
    for a, b in zip(grants, grants[1:]):
        if b.first_block < a.first_block + a.blocks:
            raise GrantError(f"{where}: grants overlap or are out of order")
    return obj, grants


def _grant(g) -> Grant:
    fields = (g["first_block"], g["blocks"], g["version"])
    if any(type(x) is not int for x in fields) or not (0 <= fields[0] < 10 ** 10
                                                       and 1 <= fields[1] <= MAX_GRANT_BLOCKS
                                                       and 0 <= fields[2] < 10 ** 9):
        raise GrantError("a grant's block, blocks or version is out of range")
    nonces = g["nonces"]
    if (not isinstance(nonces, list) or len(nonces) != fields[1]
            or not all(isinstance(n, str) and re.fullmatch(f"[0-9a-f]{{{NONCE_HEX}}}", n)
                       for n in nonces)):
        raise GrantError("a grant's nonces are not one per block")
    return Grant(fields[0], fields[1], fields[2], tuple(nonces))


def grants_bytes(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
