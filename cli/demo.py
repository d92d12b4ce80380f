"""`vrl demo`: a trainer and volunteers as processes on one machine (volunteer_rl.demo)."""

from __future__ import annotations

from typing import Optional

import typer

from volunteer_rl.config import TrainerConfig
from volunteer_rl.demo import DemoSettings, run_demo
from volunteer_rl_cli.config_file import config_option
from volunteer_rl_cli.errors import usage_errors
from volunteer_rl_cli.options import option

app = typer.Typer()


@app.command()
def demo(
    ctx: typer.Context,
    config: Optional[str] = config_option(DemoSettings, TrainerConfig),
    bucket: Optional[str] = option(DemoSettings, "bucket"),
    volunteers: int = option(DemoSettings, "volunteers"),
    rl_seconds: float = option(DemoSettings, "rl_seconds"),
    task: str = option(TrainerConfig, "task"),
    warm_start_steps: int = option(TrainerConfig, "warm_start_steps"),
    algo: str = option(TrainerConfig, "algo"),
    lr: Optional[float] = option(TrainerConfig, "lr"),
    lora_rank: int = option(TrainerConfig, "lora_rank"),
):
    """Run it all on one machine: a trainer and volunteers.

    The trainer warm-starts v0 with --warm-start-steps supervised steps, then it and the
    volunteers, separate processes sharing only a local folder bucket, run --rl-seconds of
    RL; the demo ends with the held-out accuracy of v0 and of the last version. The last
    example is a quick try of a task: a shorter warm start and a minute of RL.

    \b
    Examples:
      vrl demo
      vrl demo --task countdown
      vrl demo --task countdown --warm-start-steps 200 --rl-seconds 60
    With LoRA adapters of rank 8 as the published versions:
      vrl demo --lora-rank 8
    """
    with usage_errors():
        settings = DemoSettings(**ctx.params)
    run_demo(settings)
