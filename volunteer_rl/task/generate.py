"""`python -m volunteer_rl.task.generate`: regenerate a built-in task's CSVs. A data tool:
nothing imports it at run time.

Regenerate the shipped data with:  python -m volunteer_rl.task.generate --out data
(`--task countdown` makes the countdown task's files instead). The generators themselves are
task.calculator_generate and task.countdown_generate.
"""

from __future__ import annotations

import argparse

from volunteer_rl.task import calculator_generate, countdown_generate


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate a built-in task's CSVs.")
    parser.add_argument("--task", choices=("calculator", "countdown"), default="calculator",
                        help="calculator: train.csv, eval.csv (default); countdown: "
                             "countdown-train.csv, countdown-eval.csv")
    parser.add_argument("--out", default="data", help="output directory (default: data)")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-eval", type=int, default=500)
    parser.add_argument("--seed", type=int, default=None,
                        help=f"default: {calculator_generate.SEED} (calculator), "
                             f"{countdown_generate.SEED} (countdown)")
    args = parser.parse_args(argv)
    generator = countdown_generate if args.task == "countdown" else calculator_generate
    seed = generator.SEED if args.seed is None else args.seed
    generator.main(args.out, args.n_train, args.n_eval, seed)


if __name__ == "__main__":
    main()
