"""The curriculum's prompt picker (the trainer fills each version's prompt pool with it): pure
logic, no model."""
import random

from volunteer_rl.task import curriculum
from volunteer_rl.task.base import Row
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.task.curriculum import FLOOR
from volunteer_rl.task.dataset import Problem

stratum = CalculatorTask().stratum


def PromptPicker(rows, rng, adaptive=True):  # noqa: N802 (the picker, with the calculator's strata)
    return curriculum.PromptPicker(rows, rng, adaptive, stratum)


def problems(per_stratum: int = 50) -> list[Row]:
    exprs = ["1 + 2", "(1 + 2) * 3", "(1 + 2) * 3 - 4", "((1 + 2) * 3 - 4) // 5"]
    return [Problem(i, f"q{i}", exprs[i % 4]).row for i in range(4 * per_stratum)]


def test_stratum_counts_operators():
    assert [stratum(Problem(0, "q", e).row) for e in ["7", "1 + 2", "2 ** 3 - 1", "-(4 // 2) % 3"]] == [0, 1, 2, 3]


def test_shares_follow_the_useful_rate_with_a_floor():
    pk = PromptPicker(problems(), random.Random(0))
    assert all(abs(v - 0.25) < 1e-9 for v in pk.shares().values())  # nothing learnt yet
    for p in pk.problems:
        useful = stratum(p) == 2  # only the two-operator prompts have reward variance
        for _ in range(3):
            pk.observe(p, [1.0, 0.0] if useful else [0.0, 0.0])
    shares = pk.shares()
    assert abs(sum(shares.values()) - 1.0) < 1e-9
    assert shares[2] > 0.8
    assert min(shares.values()) >= FLOOR / (1 + len(shares) * FLOOR)  # floored, then renormalised


def test_prompts_last_seen_uniform_are_mostly_skipped():
    pk = PromptPicker(problems(), random.Random(0))
    solved = {p.id for p in pk.problems[:100]}
    for p in pk.problems[:100]:
        pk.observe(p, [1.0, 1.0])
    drawn = [p.id for _ in range(200) for p in pk.pick(8)]
    share_solved = sum(i in solved for i in drawn) / len(drawn)
    assert share_solved < 0.35  # half the prompts, drawn about a quarter as often


def test_pick_gives_distinct_prompts_even_when_all_are_uniform():
    pk = PromptPicker(problems(per_stratum=2), random.Random(0))
    for p in pk.problems:
        pk.observe(p, [0.0, 0.0])
    picked = pk.pick(8)
    assert len({p.id for p in picked}) == 8
    assert len(pk.pick(100)) == 8  # never more than the dataset holds


def test_non_adaptive_draws_uniformly_and_learns_nothing():
    pk = PromptPicker(problems(), random.Random(0), adaptive=False)
    for p in pk.problems:
        pk.observe(p, [0.0, 0.0] if stratum(p) != 1 else [1.0, 0.0])
    counts = {s: 0 for s in range(1, 5)}
    for _ in range(500):
        for p in pk.pick(4):
            counts[stratum(p)] += 1
    assert all(400 < c < 600 for c in counts.values())


def test_a_pool_is_sorted_distinct_rows_leaning_to_the_useful_stratum():
    pk = PromptPicker(problems(), random.Random(0))
    for p in pk.problems:
        pk.observe(p, [1.0, 0.0] if stratum(p) == 3 else [1.0, 1.0])
    pool = pk.pool(40)
    assert list(pool) == sorted(set(pool)) and len(pool) == 40
    assert sum(stratum(pk.problems[i]) == 3 for i in pool) > 20
    assert len(pk.pool(10_000)) == len(pk.problems)  # never more rows than the dataset has


def test_a_pool_revisits_prompts_whose_last_group_had_reward_variance(monkeypatch):
    """Half of each pool comes from the prompts whose last group had reward variance (their
    pass rate is neither 0 nor 1: the likeliest to have it again); one that turns uniform
    leaves that list, and the list is bounded."""
    pk = PromptPicker(problems(per_stratum=500), random.Random(0))  # 2,000 prompts
    useful = [p for p in pk.problems if p.id % 50 == 0]  # 40 of them, every stratum
    for p in pk.problems:
        pk.observe(p, [1.0, 0.0] if p in useful else [1.0, 1.0])
    ids = {p.id for p in useful}
    pools = [pk.pool(64) for _ in range(50)]
    share = sum(i in ids for pool in pools for i in pool) / (64 * 50)
    assert share >= 0.45  # REVISIT 0.5; without revisits: about 0.08 (uniform ones skipped 3 in 4)
    assert all(len(set(pool)) == 64 for pool in pools)
    turned = useful[0]
    pk.observe(turned, [0.0, 0.0])
    assert pk.index[turned.id] not in pk.revisits
    monkeypatch.setattr(curriculum, "MAX_REVISITS", 100)
    for p in pk.problems:
        pk.observe(p, [1.0, 0.0])
    assert list(pk.revisits) == [pk.index[p.id] for p in pk.problems[-100:]]  # the latest
