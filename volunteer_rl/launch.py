"""Starting and stopping `vrl` processes: the demo, the benchmarks and the tests all run the
trainer and volunteers as real processes, and do it the same way.

A child is the same `vrl` this process runs (same interpreter, same install), unbuffered so
its log lines arrive as they happen, with the tokenizers' thread pool off (it warns, and
competes for the cores, once a process that used it forks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def vrl_command(*args: str) -> list[str]:
    """`vrl <args>` as a subprocess command line."""
    return [sys.executable, "-m", "volunteer_rl_cli", *args]


def vrl_ranks_command(ranks: int, *args: str, restarts: int = 0) -> list[str]:
    """`vrl <args>` as `ranks` processes on this machine under torch's own launcher (torchrun,
    here `python -m torch.distributed.run`, which is the same program): the trainer as ranks.
    `restarts`: how often torchrun starts all ranks again after one fails."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "--max-restarts", str(restarts),
            "-m", "volunteer_rl_cli", *args]


def vrl_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus what every `vrl` child needs, plus `extra`.

    PYTHONSAFEPATH: `python -m` would put the child's cwd (the demo's run folder, with the
    trainer's work dir and signing key) on its sys.path, and everything on the trainer's path
    is readable to its reward worker (task.sandbox); the `vrl` script never puts it there."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONSAFEPATH": "1", **(extra or {})}


def stop(procs: list[subprocess.Popen], timeout: float = 60.0) -> list[int]:
    """SIGTERM each (volunteers upload their partial shard, a trainer publishes what it has),
    then wait up to `timeout` for each; SIGKILL stragglers. The exit codes, in order."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes
