"""Reading and checking one shard: its bytes read within bounds (fetch_shard), then decoded,
every group checked against the trainer's own view of the world (check_version, check_group)
and rescored (Rules, score_group) by check_shard, which raises ShardError with a reason code
at the first bad line.

Nothing a volunteer reports is believed that the trainer can recompute: the prompt text comes
from the trainer's dataset (the shard names only its id), the completion text is re-decoded
from the token ids, and the reward is recomputed from the trainer's own target.

A shard's rewards are computed in one batch under the bounds the intake gives it
(task.bounded.Spend, from trainer.reward_budget): over the shard's budget it is rejected
(`reward_budget`); cut short by the poll's deadline or a stop, it raises RewardsCut, keeping
the rewards computed so far in the cache for the next poll's read of the same shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import pool_prompt
from volunteer_rl.protocol.grants import seq_nonce
from volunteer_rl.protocol.ledger import group_digest
from volunteer_rl.protocol.shards import (
    MAX_SHARD_BYTES,
    SHARD_GROUPS_LIMIT,
    Budget,
    Group,
    ShardError,
    iter_groups,
)
from volunteer_rl.storage.base import Storage, TooLarge
from volunteer_rl.task.base import Row, completion_text
from volunteer_rl.task.bounded import RewardBoundExceeded, Spend
from volunteer_rl.trainer.groups import ScoredGroup, Window

REWARD_CACHE_SIZE = 200_000  # entries; cleared when full


class RewardsCut(Exception):
    """A shard's rewards were cut short (the poll's reward time ran out, or a stop came): not
    the shard's fault; it is read again at a later poll."""


@dataclass
class Rules:
    """What the trainer accepts; built from the manifest it published."""

    problems: list[Row]
    vocab_size: int
    k: int
    max_new_tokens: int
    decode: Callable[[list[int]], str]
    """Token ids to text, special tokens spelled out (Policy.decode_all)."""
    eos_id: int
    special_ids: frozenset[int]
    cache: dict = field(default_factory=dict)
    """(prompt id, token ids) -> reward. A policy that has learned a prompt answers it the
    same way again and again, so most rescoring is a lookup."""
    max_groups: int = SHARD_GROUPS_LIMIT
    """Groups per shard: the manifest's `max_shard_groups`."""
    run_id: str = ""
    """The run's id: with the version, volunteer and number, it draws each group's prompt."""
    secret: bytes = b""
    """The trainer's grant secret (protocol.grants.grant_secret): the nonce of each group's
    block of numbers, under the version it was granted for, is recomputed with it."""
    rewards: Callable[..., list[float]] | None = None
    """The task's rewards of (completion text, row) pairs, called as rewards(items) or
    rewards(items, spend) (task.bounded.Spend: the batch's bounds; what it took is written
    there; fewer values than items when cut): in the trainer, a worker process that runs
    them under the task's bounds (task.bounded.BoundedRewards.rewards, which raises
    RewardBoundExceeded); task.base.in_process(task) in unit tests (no bounds)."""

    def reward(self, prompt_id: int, token_ids: list[int]) -> float:
        """The reward of one completion (score of one)."""
        return self.score([(prompt_id, token_ids)])[0]

    def score(self, completions: list[tuple[int, list[int]]],
              spend: Spend | None = None) -> list[float]:
        """The rewards of (prompt id, token ids) pairs: 0 where vrl's rule refuses the tokens
        (task.base.completion_text), else the task's, each computed once (the cache). Raises
        ShardError (`reward_timeout`, `reward_memory`, `reward_crash`) when a completion makes
        the task's reward break its bounds, or (`reward_budget`) when the batch breaks
        `spend`'s; RewardsCut when `spend` cut it short."""
        values: list[float | None] = []
        todo: dict[tuple, list[int]] = {}  # cache key -> positions waiting for it
        items: list[tuple[str, Row]] = []
        for i, (prompt_id, token_ids) in enumerate(completions):
            key = (prompt_id, tuple(token_ids))
            value = self.cache.get(key)
            if value is None and key not in todo:
                text = completion_text(token_ids, self.decode, self.eos_id, self.special_ids)
                if text is None:
                    value = 0.0
                else:
                    todo[key] = []
                    items.append((text, self.problems[prompt_id]))
            if key in todo:
                todo[key].append(i)
            values.append(value)
        if items:
            try:
                found = self.rewards(items) if spend is None else self.rewards(items, spend)
            except RewardBoundExceeded as exc:
                flag = " (--shard-reward-seconds)" if exc.code == "reward_budget" else ""
                raise ShardError(exc.code, exc.detail + flag) from None
            if len(self.cache) + len(items) >= REWARD_CACHE_SIZE:
                self.cache.clear()
            for key, value in zip(todo, found):
                self.cache[key] = value
                for i in todo[key]:
                    values[i] = value
            if len(found) < len(items):
                raise RewardsCut(f"{len(found)} of {len(items)} rewards computed")
        return values


