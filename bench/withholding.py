"""What a withholding volunteer gets trained (issue 41, row c): the mean reward of its trained
groups against that of the groups it sampled, and its missing share as fleet.json shows it;
with the price of withholding on (--missing-bound 0.05, the default) and, as the baseline,
off (--missing-bound 1), measured in the same run.

    python -m bench.withholding [--quick] [--json PATH]

Each side is one real trainer (bench.liars.Trial: `trainer.loop.Trainer` at TrainerConfig's
defaults but for --missing-bound: every trained group verified, 32 groups a step, a publish
after every step, a window of 2 versions; one torch thread) on a folder bucket, started from
the demo's warm-started v0 (bench.trl_time_to_accuracy.shared_start), and three volunteer ids
in it that sample as `vrl volunteer` does (bench.liars.Liar: numbered groups, the prompt each
number draws from the version's pool, its committed draw keys, the weights of the version just
published) and write real shards into the bucket. Each turn, each volunteer samples TURN_GROUPS
groups and uploads, as one shard, those it keeps (in turns, so that no volunteer's groups are
always the last of a version read, which a step takes last):

1. fifth: the top FIFTH_SHARE (a fifth) of the batch, the usable groups (reward variance) of
   highest mean reward (the issue's liar: sampled 256, uploaded the 56 it liked, 0.41 against
   0.28 over all it sampled).
2. edge: what a careful liar does against a bound of 5 %, counted by blocks of 8 numbers (a
   block with one number missing counts 8): it touches blocks whose numbers never count over
   EDGE_SHARE (4 %) of those it sampled so far, the turn's blocks where leaving out costs the
   most below its mean, and in each block it touches it leaves out every usable group below
   the mean of those it sampled, which costs it nothing more.
3. honest: every group (the control, and the honest volunteer the other two train beside).

After each turn the bench runs the trainer's loop (bench.liars.Trial.round) until it took the
turn's shards and waits for groups, so a step takes what arrived and few groups go stale.
After the last turn it publishes what is left; fewer groups than a step stay untrained
("waiting").

Per volunteer: groups sampled, usable among them, uploaded, trained (the ledger's `trained`
records of its shards' lines), the mean reward (mean of group mean rewards) of its trained
groups against that of its sampled usable groups, that mean's standard error, their difference
in standard errors, the mean of everything it sampled, and fleet.json's `missing_recent` of
`numbers_recent` and `held_back` as the run ends (fleet.json is written after every publish
here and once more at the end, and read back each time: the row says in how many of those
writes it showed the volunteer held).

The reference is the usable groups because the trainer trains no zero-variance group from
anyone (their outcome is `zero_variance`): an honest volunteer's trained groups are its usable
ones, whose mean differs from that of all it sampled by construction; the mean over all it
sampled is shown beside it. Leaving out a zero-variance group changes nothing trained, so the
liars leave out usable ones.

Goal: trained mean within GOAL_SE (2) standard errors of the sampled one, or nothing trained.
Figure: that difference in s.e. (0 when nothing is trained), vrl against the price off; ratio
(|baseline| + 1) / (|vrl| + 1), as bench.liars counts.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.common import Row, cli
from bench.liars import MAX_ROUNDS, WAITING, Liar, Trial, shared_v0

COMMAND = "python -m bench.withholding"
TURN_GROUPS = 16
"""Groups each volunteer samples per turn (one shard of what it keeps): with about two thirds
of them usable, some 22 trainable groups a turn, under one step (32), so each step also takes
some of the older groups left waiting (it takes the newest versions first) and few go stale."""
FIFTH_SHARE = 0.2
"""The share of each turn's groups `fifth` uploads: its best usable ones."""
EDGE_SHARE = 0.04
"""The most of its numbers `edge` has counted missing, just under the trainer's --missing-bound
(5 %)."""
GOAL_SE = 2.0
"""The goal: a trained mean within this many standard errors of the sampled mean."""
BOUND_ON = 0.05
"""--missing-bound of vrl's side: the trainer's default."""
BOUND_OFF = 1.0
"""--missing-bound of the baseline: the price of withholding off."""


@dataclass(frozen=True)
class Sizes:
    turns: int
    """Turns of the run: each volunteer samples turns × TURN_GROUPS groups."""


FULL = Sizes(turns=64)
QUICK = Sizes(turns=5)


def group_mean(g) -> float:
    return sum(c.reward for c in g.completions) / len(g.completions)


def usable(g) -> bool:
    """The group has reward variance: the only kind the trainer trains."""
    return len({c.reward for c in g.completions}) > 1


def keep_fifth(groups: list, v: "Volunteer") -> list[int]:
    """The top FIFTH_SHARE of `groups` by mean reward, among the usable ones."""
    ranked = sorted((i for i, g in enumerate(groups) if usable(g)), key=lambda i: -group_mean(groups[i]))
    return sorted(ranked[:round(FIFTH_SHARE * len(groups))])


