"""A default `vrl trainer` run (no dashboard flag) leaves dashboard/ in the bucket for people
browsing it, and step metrics carry `time/dashboard`; `--dashboard-every 0` writes none.

Real processes on the published template (conftest), two shards of four real groups each
waiting in the bucket: two steps of four groups, then the final publish.
"""
from __future__ import annotations

import json
from pathlib import Path

from conftest import PICKED

from helpers.bucket_objects import honest_shards
from helpers.vrlproc import Proc
from volunteer_rl.protocol import layout


def short_run(template, root: Path, *args: str) -> tuple[Path, str]:
    bucket = template.copy(root / "bucket")
    honest_shards(template, bucket, 2)
    trainer = Proc(["trainer", *PICKED, "--bucket", str(bucket), "--max-steps", "2", "--groups-per-step", "4",
                    "--eval-dataset", str(template.eval_csv), "--threads", "1",
                    "--poll-seconds", "0.05", "--work-dir", str(root / "tw"),
                    "--signing-key", str(template.key), *args], root / "trainer.log", root,
                   {"OMP_NUM_THREADS": "1"})
    assert trainer.wait(180) == 0, trainer.text()[-3000:]
    return bucket, trainer.text()


def step_lines(bucket: Path) -> list[dict]:
    return [m for f in sorted((bucket / "metrics").glob("v*.jsonl"))
            for m in map(json.loads, f.read_text().splitlines()) if m["kind"] == "step"]


def test_a_default_run_writes_the_dashboard(template, tmp_path):
    bucket, log = short_run(template, tmp_path)
    final = json.loads((bucket / layout.MANIFEST).read_text())["version"]
    page = (bucket / "dashboard" / "index.html").read_text()
    assert f"version {final}</h1>" in page  # the write at the last publish
    assert all((bucket / "dashboard" / f"{p}.png").exists() for p in ("accuracy", "reward"))
    # a run this short (seconds) gets only the write at the last publish; the first comes
    # --dashboard-every (60) seconds after the start
    assert log.count("wrote dashboard/ in ") == 1
    steps = step_lines(bucket)
    assert len(steps) == 2 and all(0 <= m["time/dashboard"] < 0.1 for m in steps)
    # The trainer stopped (--max-steps): its last fleet.json says so and that it ran as one
    # process; the page says so, no longer reloads and claims no rank count (issue 39).
    trainer = json.loads((bucket / layout.FLEET).read_text())["trainer"]
    assert trainer["ranks"] == 1 and trainer["stopped_at"] is not None
    assert "The trainer stopped at" in page and 'http-equiv="refresh"' not in page
    assert "ranks" not in page and f"reward {steps[-1]['rollout/reward_mean']:.3f} (step 2)" in page


def test_dashboard_every_0_writes_none(template, tmp_path):
    bucket, log = short_run(template, tmp_path, "--dashboard-every", "0")
    assert not (bucket / "dashboard").exists() and "dashboard/" not in log
    assert [m["time/dashboard"] for m in step_lines(bucket)] == [0.0, 0.0]
