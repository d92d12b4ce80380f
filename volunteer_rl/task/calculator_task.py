"""The calculator task as a Task: English arithmetic in, one Python expression out, reward 1 when
the expression has the target's value (task.reward holds the rule, task.calculator the safe
evaluator, data/ the shipped CSVs)."""

from __future__ import annotations

import re
from pathlib import Path

from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.dataset import EXPRESSION_COLUMN, PROMPT_COLUMN, calculator_check
from volunteer_rl.task.reward import reward
_OPERATOR = re.compile(r"\*\*|//|[-+*/%]")
MAX_STRATUM = 8


class CalculatorTask(Task):
    name = "calculator"
    columns = (EXPRESSION_COLUMN, PROMPT_COLUMN)
    instruction = ("Write the arithmetic below as one Python expression. "
                   "Answer with the expression only.\n\n{question}")
    k = 8
    max_new_tokens = 32
    # safe_eval refuses anything over 200 characters before parsing and bounds every value:
    # a reward takes microseconds, so these bounds only matter if that code breaks.
    reward_seconds = 1.0
    reward_memory_mb = 64

    def check(self, row: Row) -> str | None:
        return calculator_check(row)

    def prompt(self, row: Row) -> str:
        return row[PROMPT_COLUMN]

    def reward(self, completion: str, row: Row) -> float:
        return reward(completion, row[EXPRESSION_COLUMN])

    def reference(self, row: Row) -> str:
        return row[EXPRESSION_COLUMN]

    def stratum(self, row: Row) -> int:
        """Operators in the target expression (capped): the curriculum's difficulty classes."""
        return min(len(_OPERATOR.findall(row[EXPRESSION_COLUMN])), MAX_STRATUM)

    def data(self) -> tuple[Path, Path]:
        return PACKAGE_DATA / "train.csv", PACKAGE_DATA / "eval.csv"
