"""Each volunteer's share of the trainer's time (issue 41, bench row (d)), against a live `vrl
trainer` on the trap task (tests/integration/test_reward_budget_live.py).

A "burner" volunteer sends, for every version, a shard of completions whose rewards take 80 %
of their bound each (2 s of CPU before the shard is rejected `reward_budget`), while an
honest volunteer sends the two groups each step needs. The per-shard and per-poll budgets
alone let the burner take its 2 s at every version, most of the trainer's time; with
--reward-share its rewards take at most that share of the trainer's wall time, beyond what
one full bucket and one overdrawing shard hold (its first shard, cut by the poll's share
and carried, or rejected at its budget), and its other shards wait unread (not rejected, and
not holding a publish back) while every step trains the honest groups.
"""
from __future__ import annotations

import json
import threading
import time

from test_reward_budget_live import TrapRun

from helpers.bucket_objects import gz_lines, key
from helpers.honest_groups import nonce
from helpers.vrlproc import Proc
from volunteer_rl.config import REWARD_SHARE
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import pool_prompt
from volunteer_rl.trainer.reward_budget import SHARE_BURST_SECONDS

STEPS = 8
"""Versions the trainer makes: one honest shard and one burner shard each."""
SHARD_BUDGET = 4 * 0.5
"""The trap task's --shard-reward-seconds (4 x its 0.5 s bound): CPU seconds, and about the
wall clock, one burner shard takes before it is rejected."""


def group(run: TrapRun, manifest: dict, volunteer: str, seq: int, texts: list[str],
          rewards: list[float]) -> dict:
    v, run_id = manifest["version"], manifest["run_id"]
    return {"prompt_id": pool_prompt(manifest["prompt_pool"], run_id, v, volunteer, seq,
                                     nonce(run.secret, run_id, volunteer, v, seq)),
            "policy_version": v, "volunteer_id": volunteer, "seq": seq,
            "completions": [{"token_ids": ids, "logprobs": [-1.0] * len(ids), "text": "",
                             "reward": r} for ids, r in zip(map(run.ids, texts), rewards)]}


class Feeder:
    """A thread that writes, for each new version, the honest volunteer's two groups (a right
    answer and a wrong one of its own each) and a burner shard of 16 groups of distinct "burn"
    completions (12.8 s of CPU unbounded); their keys."""

    def __init__(self, run: TrapRun):
        self.run, self.honest, self.burner = run, [], []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def _feed(self) -> None:
        fed = -1
        while not self._stop.wait(0.05):
            try:
                manifest = json.loads((self.run.bucket.path / layout.MANIFEST).read_text())
            except (OSError, ValueError):
                continue  # none yet, or mid-write
            v = manifest["version"]
            if v == fed:
                continue
            fed = v
            honest = []
            for seq in (2 * v, 2 * v + 1):
                prompt = pool_prompt(manifest["prompt_pool"], manifest["run_id"], v, "honest", seq,
                                     nonce(self.run.secret, manifest["run_id"], "honest", v, seq))
                right = self.run.template.problems[prompt]["python_expression"]
                # a wrong answer of its own per number: two numbers that draw the same prompt
                # would otherwise be the same content, and the second a duplicate, leaving the
                # step one group short for good (CI on 66576da's tree)
                honest.append(group(self.run, manifest, "honest", seq, [right, f"none {seq}"],
                                    [1.0, 0.0]))
            self.honest.append(self.run.bucket.put(key("honest", f"h{v}", v), gz_lines(honest)))
            burns = [group(self.run, manifest, "burner", seq, [f"{seq} burn", f"{seq} burn 1"],
                           [0.0, 0.0]) for seq in range(16 * v, 16 * v + 16)]
            self.burner.append(self.run.bucket.put(key("burner", f"b{v}", v), gz_lines(burns)))

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


def test_a_worst_case_reward_volunteer_takes_its_share_of_the_trainers_time_and_no_more(
        template, tmp_path):
    run = TrapRun(template, tmp_path)
    trainer = Proc(run.args(tmp_path, "--rank-timeout", "12", steps=STEPS),
                   tmp_path / "trainer.log", tmp_path, run.env)
    feeder = None
    try:
        run.manifest()  # v0
        feeder, fed = Feeder(run), time.monotonic()
        code = trainer.wait(400)
        wall = time.monotonic() - fed
    finally:
        trainer.kill()
        if feeder is not None:
            feeder.stop()
    log = trainer.text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log
    assert f"trainer stopped at v{STEPS}" in log, log[-3000:]
    for k in feeder.honest[:STEPS]:  # every step trained an honest shard
        assert f"took {k}: 2 usable" in log, log[-3000:]
    steps = run.step_metrics()
    spent = sum(m["ingest/reward_seconds"] for m in steps)
    rejected = [k for k in feeder.burner if run.quarantined(k)]
    # At most: a full bucket, the shard that overdraws it (its wall clock, with room for a
    # loaded machine), and the share of the run's wall clock; the honest rewards are
    # milliseconds. Before the share the burner's shards took 2 s each, one per version.
    bound = SHARE_BURST_SECONDS + 2 * SHARD_BUDGET + REWARD_SHARE * wall
    assert spent <= bound, (spent, bound, wall, rejected)
    assert spent >= SHARD_BUDGET / 2, spent  # the trap ran: a burner shard was scored
    assert {run.quarantined(k) for k in rejected} <= {"reward_budget"}
    assert any(m["ingest/reward_waiting"] for m in steps), steps[-1]
    print(f"burner: {len(rejected)} of {len(feeder.burner)} shards rejected; rewards "
          f"{spent:.1f} s in {wall:.1f} s (bound {bound:.1f} s)")
