"""The warm start (trainer/warmstart.py, issue 39): on a small dataset it trains on rows RL does
not sample; it runs on --warm-start-threads, then the trainer is back on --threads; and a v0
that already solves the held-out prompts gets a warning line."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

import volunteer_rl.demo as demo
import volunteer_rl.trainer.loop as loop
import volunteer_rl.trainer.records as records
import volunteer_rl.trainer.startup as startup
from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
from volunteer_rl.protocol import metrics
from volunteer_rl.volunteer.host import usable_cores
from volunteer_rl.trainer.warmstart import (
    SOLVED_AT_V0,
    solved_at_v0,
    split_rows,
    torch_threads,
)

ROWS = 200  # the small dataset's: 20 steps of 64 pass over it 6.4 times, more than the 4 allowed
STEPS = 20


def test_a_small_dataset_splits_into_disjoint_rows_and_a_large_one_does_not():
    small = split_rows(1000, 900, 4.0, seed=0)  # the issue's: 57.6 passes
    assert small.split and round(small.passes, 1) == 57.6
    assert not set(small.warm) & set(small.rl)
    assert sorted(small.warm + small.rl) == list(range(1000)) and len(small.rl) == 500
    assert split_rows(1000, 900, 4.0, seed=0) == small  # a resumed trainer draws the same rows
    demo_rows = split_rows(20_000, 900, 4.0, seed=0)  # the demo's: 2.9 passes, as before
    assert not demo_rows.split and demo_rows.warm == demo_rows.rl == list(range(20_000))
    assert not split_rows(1000, 900, 0.0, seed=0).split  # 0: never
    assert not split_rows(1, 900, 4.0, seed=0).split  # nothing to split


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A trainer on a 200-row dataset, started (warm start, v0 published and evaluated), with
    the questions its warm start trained on and its log."""
    root = tmp_path_factory.mktemp("small")
    lines = (PACKAGE_DATA / "train.csv").read_text().splitlines(True)
    (root / "train.csv").write_text("".join(lines[:ROWS + 1]))
    (root / "eval.csv").write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:6]))
    cfg = TrainerConfig(bucket=str(root / "bucket"), model="tiny", warm_start_steps=STEPS,
                        dataset=str(root / "train.csv"), eval_dataset=str(root / "eval.csv"),
                        eval_every=0, dashboard_every=0, work_dir=str(root / "work"),
                        signing_key=str(root / "key.pem"), warm_start_threads=2)
    trained: dict = {}
    real = startup.warm_start

    def recording(policy, questions, answers, steps, **kw):
        trained.update(questions=list(questions), threads=torch.get_num_threads())
        with torch_threads(1):  # two threads beside other work: 5x slower here (conftest)
            return real(policy, questions, answers, steps, **kw)

    mp = pytest.MonkeyPatch()
    mp.setattr(startup, "warm_start", recording)
    log: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # --threads 1, as the demo's trainer has from its start
    try:
        t = loop.Trainer(cfg, log=log.append)
        t.start()
        trained["after"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
        mp.undo()
    return t, trained, log


def test_rl_samples_only_rows_the_warm_start_did_not_train_on(small_run):
    t, trained, _ = small_run
    prompt = t.task.prompt
    warm = set(trained["questions"])
    rl_ids = {p.id for p in t.picker.problems}
    assert len(warm) == ROWS // 2 and len(rl_ids) == ROWS // 2
    assert not {prompt(t.problems[i]) for i in rl_ids} & warm
    assert set(t.manifest.prompt_pool) <= rl_ids  # v0's pool, what volunteers sample
    assert not {prompt(t.problems[i]) for i in t.manifest.prompt_pool} & warm


def test_the_warm_start_says_in_one_line_what_it_trained_on(small_run):
    _, _, log = small_run
    line = next(x for x in log if x.startswith("warm start: "))
    assert f"trained on {ROWS // 2} of {ROWS} rows, RL samples only the other {ROWS // 2}" in line
    assert f"{STEPS} steps would pass over all {ROWS} 6.4 times" in line and "last loss" in line


def test_the_warm_start_runs_on_its_own_threads_then_rl_on_threads(small_run):
    _, trained, _ = small_run
    assert trained["threads"] == 2 and trained["after"] == 1


def test_the_demo_gives_its_warm_start_every_core(tmp_path, monkeypatch):
    started: list[list[str]] = []

    class Recorder:
        def __init__(self, args, **kw):
            started.append(list(args))

    monkeypatch.setattr(subprocess, "Popen", Recorder)
    demo.start_processes(demo.DemoSettings(volunteers=1), tmp_path / "bucket")
    trainer = started[0]
    at = trainer.index("--warm-start-threads")
    assert trainer[at + 1] == str(usable_cores())
    assert trainer[trainer.index("--threads") + 1] == "1"  # RL's, as before


def test_a_v0_that_already_solves_the_held_out_prompts_gets_a_warning(small_run, monkeypatch):
    t, _, _ = small_run
    assert solved_at_v0(SOLVED_AT_V0 - 0.01, 1.0) is None
    line = solved_at_v0(0.97, 1.0)
    assert "97.0%" in line and "little is left for RL to learn" in line
    assert "--warm-start-steps" in line and "harder --dataset" in line
    solved = {metrics.ACCURACY_GREEDY: 1.0, metrics.ACCURACY_SAMPLED: 0.97}
    monkeypatch.setattr(records, "greedy_and_sampled", lambda *a, **kw: dict(solved))
    log: list[str] = []
    monkeypatch.setattr(t, "log", log.append)
    t.records.evaluate(0, full=True)
    assert [x for x in log if x.startswith("warning: v0 already solves")] == [line]
    log.clear()
    t.records.evaluate(10)  # a later version: no warning
    assert not [x for x in log if x.startswith("warning")]
    t.metrics_buffer.clear()
