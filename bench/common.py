"""What every benchmark shares: one result row, the machine it ran on, and a small CLI.

Each benchmark module `bench/<name>.py` exposes `results(quick: bool) -> list[Row]` and ends
with `sys.exit(cli(results, __doc__))`, so that

    python -m bench.<name> [--quick] [--json PATH]

prints its rows (figure, baseline, ratio, goal) and can hand them to `python -m bench`, which
runs every benchmark in its own process and writes docs/PERFORMANCE.md from the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass
class Row:
    benchmark: str
    """Short name of what is measured, e.g. `volunteer generation`."""
    measure: str
    """The figure and its unit, e.g. `completions/s`."""
    vrl: float
    """The figure for vrl's own code path."""
    baseline: float
    """The same figure for the baseline, measured in the same run."""
    ratio: float
    """vrl / baseline for rates (higher is better), baseline / vrl for times: >1 means vrl wins."""
    goal: str
    """The target from the issue, e.g. `>= 4x`, or `-` for a figure with no target."""
    met: bool | None
    """Whether the goal holds; None when there is no goal."""
    command: str
    """The command that reproduces this row."""
    note: str = ""
    """One line: baseline name, sizes, what limits the figure."""


def machine() -> dict[str, str]:
    """The facts a reader needs to compare figures across machines."""
    import torch

    return {"cpu": _cpu_model(), "cores": str(os.cpu_count()), "python": platform.python_version(),
            "torch": torch.__version__, "torch threads": str(torch.get_num_threads()),
            "os": f"{platform.system()} {platform.release()}"}


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_rows(rows: list[Row]) -> None:
    for r in rows:
        verdict = "" if r.met is None else ("  goal met" if r.met else "  goal MISSED")
        print(f"{r.benchmark}: {r.measure} vrl {r.vrl:.4g} vs baseline {r.baseline:.4g} -> "
              f"ratio {r.ratio:.2f} (goal {r.goal}){verdict}"
              + (f"  [{r.note}]" if r.note else ""), flush=True)


def emit_rows(rows: list[Row], json_path: str | None) -> int:
    """Print the rows, and write them as JSON to `json_path` if given (for `python -m bench`)."""
    print_rows(rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


def cli(results: Callable[[bool], list[Row]], doc: str | None) -> int:
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the code, not the figures")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    args = parser.parse_args()
    return emit_rows(results(args.quick), args.json)


if __name__ == "__main__":
    sys.exit("bench/common.py is a library; run python -m bench")
