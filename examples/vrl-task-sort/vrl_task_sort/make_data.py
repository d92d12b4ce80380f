"""Writes data/eval.csv (200 rows), data/train.csv (2,000): python -m vrl_task_sort.make_data"""
import csv
import random
from pathlib import Path


def main(folder: Path = Path(__file__).resolve().parent / "data") -> None:
    rng, seen = random.Random(0), set()
    for name, n in (("eval.csv", 200), ("train.csv", 2000)):
        rows = [("numbers", "sorted")]
        while len(rows) <= n:
            numbers = [rng.randint(0, 99) for _ in range(rng.randint(2, 6))]
            text = " ".join(map(str, numbers))
            if text not in seen:  # no list twice, and none in both files
                seen.add(text)
                rows.append((text, " ".join(map(str, sorted(numbers)))))
        with open(folder / name, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerows(rows)


if __name__ == "__main__":
    main()
