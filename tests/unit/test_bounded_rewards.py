"""task.bounded: a task's reward in a worker process, each completion under a CPU, wall-clock
and memory bound; a breach is a RewardBoundExceeded with a code and the completion's index,
and the next call gets a fresh worker. Real worker processes throughout (small bounds: 0.5 s
of CPU, so a 5.5 s wall backstop, and 64 MiB)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.process_table import holders, kill_all, wait_until
from helpers.trap_tasks import DiesOnLoad, ScoreTask, TrapTask
from volunteer_rl.task.base import Row, completion_reward
from volunteer_rl.task.bounded import (BoundedRewards, RewardBoundExceeded, WorkerStartError,
                                       wall_backstop)

TRAP = f"{TrapTask.__module__}:TrapTask"
SCORE = f"{ScoreTask.__module__}:ScoreTask"
SECONDS = TrapTask.reward_seconds
MEMORY_MB = TrapTask.reward_memory_mb
ROW = Row(7, {"question": "what is 1 + 1?"})
EOS = 0x110000  # past every code point: a "token" no text decodes to


def in_process(task, text: str, row: Row) -> float:
    """What a volunteer computes for `text`: base.completion_reward on one token per
    character, then EOS."""
    return completion_reward(task, row, [ord(c) for c in text] + [EOS],
                             lambda ids: "".join(map(chr, ids)), EOS, frozenset())


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie waiting for its reaper counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


@pytest.fixture
def trap():
    with BoundedRewards(TRAP, SECONDS, MEMORY_MB) as bounded:
        yield bounded


# -----------------------------------------------------------------------------
# Breaches


@pytest.mark.parametrize("text, code, says", [
    ("spin", "reward_timeout", f"over {SECONDS:g} s of CPU"),      # pure Python loop
    ("regex", "reward_timeout", f"over {SECONDS:g} s of CPU"),     # C: backtracking in _sre
    ("bigint", "reward_timeout", f"over {SECONDS:g} s of CPU"),    # C: 10**10**7
    ("sleep", "reward_timeout", f"over {wall_backstop(SECONDS):g} s of wall clock"),
    ("grab", "reward_memory", f"over {MEMORY_MB} MiB of memory"),  # 2 GiB against RLIMIT_AS
    ("die", "reward_crash", "the reward worker died (exit code 3)"),
])
def test_a_trap_ends_as_its_code_at_its_index_and_the_next_call_gets_a_new_worker(
        trap, text, code, says):
    assert trap.rewards([("ok", ROW)]) == [1.0]
    assert trap.memory_limit is not None or not os.path.exists("/proc/self/status")
    first = trap.pid
    with pytest.raises(RewardBoundExceeded) as caught:
        # The items behind the trap hold more than a pipe: the parent must keep watching the
        # clock while the worker, stuck, reads none of them.
        trap.rewards([("ok", ROW), ("nope", ROW), (text, ROW), ("x" * 300_000, ROW), ("ok", ROW)])
    err = caught.value
    assert (err.code, err.index) == (code, 2)
    assert err.detail == f"completion 2: {says}" or err.detail.startswith(f"completion 2: {says} (")
    assert err.detail.isprintable() and "\n" not in str(err)
    if text != "sleep":  # the CPU rule, not the wall-clock backstop, ended the others
        assert "wall clock" not in err.detail
    assert trap.pid is None and gone(first)
    assert trap.rewards([("ok", ROW), ("nope", ROW)]) == [1.0, 0.0]
    assert trap.pid not in (None, first)


def test_processes_a_reward_started_die_with_its_worker(trap):
    marker = f"vrl-spawned-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with pytest.raises(RewardBoundExceeded) as caught:
            trap.rewards([("ok", ROW), ("spawn", Row(0, {"question": marker}))])
        assert (caught.value.code, caught.value.index) == ("reward_crash", 1)
        assert "exit code 4" in caught.value.detail  # so the child was started
        assert wait_until(lambda: not holders(marker)), f"{holders(marker)} outlived the worker"
    finally:
        kill_all(marker)


def test_a_worker_killed_while_idle_is_replaced_without_blaming_a_completion(trap):
    assert trap.rewards([("ok", ROW)]) == [1.0]
    first = trap.pid
    os.kill(first, 9)
    deadline = time.monotonic() + 60  # a hang guard: SIGKILL takes milliseconds
    while not gone(first) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trap.rewards([("ok", ROW)]) == [1.0]
    assert trap.pid != first


PARENT = """
import sys
from volunteer_rl.task.base import Row
from volunteer_rl.task.bounded import BoundedRewards
b = BoundedRewards(sys.argv[1], 100.0, 64)
b.rewards([("ok", Row(0, {}))])
print(b.pid, flush=True)
b.rewards([("regex", Row(0, {}))])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_trainer_killed_mid_reward_takes_its_worker_along():
    """SIGKILL (or the OOM killer) leaves no finalizer to run: without PR_SET_PDEATHSIG the
    worker, stuck in a regex, would burn a core forever."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, TRAP], stdout=subprocess.PIPE, env=env)
    worker = None
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.2)  # into the regex
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 60  # a hang guard: SIGKILL takes milliseconds
        while not gone(worker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone(worker)
    finally:
        parent.kill()
        parent.wait()
        if worker is not None and not gone(worker):
            os.kill(worker, 9)


# -----------------------------------------------------------------------------
# Same numbers as in-process


def test_non_numbers_and_raises_give_what_completion_reward_gives(trap):
    texts = ["ok", "", "nope", "raise", "nan", "inf", "seven", "negative", "none", "true",
             "string", "huge", "recurse", "ok"]
    task = TrapTask()
    expected = [in_process(task, t, ROW) for t in texts]
    assert expected == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    got = trap.rewards([(t, ROW) for t in texts])
    assert got == expected and all(type(x) is float for x in got)


def test_thousands_of_items_in_any_unicode_equal_the_in_process_rewards():
    """Thousands of items, some of 200 KB: more requests and more results than a pipe holds
    (a parent that wrote the whole batch before reading would deadlock). Texts and fields
    with newlines, quotes, NULs, U+2028, lone surrogates and astral characters: every reward
    equals the in-process one exactly."""
    odd = ["\n", "\r\n", '"', "\\", "\x00", "\u2028", "\u2029", "\ud800", "\udfff", "😀", "é",
           "\x1b[2J"]
    rows = [Row(i, {"question": f"q{i}{odd[i % len(odd)]}",
                    "answer": odd[(i * 7) % len(odd)] * (i % 3)}) for i in range(40)]
    items = []
    for i in range(3000):
        text = "".join(odd[(i + j) % len(odd)] + str(j) for j in range(i % 17))
        if i % 397 == 5:
            text = text + "y" * 200_000
        items.append((text, rows[i % len(rows)]))
    task = ScoreTask()
    expected = [in_process(task, t, r) for t, r in items]
    assert len(set(expected)) > 1000 and 0.0 in expected and 1.0 in expected  # clamped both ways
    with BoundedRewards(SCORE, 1.0, 256) as bounded:
        assert bounded.rewards(items) == expected
        assert bounded.rewards(items[::-1]) == expected[::-1]  # the same worker, again


def test_a_tasks_stdout_stdin_and_a_flood_on_stderr_do_not_reach_the_protocol(trap):
    """print() would forge a result line, input would eat requests, and 1 MiB on stderr would
    fill its pipe and block the worker: none of them may change a reward or breach."""
    assert trap.rewards([("ok", ROW)]) == [1.0]
    first = trap.pid
    got = trap.rewards([("print", ROW), ("ok", ROW), ("shout", ROW), ("read", ROW), ("nope", ROW)])
    assert got == [1.0, 1.0, 1.0, 0.25, 0.0]
    assert trap.pid == first


# -----------------------------------------------------------------------------
# Starting, closing


@pytest.mark.parametrize("value, says", [
    (f"{TrapTask.__module__}:NoSuchTask", "cannot load (AttributeError"),
    ("no_such_module_for_vrl_tests:Task", "cannot load (ModuleNotFoundError"),
    ("json:loads", "is not a volunteer_rl.task.base.Task"),
    (f"{DiesOnLoad.__module__}:DiesOnLoad", "did not start (boom: this task cannot start here)"),
])
def test_a_task_that_does_not_load_is_a_one_line_task_error(value, says):
    """The trainer's fault, not a completion's: none was sent (test_reward_start_faults)."""
    bounded = BoundedRewards(value, SECONDS, MEMORY_MB)
    with pytest.raises(WorkerStartError) as caught:
        bounded.rewards([("ok", ROW)])
    message = str(caught.value)
    assert says in message and value in message
    assert "\n" not in message and message.isprintable()
    assert bounded.pid is None
    bounded.close()


def test_a_plugin_on_the_parents_sys_path_loads_in_the_worker(tmp_path, monkeypatch):
    """As `pip install --target X` plus PYTHONPATH=X would leave it: importable here only
    through sys.path."""
    (tmp_path / "vrl_plugin_on_path.py").write_text(
        "from volunteer_rl.task.base import Task\n"
        "class Plug(Task):\n"
        "    name = 'plug'\n"
        "    columns = ('question',)\n"
        "    def reward(self, completion, row):\n"
        "        return 0.5 if completion == row['question'] else 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with BoundedRewards("vrl_plugin_on_path:Plug", SECONDS, MEMORY_MB) as bounded:
        assert bounded.rewards([(ROW["question"], ROW), ("other", ROW)]) == [0.5, 0.0]


def test_close_kills_the_worker_and_is_safe_twice():
    with BoundedRewards(TRAP, SECONDS, MEMORY_MB) as bounded:
        assert bounded.pid is None and bounded.rewards([]) == []  # started lazily
        assert bounded.rewards([("ok", ROW)]) == [1.0]
        pid = bounded.pid
        assert pid is not None and not gone(pid)
    assert bounded.pid is None and gone(pid)
    bounded.close()
    bounded.close()
    assert bounded.rewards([("ok", ROW)]) == [1.0]  # a later call starts another
    bounded.close()


@pytest.mark.parametrize("seconds, memory_mb", [(0, 64), (-1.0, 64), (float("nan"), 64), (0.5, 0)])
def test_bounds_must_be_positive(seconds, memory_mb):
    with pytest.raises(ValueError):
        BoundedRewards(TRAP, seconds, memory_mb)
