"""Issue 41, point 4 under torchrun: a volunteer sending shards of worst-case rewards does not
cost 2 ranks the run.

Each rank reads its own volunteers' shards and then meets the other in a collective that
waits --rank-timeout (20 s here) at most. A shard of 128 "burn" completions (the trap task,
tests/integration/test_reward_budget_live.py) took 51 s of its rank's poll before the budgets:
the other rank gave up (RankLostError) and the run died. Now a poll's rewards stop at
--poll-reward-seconds (a quarter of --rank-timeout: 5 s), the shard is refused at its budget
(`reward_budget`), and the honest volunteer's groups are trained and published.
"""
from __future__ import annotations

from test_reward_budget_live import TrapRun, worker_cpu

from helpers.vrlproc import Proc, wait_for


def test_two_ranks_survive_a_worst_case_reward_volunteer(template, tmp_path):
    run = TrapRun(template, tmp_path)
    trainer = Proc(run.args(tmp_path, "--rank-timeout", "20"), tmp_path / "trainer.log", tmp_path,
                   {**run.env, "OMP_NUM_THREADS": "1"}, ranks=2)
    try:
        manifest = run.manifest()
        hostile = [run.burner(manifest, f"s{i}", 64, 64 * i) for i in range(3)]
        wait_for(lambda: worker_cpu(trainer.p.pid) > 1.0, 240, "a rank scoring the burner's shards")
        good = run.honest(manifest)
        code = trainer.wait(400)
    finally:
        trainer.kill()
    log = trainer.text()
    assert code == 0, log[-4000:]
    assert "lost the other ranks" not in log, log[-4000:]
    assert f"took {good}: 2 usable" in log, log[-4000:]
    assert "trainer stopped at v1" in log, log[-4000:]
    assert "reward_budget" in {run.quarantined(k) for k in hostile}
