"""The trainer's intake: find new shards inside the staleness window, read them within bounds,
check every group against the trainer's own view of the world, and rescore it.

Nothing a volunteer reports is believed that the trainer can recompute: the prompt text comes
from the trainer's dataset (the shard names only its id), the completion text is re-decoded
from the token ids, the reward is recomputed from the trainer's own target, and audited
shards (trainer.audit decides which) have every token replayed against its committed draw.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

from volunteer_rl.faults import crash_point
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import pool_prompt
from volunteer_rl.protocol.ledger import Ledger, group_digest
from volunteer_rl.protocol.printable import printable
from volunteer_rl.protocol.shards import (
    MAX_SHARD_BYTES,
    SHARD_GROUPS_LIMIT,
    Budget,
    Group,
    ShardError,
    iter_groups,
)
from volunteer_rl.storage.base import AlreadyExists, NotFound, Storage, StorageError, TooLarge
from volunteer_rl.task.base import Row, completion_text
from volunteer_rl.task.bounded import RewardBoundExceeded
from volunteer_rl.trainer.audit import Auditor, AuditStats
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.withheld import GroupNumbers

MAX_READ_ATTEMPTS = 3  # a shard that fails to download this often is reported and skipped
FETCH_WORKERS = 8
"""Shard GETs in flight at once. Each GET of a small object is mostly round trip (and, on a
server, its request handling), so a few in parallel keep the link busy while this thread
decodes and checks the shards that already arrived."""
PREFETCH = 16
"""Shards fetched ahead of the one being checked: bounds memory at PREFETCH x MAX_SHARD_BYTES
(128 MiB) whatever a hostile fleet uploads."""
REWARD_CACHE_SIZE = 200_000  # entries; cleared when full
MAX_OBJECTS_PER_VOLUNTEER_VERSION = 1024
"""Objects of one volunteer under one version folder the trainer considers (in key order,
which is upload order for shard names); the rest are never listed, read or recorded. Bounds
the LIST pages, GETs, ledger records and quarantine writes any one id can cause per version,
junk or not. A folder found over it is counted once in `ingest/over_cap`, and its first
objects are remembered, so it is not listed again in that version. An honest volunteer that
outruns it (a trainer stuck on one version for hours) loses only the excess."""
MAX_SHARDS_PER_VOLUNTEER_POLL = 16
"""Shards of one volunteer fetched and parsed per poll (its share of the poll): one id with a
thousand big shards waiting costs a poll this many parses, and everyone else's shards are
still read in that poll. The rest wait for the next poll."""
MAX_TRAINER_FAULTS = 3
"""Times the trainer's own fault (an exception of the replay: out of memory, a torch error)
may stop a shard's intake before the shard is left for this process, charged to nobody."""


NUMBERING_ERRORS = {
    "seq_reused": "a group number this volunteer used before",
    "seq_order": "group numbers out of order with the versions they were sampled under",
}
"""The messages of withheld.GroupNumbers' reason codes."""


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
    seq: int = 0
    """The group's number among its volunteer's groups of its version (keys its draws)."""
    line: int = 0
    """Index of the group in its shard: with `key`, its identity in the ledger."""
    digest: str = ""
    """Content hash (ledger.group_digest)."""
    shard_size: int = 0
    """Groups in its shard (the ledger's completeness count)."""
    arrival: int = 0
    """The poll that took it (Ingest's count): groups of one version are trained in order of
    arrival, then key and line, the same order on every rank (split_fresh)."""


_COUNTS = ("shards", "groups", "zero_variance", "duplicates", "denied", "over_cap", "trainer_errors")
"""IngestStats' plain counts."""


@dataclass
class IngestStats:
    shards: int = 0
    groups: int = 0
    zero_variance: int = 0
    duplicates: int = 0
    denied: int = 0
    """Shards of denied volunteers skipped: a whole folder, never listed, counts one per poll."""
    over_cap: int = 0
    """Volunteer folders found over MAX_OBJECTS_PER_VOLUNTEER_VERSION (once per version)."""
    trainer_errors: int = 0
    """Shards left after MAX_TRAINER_FAULTS faults of the trainer's own (not charged)."""
    audit: AuditStats = field(default_factory=AuditStats)
    rejected: Counter = field(default_factory=Counter)  # reason -> shards
    by_volunteer: dict = field(default_factory=dict)  # volunteer id -> [accepted, rejected] shards


    def to_json(self) -> dict:
        """For the writer rank, which counts every rank's intake in its step metrics.
        (Not dataclasses.asdict: it rebuilds a Counter from (key, count) pairs, which counts
        the pairs.)"""
        return {**{name: getattr(self, name) for name in _COUNTS},
                "rejected": dict(self.rejected), "by_volunteer": self.by_volunteer,
                "audit": dataclasses.asdict(self.audit)}

    def add_json(self, raw: dict) -> None:
        """Add another rank's counts (to_json of its IngestStats: the trainer's own rank)."""
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + raw[name])
        self.rejected.update(raw["rejected"])
        for volunteer, (accepted, rejected) in raw["by_volunteer"].items():
            counts = self.by_volunteer.setdefault(volunteer, [0, 0])
            counts[0] += accepted
            counts[1] += rejected
        a, b = self.audit, raw["audit"]
        a.audited, a.skipped, a.deferred = a.audited + b["audited"], a.skipped + b["skipped"], a.deferred + b["deferred"]
        a.seconds += b["seconds"]
        for volunteer, n in b["by_volunteer"].items():
            a.by_volunteer[volunteer] = a.by_volunteer.get(volunteer, 0) + n


