"""Which prompts volunteers sample next: the ones likely to teach the policy something.

The trainer keeps one PromptPicker, fed with the rewards it recomputed for every group it
takes, and publishes `pick`'s choice in each manifest as the version's `prompt_pool`; a
volunteer's group number draws its prompt from that pool (protocol.draws.pool_prompt), so
the curriculum is the trainer's and no volunteer chooses a prompt.

A group whose K completions all get the same reward (all right, or all wrong) has a zero
advantage on every token, so the trainer counts it and drops it. In the demo such groups
were 58 % of everything volunteers made, and they cluster by difficulty. From one demo run
(v0 to v990, 6,400 groups), by operators in the target expression:

    operators   all wrong   all right   useful (reward variance)
        1          14 %        51 %         35 %
        2          15 %        26 %         59 %
        3          35 %         5 %         60 %
        4          84 %         1 %         15 %

So the picker keeps, for each difficulty stratum (the task's `stratum`: for the calculator,
the operator count), a decayed count of the
groups it saw and of the useful ones, and draws strata in proportion to their size times the
square of their useful rate, with a floor so that no stratum starves and every estimate stays
current as the policy learns. It also remembers prompts whose last group was uniform and
skips them three times in four: most stay uniform for a while.

Half of each pool (REVISIT) comes from the prompts whose last group had reward variance: a
prompt the policy solves some of the time is the likeliest to do so again, far likelier than
its stratum's average (in the demo about half of all groups had no variance, which bounds the
share of sampled groups that can ever be trained; issue 27's useful fraction).

This only changes which prompts get sampled, never how: groups are still sampled from the
published policy, rewards are still recomputed by the trainer, and a prompt no stratum
weight favours is still drawn now and then. (Before schema 6 each volunteer ran this on its
own groups; the trainer sees every volunteer's, so its estimates are current sooner.) Pure
logic, no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from volunteer_rl.task.base import Row

DECAY = 0.995
"""Weight of an old observation after each new one in its stratum: about the last 200 count."""
FLOOR = 0.05
"""Smallest share of draws any stratum gets."""
RETRY_UNIFORM = 0.25
"""Chance that a prompt whose last group was uniform is drawn again when it comes up."""
REVISIT = 0.5
"""Share of a pool drawn from the prompts whose last group had reward variance (most likely
to have it again: their pass rate is neither 0 nor 1), the rest by stratum as before."""
MAX_REVISITS = 4096
"""Prompts remembered as last useful: the most recent ones, as a bound."""


@dataclass
class _Tally:
    seen: float = 0.0
    useful: float = 0.0

    def rate(self) -> float:
        """Useful share with a uniform prior: 0.5 before any observation."""
        return (self.useful + 1.0) / (self.seen + 2.0)


class PromptPicker:
    def __init__(self, problems: list[Row], rng: random.Random, adaptive: bool = True,
                 stratum: Callable[[Row], int] = lambda row: 0):
        """`stratum`: the task's difficulty class of a row. `adaptive` False: uniform draws
        without replacement within a call, nothing learnt."""
        self.problems = problems
        self.strata = [stratum(p) for p in problems]
        self.rng = rng
        self.adaptive = adaptive
        self.by_stratum: dict[int, list[int]] = {}
        for i, s in enumerate(self.strata):
            self.by_stratum.setdefault(s, []).append(i)
        self.tally = {s: _Tally() for s in self.by_stratum}
        self.index = {p.id: i for i, p in enumerate(problems)}
        self.uniform: set[int] = set()  # indices whose last group had one reward for all K
        self.revisits: dict[int, None] = {}  # indices whose last group had variance, oldest first

    def shares(self) -> dict[int, float]:
        """Probability of drawing each stratum next: size x rate^2, then floored, summing to 1."""
        raw = {s: len(ix) * self.tally[s].rate() ** 2 for s, ix in self.by_stratum.items()}
        total = sum(raw.values())
        floored = {s: max(FLOOR, w / total) for s, w in raw.items()}
        norm = sum(floored.values())
        return {s: w / norm for s, w in floored.items()}

    def pick(self, n: int) -> list[Row]:
        """`n` distinct prompts (fewer only if the dataset is smaller)."""
        n = min(n, len(self.problems))
        if not self.adaptive:
            return self.rng.sample(self.problems, n)
        shares = self.shares()
        strata, weights = list(shares), list(shares.values())
        revisits = list(self.revisits)
        chosen: set[int] = set(self.rng.sample(revisits, min(len(revisits), int(REVISIT * n))))
        for _ in range(50 * n):  # bounded: a tiny dataset of uniform prompts still returns
            if len(chosen) == n:
                break
            s = self.rng.choices(strata, weights)[0]
            i = self.rng.choice(self.by_stratum[s])
            if i in self.uniform and self.rng.random() >= RETRY_UNIFORM:
                continue
            chosen.add(i)
        while len(chosen) < n:  # fill up uniformly at random
            chosen.add(self.rng.randrange(len(self.problems)))
        return [self.problems[i] for i in chosen]

    def pool(self, n: int) -> tuple[int, ...]:
        """`pick(n)` as the sorted dataset rows (prompt ids) a manifest's `prompt_pool` holds."""
        return tuple(sorted(p.id for p in self.pick(n)))

    def observe(self, problem: Row, rewards: list[float]) -> None:
        """Record the rewards of one group sampled for `problem`."""
        i = self.index[problem.id]
        useful = max(rewards) != min(rewards)
        t = self.tally[self.strata[i]]
        t.seen = t.seen * DECAY + 1.0
        t.useful = t.useful * DECAY + (1.0 if useful else 0.0)
        if useful:
            self.uniform.discard(i)
            self.revisits.pop(i, None)
            self.revisits[i] = None
            if len(self.revisits) > MAX_REVISITS:
                del self.revisits[next(iter(self.revisits))]
        else:
            self.uniform.add(i)
            self.revisits.pop(i, None)
