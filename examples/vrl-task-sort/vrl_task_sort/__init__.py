"""Sort a few integers: "42 7 19" -> "7 19 42". Reward 1 for the exact answer, else 0."""
import re
from pathlib import Path

from volunteer_rl.task.base import Row, Task

NUMBERS = re.compile(r"-?\d{1,6}( -?\d{1,6}){1,19}")  # 2-20 ints of at most 6 digits


class SortTask(Task):
    name = "sort"
    columns = ("numbers", "sorted")
    instruction = "Sort these numbers from smallest to largest: {question}"
    k = 8
    max_new_tokens = 24  # 6 numbers: 6 tokens of the tiny BPE, 18 spelling digits singly
    # A reward is one string comparison (microseconds); the bounds leave room for a busy
    # trainer, whose clock is wall time where there is no /proc (macOS).
    reward_seconds = 0.5
    reward_memory_mb = 64

    def check(self, row: Row) -> str | None:
        if not NUMBERS.fullmatch(row["numbers"]):
            return f"numbers {row['numbers'][:40]!r} are not 2-20 space-separated integers"
        if row["sorted"] != self.reference(row):
            return f"sorted {row['sorted'][:40]!r} is not numbers sorted"
        return None

    def prompt(self, row: Row) -> str:
        return row["numbers"]

    def reward(self, completion: str, row: Row) -> float:
        # A plain comparison: the text is never parsed, so any text costs one linear pass.
        return 1.0 if completion.strip() == row["sorted"] else 0.0

    def reference(self, row: Row) -> str:
        return " ".join(str(n) for n in sorted(int(x) for x in row["numbers"].split()))

    def stratum(self, row: Row) -> int:
        return min(8, len(row["numbers"].split()) - 2)  # 2 numbers -> 0, ..., 10+ -> 8

    def data(self) -> tuple[Path, Path]:
        folder = Path(__file__).resolve().parent / "data"  # shipped as package data
        return folder / "train.csv", folder / "eval.csv"
