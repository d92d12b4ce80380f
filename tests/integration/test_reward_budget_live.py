"""Rewards budgeted per shard, per volunteer and per poll, and a stop that cuts a poll (issue
41, point 4), against a live `vrl trainer`, one process and 2 torchrun ranks.

The task is tests/plugins/vrl-task-trap, installed with pip into a folder of its own: the
calculator, whose reward of a completion holding "burn" takes 80 % of its 0.5 s CPU bound,
the costliest reward that stays within the per-completion bound. A "burner" volunteer sends
shards of such completions, each distinct (no cache hit), claiming their true reward (0):
before the budgets, each shard cost the trainer all its completions' rewards (0.4 s each),
and a rank scoring one past --rank-timeout lost the others. Now each shard is refused after
--shard-reward-seconds (4 x 0.5 s = 2 s of CPU: `reward_budget`), each poll's rewards stop at
--poll-reward-seconds, what is left waits, and an honest volunteer's groups are trained.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from test_hostile_rewards import TRAP_PACKAGE, rows_for

from helpers.bucket_objects import FolderBucket, gz_lines, key
from helpers.honest_groups import key_secret, nonce
from helpers.plugins import install_plugin, plugin_env
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import pool_prompt
from volunteer_rl.task.bounded import wall_backstop

K = 2
REWARD_SECONDS = 0.5
"""The trap task's per-completion bound: its shard budget is 4 times it, 2 s."""
STOP_SECONDS = 30.0
"""SIGTERM to exit, a hang guard with room for a loaded machine: the poll in hand holds
minutes of rewards (3 shards of 128 "burn" completions, 51 s of CPU each)."""


class TrapRun:
    """A bucket for the trap task, the template's model, and the text -> token ids of it."""

    def __init__(self, template, tmp_path: Path):
        from transformers import AutoTokenizer

        self.env = plugin_env(install_plugin(TRAP_PACKAGE, tmp_path / "plugin"))
        self.bucket = FolderBucket(tmp_path / "bucket")
        self.bucket.path.mkdir()
        self.model = template.model(tmp_path / "model")
        self.template = template
        self.tok = AutoTokenizer.from_pretrained(self.model)

    def args(self, tmp_path: Path, *more: str, steps: int = 1) -> list[str]:
        self.work = tmp_path / "work"
        return ["trainer", "--bucket", str(self.bucket.path), "--task", "trap", "--model",
                str(self.model), "--k", str(K), "--groups-per-step", "2", "--max-steps", str(steps),
                "--audit-tolerance", "0", "--eval-every", "0",
                "--eval-dataset", str(self.template.eval_csv), "--threads", "1",
                "--poll-seconds", "0.05", "--log-shards", "--deny-after", "0",
                "--work-dir", str(tmp_path / "work"), *more]

    def manifest(self) -> dict:
        wait_for(lambda: (self.bucket.path / layout.manifest_history_key(0)).exists(), 240, "v0")
        return json.loads((self.bucket.path / layout.MANIFEST).read_text())

    @property
    def secret(self) -> bytes:
        """The grant secret of the trainer `args` made (its signing key is in its work dir)."""
        return key_secret(self.work / "signing-key.pem")

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def burner(self, manifest: dict, name: str, groups: int, first: int = 0) -> str:
        """A shard of `groups` groups of "burn" completions, every one distinct, numbered
        `first` on (a number used twice would be refused after the rewards, `seq_reused`)."""
        rows = [rows_for(manifest, "burner", [self.ids(f"{n} burn"), self.ids(f"{n} burn 1")],
                         [0.0, 0.0], n + 1, self.secret)[-1]  # group number n, for the prompt it draws
                for n in range(first, first + groups)]
        return self.bucket.put(key("burner", name, 0), gz_lines(rows))

    def honest(self, manifest: dict) -> str:
        """Two groups with reward variance: a right answer and a wrong one each."""
        run = manifest["run_id"]
        pid = [pool_prompt(manifest["prompt_pool"], run, 0, "honest", s,
                           nonce(self.secret, run, "honest", 0, s)) for s in (0, 1)]
        right = [self.ids(self.template.problems[p]["python_expression"]) for p in pid]
        groups = [rows_for(manifest, "honest", [right[s], self.ids("none")], [1.0, 0.0], 2,
                           self.secret)[s]
                  for s in (0, 1)]
        return self.bucket.put(key("honest", "s", 0), gz_lines(groups))

    def step_metrics(self) -> list[dict]:
        return [m for f in sorted((self.bucket.path / "metrics").glob("v*.jsonl"))
                for m in map(json.loads, f.read_text().splitlines()) if m["kind"] == "step"]

    def quarantined(self, k: str) -> str | None:
        path = self.bucket.path / layout.quarantine_key(k)
        return json.loads(path.read_text())["reason"] if path.exists() else None


