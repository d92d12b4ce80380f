"""Typed settings of the trainer and the volunteer. The CLI fills these; tests build them
directly. Every field says what it does; defaults are the embedded demo's choices."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent.parent / "data"


@dataclass
class TrainerConfig:
    bucket: str
    """Bucket URI: a folder path, file://, s3://bucket/prefix, gs://bucket/prefix, memory://."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, R2, a test server); None means AWS itself."""
    model: str = "tiny"
    """`tiny` builds the project's own small Llama-shaped model; otherwise a local HF model folder."""
    dataset: str | None = None
    """Train CSV (python_expression,natural_language); None uses the shipped data/train.csv."""
    eval_dataset: str | None = None
    """Held-out CSV for eval; None uses the shipped data/eval.csv."""
    algo: str = "grpo"
    """`reinforce` (advantage r - group mean) or `grpo` (normalized advantage, clipped ratio)."""
    lr: float = 3e-4
    """AdamW learning rate of the RL phase (1e-3 collapsed the tiny model in calibration)."""
    k: int = 8
    """Completions per prompt (group size) volunteers must sample."""
    temperature: float = 1.0
    """Sampling temperature volunteers must use; behavior logprobs are under logits / T."""
    max_new_tokens: int = 32
    """Cap on generated tokens per completion."""
    max_staleness: int = 2
    """Oldest accepted policy version is current - max_staleness; older groups are dropped."""
    groups_per_step: int = 32
    """Prompt groups in one optimizer step."""
    publish_every: int = 1
    """Optimizer steps between published versions."""
    keep_versions: int = 10
    """Retention keeps the newest this many versions (and always the staleness window); older
    checkpoints and rollout shards are deleted by the passes `gc_every` turns on."""
    gc_every: int = 0
    """Run a retention pass after every this many publishes (0: never; `vrl gc` does the same
    by hand). The first pass lists checkpoints/ and rollouts/ whole, later ones only the
    versions that fell out of the kept range since."""
    eval_every: int = 10
    """Versions between held-out evaluations (0 disables them)."""
    eval_prompts: int = 200
    """Held-out prompts used by the periodic evaluation (the final one uses all)."""
    eval_samples: int = 4
    """Samples per prompt for the sampled-accuracy estimate."""
    warm_start_steps: int = 900
    """Supervised steps before v0 when the model is built from scratch (`tiny`)."""
    seed: int = 0
    """Seeds model init, the warm start and batch order."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: no limit)."""
    max_seconds: float = 0.0
    """Stop after this many seconds of RL after v0 is published (0: no limit)."""
    poll_seconds: float = 0.2
    """Sleep between bucket listings while waiting for rollouts (one LIST per window version)."""
    threads: int = 0
    """torch CPU threads during RL (0: torch's default); the warm start uses all cores."""
    device: str = "auto"
    """cuda, mps, cpu or auto."""
    work_dir: str = ".vrl/trainer"
    """Local scratch folder for checkpoint staging."""
    micro_batch: int = 256
    """Rows per forward/backward pass; gradients are accumulated over a step's rows."""
    weights_dtype: str = "fp32"
    """dtype of the published weights: `fp32`, or `bf16` (half the bytes per version for every
    volunteer to download). The trainer keeps fp32 master weights either way; with bf16 it
    audits behavior logprobs and evaluates against the bf16-rounded weights volunteers run
    (held in a second fp32 copy of the model), and saves its fp32 master in its state so a
    resume does not lose the low bits. Volunteers upcast bf16 weights to fp32 exactly."""
    audit_tolerance: float = 0.05
    """Largest difference (nats) allowed between a volunteer's behavior logprob of a token and
    the trainer's own, for the one random group of each shard made with the weights the
    trainer holds; a shard beyond it is rejected (`logprob_mismatch`). 0 turns audits off."""
    deny_after: int = 5
    """Rejected shards after which a volunteer goes on the denylist (0: never automatically)..."""
    deny_rate: float = 0.5
    """...provided at least this share of all its shards was rejected."""
    dashboard_every: float = 60.0
    """Seconds between writes of dashboard/ (index.html and PNG plots), the first this long
    after the start, plus one at the last publish; never sooner than 50 times the last
    write's duration after it, so they cost the trainer at most 2 % of its time (0: never;
    `vrl dashboard` does the same by hand). Step metrics record it as `time/dashboard`."""
    log_shards: bool = False
    """Log one line per shard taken (usable, zero-variance, duplicate groups)."""
    signing_key: str | None = None
    """Ed25519 private key (PEM) that signs every manifest; None: <work_dir>/signing-key.pem.
    Created on first use; it must stay on this host, never in the bucket."""
    allow_unsigned: bool = False
    """Resume a bucket whose manifest is unsigned (written by a trainer from before signing)."""


@dataclass
class VolunteerConfig:
    bucket: str
    """Bucket URI, as for the trainer."""
    endpoint_url: str | None = None
    """S3-compatible endpoint; None means AWS itself."""
    volunteer_id: str | None = None
    """Name in object keys; None: sanitized hostname plus a random suffix."""
    prompts_per_batch: int = 16
    """Prompts sampled per generate round (each gets K completions, all in one batched call)."""
    shard_groups: int = 32
    """Upload a shard once it holds this many groups..."""
    shard_seconds: float = 20.0
    """...or once its oldest group is this many seconds old."""
    poll_seconds: float = 1.0
    """Sleep between manifest polls while there is nothing to do."""
    curriculum: bool = True
    """Draw prompts where groups are likely to have reward variance (curriculum.py): by
    difficulty stratum, skipping most prompts whose last group was all right or all wrong.
    Off: prompts uniformly at random."""
    max_groups_per_version: int = 0
    """Generate at most this many groups with one version, then wait for the next (0: no cap).
    A trainer takes only so many groups per version; past that, donated compute only makes
    groups that go stale."""
    cap_patience_seconds: float = 2.0
    """At the cap, wait this long for a new version before making one more batch anyway."""
    manifest_grace_seconds: float = 60.0
    """Keep generating through manifest read failures for at most this long."""
    heartbeat_seconds: float = 30.0
    """Overwrite volunteers/<id>.json this often, from a thread (0: no heartbeat). `vrl status`
    calls a volunteer offline after two of its periods without one."""
    max_seconds: float = 0.0
    """Stop after this many seconds (0: until Ctrl-C / SIGTERM)."""
    threads: int = 0
    """torch CPU threads for sampling (0: auto, one for a model of under 5 M parameters on the
    CPU, torch's default otherwise; see policy.sampling_threads)."""
    nice: int = 10
    """Lower this process's CPU priority by this much at start (POSIX niceness; 0: leave it).
    Donated cycles should only be the idle ones, as with BOINC: the owner's work comes first.
    On one machine shared with a trainer it also leaves the trainer, the bottleneck, its core."""
    device: str = "auto"
    """cuda, mps, cpu or auto."""
    work_dir: str = ".vrl/volunteer"
    """Local cache for the dataset and checkpoints."""
    seed: int | None = None
    """Prompt-order and sampling seed (None: random)."""
    trust_key: str | None = None
    """The trainer's public key (`ed25519:...` or a file holding it); None: trust the key of
    the first manifest seen and pin it in <work_dir>/trusted-keys.json for this bucket."""
    allow_unsigned: bool = False
    """Accept manifests with no signature (an older trainer); signed ones are still checked."""
