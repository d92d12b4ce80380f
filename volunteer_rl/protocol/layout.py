"""Every object key in the bucket is built and parsed here, and nowhere else.

The bucket is the protocol between the trainer and volunteers that may run older builds, so
the layout is written down in docs/PROTOCOL.md and versioned by SCHEMA_VERSION. Keys are
relative to the bucket root (the storage object adds any prefix from the URI).

    manifest.json                                   the commit point (overwritten)
    manifests/v000042.json                          write-once copy of each version's manifest
    checkpoints/v000042/<file>                      immutable checkpoint files
    datasets/<name>-<sha12>.csv                     the train split volunteers sample prompts from
    rollouts/v000042/<volunteer_id>/<shard>.jsonl.gz  gzip JSONL shards, one line per prompt group
    rollouts/v000042/<volunteer_id>/ask-<block>-<n>   a volunteer's ask for group numbers (empty)
    grants/<volunteer_id>.json                      the numbers granted to it (trainer, overwritten)
    metrics/v000042.jsonl                           trainer metrics of the steps that led to v42
    ledger/v000042.jsonl                            what the steps that led to v42 did with each shard
    credit/v000042.json                             each volunteer's credit as of v42 (protocol.credit)
    quarantine/v000042/<volunteer_id>/<shard>.json  why a shard was rejected
    denylist.json                                   volunteers whose shards are skipped (overwritten)
    volunteers/<volunteer_id>.json                  each volunteer's heartbeat (overwritten by it)
    fleet.json                                      the trainer's summary of the fleet (overwritten)
    dashboard/index.html, dashboard/<plot>.png      a page and its plots for people (overwritten)

The staleness window, which rollouts/v*/ prefixes are still live, is defined here too.
"""

from __future__ import annotations

import hashlib
import re

SCHEMA_VERSION = 10
"""2: groups carry `seq` and sample with committed noise (protocol.draws). 3: the manifest's
`weights` names the weights by pieces and by a chain of keyframe and patches (protocol.patch).
4: the weights file is named by the root of its pieces (manifest.pieces_root), not by its
sha256, and patches (format 2) name their base and target by root. 5: tokens are drawn by
Gumbel-max over committed per-token noise (protocol.draws, "vrl-draw-v2"), not by inverse CDF.
6: a group's prompt is drawn from the manifest's `prompt_pool` by its number, and numbers run
across the versions of a run (protocol.draws.pool_prompt). 7: the manifest's `quota` says how
many groups of the version each volunteer should sample before it waits for the next
(manifest.Quota). 8: the manifest's `task` names the task's package and version too
(manifest.TaskRef), and the calculator is one task of several. 9: group numbers are granted
by the trainer in blocks bound to one version, and a block's nonce keys its prompt and noise
(protocol.grants; "vrl-draw-v3", "vrl-prompt-v2"). 10: the manifest's `adapter` (null, or a
LoRA version's base, rank, alpha and targets) and its adapter file (manifest.AdapterRef).
Readers refuse any other value: a volunteer of schema 2 cannot fetch a version published as a patch, nor check the pieces; one of schema 3 would look for a sha256 the manifest no longer
gives; one of schema 4 would sample tokens the replay rejects; one of schema 5 would choose its
prompts, which the trainer refuses (`prompt_mismatch`); one of schema 6 would not stop at its
quota; one of schema 7 would sample any task's prompts as calculator problems; one of schema 8
would number its groups itself and draw without a nonce (`prompt_mismatch`); one of schema 9
would sample a LoRA version with its base's weights alone, and every group fail its replay."""
MANIFEST = "manifest.json"
MANIFESTS = "manifests"
CHECKPOINTS = "checkpoints"
ROLLOUTS = "rollouts"
DATASETS = "datasets"
METRICS = "metrics"
LEDGER = "ledger"
CREDIT = "credit"
QUARANTINE = "quarantine"
DENYLIST = "denylist.json"
VOLUNTEERS = "volunteers"
FLEET = "fleet.json"
DASHBOARD = "dashboard"
GRANTS = "grants"

