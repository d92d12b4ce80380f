"""--report-to: the trainer's metrics lines, besides metrics/ in the bucket, to TensorBoard
event files and to Weights & Biases in offline mode, as the Hugging Face trainers' report_to
does.

Each line the trainer writes into metrics/vNNNNNN.jsonl (protocol.metrics) is reported as it
goes into the bucket, at the publish that writes it, under the same names: its numbers only
(`scalars`). A step line is reported at its own step; an eval line at the step of the line
before it (the last step of the version it evaluates; v0's evaluation at step 0). The writer
(rank 0) alone reports: it is the one that writes metrics/.

Both packages are optional and imported only when asked for; a trainer asked for one that is
not installed stops at start with one line saying what to install. A sink that fails later
(a full disk) is a warning and is dropped: the bucket's metrics/ is the record, these are
views of it, like dashboard/.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from volunteer_rl.config import TrainerConfig, listed
from volunteer_rl.errors import ConfigError
from volunteer_rl.protocol import metrics

_INSTALL = {"tensorboard": "pip install tensorboard (what vrl's [tensorboard] extra adds)",
            "wandb": "pip install wandb"}
"""What to install for each --report-to name; its module has the same name."""

NOT_REPORTED = (metrics.KIND, metrics.STEP, metrics.TIME)
"""Fields of a line that are no metric: its kind, the step (the x axis) and the time (the
event's own wall time)."""


def scalars(line: dict) -> dict[str, float]:
    """The numbers of one metrics line by their names in metrics/ (`rollout/reward_mean`,
    `train/loss`, `eval/accuracy_greedy`, `version`, ...): finite ints and floats only. Maps
    (the staleness histogram, sources, rejections, per-volunteer counts), None and booleans
    stay in metrics/ alone."""
    return {name: float(v) for name, v in line.items()
            if name not in NOT_REPORTED and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def folder(cfg: TrainerConfig, run_id: str) -> Path:
    """Where the files go: --logging-dir, else <work_dir>/runs/<run id>."""
    return Path(cfg.logging_dir) if cfg.logging_dir else Path(cfg.work_dir) / "runs" / run_id


class Reporters:
    """The --report-to sinks of one trainer. Built at the trainer's start, which checks the
    packages are installed (ConfigError, one line); the sinks open at the first `record`,
    once the run id is known."""

    def __init__(self, cfg: TrainerConfig, log: Callable[[str], None]):
        self.cfg, self.log = cfg, log
        self.names = listed(cfg.report_to)
        for name in self.names:
            if importlib.util.find_spec(name) is None:
                raise ConfigError(f"--report-to {name}: {name} is not installed here; "
                                  f"{_INSTALL[name]}, or leave {name} out")
        self.sinks: dict[str, object] | None = None  # name -> open writer; None: not opened
        self.last_step = 0

    def _open(self, run_id: str) -> dict[str, object]:
        where = folder(self.cfg, run_id)
        where.mkdir(parents=True, exist_ok=True)
        sinks: dict[str, object] = {}
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            sinks["tensorboard"] = SummaryWriter(log_dir=str(where))
        if "wandb" in self.names:
            import wandb

            # Offline only: the run is written under `where` and nothing leaves this host
            # until someone runs `wandb sync` there.
            sinks["wandb"] = wandb.init(mode="offline", dir=str(where), project="volunteer-rl",
                                        name=run_id, config=asdict(self.cfg))
        self.log(f"reporting metrics to {', '.join(self.names)} in {where}")
        return sinks

    def record(self, lines: list[dict], run_id: str) -> None:
        """Report these metrics lines (the ones going into the bucket now)."""
        if not self.names or not lines:
            return
        if self.sinks is None:
            self.sinks = self._open(run_id)
        for line in lines:
            if line.get(metrics.KIND) == metrics.STEP_LINE and isinstance(line.get(metrics.STEP), int):
                self.last_step = line[metrics.STEP]
            values = scalars(line)
            for name, sink in list(self.sinks.items()):
                try:
                    _write(name, sink, values, self.last_step, line.get(metrics.TIME))
                except Exception as exc:  # a view of metrics/, never the trainer's failure
                    self.log(f"warning: --report-to {name}: {type(exc).__name__}: {exc}; "
                             f"no more reports to it (metrics/ in the bucket goes on)")
                    del self.sinks[name]
        if "tensorboard" in self.sinks:
            self.sinks["tensorboard"].flush()  # readable now, not at the writer's next flush

    def close(self) -> None:
        """Flush and close the open sinks (the trainer's end)."""
        for name, sink in (self.sinks or {}).items():
            try:
                sink.close() if name == "tensorboard" else _finish_wandb(sink)
            except Exception as exc:
                self.log(f"warning: --report-to {name}: not closed ({type(exc).__name__}: {exc})")
        self.sinks = {} if self.sinks is not None else None


def _write(name: str, sink, values: dict[str, float], step: int, walltime) -> None:
    if name == "tensorboard":
        for tag, value in values.items():
            sink.add_scalar(tag, value, global_step=step,
                            walltime=walltime if isinstance(walltime, (int, float)) else None)
    else:
        sink.log(values, step=step)


def _finish_wandb(run) -> None:
    """The run finished, then wandb's service process ended: it writes the offline run's file
    after `finish` returns (seen here: one close in four left only its header when the
    process went on), and its end waits for that."""
    import wandb

    run.finish()
    wandb.teardown()
