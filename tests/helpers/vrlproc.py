"""Run real `vrl` processes from tests: each writes its output to a log file we can read."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from volunteer_rl.launch import vrl_command, vrl_env, vrl_ranks_command


def as_background_job() -> None:
    """What bash does to `cmd &` in a script (no job control) before it execs cmd: SIGINT and
    SIGQUIT ignored. Python then installs no KeyboardInterrupt handler of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)


def _before_exec(background_job: bool, cpus: set[int] | None):
    """The child's set-up between fork and exec: a background job's signals, and the CPUs it
    may run on (every thread it starts later inherits them)."""
    if not background_job and not cpus:
        return None

    def run() -> None:
        if background_job:
            as_background_job()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return run


class Proc:
    def __init__(self, args: list[str], log: Path, cwd: Path, env: dict | None = None,
                 background_job: bool = False, ranks: int = 0, restarts: int = 0,
                 cpus: set[int] | None = None):
        """`vrl <args>`, or with `ranks` that many ranks under torchrun (`restarts`: its
        --max-restarts); `cpus`: the only CPUs it may run on."""
        self.log = log
        self._f = open(log, "w")
        command = vrl_ranks_command(ranks, *args, restarts=restarts) if ranks else vrl_command(*args)
        self.p = subprocess.Popen(command, cwd=cwd, env=vrl_env(env),
                                  stdout=self._f, stderr=subprocess.STDOUT,
                                  preexec_fn=_before_exec(background_job, cpus))

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise AssertionError(f"{self.log.name} did not finish in {timeout}s:\n{self.text()[-3000:]}")

    def terminate(self, timeout: float = 60) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def stop_on_version(vols: list[Proc], version: int, timeout: float) -> list[int]:
    """Wait until each volunteer says it is on `version` (it rebuilt and checked it), then
    stop them all with SIGTERM; their exit codes."""
    for v in vols:
        wait_for(lambda: f"now on v{version} " in v.text(), timeout, f"{v.log.name} on v{version}")
    return [v.terminate() for v in vols]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def run_vrl(args: list[str], cwd: Path, timeout: float = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """`vrl <args>` to its end. `timeout` is a hang guard, not a pace: `vrl eval` of 500
    prompts takes most of a minute on an idle 2-core machine and several beside a demo."""
    return subprocess.run(vrl_command(*args), cwd=cwd, env=vrl_env(env),
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The single `error: ...` line a failed `vrl` command must print (exit 1, no traceback)."""
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    return lines[0]


FAKE_AWS_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}


def load_infra(name: str):
    """Import infra/<name>.py by path: infra/ is not a package of the project."""
    import importlib.util

    module_name = f"_vrl_infra_{name}"
    if module_name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "infra" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]
