"""What a volunteer gets by covering the groups it dislikes (issue 41, row c's hole): instead of
leaving a group out, which counts its number missing, it uploads a made-up group of equal
rewards under that number. No step trains a group without reward variance, so no step replays
it, yet it counts the number as received. Measured with the intake's replay of such groups at
`--audit-cover-floor` (its default) against 0 (the volunteer's audit rate alone, down to
--audit-floor: the rule before), in the same run.

    python -m bench.covers [--quick] [--json PATH]

Each side is one real trainer (bench.withholding.Run: bench.liars.Trial's trainer at the
defaults, every trained group verified, 32 groups a step, a publish per step) on a folder
bucket from the demo's warm-started v0, with two volunteer ids that sample as `vrl volunteer`
does and take turns of TURN_GROUPS groups each, one shard a turn:

- cover: honest for `farm_turns` turns (so its audit rate has fallen to 10 / n), then, each
  turn, it replaces usable groups whose mean reward is below the mean of the usable groups it
  sampled so far with covers: the group's completions all replaced by its lowest-reward one,
  so every reward is equal. `patient` covers only the lowest such group a turn (a shard is
  rejected whole, and each more cover in it is one more chance to be drawn), `greedy` every
  one (a row each).
- honest: uploads every group (and keeps the trainer fed).

Per side: covers sent, covers caught (in a rejected shard; a cover is a forgery, so its
volunteer is denied at once) and covers taken unreplayed, the turn of the denial, groups
trained, and the mean reward of the coverer's trained groups against that of the usable groups
it sampled (bench.withholding.stats: trained groups are usable ones, so that is the reference).

Goal: as row (c), the coverer's trained mean within GOAL_SE standard errors of its sampled
mean, or nothing trained, in every run. Figure: covers taken unreplayed over `trials` runs a
side, vrl against the rule before; ratio (baseline + 1) / (vrl + 1).
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Row, cli
from bench.liars import Liar, shared_v0
from bench.withholding import GOAL_SE, TURN_GROUPS, Run, Volunteer, group_mean, stats, usable

COMMAND = "python -m bench.covers"
BASELINE_FLOOR = 0.0
"""--audit-cover-floor of the baseline: covers drawn at the volunteer's audit rate alone."""


@dataclass(frozen=True)
class Sizes:
    trials: int
    """Runs per coverer and side: one run's figure is a handful of random draws."""
    farm_turns: int
    """Honest turns before the first cover: 16 turns are 256 groups, an audit rate of 4 %."""
    turns: int
    """All turns of the run."""


FULL = Sizes(trials=5, farm_turns=16, turns=64)
QUICK = Sizes(trials=1, farm_turns=4, turns=10)


def cover_of(group):
    """`group` with every completion replaced by its lowest-reward one: equal rewards, so never
    trained, and made up (each completion's draw is its own, so the copies fail a replay)."""
    from volunteer_rl.protocol.shards import Group

    low = min(group.completions, key=lambda c: c.reward)
    return Group(group.prompt_id, group.policy_version, group.volunteer_id, group.seq,
                 [low] * len(group.completions))


class Coverer(Volunteer):
    """A volunteer id that, once its farm turns are done, covers usable groups below its mean:
    the lowest one a turn (`greedy` False), or every one (True)."""

    def __init__(self, run: Run, farm_turns: int, greedy: bool):
        self.name, self.run, self.farm_turns, self.greedy = "cover", run, farm_turns, greedy
        self.liar = Liar(run.t, self.name)
        self.sampled: list[tuple[float, bool]] = []
        self.sent: dict[tuple[str, int], float] = {}
        self.turns = 0
        self.covers: list[tuple[str, int]] = []
        """(shard key, line) of every cover sent."""
        self.denied_turn: int | None = None

    def turn(self) -> list[str]:
        self.turns += 1
        if self.run.t.fleet.is_denied(self.liar.vid):
            if self.denied_turn is None:
                self.denied_turn = self.turns - 1
            return []  # a denied id's shards are never read: it stops, as a liar would
        groups = self.liar.sample(TURN_GROUPS)
        means = [m for m, ok in self.sampled if ok] + [group_mean(g) for g in groups if usable(g)]
        self.sampled += [(group_mean(g), usable(g)) for g in groups]
        covered: list[int] = []
        if self.turns > self.farm_turns and means:
            ref = sum(means) / len(means)
            below = sorted((i for i, g in enumerate(groups) if usable(g) and group_mean(g) < ref),
                           key=lambda i: group_mean(groups[i]))
            covered = below if self.greedy else below[:1]
            for i in covered:
                groups[i] = cover_of(groups[i])
        key = self.liar.send(groups)
        self.sent.update(((key, line), group_mean(g)) for line, g in enumerate(groups))
        self.covers += [(key, i) for i in covered]
        return [key]


