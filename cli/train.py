"""`vrl trainer`: the central trainer, its flags made from TrainerConfig."""

from __future__ import annotations

from functools import partial
from typing import Optional

import typer

from volunteer_rl.config import TrainerConfig
from volunteer_rl_cli.config_file import config_option
from volunteer_rl_cli.errors import usage_errors
from volunteer_rl_cli.options import (
    BUCKET,
    DEVICE,
    ENDPOINT_URL,
    SIGNING_KEY,
    TRAINER_WORK_DIR,
    log,
    option,
)
from volunteer_rl_cli.starting import start_stoppable

app = typer.Typer()
T = partial(option, TrainerConfig)  # T("lr"): the --lr option, from TrainerConfig.lr


@app.command()
def trainer(
    ctx: typer.Context,
    config: Optional[str] = config_option(TrainerConfig),
    bucket: str = BUCKET,
    endpoint_url: Optional[str] = ENDPOINT_URL,
    model: str = T("model"),
    task: str = T("task"),
    dataset: Optional[str] = T("dataset"),
    eval_dataset: Optional[str] = T("eval_dataset"),
    algo: str = T("algo"),
    lr: Optional[float] = T("lr"),
    k: Optional[int] = T("k"),
    temperature: float = T("temperature"),
    max_new_tokens: Optional[int] = T("max_new_tokens"),
    max_staleness: int = T("max_staleness"),
    groups_per_step: int = T("groups_per_step"),
    micro_batch: int = T("micro_batch"),
    gradient_checkpointing: bool = T("gradient_checkpointing"),
    publish_every: int = T("publish_every"),
    publish_min_seconds: float = T("publish_min_seconds"),
    keyframe_every: int = T("keyframe_every"),
    patch_max_fraction: float = T("patch_max_fraction"),
    keep_versions: int = T("keep_versions"),
    gc_every: int = T("gc_every"),
    eval_every: int = T("eval_every"),
    warm_start_steps: int = T("warm_start_steps"),
    warm_start_max_passes: float = T("warm_start_max_passes"),
    warm_start_threads: int = T("warm_start_threads"),
    max_steps: int = T("max_steps"),
    max_seconds: float = T("max_seconds"),
    seed: int = T("seed"),
    poll_seconds: float = T("poll_seconds"),
    threads: int = T("threads"),
    device: str = DEVICE,
    rank_timeout: float = T("rank_timeout"),
    work_dir: str = TRAINER_WORK_DIR,
    signing_key: Optional[str] = SIGNING_KEY,
    allow_unsigned: bool = T("allow_unsigned"),
    weights_dtype: str = T("weights_dtype"),
    lora_rank: int = T("lora_rank"),
    lora_alpha: float = T("lora_alpha"),
    lora_targets: str = T("lora_targets"),
    audit_tolerance: float = T("audit_tolerance"),
    replay_tolerance: float = T("replay_tolerance"),
    audit_share: float = T("audit_share"),
    audit_full_groups: int = T("audit_full_groups"),
    audit_floor: float = T("audit_floor"),
    audit_cover_floor: float = T("audit_cover_floor"),
    verify: str = T("verify"),
    curriculum: bool = T("curriculum"),
    prompt_pool: int = T("prompt_pool"),
    shard_reward_seconds: Optional[float] = T("shard_reward_seconds"),
    poll_reward_seconds: Optional[float] = T("poll_reward_seconds"),
    reward_share: float = T("reward_share"),
    deny_after: int = T("deny_after"),
    deny_rate: float = T("deny_rate"),
    missing_bound: float = T("missing_bound"),
    log_shards: bool = T("log_shards"),
    dashboard_every: float = T("dashboard_every"),
    quota_headroom: float = T("quota_headroom"),
    log_level: str = T("log_level"),
    report_to: str = T("report_to"),
    logging_dir: Optional[str] = T("logging_dir"),
):
    """Train on volunteers' rollouts and publish new versions.

    The trainer publishes v0 on an empty bucket (or resumes from its manifest), learns from
    fresh rollout shards and publishes a new version every --publish-every steps. It is the
    only process that writes checkpoints and the manifest.

    Ctrl-C or SIGTERM, also to a trainer started in the background (`vrl trainer ... &`),
    finishes the current step, publishes the steps not yet published (without the final
    evaluation), writes their metrics, fleet.json and dashboard/, and exits 0; before the
    first step it stops at once, leaving no half-made version. A second signal while stopping
    exits at once.

    \b
    Examples:
      vrl trainer --bucket s3://bucket/run1 --algo grpo --max-staleness 2
    As 8 ranks sharing the model with FSDP2 (docs/SCALE.md):
      torchrun --nproc-per-node 8 -m volunteer_rl_cli trainer -b s3://bucket/run1
    """
    from volunteer_rl.stopping import Stopped
    from volunteer_rl.storage.uri import check_bucket
    from volunteer_rl.trainer.preflight import read_inputs

    with usage_errors():
        cfg = TrainerConfig(**ctx.params)
    log.level = cfg.log_level
    # Before seconds of imports: the task, its datasets and the key's place are checked (one
    # line, and nothing made, if one is wrong); then a bad --bucket fails, and a new folder
    # bucket is made, so that it exists by the time volunteers started beside the trainer
    # look for it.
    inputs = read_inputs(cfg)
    check_bucket(cfg.bucket, cfg.endpoint_url)
    trainer_ = None

    def stopped_early(signum: int) -> str:
        published = getattr(trainer_, "manifest", None)
        return (f"trainer stopped by signal {signum} before its first step; "
                + (f"the bucket stands at v{published.version}" if published else "nothing published"))

    def build(stop):
        from volunteer_rl.trainer.loop import Trainer

        return Trainer(cfg, log=log, stop=stop, inputs=inputs)

    try:
        trainer_ = start_stoppable(cfg.threads, stopped_early, build)  # cli/starting.py
        trainer_.start()
        manifest = trainer_.run()
    except Stopped as exc:
        if trainer_ is None or trainer_.ranks.is_writer:  # once, not once per torchrun rank
            log(stopped_early(exc.signum))
        return
    if trainer_.ranks.is_writer:
        log(f"trainer stopped at v{manifest.version}")
