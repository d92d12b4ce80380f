"""A real Trainer on a fresh folder bucket, started and ready to step or audit, for unit tests
of what it does with groups: no warm start, no evaluation, no dashboard, and a held-out file
of five prompts (the trainer still reads one at start)."""
from __future__ import annotations

from pathlib import Path

from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
from volunteer_rl.trainer.loop import Trainer


def started_trainer(root: Path, **settings) -> Trainer:
    """A started Trainer whose bucket, work dir and signing key live under `root`; `settings`
    are TrainerConfig fields on top of the bare ones."""
    eval_csv = root / "eval5.csv"
    eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:6]))
    cfg = TrainerConfig(**{"bucket": str(root / "bucket"), "warm_start_steps": 0,
                           "eval_every": 0, "eval_dataset": str(eval_csv),
                           "work_dir": str(root / "work"), "signing_key": str(root / "key.pem"),
                           "dashboard_every": 0, **settings})
    t = Trainer(cfg, log=lambda m: None)
    t.start()
    return t
