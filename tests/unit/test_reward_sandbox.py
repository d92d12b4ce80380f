"""What a completion that takes over a task's reward can reach from the reward worker
(task.bounded_process, task.sandbox): a hostile grader (helpers/snoop_task.py) in a real
worker tries the trainer's environment and secrets, the network, files outside its folder, a
signal to the trainer, and a process that outlives the worker. Linux; where the kernel refuses
a wall the trainer says so and these tests skip, naming it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from helpers.process_table import holders, kill_all, wait_until
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded import BoundedRewards

SNOOP = "helpers.snoop_task:SnoopTask"
SECRET = "AKIAvrl-test-secret-0123456789"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's walls")

TRAINER = r"""
import json, os, socket, sys
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded import BoundedRewards

key, aws, outside, secret = sys.argv[1:5]
tcp = socket.socket()
tcp.bind(("127.0.0.1", 0))
tcp.listen()
tcp.setblocking(False)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 0))
udp.setblocking(False)
os.dup2(os.open(key, os.O_RDONLY), 200)  # an inheritable descriptor on the signing key
probes = {"ok": ("ok", ""), "env": ("env", secret), "parent_environ": ("parent_environ", secret),
          "read_key": ("read", key), "read_aws": ("read", aws), "fd": ("fd", "200"),
          "tcp": ("tcp", str(tcp.getsockname()[1])), "udp": ("udp", str(udp.getsockname()[1])),
          "write": ("write", outside), "signal_parent": ("signal_parent", ""),
          "home": ("home", os.getcwd()), "write_home": ("write_home", "")}
with BoundedRewards("helpers.snoop_task:SnoopTask", 10.0, 256) as bounded:
    got = bounded.rewards([(p, Row(0, {"question": a})) for p, a in probes.values()])
got = dict(zip(probes, got))
for name, sock in (("tcp_accepted", tcp.accept), ("udp_received", lambda: udp.recv(1))):
    try:
        sock()
        got[name] = True
    except BlockingIOError:
        got[name] = False
print(json.dumps(got))
"""


def skip_if_refused(stderr: str) -> None:
    refused = [line for line in stderr.splitlines() if "the kernel refused" in line]
    if refused:
        pytest.skip(refused[0])


def test_a_hijacked_reward_reaches_no_secret_socket_or_file_of_the_trainers(tmp_path):
    """The trainer (a process of its own, so its /proc/<pid>/environ holds the secret) has an
    AWS secret and a key path in its environment, the key open on a descriptor, credentials
    in its HOME, and a TCP and a UDP socket listening on 127.0.0.1. Each probe of the worker
    gets nothing; the worker's own folder (HOME, TMPDIR, cwd: fresh and empty) still works."""
    key = tmp_path / "keys" / "signing.pem"
    aws = tmp_path / "home" / ".aws" / "credentials"
    for path, text in ((key, "-----BEGIN PRIVATE KEY-----\n"), (aws, f"[default]\n{SECRET}\n")):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    outside = tmp_path / "outside.txt"
    here = tmp_path / "cwd"  # the trainer's cwd is on its sys.path: nothing secret in it
    here.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path),
           "AWS_SECRET_ACCESS_KEY": SECRET, "VRL_SIGNING_KEY": str(key)}
    done = subprocess.run([sys.executable, "-c", TRAINER, str(key), str(aws), str(outside), SECRET],
                          cwd=here, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    skip_if_refused(done.stderr)
    got = json.loads(done.stdout)
    expected = {"ok": 1.0, "env": 0.0, "parent_environ": 0.0, "read_key": 0.0, "read_aws": 0.0,
                "fd": 0.0, "tcp": 0.0, "udp": 0.0, "write": 0.0, "signal_parent": 0.0,
                "home": 1.0, "write_home": 1.0, "tcp_accepted": False, "udp_received": False}
    wrong = {probe: got.get(probe) for probe in expected if got.get(probe) != expected[probe]}
    assert not wrong, f"probes that got through (or a folder of its own that failed): {wrong}"
    assert not outside.exists()
    assert [p.name for p in here.iterdir()] == []  # scratch went to the worker's own folder


@pytest.mark.parametrize("attempt", range(5))
def test_a_process_a_reward_left_in_a_session_of_its_own_dies_with_the_worker(attempt):
    """The reward starts a process with setsid(), holding the worker's stderr (the trainer's
    pipe): killing the worker's process group would miss it. Ending the worker takes it along,
    the thread that drains the pipe ends, and the worker's folder is removed."""
    marker = f"vrl-setsid-{os.getpid()}-{attempt}-{time.monotonic_ns()}"
    bounded = BoundedRewards(SNOOP, 10.0, 256)
    try:
        assert bounded.rewards([("setsid", Row(0, {"question": marker}))]) == [1.0]
        worker = bounded._worker
        if worker.refused:
            pytest.skip(f"the kernel refused the worker {worker.refused}")
        assert wait_until(lambda: holders(marker)), "the reward's process never ran"
        assert os.path.isdir(worker.folder)
        bounded.close()
        assert wait_until(lambda: not holders(marker)), f"{holders(marker)} outlived the worker"
        worker.drain.join(timeout=60)
        assert not worker.drain.is_alive()
        assert not os.path.exists(worker.folder)
    finally:
        bounded.close()
        kill_all(marker)


def test_a_reward_that_moves_the_reaper_out_of_the_group_still_loses_its_processes():
    """The reward takes the reaper out of the worker's process group and leaves a forked child
    holding the reaper's pipe: the group's kill misses both and the pipe never ends. The
    trainer kills the reaper itself (a pidfd taken before any completion), and so all."""
    marker = f"vrl-escape-{os.getpid()}-{time.monotonic_ns()}"
    bounded = BoundedRewards(SNOOP, 10.0, 256)
    try:
        assert bounded.rewards([("escape", Row(0, {"question": marker}))]) == [1.0]
        if bounded._worker.refused:
            pytest.skip(f"the kernel refused the worker {bounded._worker.refused}")
        assert wait_until(lambda: holders(marker)), "the reward's process never ran"
        bounded.close()
        assert wait_until(lambda: not holders(marker)), f"{holders(marker)} outlived the worker"
    finally:
        bounded.close()
        kill_all(marker)


KILLED = r"""
import sys, time
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded import BoundedRewards
bounded = BoundedRewards("helpers.snoop_task:SnoopTask", 10.0, 256)
print(bounded.rewards([("setsid", Row(0, {"question": sys.argv[1]}))]), bounded._worker.refused,
      flush=True)
time.sleep(300)
"""


def test_a_trainer_killed_takes_the_processes_its_rewards_started_along():
    """SIGKILL leaves no end() to run: the worker dies with the trainer (PR_SET_PDEATHSIG),
    the reaper with the worker (its pipe ends), and the setsid child with the reaper."""
    marker = f"vrl-orphan-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path))
    trainer = subprocess.Popen([sys.executable, "-c", KILLED, marker], stdout=subprocess.PIPE,
                               text=True, env=env)
    try:
        said = trainer.stdout.readline()
        assert said.startswith("[1.0] "), said
        if said.strip() != "[1.0] {}":
            pytest.skip(f"the kernel refused the worker {said}")
        assert wait_until(lambda: holders(marker)), "the reward's process never ran"
        trainer.kill()
        trainer.wait()
        assert wait_until(lambda: not holders(marker)), f"{holders(marker)} outlived the trainer"
    finally:
        trainer.kill()
        trainer.wait()
        kill_all(marker)