# Volunteer ids and shard names end up in object keys: keep them to a safe alphabet so no id
# can climb out of its prefix ("../") or collide with another after normalisation. Every
# pattern here is matched whole with fullmatch (`$` would let a trailing newline through) and
# spells digits [0-9] (`\d` also matches other scripts' digits, which int() accepts).
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_VERSION_DIR = re.compile(r"v([0-9]{6,})")
SHARD_SUFFIX = ".jsonl.gz"


def window(current: int, max_staleness: int) -> range:
    """The staleness rule: the policy versions whose rollouts a trainer at version `current`
    takes, oldest to newest: `current` and the `max_staleness` before it, none below v0.

    It decides which rollouts/v*/ prefixes are still live, so it sits with the keys. Every
    other form of the rule (in_window, the trainer's intake, retention, `vrl status`, the
    volunteer's check of its weights) is read off this range."""
    return range(max(0, current - max_staleness), current + 1)


def in_window(lag: int, max_staleness: int) -> bool:
    """Groups sampled `lag` versions behind the trainer may be trained on (`lag` < 0: from a
    version the trainer has not reached, never).

    The window of a trainer at version `max_staleness` is the one v0 does not cut short, so
    the lags it accepts are the lags of any window."""
    return max_staleness - lag in window(max_staleness, max_staleness)


def is_safe_name(name: str) -> bool:
    """True if `name` may be used as one path component of a key (no slashes, no '..')."""
    return isinstance(name, str) and bool(SAFE_NAME.fullmatch(name)) and ".." not in name


def version_dir(version: int) -> str:
    """`v000042` for 42; zero-padded so keys sort in version order."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"v{version:06d}"


def parse_version_dir(name: str) -> int | None:
    """42 for `v000042`, None for anything else."""
    m = _VERSION_DIR.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


_VERSIONED_NAME = re.compile(r"v([0-9]{6,})(?:\.[a-z]+)*")


def versioned_prefix(top: str, version: int) -> str:
    """`checkpoints/v000042` for ("checkpoints", 42): everything one version filed under `top`."""
    return f"{top}/{version_dir(version)}"


def split_versioned_key(key: str) -> tuple[str, int] | None:
    """(top-level prefix, version) of a key filed by version, else None.

    Both shapes of the layout parse: a version folder (`checkpoints/v000042/model.safetensors`,
    `rollouts/v000042/<id>/<shard>.jsonl.gz`) and a version file (`manifests/v000042.json`,
    `metrics/v000042.jsonl`). Retention decides what to keep by this; a key that does not
    parse is never deleted by it."""
    parts = key.strip("/").split("/")
    if len(parts) < 2:
        return None
    m = _VERSIONED_NAME.fullmatch(parts[1])
    if m is None or (len(parts) > 2 and "." in parts[1]):
        return None
    return parts[0], int(m.group(1))


def manifest_history_key(version: int) -> str:
    """Each version's manifest, kept so any published version can be fetched and verified."""
    return f"{MANIFESTS}/{version_dir(version)}.json"


def checkpoint_prefix(version: int) -> str:
    return versioned_prefix(CHECKPOINTS, version)


def checkpoint_key(version: int, filename: str) -> str:
    if not is_safe_name(filename):
        raise ValueError(f"unsafe checkpoint file name: {filename!r}")
    return f"{checkpoint_prefix(version)}/{filename}"