def worker_cpu(root: int) -> float:
    """CPU seconds of the busiest reward worker among the descendants of process `root`
    (Linux /proc; 0 if none)."""
    parents, best = {}, 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            parents[int(entry)] = (int(stat[1]), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"),
                                   b"bounded_worker" in cmd)
    for pid, (_, cpu, is_worker) in parents.items():
        p = pid
        while is_worker and p in parents and p != root:
            p = parents[p][0]
        if is_worker and p == root:
            best = max(best, cpu)
    return best


def test_a_worst_case_reward_volunteer_stays_within_the_budgets_and_an_honest_one_trains(
        template, tmp_path):
    run = TrapRun(template, tmp_path)
    cap = 3.0  # --poll-reward-seconds' default: a quarter of --rank-timeout
    trainer = Proc(run.args(tmp_path, "--rank-timeout", str(4 * cap)), tmp_path / "trainer.log",
                   tmp_path, run.env)
    try:
        manifest = run.manifest()
        # 6 shards of 16 groups: 32 completions, 12.8 s of CPU each unbounded
        hostile = [run.burner(manifest, f"s{i}", 16, 16 * i) for i in range(6)]
        wait_for(lambda: "reward_budget" in trainer.text(), 240, "a shard over its budget")
        good = run.honest(manifest)
        assert trainer.wait(300) == 0, trainer.text()[-3000:]
    finally:
        trainer.kill()
    log = trainer.text()
    assert f"took {good}: 2 usable" in log, log[-3000:]
    assert "Traceback" not in log
    reasons = {k: run.quarantined(k) for k in hostile}
    assert set(reasons.values()) <= {"reward_budget", None} and "reward_budget" in reasons.values()
    assert f"rejected {hostile[0]}: reward_budget: " in log and "(--shard-reward-seconds)" in log
    [step] = run.step_metrics()
    # Every poll before the step kept its rewards within the cap, give or take one
    # completion's bound (a cut lands within one CPU check, the worker's start is not cut).
    assert 0 < step["ingest/reward_poll_max"] <= cap + wall_backstop(REWARD_SECONDS), step
    assert step["ingest/reward_seconds"] >= step["ingest/reward_poll_max"]


def test_a_stop_cuts_a_poll_of_worst_case_rewards(template, tmp_path):
    run = TrapRun(template, tmp_path)
    trainer = Proc(run.args(tmp_path, "--shard-reward-seconds", "100", "--poll-reward-seconds",
                            "500"), tmp_path / "trainer.log", tmp_path, run.env)
    try:
        manifest = run.manifest()
        hostile = [run.burner(manifest, f"s{i}", 64, 64 * i) for i in range(3)]
        wait_for(lambda: worker_cpu(trainer.p.pid) > 2.0, 240, "a reward worker busy")
        sent = time.time()
        trainer.p.send_signal(signal.SIGTERM)
        try:
            code = trainer.p.wait(STOP_SECONDS)
        except Exception:
            raise AssertionError(f"still running {STOP_SECONDS}s after SIGTERM:\n"
                                 f"{trainer.text()[-3000:]}")
        took = time.time() - sent
    finally:
        trainer.kill()
    log = trainer.text()
    assert code == 0, log[-3000:]
    assert "trainer stopped at v0" in log, log[-3000:]
    assert "Traceback" not in log
    assert all(run.quarantined(k) is None for k in hostile)  # cut, not blamed
    print(f"exited {took:.1f}s after SIGTERM")
