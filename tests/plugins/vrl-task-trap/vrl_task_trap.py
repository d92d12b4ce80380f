"""The calculator with a reward a completion can break on purpose: "spin" makes it loop
forever, "grab" makes it allocate 2 GiB. What a buggy or careless task might do on text a
hostile volunteer crafted; the trainer must turn such completions into reason codes."""

from volunteer_rl.task.calculator_task import CalculatorTask


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
        return super().reward(completion, row)
