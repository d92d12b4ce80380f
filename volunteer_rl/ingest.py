"""The trainer's intake: find new shards inside the staleness window, read them within bounds,
check every group against the trainer's own view of the world, and rescore it.

Nothing a volunteer reports is believed that the trainer can recompute: the prompt text comes
from the trainer's dataset (the shard names only its id), the completion text is re-decoded
from the token ids, and the reward is recomputed from the trainer's own target.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from . import layout
from .shards import MAX_SHARD_BYTES, Group, ShardError, decode_shard
from .storage import NotFound, Storage, StorageError, TooLarge
from .task import Problem, reward

MAX_READ_ATTEMPTS = 3  # a shard that fails to download this often is reported and skipped
REWARD_CACHE_SIZE = 200_000  # entries; cleared when full


@dataclass
class ScoredGroup:
    """A validated group with the trainer's own rewards."""

    prompt_id: int
    policy_version: int
    volunteer_id: str
    token_ids: list[list[int]]
    behavior_logprobs: list[list[float]]
    rewards: list[float]
    key: str


@dataclass
class IngestStats:
    shards: int = 0
    groups: int = 0
    zero_variance: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> shards


@dataclass
class Rules:
    """What the trainer accepts; built from the manifest it published."""

    problems: list[Problem]
    vocab_size: int
    k: int
    max_new_tokens: int
    decode: Callable[[list[int]], str]
    cache: dict = field(default_factory=dict)
    """(prompt id, token ids) -> reward. A policy that has learned a prompt answers it the
    same way again and again, so most rescoring is a lookup."""

    def reward(self, prompt_id: int, token_ids: list[int]) -> float:
        key = (prompt_id, tuple(token_ids))
        value = self.cache.get(key)
        if value is None:
            if len(self.cache) >= REWARD_CACHE_SIZE:
                self.cache.clear()
            value = reward(self.decode(token_ids), self.problems[prompt_id].expression)
            self.cache[key] = value
        return value


def window(version: int, max_staleness: int) -> range:
    """Policy versions whose groups may still be trained on."""
    return range(max(0, version - max_staleness), version + 1)


def split_fresh(groups: list[ScoredGroup], version: int,
                max_staleness: int) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
    """(fresh, stale): fresh groups sorted newest first, stale ones past the window.

    Newest first so the trainer learns from the most on-policy data it has; the rest waits
    for the next step or falls out of the window."""
    fresh = [g for g in groups if 0 <= version - g.policy_version <= max_staleness]
    stale = [g for g in groups if not 0 <= version - g.policy_version <= max_staleness]
    fresh.sort(key=lambda g: g.policy_version, reverse=True)
    return fresh, stale


def check_group(g: Group, key_version: int, key_volunteer: str, rules: Rules) -> None:
    """Raise ShardError if a decoded group breaks a rule the schema alone cannot see."""
    if g.policy_version != key_version:
        raise ShardError("version_mismatch", f"group says v{g.policy_version}, key says v{key_version}")
    if g.volunteer_id != key_volunteer:
        raise ShardError("volunteer_mismatch", f"group says {g.volunteer_id!r}")
    if not 0 <= g.prompt_id < len(rules.problems):
        raise ShardError("unknown_prompt", f"prompt id {g.prompt_id}")
    if len(g.completions) != rules.k:
        raise ShardError("bad_group_size", f"{len(g.completions)} completions, manifest says {rules.k}")
    for c in g.completions:
        if len(c.token_ids) > rules.max_new_tokens:
            raise ShardError("too_many_tokens", f"{len(c.token_ids)} > {rules.max_new_tokens}")
        if not all(0 <= t < rules.vocab_size for t in c.token_ids):
            raise ShardError("bad_token", "token id outside the vocabulary")


def score_group(g: Group, key: str, rules: Rules) -> ScoredGroup:
    rewards = [rules.reward(g.prompt_id, c.token_ids) for c in g.completions]
    return ScoredGroup(g.prompt_id, g.policy_version, g.volunteer_id,
                       [c.token_ids for c in g.completions],
                       [c.logprobs for c in g.completions], rewards, key)


def read_shard(storage: Storage, key: str, rules: Rules) -> list[ScoredGroup]:
    """Download, decode, check and rescore one shard; ShardError if any part of it is bad.

    A shard is accepted or rejected whole: one bad line means its author is not following
    the protocol, and the rest of its content is not worth trusting either."""
    parsed = layout.parse_shard_key(key)
    if parsed is None:
        raise ShardError("bad_key", "not a shard key")
    version, volunteer, _ = parsed
    try:
        data = storage.read(key, max_bytes=MAX_SHARD_BYTES)
    except TooLarge:
        raise ShardError("too_large", f"more than {MAX_SHARD_BYTES} compressed bytes") from None
    groups = decode_shard(data)
    for g in groups:
        check_group(g, version, volunteer, rules)
    return [score_group(g, key, rules) for g in groups]


class Ingest:
    """Remembers which shards were handled and pulls in the new ones each poll."""

    def __init__(self, storage: Storage, rules: Rules, log: Callable[[str], None] = print):
        self.storage = storage
        self.rules = rules
        self.log = log
        self.seen: set[str] = set()
        self.failures: Counter = Counter()

    def poll(self, version: int, max_staleness: int, stats: IngestStats) -> list[ScoredGroup]:
        """New groups from shards of versions in the window. Only the window's prefixes are
        listed, so the cost of a poll does not grow with the run's history."""
        out: list[ScoredGroup] = []
        for v in window(version, max_staleness):
            try:
                keys = self.storage.list(layout.rollout_version_prefix(v))
            except StorageError as exc:
                self.log(f"warning: {exc}")
                continue
            for key in keys:
                if key not in self.seen:
                    out.extend(self._take(key, stats))
        return out

    def _take(self, key: str, stats: IngestStats) -> list[ScoredGroup]:
        try:
            groups = read_shard(self.storage, key, self.rules)
        except ShardError as exc:
            self.seen.add(key)
            stats.rejected[exc.reason] += 1
            self.log(f"rejected {key}: {exc}")
            return []
        except NotFound:
            self.seen.add(key)  # deleted between list and read (retention): nothing to take
            return []
        except StorageError as exc:
            self.failures[key] += 1
            if self.failures[key] >= MAX_READ_ATTEMPTS:
                self.seen.add(key)
                stats.rejected["unreadable"] += 1
                self.log(f"skipped {key} after {MAX_READ_ATTEMPTS} failed reads: {exc}")
            return []
        self.seen.add(key)
        stats.shards += 1
        stats.groups += len(groups)
        return groups
