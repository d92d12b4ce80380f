"""The bookkeeping of bench/trl_time_to_accuracy.py that needs neither TRL nor a run."""
import gzip
import json
import os

import pytest

from bench.trl_time_to_accuracy import Plan, time_to, vrl_snapshots


def test_time_to_interpolates_between_grid_points():
    curve = {0.0: {"eval/accuracy_sampled": 0.30}, 10.0: {"eval/accuracy_sampled": 0.35},
             20.0: {"eval/accuracy_sampled": 0.45}, 30.0: {"eval/accuracy_sampled": 0.39}}
    assert time_to(curve, 0.40) == pytest.approx(15.0)         # halfway from 0.35 at 10 s to 0.45 at 20 s
    assert time_to(curve, 0.45) == 20.0
    assert time_to(curve, 0.30) == 0.0           # reached at the start
    assert time_to(curve, 0.50) is None          # never reached


def test_vrl_snapshots_take_the_newest_version_committed_by_each_grid_time(tmp_path):
    bucket = tmp_path / "bucket"
    (bucket / "manifests").mkdir(parents=True)
    t0 = 1_000_000.0
    for version, after in [(0, 0.0), (1, 4.0), (2, 5.0), (3, 9.5), (4, 10.5)]:
        (bucket / "manifests" / f"v{version:06d}.json").write_text(
            json.dumps({"version": version, "created_at": t0 + after}))
    (bucket / "metrics").mkdir()
    steps = [{"kind": "step", "time": t0 + s} for s in (4.0, 5.0, 9.5, 10.5)]
    (bucket / "metrics" / "v000004.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in steps + [{"kind": "eval", "time": t0 + 10.6}]))
    shard = bucket / "rollouts" / "v000000" / "vol" / "s.jsonl.gz"
    shard.parent.mkdir(parents=True)
    with gzip.open(shard, "wt") as f:
        f.write("{}\n{}\n")
    os.utime(shard, (t0 + 3.0, t0 + 3.0))  # written within the budget
    late = bucket / "rollouts" / "v000004" / "vol" / "late.jsonl.gz"
    late.parent.mkdir(parents=True)
    with gzip.open(late, "wt") as f:
        f.write("{}\n")
    os.utime(late, (t0 + 30.0, t0 + 30.0))  # after the budget: not counted
    run = vrl_snapshots(bucket, Plan(budget=10.0, grid=5.0, gain=0.1, eval_prompts=1), launched=t0 - 2.0)
    # launched 2 s before v0: versions 1-4 came 6, 7, 11.5 and 12.5 s after launch
    assert {g: p.name for g, p in run.snapshots.items()} == {0.0: "v000000", 5.0: "v000000", 10.0: "v000002"}
    assert run.steps == 2                        # the steps 11.5 and 12.5 s after launch are late
    assert run.first_step == 6.0
    assert run.completions == 2 * 8
