"""Issue 39 with a real `vrl trainer` process: --log-level warning prints its warnings and
none of its info lines, and --report-to tensorboard writes every step's metrics, under the
names of metrics/ in the bucket, to event files in --logging-dir.

The published template (conftest), resumed with a fresh --work-dir (so the trainer warns that
it has no saved state for it), and two shards of four real groups waiting in the bucket: two
steps of four groups, then the final publish.
"""
from __future__ import annotations

import json

import pytest

from conftest import PICKED

from helpers.bucket_objects import honest_shards
from helpers.vrlproc import Proc


def test_a_quiet_trainer_warns_and_reports_to_tensorboard(template, tmp_path):
    pytest.importorskip("tensorboard")  # the test extra installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    bucket = template.copy(tmp_path / "bucket")
    honest_shards(template, bucket, 2)
    trainer = Proc(["trainer", *PICKED, "--bucket", str(bucket), "--max-steps", "2", "--groups-per-step", "4",
                    "--eval-dataset", str(template.eval_csv), "--threads", "1",
                    "--poll-seconds", "0.05", "--work-dir", str(tmp_path / "tw"),
                    "--dashboard-every", "0", "--signing-key", str(template.key),
                    "--log-level", "warning", "--report-to", "tensorboard",
                    "--logging-dir", str(tmp_path / "tb")], tmp_path / "trainer.log", tmp_path,
                   {"OMP_NUM_THREADS": "1"})
    assert trainer.wait(180) == 0, trainer.text()[-3000:]
    ours = [line for line in trainer.text().splitlines()  # (torch's own stderr aside)
            if not line.startswith(("[W", "/", " "))]
    assert any(line.startswith("warning: no saved trainer state for v2") for line in ours), ours
    # info lines (resuming, steps, publishes, the last word) are left out
    assert all(line.startswith(("warning:", "error:")) for line in ours), ours

    steps = [m for f in sorted((bucket / "metrics").glob("v*.jsonl"))
             for m in map(json.loads, f.read_text().splitlines()) if m["kind"] == "step"]
    assert [m["step"] for m in steps] == [1, 2]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == \
        [(m["step"], pytest.approx(m["rollout/reward_mean"])) for m in steps]
    assert not (tmp_path / "tw" / "runs").exists()  # --logging-dir, not the default