def dataset_key(name: str, sha256: str) -> str:
    """Datasets are content-addressed so a changed file can never replace a published one."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:40] or "dataset"
    return f"{DATASETS}/{stem}-{sha256[:12]}.csv"


def rollout_version_prefix(version: int) -> str:
    return versioned_prefix(ROLLOUTS, version)


def rollout_volunteer_prefix(version: int, volunteer_id: str) -> str:
    if not is_safe_name(volunteer_id):
        raise ValueError(f"unsafe volunteer id: {volunteer_id!r}")
    return f"{rollout_version_prefix(version)}/{volunteer_id}"


def shard_key(version: int, volunteer_id: str, shard_name: str) -> str:
    if not is_safe_name(shard_name):
        raise ValueError(f"unsafe shard name: {shard_name!r}")
    return f"{rollout_volunteer_prefix(version, volunteer_id)}/{shard_name}{SHARD_SUFFIX}"


def parse_shard_key(key: str) -> tuple[int, str, str] | None:
    """(version, volunteer_id, shard_name) for a well-formed shard key, else None.

    The trainer only trusts what this returns: a key that does not parse is not a shard.
    """
    parts = key.strip("/").split("/")
    if len(parts) != 4 or parts[0] != ROLLOUTS or not parts[3].endswith(SHARD_SUFFIX):
        return None
    version = parse_version_dir(parts[1])
    name = parts[3][: -len(SHARD_SUFFIX)]
    if version is None or not is_safe_name(parts[2]) or not is_safe_name(name):
        return None
    return version, parts[2], name


def rollout_author(key: str) -> tuple[int, str] | None:
    """(version, volunteer id) of any key under a volunteer's rollouts prefix, shard or not.

    The deployed policies let a volunteer write only under `rollouts/*/<its id>/`, so whatever
    sits there (junk names included) is charged to that id; None for keys outside any."""
    parts = key.split("/")
    if len(parts) < 4 or parts[0] != ROLLOUTS or not is_safe_name(parts[2]):
        return None
    version = parse_version_dir(parts[1])
    return None if version is None else (version, parts[2])


def metrics_key(version: int) -> str:
    return f"{METRICS}/{version_dir(version)}.jsonl"


def parse_metrics_key(key: str) -> int | None:
    """The version of a well-formed metrics key (`metrics/v000042.jsonl`), else None."""
    parts = key.strip("/").split("/")
    if len(parts) != 2 or parts[0] != METRICS or not parts[1].endswith(".jsonl"):
        return None
    return parse_version_dir(parts[1][: -len(".jsonl")])


def ledger_key(version: int) -> str:
    """The trainer's record of every shard outcome in the steps that led to `version`."""
    return f"{LEDGER}/{version_dir(version)}.jsonl"


def credit_key(version: int) -> str:
    """Each volunteer's credit as of `version` (protocol.credit): one small JSON object."""
    return f"{CREDIT}/{version_dir(version)}.json"


def quarantine_key(key: str) -> str:
    """Where the reason an object under rollouts/ was rejected is kept: a shard's own key under
    quarantine/ (`.json` for `.jsonl.gz`); any other object of a volunteer's prefix as
    `junk-<sha256 of its key, 16 hex>.json` in that volunteer's folder. ValueError for a key
    outside every volunteer's prefix."""
    parsed = parse_shard_key(key)
    if parsed is not None:
        version, volunteer, name = parsed
        return f"{QUARANTINE}/{version_dir(version)}/{volunteer}/{name}.json"
    author = rollout_author(key)
    if author is None:
        raise ValueError(f"not under a volunteer's rollouts prefix: {key[:100]!r}")
    digest = hashlib.sha256(key.encode(errors="surrogatepass")).hexdigest()[:16]
    return f"{QUARANTINE}/{version_dir(author[0])}/{author[1]}/junk-{digest}.json"


def heartbeat_key(volunteer_id: str) -> str:
    """`volunteers/<id>.json`: the one object a volunteer overwrites, its heartbeat."""
    if not is_safe_name(volunteer_id):
        raise ValueError(f"unsafe volunteer id: {volunteer_id!r}")
    return f"{VOLUNTEERS}/{volunteer_id}.json"


def parse_heartbeat_key(key: str) -> str | None:
    """The volunteer id of a well-formed heartbeat key, else None."""
    parts = key.strip("/").split("/")
    if len(parts) != 2 or parts[0] != VOLUNTEERS or not parts[1].endswith(".json"):
        return None
    volunteer = parts[1][: -len(".json")]
    return volunteer if is_safe_name(volunteer) else None


def dashboard_key(name: str) -> str:
    """`dashboard/<name>`: one object of the dashboard, which its page links by `name` alone."""
    if not is_safe_name(name):
        raise ValueError(f"unsafe dashboard file name: {name!r}")
    return f"{DASHBOARD}/{name}"


def parse_dashboard_key(key: str) -> str | None:
    """The file name of a well-formed dashboard key, else None."""
    parts = key.strip("/").split("/")
    if len(parts) != 2 or parts[0] != DASHBOARD or not is_safe_name(parts[1]):
        return None
    return parts[1]
