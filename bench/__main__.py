"""Run every benchmark, each in its own process, and write docs/PERFORMANCE.md from the rows.

    python -m bench [--quick] [--only generation,s3_checkpoint] [--out docs/PERFORMANCE.md]

Each benchmark runs alone (one after the other, never two at once: they measure a shared
2-core machine) as `python -m bench.<name> --json <tmp>`; its rows, the machine's facts and
the command that reproduces each row go into one Markdown table (and the rows into
docs/PERFORMANCE.json, so that `--only` reruns some benchmarks and keeps the others' rows). A
benchmark that fails is named in the file with its exit code, and the others still run. `--quick` checks the code
with small sizes; its figures mean little and the file says so. Sections people wrote below
the generated part (any `## ` heading after "## Reproduce each row") are kept as they are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import Row, machine

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ["generation", "trl_time_to_accuracy", "prototype_recipe", "balance", "checkpoint_sync",
              "s3_checkpoint", "ingest_fleet", "hostile_flood", "audit_cost", "audit_parking", "replay_choice",
              "trust_farming", "liars", "withholding", "covers", "patch_size", "catch_up",
              "lora_bytes", "lora_accuracy", "startup", "rank_steps", "intake_ranks", "rank_memory",
              "lora_memory", "reward_budget", "host_share"]
"""In the order of docs/PERFORMANCE.md; each is bench/<name>.py."""


def run_one(name: str, quick: bool) -> tuple[list[Row], str | None, float]:
    """(rows, error or None, seconds) of one benchmark run in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", f"bench.{name}", "--json", str(out)] + (["--quick"] if quick else [])
        print(f"== {' '.join(cmd[1:])}", flush=True)
        start = time.time()
        code = subprocess.call(cmd, cwd=ROOT)
        seconds = time.time() - start
        if code != 0 or not out.exists():
            return [], f"exited with code {code}", seconds
        return [Row(**r) for r in json.loads(out.read_text())], None, seconds


def fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"


REPRODUCE = "## Reproduce each row"


def written_notes(out: Path) -> str:
    """The hand-written sections of the existing file: from the first `## ` heading after the
    generated "Reproduce each row" section to the end ('' if none)."""
    try:
        lines = out.read_text().splitlines(keepends=True)
    except OSError:
        return ""
    seen = False
    for i, line in enumerate(lines):
        if line.rstrip() == REPRODUCE:
            seen = True
        elif seen and line.startswith("## "):
            return "".join(lines[i:])
    return ""


def render(results: dict[str, tuple[list[Row], str | None, float]], quick: bool,
           dates: dict[str, str] | None = None) -> str:
    facts = machine()
    lines = [
        "# Performance",
        "",
        "Written by `python -m bench`" + (" --quick (small sizes: these figures check the code and mean little)" if quick else "")
        + f" on {time.strftime('%Y-%m-%d')}. Every ratio compares vrl with a baseline measured in the",
        "same run on the same machine; a ratio above 1 means vrl is better (faster, or more per second).",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()) + ".",
        "",
        "| benchmark | measure | vrl | baseline | ratio | goal | met | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    commands = []
    for name, (rows, error, seconds) in results.items():
        if error:
            lines.append(f"| {name} | - | - | - | - | - | **failed** | `python -m bench.{name}` {error} |")
            continue
        for r in rows:
            met = "-" if r.met is None else ("yes" if r.met else "**no**")
            lines.append(f"| {r.benchmark} | {r.measure} | {fmt(r.vrl)} | {fmt(r.baseline)} | "
                         f"{r.ratio:.2f} | {r.goal} | {met} | {r.note} |")
        when = f", {dates[name]}" if dates and dates.get(name) else ""
        commands.append(f"- `{rows[0].command if rows else 'python -m bench.' + name}` "
                        f"({name}, {seconds:.0f} s here{when})")
    lines += ["", REPRODUCE, "", *commands, "",
              "Run them on an otherwise idle machine: the figures are wall-clock rates on shared cores.", ""]
    return "\n".join(lines)


def rows_file(out: Path) -> Path:
    """The rows behind the Markdown file, so `--only` can redo some and keep the others."""
    return out.with_suffix(".json")


def kept(out: Path, redone: list[str], quick: bool) -> tuple[dict[str, tuple[list[Row], str | None, float]],
                                                              dict[str, str]]:
    """Results of the benchmarks not being rerun, from the last run of the same size, and the
    dates they were measured on (where the file says)."""
    try:
        old = json.loads(rows_file(out).read_text())
    except (OSError, ValueError):
        return {}, {}
    if old.get("quick") != quick:
        return {}, {}
    keep = {name: b for name, b in old["benchmarks"].items() if name in BENCHMARKS and name not in redone}
    return ({name: ([Row(**r) for r in b["rows"]], b["error"], b["seconds"]) for name, b in keep.items()},
            {name: b["date"] for name, b in keep.items() if b.get("date")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (checks the code)")
    parser.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(BENCHMARKS))
    parser.add_argument("--out", default=str(ROOT / "docs" / "PERFORMANCE.md"), help="file to write")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or BENCHMARKS
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {', '.join(unknown)}")
    fresh = {name: run_one(name, args.quick) for name in names}
    old, dates = kept(Path(args.out), names, args.quick)
    dates.update({name: time.strftime("%Y-%m-%d") for name in fresh})
    results = {**old, **fresh}
    results = {name: results[name] for name in BENCHMARKS if name in results}
    notes = written_notes(Path(args.out))
    Path(args.out).write_text(render(results, args.quick, dates) + ("\n" + notes if notes else ""))
    rows_file(Path(args.out)).write_text(json.dumps(
        {"quick": args.quick, "benchmarks": {name: {"rows": [asdict(r) for r in rows], "error": err,
                                                    "seconds": sec, "date": dates.get(name)}
                                             for name, (rows, err, sec) in results.items()}}, indent=1))
    print(f"wrote {args.out}")
    return 1 if any(err for _, err, _ in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
