"""The calculator task's problem generator: English arithmetic sentences assembled from the
phrasing templates (task.calculator_templates), each checked against the safe evaluator, and
the train/eval split written to data/. A data tool: nothing imports it at run time.

Regenerate the shipped data with:  python -m volunteer_rl.task.generate --out data
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Iterator

from volunteer_rl.task.calculator import render, safe_eval
from volunteer_rl.task.calculator_templates import (
    MAX_TARGET_MAGNITUDE,
    STARTS,
    STEPS,
    Template,
    Value,
)
from volunteer_rl.task.dataset import Problem, file_sha256, load_csv, write_csv

SEED = 1234
"""The train split's seed (eval's is SEED + 1): the shipped data/train.csv and eval.csv."""

# -----------------------------------------------------------------------------
# Assembling a sentence

def _pick(rng: random.Random, templates: list[Template], n_ops: int) -> Template | None:
    """Weighted choice among templates that can use exactly n_ops operators."""
    fits = [t for t in templates if n_ops in t.ops]
    if not fits:
        return None
    return rng.choices(fits, weights=[t.weight for t in fits])[0]


def _connector(rng: random.Random, i: int, n_steps: int, bare: bool) -> str:
    """The glue before step i: ', ' / ', then ' / ', and finally ' ..."""
    if bare:
        return ", "
    if i == n_steps - 1:
        if n_steps == 1:
            return rng.choice([", then ", ", and then ", ", then ", ", and "])
        return rng.choice([", then ", ", and then ", ", and finally ", ", finally "])
    if i == 0:
        return rng.choice([", ", ", then "])
    return rng.choice([", ", ", then ", "; then "])


def _in_bounds(v: Value) -> bool:
    return abs(v.value) <= MAX_TARGET_MAGNITUDE


def _make_one(rng: random.Random, n_ops: int) -> tuple[str, str, tuple[str, ...]] | None:
    """One attempt at a problem with n_ops operators: (prompt, expression, template names) or
    None."""
    # the start clause uses some of the operators, the steps use the rest.
    # Only one start template ("start with 7") uses 0 operators, so give it a
    # modest share rather than 1/(n_ops+1) of all problems.
    start_ops = 0 if rng.random() < 0.2 else rng.randint(1, min(3, n_ops))
    start = _pick(rng, STARTS, start_ops)
    made = start.fn(rng, start_ops)
    if made is None:
        return None
    text, is_noun_phrase, cur = made
    names = [f"start:{start.name}"]
    steps: list[tuple[str, bool]] = []
    remaining = n_ops - start_ops
    for _ in range(50):  # bounded: a step may decline (returns None) and we retry
        if remaining == 0:
            break
        # only "add 4 and 5" uses two operators; keep it an occasional treat
        step_ops = 2 if remaining >= 2 and rng.random() < 0.12 else 1
        step = _pick(rng, STEPS, step_ops)
        made = step.fn(rng, cur)
        if made is None:
            continue  # e.g. no even divisor for this value: pick another step
        step_text, bare, cur = made
        if not _in_bounds(cur):
            return None
        steps.append((step_text, bare))
        names.append(f"step:{step.name}")
        remaining -= step.ops[0]
    if remaining or not _in_bounds(cur):
        return None

    if is_noun_phrase and not steps and rng.random() < 0.4:
        prompt = f"what is {text}?"
    else:
        if is_noun_phrase:
            verb = rng.choice(["compute", "calculate", "work out", "find", "evaluate"])
            text = f"{verb} {text}"
        for i, (step_text, bare) in enumerate(steps):
            text += _connector(rng, i, len(steps), bare) + step_text
        prompt = text + "."
    if rng.random() < 0.5:
        prompt = prompt[0].upper() + prompt[1:]

    # the rendered expression must evaluate (safely) to the exact tracked value
    expression = render(cur.node)
    value = safe_eval(expression)
    if value is None or not math.isclose(value, float(cur.value), rel_tol=1e-9, abs_tol=1e-9):
        return None
    return prompt, expression, tuple(names)


def _stream(seed: int, ops_range=(1, 4)) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """Endless deterministic stream of (prompt, expression, templates) with unique prompts."""
    lo, hi = ops_range
    if not 1 <= lo <= hi:
        raise ValueError(f"bad ops_range {ops_range!r}: need 1 <= lo <= hi")
    rng = random.Random(seed)
    seen: set[str] = set()
    misses = 0
    while True:
        try:
            made = _make_one(rng, rng.randint(lo, hi))
        except ZeroDivisionError:
            made = None  # e.g. 'subtract 5 from that', then 'divide 7 by it' with it == 0
        if made is None or made[0] in seen:
            misses += 1
            if misses > 100_000:  # only if the template space is exhausted
                raise RuntimeError(f"generator stuck after {len(seen)} unique problems")
            continue
        misses = 0
        seen.add(made[0])
        yield made


def generate_labelled(n: int, seed: int, ops_range=(1, 4)) -> list[tuple[Problem, tuple[str, ...]]]:
    """Like generate_problems, but each problem comes with the template labels that built it.

    Labels look like ('start:add_list', 'step:multiply_by', 'step:subtract').
    """
    stream = _stream(seed, ops_range)
    out = []
    for i in range(n):
        prompt, expression, names = next(stream)
        out.append((Problem(i, prompt, expression), names))
    return out


def generate_problems(n: int, seed: int, ops_range=(1, 4)) -> list[Problem]:
    """n procedurally generated problems with unique prompts; deterministic for a given seed.

    1-4 binary operators chained in English with many phrasings; targets are
    canonical Python expressions whose |value| <= 1e9, divisions mostly exact.
    """
    return [p for p, _ in generate_labelled(n, seed, ops_range)]


def template_names() -> list[str]:
    """All template labels, as used by generate_labelled: 'start:add_list', 'step:times', ..."""
    return [f"start:{t.name}" for t in STARTS] + [f"step:{t.name}" for t in STEPS]


# -----------------------------------------------------------------------------
# Train / eval splits


def make_splits(out_dir, n_train=20000, n_eval=500, seed=SEED) -> tuple[Path, Path]:
    """Generate train.csv and a held-out eval.csv in out_dir; returns (train_path, eval_path).

    Eval is drawn first (so it is an unbiased sample of the generator), then
    train is drawn from a different seed, skipping any problem whose prompt OR
    expression appears in eval, so eval can't be solved by memorising train.
    """
    out_dir = Path(out_dir)
    eval_problems = generate_problems(n_eval, seed=seed + 1)
    eval_prompts = {p.prompt for p in eval_problems}
    eval_expressions = {p.expression for p in eval_problems}
    train_problems = []
    for prompt, expression, _ in _stream(seed):
        if len(train_problems) == n_train:
            break
        if prompt in eval_prompts or expression in eval_expressions:
            continue
        train_problems.append(Problem(len(train_problems), prompt, expression))
    train_path, eval_path = out_dir / "train.csv", out_dir / "eval.csv"
    write_csv(train_path, train_problems)
    write_csv(eval_path, eval_problems)
    return train_path, eval_path


def main(out_dir, n_train: int = 20000, n_eval: int = 500, seed: int = SEED) -> None:
    """make_splits, then read every row back (everything we ship must load) and print each
    file's rows and sha256. task.generate's default --task calculator."""
    for path in make_splits(out_dir, n_train, n_eval, seed):
        rows = load_csv(path)
        print(f"{path}: {len(rows)} rows, sha256 {file_sha256(path)}")
