"""Typed settings of the trainer and the volunteer, and the values each setting accepts.

This is the one place for a setting's default, its meaning (the docstring under the field) and
its allowed values (`setting(...)`): tests and benchmarks build these classes directly, and the
CLI makes its options from them (cli/options.py: the default is the field's, the help is the
first sentence of its docstring, the flag is `flag(name)`). A value out of range raises
ConfigError when the object is built, naming the flag as the user spells it. Defaults are the
embedded demo's choices.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from volunteer_rl.errors import ConfigError

PACKAGE_DATA = Path(__file__).resolve().parent.parent / "data"


# ---------------------------------------------------------------------------------------------
# Where a command keeps its local state when --work-dir is not given: a folder per user and
# per bucket, so a trainer or volunteer restarted from another folder finds the same signing
# key, optimizer state, volunteer ids and pinned keys (a default relative to the current
# folder made a new key there, which then could not resume the run).

def user_state_dir() -> Path:
    """The per-user folder of vrl's state: $XDG_STATE_HOME/vrl where that is set (to an
    absolute path, as the XDG spec asks), else ~/Library/Application Support/vrl on macOS,
    %LOCALAPPDATA%\\vrl on Windows, and ~/.local/state/vrl (XDG's default) elsewhere."""
    xdg = os.environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "vrl"
    if sys.platform == "win32":
        local = os.environ.get("LOCALAPPDATA", "")
        return (Path(local) if os.path.isabs(local) else Path.home() / "AppData" / "Local") / "vrl"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "vrl"
    return Path.home() / ".local" / "state" / "vrl"


def bucket_folder_name(bucket: str) -> str:
    """A folder name for a bucket: its URI's readable tail, then 10 hex digits of the sha256 of
    the URI (a folder bucket's absolute path, so `./b` from two folders are two buckets and
    one folder reached by two relative paths is one). The endpoint is not part of it: one
    s3:// bucket reached through two endpoint spellings keeps one state."""
    local = bucket[len("file://"):] if bucket.startswith("file://") else (
        None if "://" in bucket else bucket)
    uri = str(Path(local).expanduser().resolve()) if local is not None else bucket.rstrip("/")
    tail = Path(uri).name if local is not None else uri.replace("://", "-")
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "-", tail).strip("-.")[-40:].lstrip("-.") or "bucket"
    return f"{readable}-{hashlib.sha256(uri.encode()).hexdigest()[:10]}"


def default_work_dir(role: str, bucket: str) -> Path:
    """Where `role` (trainer, volunteer, eval) keeps its state for `bucket` without
    --work-dir: user_state_dir()/<role>/<bucket_folder_name>. Nothing is created here."""
    return user_state_dir() / role / bucket_folder_name(bucket)


ALGOS = ("reinforce", "grpo")
WEIGHTS_DTYPES = ("fp32", "bf16")
VERIFY_MODES = ("every", "sampled")
LOG_LEVELS = ("debug", "info", "warning", "error")
"""progress.LOG_LEVELS, which this room cannot import (tests/unit/test_logging.py checks
they are the same)."""
REPORT_TO = ("tensorboard", "wandb")
"""Where `--report-to` can send the trainer's metrics besides the bucket (trainer.reporters)."""

SHARD_REWARD_BOUNDS = 4.0
"""--shard-reward-seconds' default, in per-completion bounds (the task's reward_seconds): a
shard's rewards may take together what four of its completions may take each. The rewards
of vrl's own tasks take microseconds, so an honest shard of 2,048 completions uses under 1 %
of it; a shard of completions crafted to take most of their bound each is refused after
about five of them."""
POLL_REWARD_SHARE = 0.25
"""--poll-reward-seconds' default, as a share of --rank-timeout: a poll's rewards stay well
inside the time the other ranks wait for it in a collective (the rest of the poll, its reads,
audits and the step, need room too)."""
REWARD_SHARE = 0.03
"""--reward-share's default: the share of the trainer's wall time one volunteer's rewards may
take. The calculator's rewards of one demo volunteer take about 1.2 % of an idle 2-core
trainer's time (docs/PERFORMANCE.md, the reward rows alone), and of a volunteer of a larger
model far less (fewer groups a second); a volunteer sending worst-case rewards then costs
about this share, and issue 41's bench row (d) allows 10 %."""

