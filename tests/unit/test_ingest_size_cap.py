"""The size check before a shard is downloaded (trainer.checks.fetch_shard reads at most
MAX_SHARD_BYTES, issue 26, point 9). The parser refuses an object over the cap too
(shards.iter_groups), so the reason code alone cannot tell the two apart: what the capped read
buys is that the object's bytes never reach the trainer (PREFETCH such objects in memory at
once, whatever their size). The object here is an honest shard with zeros appended (the
gunzip ignores what follows the first member), so only a size check can refuse it."""
from __future__ import annotations

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.protocol.shards import MAX_SHARD_BYTES, Completion, Group, encode_shard
from volunteer_rl.storage import open_storage
from volunteer_rl.task.base import in_process
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.task.dataset import Problem
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.checks import Rules
from volunteer_rl.trainer.groups import IngestStats, Window
from volunteer_rl.trainer.ingest import Ingest

# token id t < 100 decodes to str(t), 100 is EOS (as in test_ingest)
PROBLEMS = [Problem(0, "add 5 and 7", "5 + 7")]
EOS = 100


class CountingStorage:
    """A real storage that counts the bytes its reads hand back, by key."""

    def __init__(self, inner):
        self.inner, self.uri, self.bytes_read = inner, inner.uri, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, key, max_bytes=None):
        data = self.inner.read(key, max_bytes=max_bytes)
        self.bytes_read[key] = self.bytes_read.get(key, 0) + len(data)
        return data


def rules() -> Rules:
    return Rules([p.row for p in PROBLEMS], vocab_size=101, k=2, max_new_tokens=8,
                 rewards=in_process(CalculatorTask()),
                 decode=lambda ids: "".join(str(t) for t in ids), eos_id=EOS,
                 special_ids=frozenset({EOS}))


def shard(volunteer: str) -> bytes:
    """One honest group of v3 (rewards as the trainer computes them): [12] is right, [9] not."""
    completions = [Completion([12, EOS], [-0.5, -0.5], "", 1.0),
                   Completion([9, EOS], [-0.5, -0.5], "", 0.0)]
    return encode_shard([Group(0, 3, volunteer, 0, completions)])


def test_a_shard_over_the_size_cap_is_rejected_unread(tmp_path):
    storage = CountingStorage(open_storage(str(tmp_path / "bucket")))
    fits = layout.shard_key(3, "small", "s1")
    storage.write(fits, shard("small"))
    padded = layout.shard_key(3, "big", "s1")
    data = shard("big")
    storage.write(padded, data + bytes(MAX_SHARD_BYTES + 1 - len(data)))  # one byte too many
    stats = IngestStats()
    ingest = Ingest(storage, rules(), Ledger(), Fleet(), None, lambda m: None)
    taken = ingest.poll(Window(3, 2, {1, 2, 3}), stats)
    assert [g.key for g in taken] == [fits]  # the same group without the padding is taken
    assert stats.rejected == {"too_large": 1}
    assert stats.by_volunteer == {"small": [1, 0], "big": [0, 1]}
    assert storage.bytes_read[fits] == len(shard("small"))
    assert storage.bytes_read.get(padded, 0) <= MAX_SHARD_BYTES  # none of it, as read today