@dataclass
class Window:
    """The versions whose groups may be taken now, as the trainer knows them."""

    version: int
    max_staleness: int
    published: set[int]
    """Committed versions inside the window (a crashed publish leaves gaps)."""
    pools: dict[int, tuple[int, ...]] | None = None
    """Each published version's prompt pool (its manifest's `prompt_pool`): a group's prompt
    must be the one its number draws from it. The trainer always gives them; None only in
    unit tests of the other rules."""

    def versions(self) -> range:
        return layout.window(self.version, self.max_staleness)

    @property
    def low(self) -> int:
        return self.versions().start


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
    rewards: Callable[[list[tuple[str, Row]]], list[float]] | None = None
    """The task's rewards of (completion text, row) pairs: in the trainer, a worker process
    that runs them under the task's bounds (task.bounded.BoundedRewards.rewards, which raises
    RewardBoundExceeded); task.base.in_process(task) in unit tests."""

    def reward(self, prompt_id: int, token_ids: list[int]) -> float:
        """The reward of one completion (score of one)."""
        return self.score([(prompt_id, token_ids)])[0]

    def score(self, completions: list[tuple[int, list[int]]]) -> list[float]:
        """The rewards of (prompt id, token ids) pairs: 0 where vrl's rule refuses the tokens
        (task.base.completion_text), else the task's, each computed once (the cache). Raises
        ShardError (`reward_timeout`, `reward_memory`, `reward_crash`) when a completion makes
        the task's reward break its bounds."""
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
                found = self.rewards(items)
            except RewardBoundExceeded as exc:
                raise ShardError(exc.code, exc.detail) from None
            if len(self.cache) + len(items) >= REWARD_CACHE_SIZE:
                self.cache.clear()
            for key, value in zip(todo, found):
                self.cache[key] = value
                for i in todo[key]:
                    values[i] = value
        return values


def split_fresh(groups: list[ScoredGroup], version: int,
                max_staleness: int) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
    """(fresh, stale): fresh groups in training order (train_order), stale ones past the
    window.

    Newest first so the trainer learns from the most on-policy data it has; the rest waits
    for the next step or falls out of the window."""
    fresh = [g for g in groups if layout.in_window(version - g.policy_version, max_staleness)]
    stale = [g for g in groups if not layout.in_window(version - g.policy_version, max_staleness)]
    fresh.sort(key=train_order)
    return fresh, stale


def train_order(g: ScoredGroup) -> tuple:
    """Newest version first; within one, first arrived first, then key and line. The ranks
    sort the groups they took by it and agree on a step's batch as the first of their merged
    lists, so 2 ranks pick the very groups one process would."""
    return (-g.policy_version, g.arrival, g.key, g.line)


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
        drawn = pool_prompt(pool, rules.run_id, g.policy_version, g.volunteer_id, g.seq)
        if g.prompt_id != drawn:
            raise ShardError("prompt_mismatch", f"group {g.seq} is for prompt {g.prompt_id}, its "
                             f"number draws prompt {drawn} from v{g.policy_version}'s pool")
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
                       group_digest(g.prompt_id, g.policy_version, ids))


def fetch_shard(storage: Storage, key: str) -> bytes:
    """The bytes of one shard, read within MAX_SHARD_BYTES; ShardError for a key that is not
    a shard or an object that is too large. Safe to call from several threads."""
    if layout.parse_shard_key(key) is None:
        raise ShardError("bad_key", "not a shard key")
    try:
        return storage.read(key, max_bytes=MAX_SHARD_BYTES)
    except TooLarge:
        raise ShardError("too_large", f"more than {MAX_SHARD_BYTES} compressed bytes") from None


def check_shard(data: bytes, key: str, rules: Rules, win: Window) -> list[ScoredGroup]:
    """Decode, check and rescore the bytes of shard `key`; ShardError if any part is bad.

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
    rules.score([(g.prompt_id, c.token_ids) for g in groups for c in g.completions])
    return [score_group(g, key, i, rules) for i, g in enumerate(groups)]


def _key_version(key: str) -> int:
    """The version folder a key under rollouts/ sits in (-1 if none), shard or not."""
    parts = layout.split_versioned_key(key)
    return parts[1] if parts else -1


class FleetShare(Protocol):
    """What Ingest needs of a rank's share of the fleet (trainer.shares.Share)."""

    rank: int
    owns_nobodys: bool

    def owns(self, volunteer: str) -> bool: ...

    def exchange(self, report: dict) -> list[dict]: ...


