"""No silent minutes, no line per shard: what the long phases and loops print (progress.py).

Off a terminal (pytest's output is not one) a phase logs a status line per STATUS_SECONDS with
its rate and time left; the trainer says why it waits for groups at most once per interval;
a volunteer sums its uploads up in one line per interval; the evaluation, cut into calls so
it can show progress, gives the same figures as one call.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from helpers.honest_groups import drawn_prompt
from helpers.trainers import started_trainer
from volunteer_rl import progress
from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.model.policy import Policy, encode_prompts
from volunteer_rl.model.sampling import sample
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.shards import Completion, Group, encode_shard
from volunteer_rl.task.dataset import load_csv
from volunteer_rl.task.reward import completion_reward
from volunteer_rl.task.calculator_task import CalculatorTask
from volunteer_rl.trainer.evaluate import accuracy, greedy_and_sampled
from volunteer_rl.trainer.warmstart import warm_start


def test_every_is_due_at_first_then_once_per_interval():
    now = [100.0]
    every = progress.Every(10, clock=lambda: now[0])
    seen = []
    for t in (100.0, 101.0, 109.9, 110.0, 115.0, 125.0):
        now[0] = t
        seen.append(every.due())
    assert seen == [True, False, False, True, False, True]


def test_status_line_has_counts_rate_and_time_left():
    assert progress.status_line("warm start", 120, 900, 25.0, "steps", note="loss 1.234") == \
        "warm start 120/900 steps (13%), loss 1.234, 4.8 steps/s, about 2m42s left"
    assert progress.status_line("fetch v3", 20e6, 80e6, 4.0, unit_bytes=True) == \
        "fetch v3 20.0/80.0 MB (25%), 5.0 MB/s, about 12s left"


def test_off_a_terminal_a_phase_logs_at_most_once_per_interval(monkeypatch):
    lines: list[str] = []
    with progress.progress("work", 5, enabled=False, log=lines.append, unit="items", every=0) as advance:
        for _ in range(5):
            advance(1)
    # one per advance (the interval is 0) but none once all 5 are done
    assert len(lines) == 4 and lines[0].startswith("work 1/5 items (20%), ") and "items/s" in lines[0]
    lines.clear()
    with progress.progress("work", 5, enabled=False, log=lines.append) as advance:
        for _ in range(5):
            advance(1)
    assert lines == []  # all within the first STATUS_SECONDS


@pytest.fixture(scope="module")
def tiny():
    problems = load_csv(PACKAGE_DATA / "eval.csv")[:150]
    tok = build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems])
    policy = Policy(build_tiny_model(tok, seed=0), tok, "plain", torch.device("cpu"))
    return policy, problems


def test_the_warm_start_logs_its_first_and_last_step_and_status_lines_between(tiny, monkeypatch):
    policy, problems = tiny
    lines: list[str] = []
    monkeypatch.setattr(progress, "STATUS_SECONDS", 1e9)  # no interval passes
    warm_start(policy, [p.prompt for p in problems], [p.expression for p in problems], 120, batch_size=4, log=lines.append)
    # not every 100 steps: a line at step 1 and one at the last, nothing else within an interval
    assert [re.sub(r" loss .*", "", line) for line in lines] == \
        ["warm start step 1/120", "warm start step 120/120"]
    lines.clear()
    monkeypatch.setattr(progress, "STATUS_SECONDS", 0.0)  # every step is one interval later
    warm_start(policy, [p.prompt for p in problems], [p.expression for p in problems], 5, batch_size=4, log=lines.append)
    status = [line for line in lines if "steps/s" in line]
    assert len(status) == 4 and status[0].startswith("warm start 1/5 steps (20%), loss ")
    assert " left" in status[0]


def test_the_evaluation_shows_progress_and_gives_what_one_call_gives(tiny, monkeypatch):
    policy, problems = tiny
    lines: list[str] = []
    monkeypatch.setattr(progress, "STATUS_SECONDS", 0.0)
    torch.manual_seed(3)
    rows, task = [p.row for p in problems], CalculatorTask()
    res = greedy_and_sampled(policy, task, rows, 1.0, 4, 8, log=lines.append, label="eval v7")
    # greedy: one call of 150 prompts; sampled: 64 prompts a call, 3 calls (the last ends it)
    assert len(lines) == 3 and all(line.startswith("eval v7 ") for line in lines)
    assert lines[0].startswith("eval v7 150/750 completions (20%)") and "completions/s" in lines[0]
    # the figures of sampling every prompt in one call, as before the evaluation was cut up
    torch.manual_seed(3)
    assert accuracy(policy, task, rows, 0.0, 1, 8) == res["eval/accuracy_greedy"]
    out = sample(policy, encode_prompts(policy, [p.prompt for p in problems]), 4, 1.0, 8)
    whole = sum(completion_reward(s.token_ids, p.expression, policy.decode_all, policy.eos_id,
                                  policy.special_ids) for p, g in zip(problems, out) for s in g)
    assert whole / (4 * len(problems)) == res["eval/accuracy_sampled"]


def test_the_trainer_says_why_it_waits_once_per_interval(tmp_path):
    t = started_trainer(tmp_path, k=2, audit_tolerance=0.0,
                        groups_per_step=8, max_seconds=1.5, poll_seconds=0.05)
    logs: list[str] = []
    t.log = logs.append
    p = t.published_policy
    rng = random.Random(0)

    def group(seq: int, right: bool) -> Group:
        pid = drawn_prompt(t, 0, "vol", seq)
        expression = t.problems[pid]["python_expression"]

        def reward(tokens: list[int]) -> float:
            return completion_reward(tokens, expression, p.decode_all, p.eos_id, p.special_ids)

        good = list(p.tokenizer(expression, add_special_tokens=False)["input_ids"]) + [p.eos_id]
        # a wrong answer: one prompt token that scores nothing (the prompt is drawn with the
        # run's secret, so a token picked blindly can be the answer itself)
        candidates = [[tok, p.eos_id] for tok in t.prompt_ids[pid]]
        rng.shuffle(candidates)
        wrong = next(c for c in candidates if reward(c) == 0.0)
        return Group(pid, 0, "vol", seq, [Completion(tokens, [-1.0] * len(tokens), "", reward(tokens))
                                          for tokens in (good if right else wrong, wrong)])

    groups = [group(0, True), group(1, True), group(2, False), group(3, False), group(4, False)]
    assert [len({c.reward for c in g.completions}) for g in groups] == [2, 2, 1, 1, 1]
    t.storage.write(layout.shard_key(0, "vol", "a"), encode_shard(groups))
    t.run()
    waiting = [line for line in logs if "waiting for" in line]
    # 1.5 s of polls every 0.05 s, one line: the interval (STATUS_SECONDS) did not pass
    assert waiting == ["2 usable groups, 3 without reward variance (of 5 received so far), "
                       "waiting for 8"]