LR = 3e-4
"""--lr's default with full fine-tuning (1e-3 collapsed the tiny model in calibration)."""
LORA_LR_FACTOR = 10.0
"""--lr's default with --lora-rank, in multiples of LR: "LoRA Without Regret" (Schulman et al.,
Thinking Machines, 2025) found the best LoRA learning rate about ten times full fine-tuning's,
for every rank, with alpha fixed (so B @ A is scaled by alpha / rank)."""
MAX_LORA_RANK = 1024
"""The highest --lora-rank, and the highest rank a manifest's adapter may state: far above any
rank RL needs (rank 1 matched full fine-tuning in that paper), and a bound on what a reader
allocates for one adapter."""
MAX_LORA_ALPHA = 1e6
LORA_TARGETS = re.compile(r"[A-Za-z0-9_.,-]{1,200}")
"""What --lora-targets (and a manifest's adapter.targets) may be: `all-linear` or module names
separated by commas."""

# Settings whose flag is not `--` plus the field name with dashes.
_FLAGS = {"volunteer_id": "--id"}


def flag(name: str) -> str:
    """The command-line flag of the setting `name`, as messages and `vrl --help` spell it."""
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def setting(default: Any, *, at_least: float | None = None, at_most: float | None = None,
            above: float | None = None, one_of: tuple[str, ...] | None = None,
            list_of: tuple[str, ...] | None = None, rate: bool | None = None) -> Any:
    """A field with `default` that accepts only at_least <= value <= at_most, value > above,
    one of `one_of`, `none` or a comma-separated list of `list_of` (`listed`), or with `rate`
    a number of bytes per second (`parse_rate`); checked when the settings object is built."""
    rules = {"at_least": at_least, "at_most": at_most, "above": above, "one_of": one_of,
             "list_of": list_of, "rate": rate}
    return field(default=default, metadata={k: v for k, v in rules.items() if v is not None})


def _why_not(rules: Mapping[str, Any], value: Any) -> str | None:
    """Why the rules of a setting refuse `value` ("must be at least 1, not 0"), or None if
    they allow it. None (an optional setting left unset) is always allowed."""
    if value is None:
        return None
    if "one_of" in rules and value not in rules["one_of"]:
        return f"use {' or '.join(rules['one_of'])}, not {value!r}"
    if "rate" in rules:
        try:
            parse_rate(value)
        except ValueError as exc:
            return str(exc)
    if "list_of" in rules and value != "none" and (
            not all(name in rules["list_of"] for name in value.split(","))):
        return (f"use none or a comma-separated list of {', '.join(rules['list_of'])}, "
                f"not {value!r}")
    # `not (value >= x)` rather than `value < x`: NaN fails every comparison and is refused.
    if "at_least" in rules and not value >= rules["at_least"]:
        return f"must be at least {rules['at_least']}, not {value!r}"
    if "at_most" in rules and not value <= rules["at_most"]:
        return f"must be at most {rules['at_most']}, not {value!r}"
    if "above" in rules and not value > rules["above"]:
        return f"must be more than {rules['above']}, not {value!r}"
    return None


def _field(cls: type, name: str) -> Field:
    return next(f for f in fields(cls) if f.name == name)


def why_not(cls: type, name: str, value: Any) -> str | None:
    """Why the field `name` of the settings class `cls` refuses `value`, without naming it
    (the CLI's option check says which flag), or None if it is allowed."""
    return _why_not(_field(cls, name).metadata, value)