class Ingest:
    """Pulls in the new shards of the window each poll, against the ledger.

    A shard is read once per process; one whose groups all have an outcome in the ledger is
    never read again, one left half-taken by a crash is read again and only its groups
    without an outcome are taken."""

    def __init__(self, storage: Storage, rules: Rules, ledger: Ledger, fleet: Fleet,
                 auditor: Auditor | None = None, log: Callable[[str], None] = print,
                 log_shards: bool = False, fetch_workers: int = FETCH_WORKERS,
                 numbers: GroupNumbers | None = None,
                 observe: Callable[[int, list[float]], None] | None = None,
                 share: "FleetShare | None" = None):
        self.storage = storage
        self.rules = rules
        self.ledger = ledger
        self.fleet = fleet
        self.auditor = auditor
        """None: no shard is audited (--audit-tolerance 0)."""
        self.numbers = numbers or GroupNumbers()
        """Group numbers received (withheld.GroupNumbers): saved with the trainer's state."""
        self.observe = observe
        """Called with (prompt id, rewards) of every group taken, duplicates aside: the
        curriculum's observations."""
        self.log = log
        self.log_shards = log_shards
        self.taken: set[str] = set()
        self.failures: Counter = Counter()
        """Key -> failed reads (MAX_READ_ATTEMPTS)."""
        self.faults: Counter = Counter()
        """Key -> faults of the trainer's own while taking it (MAX_TRAINER_FAULTS)."""
        self.unaudited: dict[str, dict[str, list[ScoredGroup]]] = {}
        """Volunteer -> key -> usable groups of its shards taken without being replayed (the
        whole shard, or all but its contested groups): replayed after all if the volunteer is
        caught, or their content shows up under another id, while some are not trained yet."""
        self.withdrawn: set[str] = set()
        """Keys rejected or left after their groups were handed out: poll drops those groups
        from the ones waiting to be trained."""
        self.fetch_workers = max(1, fetch_workers)
        self._low = 0  # window's lowest version at the last poll (see _forget_below)
        self._polls = 0  # turns the order in which volunteers are admitted (see _admit)
        self.capped: dict[str, list[str]] = {}
        """Folder -> its first MAX_OBJECTS_PER_VOLUNTEER_VERSION keys, for the folders found
        over the cap: those keys are all the trainer will ever take from them."""
        self.share = share
        """Under torchrun, this rank's share of the fleet (trainer.shares): only its own
        volunteers are listed, and every poll meets the other ranks twice. None: a single
        process, which reads every volunteer."""
        self._claims: list[list] = []  # [digest, version, volunteer] claimed this poll
        self._released: list[str] = []  # claims given back this poll (a failed re-audit)
        self._rechecks: list[list] = []  # [volunteer, digests]: re-audits for other ranks

    def poll(self, win: Window, stats: IngestStats,
             waiting: list[ScoredGroup] = ()) -> list[ScoredGroup]:
        """New usable groups from shards of the window, after `waiting` (groups taken by
        earlier polls and not trained yet) less those of shards rejected since they were
        taken. Only the window's prefixes are
        listed and only keys not yet taken are read, so a poll costs one denylist GET, one
        LIST of each window version's folder names, a LIST of at most
        MAX_OBJECTS_PER_VOLUNTEER_VERSION + 1 keys per volunteer folder (none for a denied
        one or one already found over the cap), and one GET per new shard admitted (_admit):
        bounded by the volunteers and the caps, however long the run's history and whatever
        a volunteer wrote.

        Admitted shards are fetched FETCH_WORKERS at a time and parsed on this thread in key
        order; then the groups whose content also appears under another volunteer are found
        (_contest); then each shard is audited if due, or has its contested groups replayed,
        and is taken, in key order. So a
        poll holds the parsed groups of at most MAX_SHARDS_PER_VOLUNTEER_POLL shards per
        volunteer at once."""
        self._refresh_denylist()
        self._forget_below(win.low)
        self._drop_trained()
        listed: list[str] = []
        for v in win.versions():
            listed += [key for key in self._list_version(v, stats) if self._wanted(key)]
        parsed: list[tuple[str, list[ScoredGroup]]] = []
        out: list[ScoredGroup] = []
        try:
            for key, fetched in self._prefetch(self._admit(listed, stats)):
                if self._denied(key, stats):  # denied by an earlier shard of this very poll
                    continue
                groups = self._read(key, fetched, win, stats)
                if groups is not None:
                    parsed.append((key, groups))
            contested = self._contest(parsed, self._parsed_elsewhere(parsed))
            for key, groups in parsed:
                if not self._denied(key, stats):
                    out.extend(self._take(key, groups, stats, contested.get(key, frozenset())))
            out = self._claimed_elsewhere(out, stats)
        finally:
            if self.auditor is not None:
                self.auditor.settle()
        for g in out:
            g.arrival = self._polls
        return [g for g in [*waiting, *out] if g.key not in self.withdrawn]

    def _list_version(self, version: int, stats: IngestStats) -> list[str]:
        """The keys of one version folder the trainer considers, sorted: up to
        MAX_OBJECTS_PER_VOLUNTEER_VERSION of each volunteer folder that is not denied, the
        first ones in key order. Objects directly in the version folder are no volunteer's
        (only the trainer's credentials can write there): up to the cap of them are kept, to
        be rejected as `bad_key` like any other object that is no shard."""
        cap = MAX_OBJECTS_PER_VOLUNTEER_VERSION
        try:
            entries = self.storage.list_level(layout.rollout_version_prefix(version))
        except StorageError as exc:
            self.log(f"warning: {exc}")
            return []
        nobodys = self.share is None or self.share.owns_nobodys
        keys = [e for e in entries if not e.endswith("/")][:cap] if nobodys else []
        for folder in (e for e in entries if e.endswith("/")):
            if not self._mine(folder):
                continue
            if self._denied(folder, stats):
                continue
            if folder in self.capped:
                keys += self.capped[folder]
                continue
            try:
                listed = self.storage.list(folder, limit=cap + 1)
            except StorageError as exc:
                self.log(f"warning: {exc}")
                continue
            if len(listed) > cap:
                stats.over_cap += 1
                listed = self.capped[folder] = listed[:cap]
            keys += listed
        return sorted(keys)

    def _mine(self, folder: str) -> bool:
        """True if this process reads `folder` (a volunteer's folder in a version): always
        for a single process; under ranks, if the volunteer is this rank's (trainer.shares).
        A folder whose name is no volunteer id is the writer's, to reject its objects."""
        if self.share is None:
            return True
        author = layout.rollout_author(folder)  # as for a key inside it
        if author is None:
            return self.share.owns_nobodys
        return self.share.owns(author[1])

    def _wanted(self, key: str) -> bool:
        """True if `key` still has something to take."""
        return key not in self.taken and not self.ledger.finished(key)

    def _admit(self, keys: list[str], stats: IngestStats) -> list[str]:
        """The keys to fetch this poll, in key order: of each volunteer, its first keys up to
        MAX_SHARDS_PER_VOLUNTEER_POLL, skipping (unfetched) those due for an audit that the
        budget has no room for. Volunteers take turns, one key each, from a first volunteer
        that changes every poll, so the budget's room goes round the fleet instead of to the
        id that sorts first."""
        chosen = [k for k in keys if layout.rollout_author(k) is None]  # nobody's: bad_key
        queues: dict[str, deque[str]] = {}
        for key in keys:
            author = layout.rollout_author(key)
            if author is not None:
                queues.setdefault(author[1], deque()).append(key)
        order = sorted(queues)
        self._polls += 1
        if order:
            turn = self._polls % len(order)
            order = order[turn:] + order[:turn]
        room = dict.fromkeys(order, MAX_SHARDS_PER_VOLUNTEER_POLL)
        while order:
            for volunteer in list(order):
                key = queues[volunteer].popleft()
                if not self._waits_for_audit(key, volunteer, stats):
                    chosen.append(key)
                    room[volunteer] -= 1
                if not queues[volunteer] or not room[volunteer]:
                    order.remove(volunteer)
        return sorted(chosen)

    def _waits_for_audit(self, key: str, volunteer: str, stats: IngestStats) -> bool:
        """True if `key` is known to be due for an audit and the budget has no room for it: it
        is not even fetched this poll, so a shard waiting for its audit costs a listing, no
        GET and no parse. A shard admitted here has its audit's cost reserved."""
        if self.auditor is None or layout.parse_shard_key(key) is None:
            return False
        if not self.auditor.surely_due(key, self.fleet.clean(volunteer)):
            return False
        if self.auditor.admit(key, self.rules.max_groups):
            return False
        stats.audit.deferred += 1
        return True

    def _denied(self, key: str, stats: IngestStats) -> bool:
        parsed = layout.rollout_author(key)
        if parsed and self.fleet.is_denied(parsed[1]):
            stats.denied += 1
            return True
        return False

    def _prefetch(self, keys: list[str]):
        """(key, future of its bytes) in the order of `keys`, with at most PREFETCH fetched
        ahead of the consumer and FETCH_WORKERS GETs in flight."""
        if not keys:
            return
        ahead: deque[tuple[str, Future]] = deque()
        with ThreadPoolExecutor(min(self.fetch_workers, len(keys))) as pool:
            try:
                for key in keys:
                    ahead.append((key, pool.submit(fetch_shard, self.storage, key)))
                    if len(ahead) >= PREFETCH:
                        yield ahead.popleft()
                while ahead:
                    yield ahead.popleft()
            finally:  # the consumer stopped early (an exception): drop what was queued
                for _, fut in ahead:
                    fut.cancel()

    def _forget_below(self, low: int) -> None:
        """Drop what is remembered about keys of versions below the window: they are never
        listed again, so memory stays bounded by the window, not the history."""
        if low <= self._low:
            return
        self._low = low
        self.taken = {k for k in self.taken if _key_version(k) >= low}
        for volunteer, (used, missing) in self.numbers.close_below(low).items():
            self.fleet.count_numbers(volunteer, used, missing)
        if self.auditor is not None:
            self.auditor.forget(lambda k: _key_version(k) >= low)
        self.capped = {k: v for k, v in self.capped.items() if _key_version(k) >= low}
        self.failures = Counter({k: n for k, n in self.failures.items() if _key_version(k) >= low})
        self.faults = Counter({k: n for k, n in self.faults.items() if _key_version(k) >= low})
        self.withdrawn = {k for k in self.withdrawn if _key_version(k) >= low}
        for shards in self.unaudited.values():
            for key in [k for k in shards if _key_version(k) < low]:
                del shards[key]

    def _drop_trained(self) -> None:
        """Forget the unaudited shards whose groups all have an outcome now (trained, stale):
        an audit of them could no longer keep anything out of a step."""
        for volunteer, shards in list(self.unaudited.items()):
            for key in [k for k, gs in shards.items()
                        if all(self.ledger.is_done(k, g.line) for g in gs)]:
                del shards[key]
            if not shards:
                del self.unaudited[volunteer]

    def _refresh_denylist(self) -> None:
        try:
            self.fleet.refresh(self.storage)
        except Exception as exc:  # a broken denylist must not stop training
            self.log(f"warning: {layout.DENYLIST}: {exc}")

    def _read(self, key: str, fetched: Future, win: Window,
              stats: IngestStats) -> list[ScoredGroup] | None:
        """The checked and rescored groups of `key`, or None: rejected, or not to be read now."""
        try:
            return check_shard(fetched.result(), key, self.rules, win)
        except ShardError as exc:
            self._reject(key, exc.reason, str(exc), stats)
        except NotFound:
            self.taken.add(key)  # deleted between list and read (retention): nothing to take
        except StorageError as exc:
            self.failures[key] += 1
            if self.failures[key] >= MAX_READ_ATTEMPTS:
                self._reject(key, "unreadable", f"{MAX_READ_ATTEMPTS} failed reads: {exc}", stats)
        except MemoryError as exc:  # the bytes are bounded by the manifest: our machine's limit
            self._trainer_fault(key, exc, stats)
        except Exception as exc:
            # Reading one object ends in "accepted" or a reason code, never in a dead trainer:
            # an error nobody foresaw while reading a volunteer's bytes is a bug of ours that
            # those bytes found, so its traceback goes to the log, and the shard is recorded
            # (and so never read again after a restart) like any reject.
            self._log_trace(f"unexpected {type(exc).__name__} while checking {printable(key)}", exc)
            self._reject(key, "internal_error", type(exc).__name__, stats)
        return None

    def _parsed_elsewhere(self, parsed: list[tuple[str, list[ScoredGroup]]]) -> dict[str, set[str]]:
        """Under ranks (a collective): digest -> volunteers of the groups the other ranks
        parsed in this poll, for _contest; each rank sends its own. A single process: {}."""
        if self.share is None:
            return {}
        mine = [[g.digest, g.volunteer_id] for _, groups in parsed for g in groups]
        others: dict[str, set[str]] = {}
        for rank, report in enumerate(self.share.exchange({"parsed": mine})):
            if rank != self.share.rank:
                for digest, volunteer in report.get("parsed", ()):
                    others.setdefault(digest, set()).add(volunteer)
        return others

    def _claimed_elsewhere(self, out: list[ScoredGroup], stats: IngestStats) -> list[ScoredGroup]:
        """Under ranks (a collective): tell the other ranks the contents this poll claimed,
        the claims given back and the re-audits asked of them; learn theirs. Their claims
        become owners in this rank's ledger (so a later copy of them here is contested);
        content claimed here and by a lower rank in the same poll is recorded a duplicate
        here and dropped from `out`; re-audits of this rank's volunteers run now. A single
        process: `out` as it is."""
        if self.share is None:
            return out
        report = {"claims": self._claims, "released": self._released, "recheck": self._rechecks}
        self._claims, self._released, self._rechecks = [], [], []
        reports = self.share.exchange(report)
        mine = {c[0] for c in reports[self.share.rank]["claims"]}
        lost: dict[str, tuple[int, str]] = {}
        for rank, other in enumerate(reports):
            if rank == self.share.rank:
                continue
            for digest, version, volunteer in other["claims"]:
                if digest in mine:
                    if rank < self.share.rank:
                        lost.setdefault(digest, (version, volunteer))
                    continue
                self.ledger.claim(digest, version, volunteer)
            for digest in other["released"]:
                owner = self.ledger.owner(digest)
                if owner is not None and not self.share.owns(owner):
                    self.ledger.release([digest])
        if lost:
            dup = [g for g in out if g.digest in lost]
            for key in sorted({g.key for g in dup}):
                gs = [g for g in dup if g.key == key]
                self.ledger.record(key, "duplicate", [g.line for g in gs], gs[0].shard_size)
            for digest, (version, volunteer) in lost.items():  # the lower rank's claim stands
                self.ledger.release([digest])
                self.ledger.claim(digest, version, volunteer)
            stats.duplicates += len(dup)
            out = [g for g in out if g.digest not in lost]
        for other in reports:
            for volunteer, digests in other["recheck"]:
                if self.share.owns(volunteer):
                    self._recheck_holding(volunteer, frozenset(digests), stats)
        return out

    def _contest(self, parsed: list[tuple[str, list[ScoredGroup]]],
                 elsewhere: dict[str, set[str]] | None = None) -> dict[str, frozenset[str]]:
        """Key -> digests of its groups whose content is also in another volunteer's shard of
        this poll, or was taken from another volunteer before. Committed noise is keyed by the
        volunteer, so the same tokens under two ids mean one of them did not sample them:
        replaying those groups fails the copy and passes the original (_audit). Only those
        groups are replayed, not their whole shards: honest volunteers sampling one prompt
        from a confident policy send identical groups all the time (a 300 s demo had 488 in
        412 of its 2,568 shards), and whole-shard replays of them kept the audit budget spent
        for the whole run. Under ranks, `elsewhere` adds the other ranks' groups of this poll
        (_parsed_elsewhere), and the ledger's owners include their earlier claims."""
        if self.auditor is None:
            return {}
        ids: dict[str, set[str]] = {d: set(v) for d, v in (elsewhere or {}).items()}
        for key, groups in parsed:
            for g in groups:
                ids.setdefault(g.digest, set()).add(g.volunteer_id)
        contested: dict[str, frozenset[str]] = {}
        for key, groups in parsed:
            mine = frozenset(g.digest for g in groups
                             if len(ids[g.digest]) > 1
                             or self.ledger.owner(g.digest) not in (None, g.volunteer_id))
            if mine:
                contested[key] = mine
        return contested

    def _take(self, key: str, groups: list[ScoredGroup], stats: IngestStats,
              contested: frozenset[str] = frozenset()) -> list[ScoredGroup]:
        """Audit (if due, or only its `contested` groups) and take one parsed shard; its usable
        groups."""
        volunteer = layout.rollout_author(key)[1]  # a shard key: check_shard parsed it
        try:
            replayed = self._audit(key, volunteer, groups, contested, stats)
        except ShardError as exc:
            self._reject(key, exc.reason, str(exc), stats, len(groups))
            return []
        except Exception as exc:  # raised by the trainer's own model on checked input
            self._trainer_fault(key, exc, stats)
            return []
        if replayed is None:
            return []  # due for an audit that cannot run now: read again later
        crash_point("ingest")
        if self._only_repeats(key, volunteer, groups):
            # Repeats cost nothing to make: counted as accepted they would dilute any number
            # of rejects below --deny-rate.
            self._reject(key, "duplicate_only", f"duplicate_only: all {len(groups)} groups were taken before", stats, len(groups))
            return []
        refused = self._numbered(key, groups)
        if refused:
            self._reject(key, refused, NUMBERING_ERRORS[refused], stats, len(groups))
            return []
        if replayed:
            self._audit_claimants(volunteer, replayed, stats)
        self.taken.add(key)
        stats.shards += 1
        self._count(key, True, stats, len(groups))
        usable = self._sort(key, groups, stats)
        passed = {g.line for g in replayed}
        unreplayed = [g for g in usable if g.line not in passed]
        if unreplayed and self.auditor is not None:
            self.unaudited.setdefault(volunteer, {})[key] = unreplayed
        return usable

    def _only_repeats(self, key: str, volunteer: str, groups: list[ScoredGroup]) -> bool:
        """True if every group of `key` is content its own volunteer had taken before, from
        other shards. A shard half taken before a restart (some of its lines already have
        outcomes) is not one, nor is a repeat of another volunteer's content: that one is
        audited (_contest), and a copy fails its audit; an original that passes is never
        charged for a copy taken before it."""
        return (bool(groups) and not any(self.ledger.is_done(key, g.line) for g in groups)
                and all(self.ledger.owner(g.digest) == volunteer for g in groups))

    def _audit(self, key: str, volunteer: str, groups: list[ScoredGroup],
               contested: frozenset[str], stats: IngestStats) -> list[ScoredGroup] | None:
        """Replay the shard's groups if it is due, else its `contested` groups (_contest): the
        groups replayed and passed (ShardError if one fails; [] if none was due), or None if
        due but not auditable now (no room in the budget, weights not held). A fault of the
        replay's own propagates."""
        if self.auditor is None or not groups:
            return []
        if self.auditor.due(key, self.fleet.clean(volunteer), len(groups)):
            replay = groups
        else:
            replay = [g for g in groups if g.digest in contested]
            if not replay:
                stats.audit.skipped += 1
                return []
        if not self.auditor.admit(key, len(groups), len(replay)):
            stats.audit.deferred += 1
            return None
        outcome, problem = self.auditor.run(key, volunteer, groups[0].policy_version, replay,
                                            stats.audit, chunked=not self.fleet.clean(volunteer))
        if outcome == "deferred":
            return None
        self.fleet.count_audit(volunteer)
        if problem:
            raise ShardError(*problem)
        return replay

    def _audit_claimants(self, volunteer: str, groups: list[ScoredGroup], stats: IngestStats) -> None:
        """`groups` of a shard passed their replay, and some hold content taken before from
        another volunteer's shard without an audit: replay those groups of that shard now, if
        they are not trained yet. A copy fails, is rejected (charged to the copier) and gives
        its claims back, so the original's groups are taken."""
        mine = frozenset(g.digest for g in groups)
        for other in {self.ledger.owner(d) for d in mine} - {None, volunteer}:
            if self.share is not None and not self.share.owns(other):  # its rank re-audits
                self._rechecks.append([other, sorted(d for d in mine if self.ledger.owner(d) == other)])
                continue
            self._recheck_holding(other, mine, stats)

    def _recheck_holding(self, volunteer: str, digests: frozenset[str], stats: IngestStats) -> None:
        """_recheck, on those groups only, every shard of `volunteer` taken unaudited that
        holds one of `digests` (asked by this rank's intake, or by another rank's)."""
        for key, gs in list(self.unaudited.get(volunteer, {}).items()):
            if any(g.digest in digests for g in gs):
                self._recheck(volunteer, key, stats, only=digests)

    def _caught(self, volunteer: str, stats: IngestStats) -> None:
        """After a rejection of `volunteer`: audit every shard of its that was taken without an
        audit and is not all trained. (Its later shards are due anyway: its clean count is 0,
        so its rate is 1, and a draw is made from the rate of the moment.)"""
        for key in list(self.unaudited.get(volunteer, {})):
            self._recheck(volunteer, key, stats)

    def _recheck(self, volunteer: str, key: str, stats: IngestStats,
                 only: frozenset[str] | None = None) -> None:
        """Audit now, whatever the budget, the untrained groups of `key`, taken without an
        audit (with `only`: those of its untrained groups whose digest is in it; the rest stay
        unaudited, as in _take). Failed: the shard is rejected and all its untrained groups
        withdrawn; not auditable (weights not held, a fault of the trainer): withdrawn,
        charged to nobody."""
        shards = self.unaudited.get(volunteer, {})
        untrained = [g for g in shards.pop(key, []) if not self.ledger.is_done(key, g.line)]
        groups = untrained if only is None else [g for g in untrained if g.digest in only]
        lines = {g.line for g in groups}
        rest = [g for g in untrained if g.line not in lines]
        if rest:
            shards[key] = rest
        if not groups or self.auditor is None:
            return
        try:
            outcome, problem = self.auditor.run(key, volunteer, groups[0].policy_version, groups,
                                                stats.audit, chunked=not self.fleet.clean(volunteer))
        except Exception as exc:  # the trainer's own fault: nobody is charged
            self._log_trace(f"{type(exc).__name__} of the trainer's own while re-auditing "
                            f"{printable(key)}", exc)
            outcome, problem = "deferred", None
        if outcome != "deferred":
            self.fleet.count_audit(volunteer)
        if outcome == "passed":
            return
        shards.pop(key, None)  # rejected or left whole: nothing of it stays unaudited
        self.withdrawn.add(key)
        self.ledger.release([g.digest for g in untrained])
        if self.share is not None:
            self._released += [g.digest for g in untrained]
        if problem:
            self.fleet.revoke(volunteer, groups[0].shard_size)
            self._reject(key, problem[0], problem[1], stats, groups[0].shard_size)
        else:
            self.log(f"left {printable(key)}: its re-audit cannot run now; {len(untrained)} groups "
                     "withdrawn, charged to nobody")

    def _trainer_fault(self, key: str, exc: BaseException, stats: IngestStats) -> None:
        """A fault of the trainer's own while taking `key` (its replay raised, memory ran
        out): never charged to the volunteer. The shard is read again at later polls, and
        after MAX_TRAINER_FAULTS faults left for this process (`trainer_error`, no ledger
        record: a restarted trainer tries again)."""
        self.faults[key] += 1
        n = self.faults[key]
        self._log_trace(f"{type(exc).__name__} of the trainer's own while taking {printable(key)} "
                        f"({n} of {MAX_TRAINER_FAULTS}; not charged to its volunteer)", exc)
        if n >= MAX_TRAINER_FAULTS:
            self.taken.add(key)
            stats.trainer_errors += 1
            self.log(f"left {printable(key)}: trainer_error after {n} faults of the trainer's own")

    def _log_trace(self, what: str, exc: BaseException) -> None:
        trace = "".join(traceback.format_exception(exc)).splitlines()  # may quote the shard
        self.log(f"error: {what}:\n" + "\n".join(printable(line, 1000) for line in trace))

    def _numbered(self, key: str, groups: list[ScoredGroup]) -> str | None:
        """Record the shard's group numbers (withheld.GroupNumbers); the reason code if they
        are refused. A shard re-read after a restart, half taken, is fine."""
        author = layout.rollout_author(key)
        if author is None or not groups:
            return None
        return self.numbers.add(author[1], key, groups[0].policy_version, [g.seq for g in groups])

    def _sort(self, key: str, groups: list[ScoredGroup], stats: IngestStats) -> list[ScoredGroup]:
        """Give zero-variance and duplicate groups their outcome now; return the rest."""
        usable, zero, dup = [], [], []
        for g in groups:
            g.shard_size = len(groups)
            if self.ledger.is_done(key, g.line):
                continue
            if not self.ledger.claim(g.digest, g.policy_version, g.volunteer_id):
                dup.append(g)
                continue
            if self.share is not None:
                self._claims.append([g.digest, g.policy_version, g.volunteer_id])
            if self.observe is not None:
                self.observe(g.prompt_id, g.rewards)
            if max(g.rewards) == min(g.rewards):
                zero.append(g)
            else:
                usable.append(g)
        n = len(groups)
        if zero:
            self.ledger.record(key, "zero_variance", [g.line for g in zero], n, [g.digest for g in zero])
        if dup:
            self.ledger.record(key, "duplicate", [g.line for g in dup], n)
        self.ledger.set_size(key, n)
        stats.groups += len(groups)
        stats.zero_variance += len(zero)
        stats.duplicates += len(dup)
        if self.log_shards:
            self.log(f"took {printable(key)}: {len(usable)} usable, {len(zero)} zero-variance, "
                     f"{len(dup)} duplicate")
        return usable

    def reject(self, key: str, reason: str, detail: str, stats: IngestStats) -> None:
        """Reject a shard after intake (the trainer found its groups poison a step)."""
        self._reject(key, reason, detail, stats)

    def _reject(self, key: str, reason: str, detail: str, stats: IngestStats, groups: int = 1) -> None:
        """Record the rejection (ledger, quarantine/, counts) of a shard of `groups` groups
        (1 when they were not counted); deny a volunteer that keeps sending bad shards, and
        audit what was taken from it without an audit (_caught)."""
        self.taken.add(key)
        self.withdrawn.add(key)
        stats.rejected[reason] += 1
        self.ledger.record(key, "rejected", [], 0, reason=reason)
        self.log(f"rejected {printable(key)}: {printable(detail)}")
        record = {"key": key[:1024], "reason": reason, "detail": detail[:1000], "time": time.time()}
        try:
            self.storage.create(layout.quarantine_key(key), json.dumps(record).encode())
        except (AlreadyExists, ValueError):
            pass  # rejected before a restart: the first record stands
        except StorageError as exc:
            self.log(f"warning: {exc}")
        self._count(key, False, stats, groups)
        author = layout.rollout_author(key)
        if author is not None:
            self.unaudited.get(author[1], {}).pop(key, None)
            self._caught(author[1], stats)

    def _count(self, key: str, accepted: bool, stats: IngestStats, groups: int = 1) -> None:
        parsed = layout.rollout_author(key)
        if parsed is None:
            return
        volunteer = parsed[1]
        stats.by_volunteer.setdefault(volunteer, [0, 0])[0 if accepted else 1] += 1
        if self.fleet.note(volunteer, accepted, groups):
            c = self.fleet.counts[volunteer]
            reason = (f"{c.rejected} of {c.accepted + c.rejected} shards "
                      f"({c.rejected_groups} of {c.accepted_groups + c.rejected_groups} groups) rejected")
            try:
                self.fleet.deny(self.storage, volunteer, reason)
                self.log(f"denied volunteer {volunteer}: {reason}; lift with "
                         f"`vrl volunteers allow {volunteer}`")
            except Exception as exc:
                self.log(f"warning: could not deny {volunteer}: {exc}")