def check_version(claimed: int, key_version: int, win: Window) -> None:
    """The group's policy version must be a committed one inside the window, and its key's."""
    if claimed > win.version or (win.low <= claimed and claimed not in win.published):
        raise ShardError("unpublished_version", f"v{claimed} was never published")
    if claimed < win.low:
        raise ShardError("stale_version", f"v{claimed} is older than the window's v{win.low}")
    if claimed != key_version:
        raise ShardError("version_mismatch", f"group says v{claimed}, key says v{key_version}")


def check_group(g: Group, key_version: int, key_volunteer: str, rules: Rules, win: Window) -> None:
    """Raise ShardError if a decoded group breaks a rule the schema alone cannot see."""
    check_version(g.policy_version, key_version, win)
    if g.volunteer_id != key_volunteer:
        raise ShardError("volunteer_mismatch", f"group says {g.volunteer_id!r}")
    if not 0 <= g.prompt_id < len(rules.problems):
        raise ShardError("unknown_prompt", f"prompt id {g.prompt_id}")
    if win.pools is not None:
        pool = win.pools.get(g.policy_version)
        if not pool:  # a published version whose pool the trainer could not read back
            raise ShardError("unpublished_version", f"v{g.policy_version}: its prompt pool is unknown")
        drawn = pool_prompt(pool, rules.run_id, g.policy_version, g.volunteer_id, g.seq,
                            group_nonce(g, rules))
        if g.prompt_id != drawn:
            raise ShardError("prompt_mismatch", f"group {g.seq} is for prompt {g.prompt_id}, its "
                             f"number draws prompt {drawn} from v{g.policy_version}'s pool (if it "
                             "was granted for that version)")
    if len(g.completions) != rules.k:
        raise ShardError("bad_group_size", f"{len(g.completions)} completions, manifest says {rules.k}")
    for c in g.completions:
        if len(c.token_ids) > rules.max_new_tokens:
            raise ShardError("too_many_tokens", f"{len(c.token_ids)} > {rules.max_new_tokens}")
        if not all(0 <= t < rules.vocab_size for t in c.token_ids):
            raise ShardError("bad_token", "token id outside the vocabulary")
        # A sampler stops at the first EOS or at the cap, nowhere else.
        if rules.eos_id in c.token_ids[:-1]:
            raise ShardError("after_eos", "tokens after EOS")
        if c.token_ids[-1] != rules.eos_id and len(c.token_ids) != rules.max_new_tokens:
            raise ShardError("short_completion", f"{len(c.token_ids)} tokens, no EOS and below "
                             f"max_new_tokens {rules.max_new_tokens}")


def group_nonce(g: Group, rules: Rules) -> str:
    """The nonce `g`'s draws are keyed by if its number was granted for its version
    (protocol.grants): a volunteer that was not granted it there cannot know it."""
    return seq_nonce(rules.secret, rules.run_id, g.volunteer_id, g.policy_version, g.seq)


def score_group(g: Group, key: str, line: int, rules: Rules) -> ScoredGroup:
    """Rescore every completion; a reward that differs from the volunteer's claim means it
    runs another task or lies, and its shard is not taken."""
    rewards = rules.score([(g.prompt_id, c.token_ids) for c in g.completions])
    for c, r in zip(g.completions, rewards):
        if abs(c.reward - r) > 1e-6:
            raise ShardError("reward_mismatch", f"claims reward {c.reward:g}, the trainer finds {r:g}")
    ids = [c.token_ids for c in g.completions]
    return ScoredGroup(g.prompt_id, g.policy_version, g.volunteer_id, ids,
                       [c.logprobs for c in g.completions], rewards, key, g.seq, line,
                       group_digest(g.prompt_id, g.policy_version, ids), nonce=group_nonce(g, rules))


def fetch_shard(storage: Storage, key: str) -> bytes:
    """The bytes of one shard, read within MAX_SHARD_BYTES; ShardError for a key that is not
    a shard or an object that is too large. Safe to call from several threads."""
    if layout.parse_shard_key(key) is None:
        raise ShardError("bad_key", "not a shard key")
    try:
        return storage.read(key, max_bytes=MAX_SHARD_BYTES)
    except TooLarge:
        raise ShardError("too_large", f"more than {MAX_SHARD_BYTES} compressed bytes") from None


def check_shard(data: bytes, key: str, rules: Rules, win: Window,
                spend: Spend | None = None) -> list[ScoredGroup]:
    """Decode, check and rescore the bytes of shard `key`; ShardError if any part is bad,
    RewardsCut if its rewards were cut short (`spend`: their bounds, Rules.score).

    A shard is accepted or rejected whole: one bad line means its author is not following
    the protocol, and the rest of its content is not worth trusting either."""
    parsed = layout.parse_shard_key(key)
    if parsed is None:
        raise ShardError("bad_key", "not a shard key")
    version, volunteer, _ = parsed
    groups = []
    for g in iter_groups(data, Budget(rules.k, rules.max_new_tokens, rules.max_groups)):
        check_group(g, version, volunteer, rules, win)  # stop paying at the first bad line
        groups.append(g)
    # The whole shard's rewards in one batch (a worker's round trip per shard, not per group);
    # each group's scoring then finds them in the cache.
    rules.score([(g.prompt_id, c.token_ids) for g in groups for c in g.completions], spend)
    return [score_group(g, key, i, rules) for i, g in enumerate(groups)]