def range_text(cls: type, name: str) -> str | None:
    """The values the field `name` of `cls` allows, for help ("x>=0", "0<x<=1", "grpo|...")."""
    rules = _field(cls, name).metadata
    if "rate" in rules:
        return "RATE"
    if "one_of" in rules:
        return "|".join(rules["one_of"])
    if "list_of" in rules:
        return "none|" + ",".join(rules["list_of"])
    low = (f"{rules['at_least']}<=" if "at_least" in rules
           else f"{rules['above']}<" if "above" in rules else "")
    if "at_most" in rules:
        return f"{low}x<={rules['at_most']}"
    if low:  # one-sided: written as x>=1, x>0
        return "x" + (f">={rules['at_least']}" if "at_least" in rules else f">{rules['above']}")
    return None


RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9,
              "ki": 2**10, "mi": 2**20, "gi": 2**30}
"""What a rate's unit multiplies its number by: SI k, M, G are powers of 1000 (as network
speeds are quoted), KiB, MiB, GiB powers of 1024. Case does not matter: 2m is 2M."""
_RATE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmg]i?)?(b)?(?:/s)?", re.IGNORECASE)


def parse_rate(text: str) -> int:
    """Bytes per second from a rate as a user writes it: a plain number of bytes (`250000`), or
    one with a unit, `500k`, `2M`, `1.5MB`, `10MiB`, `2MiB/s` (RATE_UNITS); 0 is no cap.
    ValueError, one line, for anything else: a bit rate (`8Mb`: a lowercase b), a
    negative number, a rate under 1 byte a second other than 0."""
    match = _RATE.fullmatch(str(text).strip())
    wanted = "use bytes per second such as 500k, 2M, 1.5MB or 10MiB, or 0 for no cap"
    if match is None:
        raise ValueError(f"{wanted}, not {text!r}")
    number, unit, byte = match.groups()
    if byte == "b":
        raise ValueError(f"{wanted}, not {text!r}: a lowercase b is bits, write B for bytes")
    rate = round(float(number) * RATE_UNITS[(unit or "").lower()])
    if rate < 1 and float(number) > 0:
        raise ValueError(f"{wanted}, not {text!r}: under 1 byte per second")
    return rate


def listed(value: str) -> tuple[str, ...]:
    """The names of a `list_of` setting's value: `tensorboard,wandb` -> both, `none` -> ()."""
    return () if value == "none" else tuple(dict.fromkeys(value.split(",")))


def check(cls: type, name: str, value: Any, where: str | None = None) -> None:
    """ConfigError unless `value` is allowed for the field `name` of the settings class `cls`
    (for code that takes one setting on its own, such as retention's keep_versions); the
    message names `where` (such as `run.toml: max_steps`) instead of the flag if given."""
    why = why_not(cls, name, value)
    if why:
        raise ConfigError(f"{where or flag(name)}: {why}")


class Checked:
    """Checks every field of the settings dataclass that derives from it when it is built."""

    def __post_init__(self) -> None:
        for f in fields(self):
            check(type(self), f.name, getattr(self, f.name))


