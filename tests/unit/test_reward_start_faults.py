"""A reward worker that cannot start (no descriptors or processes left, an import past
START_SECONDS, a task that does not load there) is the trainer's fault, not a completion's:
task.bounded raises WorkerStartError before any completion is sent, and the intake leaves
the shard for a later poll, charging its volunteer nothing. Real workers and a real intake
(memory storage)."""
from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys

import pytest

import volunteer_rl.task.bounded as bounded_mod
import volunteer_rl.task.bounded_process as process_mod
from test_ingest import fresh_storage, g, put, rules, win
from volunteer_rl.protocol.ledger import Ledger
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded import BoundedRewards, WorkerStartError
from volunteer_rl.trainer.fleet import Fleet
from volunteer_rl.trainer.groups import IngestStats
from volunteer_rl.trainer.ingest import Ingest

CALCULATOR = "volunteer_rl.task.calculator_task:CalculatorTask"


def test_shards_met_by_a_worker_that_cannot_start_wait_uncharged_and_train_once_it_can(
        monkeypatch):
    """Six honest shards while the trainer has no descriptor left to start a worker with:
    none is rejected, its volunteer (denied after 5 rejects) is not denied, each waiting shard
    is named in one line; once a worker starts, all six are taken."""
    s = fresh_storage("worker-cannot-start")
    keys = [put(s, 3, "honest", [g(0, 3, "honest", [[12], [i]])], name=f"s{i}") for i in range(6)]
    real = process_mod.subprocess.Popen

    def refuse(*args, **kwargs):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(process_mod.subprocess, "Popen", refuse)
    logs, fleet = [], Fleet(deny_after=5, deny_rate=0.5)
    with BoundedRewards(CALCULATOR, 1.0, 64) as bounded:
        ing = Ingest(s, dataclasses.replace(rules(), rewards=bounded.rewards), Ledger(), fleet,
                     None, logs.append)
        stats = IngestStats()
        for _ in range(3):
            assert ing.poll(win(3), stats) == []
        assert not stats.rejected and not fleet.is_denied("honest")
        assert fleet.counts.get("honest") is None or fleet.counts["honest"].rejected == 0
        left = [m for m in logs if "for a later poll" in m]
        assert len(left) == 18 and all("Too many open files" in m and "\n" not in m for m in left)
        monkeypatch.setattr(process_mod.subprocess, "Popen", real)
        taken = ing.poll(win(3), stats)
    assert sorted(x.key for x in taken) == sorted(keys)
    assert not stats.rejected and stats.shards == 6


def test_a_task_whose_import_outlasts_the_start_limit_is_a_start_fault(tmp_path, monkeypatch):
    (tmp_path / "vrl_slow_import.py").write_text(
        "import time\n"
        "time.sleep(120)\n"
        "from volunteer_rl.task.calculator_task import CalculatorTask as Slow\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bounded_mod, "START_SECONDS", 1.0)
    with BoundedRewards("vrl_slow_import:Slow", 1.0, 64) as bounded:
        with pytest.raises(WorkerStartError) as caught:
            bounded.rewards([("12", Row(0, {"question": "q", "python_expression": "5 + 7"}))])
        assert "did not load the task within 1 s" in str(caught.value)
        assert bounded.pid is None


TRAINER = r"""
import os, resource, sys
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded import BoundedRewards, WorkerStartError
bounded = BoundedRewards(sys.argv[1], 1.0, 64)
# Room for one pipe more than is open now: the worker's second pipe finds none.
room = len(os.listdir("/proc/self/fd")) + 1  # the listing's own descriptor is counted
resource.setrlimit(resource.RLIMIT_NOFILE, (room, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    bounded.rewards([("12", Row(0, {"python_expression": "5 + 7"}))])
except WorkerStartError as exc:
    print(exc)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_trainer_out_of_descriptors_gets_a_start_fault():
    """A real EMFILE: the trainer's descriptor limit leaves no room for the worker's pipes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path))
    done = subprocess.run([sys.executable, "-c", TRAINER, CALCULATOR],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot start the reward worker ([Errno 24] Too many open files)" in done.stdout, \
        done.stdout + done.stderr[-2000:]