def keep_edge(groups: list, v: "Volunteer") -> list[int]:
    """All but the usable groups below its sampled mean in the turn's blocks where they are
    furthest below it, as many blocks as keep the numbers counted missing (8 per block
    touched) within EDGE_SHARE of those it sampled."""
    from volunteer_rl.protocol.grants import GRANT_BLOCK

    budget = math.floor(EDGE_SHARE * len(v.sampled) / GRANT_BLOCK) - v.blocks_touched
    means = [m for m, ok in v.sampled if ok]
    if budget <= 0 or not means:
        return list(range(len(groups)))
    ref = sum(means) / len(means)
    below: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        if usable(g) and group_mean(g) < ref:
            below.setdefault(g.seq // GRANT_BLOCK, []).append(i)
    cost = {b: sum(ref - group_mean(groups[i]) for i in xs) for b, xs in below.items()}
    touched = sorted(cost, key=lambda b: -cost[b])[:budget]
    v.blocks_touched += len(touched)
    drop = {i for b in touched for i in below[b]}
    return [i for i in range(len(groups)) if i not in drop]


def keep_all(groups: list, v: "Volunteer") -> list[int]:
    return list(range(len(groups)))


VOLUNTEERS: dict[str, tuple[Callable[[list, "Volunteer"], list[int]], str]] = {
    "fifth": (keep_fifth, f"uploads its best {round(FIFTH_SHARE * TURN_GROUPS)} usable groups of "
              f"each {TURN_GROUPS} it samples"),
    "edge": (keep_edge, f"leaves out its usable groups below its mean in its worst blocks of 8, "
             f"at most {EDGE_SHARE:.0%} of its numbers counted missing"),
    "honest": (keep_all, "uploads every group"),
}


class Volunteer:
    """One volunteer id: what it sampled, and the shard lines it uploaded."""

    def __init__(self, trial: Trial, name: str):
        self.name, self.keep = name, VOLUNTEERS[name][0]
        self.liar = Liar(trial.t, name)
        self.sampled: list[tuple[float, bool]] = []
        """(mean reward, usable) of every group it sampled."""
        self.sent: dict[tuple[str, int], float] = {}
        """(shard key, line) -> mean reward, of every group it uploaded."""
        self.blocks_touched = 0
        """Blocks of numbers `edge` left a group out of: each counts 8 missing."""

    def turn(self) -> list[str]:
        """Sample a turn's groups and upload those it keeps; the shard's key, if any."""
        groups = self.liar.sample(TURN_GROUPS)
        self.sampled += [(group_mean(g), usable(g)) for g in groups]
        kept = self.keep(groups, self)
        if kept:
            key = self.liar.send([groups[i] for i in kept])
            self.sent.update(((key, line), group_mean(groups[i])) for line, i in enumerate(kept))
            return [key]
        return []


class Run(Trial):
    """A trial whose fleet.json is written after every publish and read back each time."""

    def __init__(self, root: Path, model: Path, **settings):
        """`settings`: TrainerConfig fields (--missing-bound here; --audit-cover-floor in
        bench.covers)."""
        super().__init__(root, model, "every", **settings)
        self.t.records.fleet_summary.interval = 0
        self.views: list[dict] = []
        """fleet.json's `volunteers` after each publish."""

    def publish(self) -> None:
        from volunteer_rl.protocol import layout

        super().publish()
        self.views.append(json.loads(self.t.storage.read(layout.FLEET))["volunteers"])

    def stop(self) -> None:
        """Stop, and write and read fleet.json once more, as the run ends."""
        from volunteer_rl.protocol import layout

        super().stop()
        self.t.publisher.write_views(final=True)
        self.views.append(json.loads(self.t.storage.read(layout.FLEET))["volunteers"])

    def drain(self, keys: list[str]) -> None:
        """Loop iterations until the trainer took (or settled) every shard of `keys` and waits
        for groups (a poll takes one new shard per volunteer)."""
        for _ in range(MAX_ROUNDS):
            if self.round() == WAITING and all(k in self.t.ingest.taken or self.settled(k) for k in keys):
                return
        raise RuntimeError(f"shards not taken after {MAX_ROUNDS} iterations of the trainer's loop")


def stats(v: Volunteer, outcomes: dict[tuple[str, int], str], views: list[dict]) -> dict:
    """What one volunteer sampled, uploaded and got trained, and what fleet.json showed."""
    fate = Counter(outcomes.get((key, -1)) or outcomes.get((key, line), "waiting") for key, line in v.sent)
    trained = [r for (key, line), r in v.sent.items() if outcomes.get((key, line)) == "trained"]
    ref = [r for r, ok in v.sampled if ok]
    mean = sum(ref) / len(ref) if ref else 0.0
    se = math.sqrt(sum((r - mean) ** 2 for r in ref) / (len(ref) - 1) / len(ref)) if len(ref) > 1 else 0.0
    trained_mean = sum(trained) / len(trained) if trained else None
    diff = 0.0 if trained_mean is None else (trained_mean - mean) / se if se else math.inf
    shown = [view.get(v.name, {}) for view in views]
    last = shown[-1] if shown else {}
    return {"sampled": len(v.sampled), "usable": len(ref), "uploaded": len(v.sent),
            "trained": len(trained), "fate": dict(fate),
            "sampled_mean_all": sum(r for r, _ in v.sampled) / len(v.sampled),
            "sampled_mean": mean, "sampled_se": se, "trained_mean": trained_mean, "diff_se": diff,
            "met": not trained or abs(diff) <= GOAL_SE,
            "missing_recent": last.get("missing_recent"), "numbers_recent": last.get("numbers_recent"),
            "held_back": last.get("held_back"), "held_writes": sum(bool(r.get("held_back")) for r in shown),
            "writes": len(shown)}


def run(s: Sizes, model: Path, missing_bound: float) -> dict[str, dict]:
    """One trainer run with the three volunteers; their stats by name."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vrl-withholding-") as tmp:
        r = Run(Path(tmp), model, missing_bound=missing_bound)
        volunteers = [Volunteer(r, name) for name in VOLUNTEERS]
        try:
            for turn in range(s.turns):
                order = volunteers[turn % 3:] + volunteers[:turn % 3]  # whose shard is read first
                r.drain([key for v in order for key in v.turn()])
        except Exception:
            print("\n".join(["the trainer's last lines:", *r.log]), flush=True)
            raise
        finally:
            r.stop()
        out = {v.name: stats(v, r.outcomes, r.views) for v in volunteers}
    print(f"--missing-bound {missing_bound:g}: {r.t.learner.steps} steps, {time.time() - started:.0f} s",
          flush=True)
    return out


def table(sides: dict[str, dict[str, dict]]) -> None:
    print(f"{'volunteer':9} {'bound':>5} {'sampled':>7} {'usable':>6} {'upload':>6} {'trained':>7} "
          f"{'trained':>7} {'sampled':>7} {'s.e.':>6} {'diff':>6} {'all':>6} {'missing':>11} "
          f"{'held':>9} goal", flush=True)
    for bound, side in sides.items():
        for name, x in side.items():
            tm = "-" if x["trained_mean"] is None else f"{x['trained_mean']:.3f}"
            print(f"{name:9} {bound:>5} {x['sampled']:7} {x['usable']:6} {x['uploaded']:6} "
                  f"{x['trained']:7} {tm:>7} {x['sampled_mean']:7.3f} {x['sampled_se']:6.3f} "
                  f"{x['diff_se']:+6.2f} {x['sampled_mean_all']:6.3f} "
                  f"{str(x['missing_recent']):>5}/{str(x['numbers_recent']):<5} "
                  f"{x['held_writes']:>4}/{x['writes']:<4} {'met' if x['met'] else 'MISSED'}",
                  flush=True)


def describe(x: dict) -> str:
    tm = "nothing trained" if x["trained_mean"] is None else f"trained mean {x['trained_mean']:.3f}"
    return (f"sampled {x['sampled']} ({x['usable']} usable), uploaded {x['uploaded']}, trained "
            f"{x['trained']} ({', '.join(f'{k} {n}' for k, n in sorted(x['fate'].items()))}); {tm} "
            f"against {x['sampled_mean']:.3f} ± {x['sampled_se']:.3f} over its usable sampled groups "
            f"({x['diff_se']:+.2f} s.e.; {x['sampled_mean_all']:.3f} over all it sampled); fleet.json: "
            f"missing_recent {x['missing_recent']} of numbers_recent {x['numbers_recent']}, "
            f"held_back {x['held_back']}, held in {x['held_writes']} of its {x['writes']} writes")


def results(quick: bool) -> list[Row]:
    s = QUICK if quick else FULL
    model = shared_v0()
    sides = {f"{b:g}": run(s, model, b) for b in (BOUND_ON, BOUND_OFF)}
    table(sides)
    rows = []
    for name, (_, how) in VOLUNTEERS.items():
        now, off = sides[f"{BOUND_ON:g}"][name], sides[f"{BOUND_OFF:g}"][name]
        rows.append(Row(
            benchmark=f"withholding volunteer's trained reward, volunteer: {name}",
            measure="trained mean reward minus sampled mean, in s.e.",
            vrl=now["diff_se"], baseline=off["diff_se"],
            ratio=(abs(off["diff_se"]) + 1) / (abs(now["diff_se"]) + 1),
            goal=f"within {GOAL_SE:g} s.e., or nothing trained", met=now["met"],
            command=COMMAND + (" --quick" if quick else ""),
            note=(f"{name} {how}, beside the other two in one live trainer at the defaults (32 "
                  f"groups a step, a publish per step, every trained group verified) from the "
                  f"demo's v0, {s.turns} turns of {TURN_GROUPS} groups; --missing-bound {BOUND_ON:g}: "
                  f"{describe(now)}; baseline --missing-bound {BOUND_OFF:g}: {describe(off)}")))
    return rows


if __name__ == "__main__":
    sys.exit(cli(results, __doc__))