@dataclass
class TrainerConfig(Checked):
    bucket: str
    """Bucket URI: a folder path, file://, s3://bucket/prefix, gs://bucket/prefix, memory://."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, R2, a test server); without one, AWS itself."""
    model: str = "tiny"
    """`tiny` (the project's own small Llama-shaped model, built offline) or a local Hugging
    Face model folder."""
    task: str = "calculator"
    """The task to train: an installed task's name (`vrl tasks` lists them; docs/TASKS.md)."""
    dataset: str | None = None
    """Train CSV with the task's columns (default: the task's own train rows, shipped with
    it)."""
    eval_dataset: str | None = None
    """Held-out CSV of the same columns (default: the task's own held-out rows, shipped with
    it)."""
    algo: str = setting("grpo", one_of=ALGOS)
    """`reinforce` (advantage r - group mean) or `grpo` (normalized advantage, clipped ratio)."""
    lr: float | None = setting(None, above=0)
    """AdamW learning rate of the RL phase (default: 3e-4, or ten times that with --lora-rank,
    as "LoRA Without Regret" found best for LoRA).

    The defaults are LR and LORA_LR_FACTOR."""
    k: int | None = setting(None, at_least=1)
    """Completions per prompt (group size) volunteers must sample (default: the task's; 8
    for the calculator and countdown)."""
    temperature: float = setting(1.0, above=0)
    """Sampling temperature volunteers must use; behavior logprobs are under logits / T."""
    max_new_tokens: int | None = setting(None, at_least=1)
    """Cap on generated tokens per completion (default: the task's; 32 for the calculator)."""
    max_staleness: int = setting(2, at_least=0)
    """Versions a group may lag the trainer and still be used: the oldest accepted policy
    version is current - max_staleness; older groups are dropped."""
    groups_per_step: int = setting(32, at_least=1)
    """Prompt groups in one optimizer step."""
    publish_every: int = setting(1, at_least=1)
    """Optimizer steps between published versions."""
    publish_min_seconds: float = setting(0.0, at_least=0)
    """Seconds at least between the starts of two publishes (0: no minimum): steps go on in
    between and the next publish carries them all, so a large model is not published faster
    than it uploads."""
    keyframe_every: int = setting(20, at_least=1, at_most=256)
    """Versions between keyframes (whole weights files); the versions between are published
    as patches when they are small enough (patch_max_fraction). A volunteer that falls behind
    or joins fetches the newest keyframe and at most this many patches minus one."""
    patch_max_fraction: float = setting(0.5, above=0, at_most=1)
    """A version is published as a patch only when the patch is at most this share of the
    whole weights file; otherwise it is a keyframe. 1 takes any patch smaller than the file."""
    keep_versions: int = setting(10, at_least=1)
    """Retention keeps the newest this many versions (and always the staleness window). Older
    checkpoints and rollout shards are deleted by `vrl gc` or by the trainer's own passes
    (gc_every)."""
    gc_every: int = setting(0, at_least=0)
    """Run a retention pass after every this many publishes (0: never; `vrl gc` does the same
    by hand), on a thread of its own, each pass bounded in listings and deletes; the next pass
    goes on where one stopped."""
    eval_every: int = setting(10, at_least=0)
    """Versions between held-out evaluations (0: none)."""
    eval_prompts: int = setting(200, at_least=1)
    """Held-out prompts used by the periodic evaluation (the final one uses all)."""
    eval_samples: int = setting(4, at_least=1)
    """Samples per prompt for the sampled-accuracy estimate."""
    warm_start_steps: int = setting(900, at_least=0)
    """Supervised steps before v0 when the model is built from scratch (`tiny`)."""
    warm_start_max_passes: float = setting(4.0, at_least=0)
    """When the warm start's steps of 64 rows would pass over the training rows more than this
    many times (a small dataset), it trains on half of the rows only and RL samples the other
    half: a warm start that memorises the rows RL samples leaves RL nothing to learn. 0:
    never split."""
    warm_start_threads: int = setting(0, at_least=0)
    """torch CPU threads during the warm start alone (0: as --threads). Before v0 volunteers
    have nothing to sample: `vrl demo` gives the warm start every core, RL --threads 1."""
    seed: int = setting(0, at_least=0)
    """Seeds model init, the warm start, batch order and the curriculum's pools."""
    curriculum: bool = True
    """Fill each version's prompt pool where groups are likely to have reward variance, by
    difficulty stratum, skipping most prompts whose last group was all right or all wrong;
    off: uniformly at random."""
    prompt_pool: int = setting(256, at_least=1, at_most=4096)
    """Prompts in each version's pool (the manifest's `prompt_pool`, at most 4,096):
    volunteers' groups are drawn from it by group number. Large enough that the
    groups of one version rarely share a prompt."""
    max_steps: int = setting(0, at_least=0)
    """Stop after this many optimizer steps (0: no limit)."""
    max_seconds: float = setting(0.0, at_least=0)
    """Stop after this many seconds of RL after v0 is published (0: no limit)."""
    poll_seconds: float = setting(0.2, above=0)
    """Seconds between bucket listings while waiting for rollouts (one LIST per window
    version)."""
    threads: int = setting(0, at_least=0)
    """torch CPU threads of the whole process, from its start: model build, warm start (unless
    --warm-start-threads) and RL (0: torch's default, one per core)."""
    device: str = "auto"
    """cuda, mps, cpu or auto."""
    rank_timeout: float = setting(600.0, above=0)
    """Under torchrun (several ranks): seconds a rank waits to join the others, and for any
    collective after that, before it fails with an error instead of hanging. The other ranks
    wait in a collective while the writer (rank 0) warm-starts, publishes, evaluates or reads
    shards, so it must cover the longest of those. A single process ignores it, but for the
    default of --poll-reward-seconds."""
    work_dir: str | None = None
    """Local folder of this trainer's state: its signing key, the optimizer between publishes
    (state/) and checkpoint staging (default: trainer/<bucket>-<hash> in the per-user state
    folder, $XDG_STATE_HOME/vrl or ~/.local/state/vrl on Linux, ~/Library/Application
    Support/vrl on macOS, %LOCALAPPDATA%\\vrl on Windows): one per bucket, so a trainer
    restarted from any folder finds the same key and state. Under torchrun on several nodes
    give one folder they all share."""
    micro_batch: int = setting(256, at_least=1)
    """Rows per forward/backward pass; gradients are accumulated over a step's rows."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them from
    the forward: less memory in a step, for more time.

    Activation checkpointing (model.recompute): a step keeps each layer's inputs only, and
    runs each layer's forward once more in the backward. The loss, the gradients and the
    step's replay of its groups are unchanged; it works with --lora-rank and under torchrun.
    Its price, one torch thread, train_step on its own: the demo's tiny model (32 groups of
    8, full fine-tuning) 0.26-0.27 s a step without, 0.30-0.32 s with (1.14-1.16x); the Qwen3-0.6B
    shape with --lora-rank 1 (2 groups of 8, one a micro-batch) 6.9 s against 9.5 s (1.37x).
    What it saves: docs/LORA.md, the trainer host's memory."""
    lora_rank: int = setting(0, at_least=0, at_most=MAX_LORA_RANK)
    """Train rank-R LoRA adapters and publish each version as its adapter, on a base
    published once (0: train every weight). One process only; docs/LORA.md says when."""
    lora_alpha: float = setting(32.0, above=0, at_most=MAX_LORA_ALPHA)
    """LoRA's alpha: an adapter adds (alpha / rank) * B @ A to each adapted weight."""
    lora_targets: str = "all-linear"
    """The layers --lora-rank adapts: `all-linear` (every linear layer but the output
    embedding), or module names separated by commas, as q_proj,v_proj."""
    weights_dtype: str = setting("fp32", one_of=WEIGHTS_DTYPES)
    """dtype of the published weights: `fp32`, or `bf16` (half the bytes per version for every
    volunteer to download). The trainer keeps fp32 master weights either way; with bf16 it
    audits behavior logprobs and evaluates against the bf16-rounded weights volunteers run
    (held in a second fp32 copy of the model), and saves its fp32 master in its state so a
    resume does not lose the low bits. Volunteers upcast bf16 weights to fp32 exactly."""
    audit_tolerance: float = setting(0.05, at_least=0)
    """Largest gap (nats) allowed between a volunteer's behavior logprob of a token and the
    trainer's own in an audited group (0: no audit at all). A shard beyond it is rejected
    (`logprob_mismatch`)."""
    replay_tolerance: float = setting(5e-5, at_least=0)
    """How far (nats) an audited token's perturbed score may fall below the top one of the
    trainer's replay of its committed draw: the runner-up of a near-tie passes within it (room
    for float noise between machines), nothing else does; 0 accepts only the replay's own
    token. A token beyond it was not sampled (`replay_mismatch`). Audits are off only with
    --audit-tolerance 0."""
    audit_share: float = setting(0.1, above=0, at_most=1)
    """Share of the trainer's wall time the audit may take; a shard drawn for an audit when it
    is spent waits for a later poll."""
    audit_full_groups: int = setting(10, at_least=1)
    """A volunteer has every shard audited until its shards accepted since its last rejected
    one hold this many groups. After n such groups, with --verify sampled, each group is drawn
    at a rate full_groups / n (never below --audit-floor), and a shard is audited if any of
    its groups is drawn; with --verify every none is, as each of its groups is replayed before
    it is trained."""
    audit_floor: float = setting(0.005, above=0, at_most=1)
    """With --verify sampled, the lowest rate at which a trusted volunteer's groups are drawn
    for an audit: a shard of g groups is audited with a chance of at least 1 - (1 - floor)^g
    (16 groups: 7.7 %, 256 groups: 72 %)."""
    audit_cover_floor: float = setting(0.3, at_least=0, at_most=1)
    """With --verify every, the least share of a volunteer's groups that no step trains
    (all rewards equal, or content taken before) replayed at intake, each group drawn on its
    own (at its volunteer's audit rate while that is higher). No step replays them, yet each
    counts its number as received, so a made-up one would hide a group its volunteer kept
    back; one that fails denies its volunteer. A coverer gets about (1 - floor) / floor of
    them through per identity (about 2 at 0.3), on top of the --missing-bound share any
    volunteer may leave out; 1 replays every one (in the demo, about half of what volunteers
    send). 0 leaves them at the audit rate alone (down to --audit-floor)."""
    verify: str = setting("every", one_of=VERIFY_MODES)
    """Which groups are replayed against their committed draws before they are trained:
    `every` group of every step (one forward pass each with its version's weights, unless an
    intake audit replayed it already; one that fails is dropped from the step, its shard
    rejected, and a token its draw cannot give denies its volunteer at once), or `sampled`:
    only the shards the intake's audits draw (--audit-full-groups, --audit-floor), which lets
    a patient liar get about 1/rate lying groups trained. Nothing is replayed with
    --audit-tolerance 0."""
    shard_reward_seconds: float | None = setting(None, above=0)
    """CPU seconds the trainer's rewards of one shard's completions may take together; over
    it the shard is rejected (`reward_budget`), as are shards whose rewards take over
    max(10x, +5 s) of it in wall clock (default: SHARD_REWARD_BOUNDS, 4, times the task's
    reward_seconds). An honest shard must fit: raise it for a task whose rewards cost more."""
    poll_reward_seconds: float | None = setting(None, above=0)
    """Wall-clock seconds one poll's rewards may take (each rank's own poll under torchrun);
    the shards left wait for the next poll, and each volunteer's shards get an equal share of
    it, at least one shard's budget (default: POLL_REWARD_SHARE, a quarter, of
    --rank-timeout)."""
    reward_share: float = setting(REWARD_SHARE, above=0, at_most=1)
    """Share of the trainer's wall time (each rank's, under torchrun) the rewards of one
    volunteer's shards may take: past it its next shards wait unread, not rejected, until its
    share has grown back, so a volunteer whose rewards are slow (hostile or an honestly
    expensive task) is slowed, and no volunteer takes the trainer's time from the others.
    Raise it for a task whose honest rewards cost more."""
    deny_after: int = setting(5, at_least=0)
    """Rejected shards after which a volunteer goes on the denylist (0: never automatically,
    not even for forged tokens, which otherwise deny at the first)..."""
    deny_rate: float = setting(0.5, at_least=0, at_most=1)
    """...provided at least this share of all its shards was rejected."""
    missing_bound: float = setting(0.05, at_least=0, at_most=1)
    """Most share of a volunteer's last 1,024 group numbers that may be missing while its
    groups are trained (a block of 8 numbers with one missing counts whole): over it its
    groups wait untrained, so a volunteer cannot upload only the groups it likes. Honest
    volunteers miss none; a crash loses a shard (1: no price)."""
    dashboard_every: float = setting(60.0, at_least=0)
    """Seconds between writes of dashboard/ (index.html and PNG plots), the first this long
    after the start, plus one at the last publish; never sooner than 50 times the last
    write's duration after it, so they cost the trainer at most 2 % of its time (0: never;
    `vrl dashboard` does the same by hand). Step metrics record it as `time/dashboard`."""
    log_shards: bool = False
    """Log one line per shard taken (usable, zero-variance, duplicate groups)."""
    log_level: str = setting("info", one_of=LOG_LEVELS)
    """Log lines of this level and above: `debug`, `info` (steps, publishes, status lines),
    `warning` or `error` (the lines that start with `warning:` or `error:`). Under torchrun
    each rank's lines start with `[rank R]`."""
    report_to: str = setting("none", list_of=REPORT_TO)
    """Also report every metrics line to `tensorboard`, `wandb`, both (`tensorboard,wandb`)
    or `none`, as the Hugging Face trainers' report_to does. The same names and values as
    metrics/ in the bucket (the numbers only), at the step they belong to; rank 0 alone
    reports. tensorboard: event files under --logging-dir (pip install
    tensorboard); wandb: Weights & Biases in offline mode, where it is
    installed (`wandb sync` uploads the run later)."""
    logging_dir: str | None = None
    """Folder of the --report-to files (default: <work_dir>/runs/<run id>)."""
    signing_key: str | None = None
    """The trainer's Ed25519 private key (PEM) that signs every manifest (default:
    <work_dir>/signing-key.pem). Created if missing only while the bucket has no signed
    manifest: a bucket that has a run is resumed only with the key that signed it. Keep it on
    this host, never in the bucket."""
    allow_unsigned: bool = False
    """Resume a bucket whose manifest is unsigned (written by a trainer from before signing)."""
    # -- balance (trainer/balance.py) --
    quota_headroom: float = setting(1.5, at_least=0, at_most=100)
    """Each volunteer is asked for this many times its share of the groups a version needs (0:
    no quota, volunteers sample until the next version). The manifest's `quota`: groups per
    step, less the usable groups in hand, over the share of groups received that are usable
    and over the volunteers sending them (trainer/balance.py)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.work_dir is None:  # resolved once, so every part of the trainer sees one folder
            self.work_dir = str(default_work_dir("trainer", self.bucket))
        if self.lr is None:  # resolved once too: the optimizer and the run's config see it
            self.lr = LR * (LORA_LR_FACTOR if self.lora_rank else 1.0)
        if not LORA_TARGETS.fullmatch(self.lora_targets):
            raise ConfigError(f"{flag('lora_targets')}: {self.lora_targets!r:.60} is not "
                              "all-linear or module names separated by commas")

    def with_task_defaults(self, task) -> "TrainerConfig":
        """These settings with each one left unset (k, max_new_tokens) taken from the task's
        suggestion (task.base.Task), and the reward budgets unset derived from the task's
        reward_seconds and --rank-timeout."""
        return replace(self, k=self.k or task.k,
                       max_new_tokens=self.max_new_tokens or task.max_new_tokens,
                       shard_reward_seconds=(self.shard_reward_seconds
                                             or SHARD_REWARD_BOUNDS * task.reward_seconds),
                       poll_reward_seconds=(self.poll_reward_seconds
                                            or POLL_REWARD_SHARE * self.rank_timeout))


@dataclass
class VolunteerConfig(Checked):
    bucket: str
    """Bucket URI, as for the trainer."""
    endpoint_url: str | None = None
    """S3-compatible endpoint, as for the trainer."""
    volunteer_id: str | None = None
    """Volunteer id, the name in object keys (default: the one this --work-dir saved, else a
    new one, the sanitized hostname plus a random suffix, saved there for the next start)."""
    prompts_per_batch: int = setting(0, at_least=0)
    """Prompts sampled per generate round, K completions each, in batched calls of at most 256
    completions (0: auto, 32 for a model under 5 M parameters, 16 for bigger ones, whose rows'
    KV cache takes memory)."""
    shard_groups: int = setting(32, at_least=1)
    """Upload a shard once it holds this many groups..."""
    shard_seconds: float = setting(20.0, at_least=0)
    """...or once its oldest group is this many seconds old."""
    poll_seconds: float = setting(1.0, above=0)
    """Seconds between manifest polls while there is nothing to do."""
    max_groups_per_version: int = setting(0, at_least=0)
    """Generate at most this many groups with one version, then wait for the next (0: no cap).
    A trainer takes only so many groups per version; past that, donated compute only makes
    groups that go stale."""
    cap_patience_seconds: float = setting(2.0, at_least=0)
    """At the cap, wait this long for a new version before making one more batch anyway."""
    manifest_grace_seconds: float = setting(60.0, at_least=0)
    """Keep generating through manifest read failures for at most this long."""
    heartbeat_seconds: float = setting(30.0, at_least=0)
    """Seconds between heartbeats, overwrites of volunteers/<id>.json from a thread (0: none).
    `vrl status` calls a volunteer offline after two of its periods without one."""
    max_seconds: float = setting(0.0, at_least=0)
    """Stop after this many seconds (0: until Ctrl-C or SIGTERM)."""
    log_shards: bool = False
    """Log one line per shard uploaded (its key, groups, mean reward). Without it a volunteer
    logs one summary line every 10 s."""
    log_level: str = setting("info", one_of=LOG_LEVELS)
    """Log lines of this level and above: `debug`, `info` (uploads, versions, status lines),
    `warning` or `error` (the lines that start with `warning:` or `error:`)."""
    threads: int = setting(0, at_least=0)
    """torch CPU threads of the whole process, from its start: loading and sampling (0: auto,
    torch's default while loading, then for sampling one thread for a model of under 5 M
    parameters on the CPU and torch's default otherwise)."""
    nice: int = setting(10, at_least=0, at_most=19)
    """Lower this process's CPU priority by this much at start (POSIX niceness; 0: leave it).
    Donated cycles should only be the idle ones, as with BOINC: the owner's work comes first.
    On one machine shared with a trainer it also leaves the trainer, the bottleneck, its core."""
    cpu_share: float = setting(1.0, above=0, at_most=1)
    """Use at most this share of the cores this process may run on, on average over a batch and
    its rest: it samples a batch, then rests, then asks for more (1: no limit). 0.5 on a 4-core
    laptop is 2 cores' worth."""
    pause_when_busy: float = setting(0.0, at_least=0, at_most=1)
    """Pause sampling while the rest of the machine uses more than this share of its CPU (all
    cores), and resume once it falls under 0.8 of it, as BOINC's "suspend when non-BOINC usage
    is above" (0: never). Numbers already granted are still sampled before they would go
    stale, so a pause leaves none missing."""
    run_on_battery: bool = False
    """Keep sampling on battery power. Without it a volunteer pauses while the machine runs on
    battery, where psutil can tell (a machine with no battery sensor is said once and treated
    as on mains)."""
    device: str = "auto"
    """cuda, mps, cpu or auto."""
    work_dir: str | None = None
    """Local folder of this volunteer's state: its saved ids, pinned keys, group numbers, the
    cached dataset and checkpoints (default: volunteer/<bucket>-<hash> in the per-user state
    folder, $XDG_STATE_HOME/vrl or ~/.local/state/vrl on Linux). One per bucket, as for the
    trainer, so a volunteer restarted from any folder comes back with the same id."""
    trust_key: str | None = None
    """The trainer's public key (`ed25519:...` or a file holding it); without it the key of the
    first manifest seen is trusted and pinned for this bucket, in <work_dir>/trusted-keys.json."""
    allow_unsigned: bool = False
    """Accept manifests with no signature (an older trainer); signed ones are still checked."""
    max_download_rate: str = setting("0", rate=True)
    """Bytes per second this volunteer downloads at most, over all it reads from the bucket: a
    number with k, M, G (1000-based) or KiB, MiB, GiB (1024-based), such as 500k, 2M or 10MiB
    (0: no cap). Manifest polls, checkpoint files, patches, adapters and the dataset alike,
    averaged over each transfer (storage/pace.py; docs/LIMITS.md for its granularity)."""
    max_upload_rate: str = setting("0", rate=True)
    """Bytes per second this volunteer uploads at most, over all it writes to the bucket
    (shards, asks for group numbers, heartbeats), written as for --max-download-rate (0: no
    cap)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.work_dir is None:
            self.work_dir = str(default_work_dir("volunteer", self.bucket))