STRATEGIES = {"patient": False, "greedy": True}
"""Coverers by name: whether it covers every usable group below its mean a turn (greedy) or
only the lowest (patient: a shard is rejected whole, so each more cover is one more chance
to be drawn)."""


def run(s: Sizes, model: Path, floor: float | None, greedy: bool) -> dict:
    """One trainer run with a coverer and an honest volunteer (`floor` None: the default)."""
    started = time.time()
    settings = {} if floor is None else {"audit_cover_floor": floor}
    with tempfile.TemporaryDirectory(prefix="vrl-covers-") as tmp:
        r = Run(Path(tmp), model, **settings)
        cover, honest = Coverer(r, s.farm_turns, greedy), Volunteer(r, "honest")
        try:
            for turn in range(s.turns):
                order = [cover, honest] if turn % 2 else [honest, cover]
                r.drain([key for v in order for key in v.turn()])
        except Exception:
            print("\n".join(["the trainer's last lines:", *r.log]), flush=True)
            raise
        finally:
            r.stop()
        out = stats(cover, r.outcomes, r.views)
        out.update(covers=len(cover.covers),
                   caught=sum(r.outcomes.get((k, -1)) == "rejected" for k, _ in cover.covers),
                   through=sum(r.outcomes.get((k, line)) == "zero_variance" for k, line in cover.covers),
                   denied=r.t.fleet.is_denied(cover.liar.vid), denied_turn=cover.denied_turn,
                   honest_trained=stats(honest, r.outcomes, r.views)["trained"],
                   floor=r.t.cfg.audit_cover_floor)
    print(f"{'greedy' if greedy else 'patient'} coverer, --audit-cover-floor {out['floor']:g}: {r.t.learner.steps} steps, {time.time() - started:.0f} s: "
          f"{out['covers']} covers, {out['caught']} caught, {out['through']} through, denied "
          f"{out['denied']} (turn {out['denied_turn']}), trained {out['trained']}, "
          f"{out['diff_se']:+.2f} s.e.", flush=True)
    return out


def describe(xs: list[dict]) -> str:
    """The trials of one side, totals first."""
    total = {k: sum(x[k] for x in xs) for k in ("covers", "caught", "through", "trained", "honest_trained")}
    turns = ", ".join(str(x["denied_turn"]) if x["denied_turn"] is not None
                      else "the last" if x["denied"] else "never" for x in xs)
    diffs = ", ".join(f"{x['diff_se']:+.2f}" for x in xs)
    return (f"--audit-cover-floor {xs[0]['floor']:g}, {len(xs)} runs: {total['covers']} covers sent, "
            f"{total['caught']} caught, {total['through']} taken unreplayed (by run: "
            f"{', '.join(str(x['through']) for x in xs)}), denied after turn {turns}; trained "
            f"{total['trained']} of its groups, trained mean minus sampled {diffs} s.e. by run; the "
            f"honest volunteer beside it had {total['honest_trained']} trained")


def results(quick: bool) -> list[Row]:
    s = QUICK if quick else FULL
    model = shared_v0()
    rows = []
    for name, greedy in STRATEGIES.items():
        now = [run(s, model, None, greedy) for _ in range(s.trials)]
        before = [run(s, model, BASELINE_FLOOR, greedy) for _ in range(s.trials)]
        through_now, through_before = sum(x["through"] for x in now), sum(x["through"] for x in before)
        how = ("every usable group below its mean" if greedy
               else "its worst usable group below its mean, one cover a shard")
        rows.append(Row(
            benchmark=f"covering volunteer: made-up equal-reward groups for the numbers it disliked, {name}",
            measure=f"covers taken unreplayed, {s.trials} runs",
            vrl=through_now, baseline=through_before,
            ratio=(through_before + 1) / (through_now + 1),
            goal=f"trained mean within {GOAL_SE:g} s.e. of sampled, or nothing trained",
            met=all(x["met"] for x in now), command=COMMAND + (" --quick" if quick else ""),
            note=(f"one coverer beside an honest volunteer in one live trainer at the defaults, from "
                  f"the demo's v0, {s.turns} turns of {TURN_GROUPS} groups, honest for {s.farm_turns} "
                  f"turns, then covering {how}; {describe(now)}. Baseline, {describe(before)}")))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
