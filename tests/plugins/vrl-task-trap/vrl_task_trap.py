"""The calculator with a reward a completion can break on purpose: "spin" makes it loop
forever, "grab" makes it allocate 2 GiB, "burn" makes it take BURN of its CPU bound (the
costliest reward that stays within it). What a buggy or careless task might do on text a
hostile volunteer crafted; the trainer must turn such completions into reason codes."""

import time

from volunteer_rl.task.calculator_task import CalculatorTask

BURN = 0.8
"""Share of reward_seconds a "burn" completion's reward takes, in CPU time."""


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
        if "burn" in completion:
            end = time.process_time() + BURN * self.reward_seconds
            while time.process_time() < end:
                pass
        return super().reward(completion, row)
