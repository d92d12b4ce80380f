"""Volunteers that choose their tokens, against a live `vrl trainer` at its default audit rate.

Each cheat is a new volunteer (so every one of its shards is audited) sending three shards of
four groups, each group with at least one completion that was not sampled as the protocol
says, with the true logprobs of its tokens under the published weights (what a volunteer that
holds the weights can compute):
- injected: a hand-picked completion, the right answer, in place of a sampled wrong one;
- after_eos: a sampled completion with tokens after its EOS;
- trailing_text: the right answer followed by a second line of payload, claiming reward 1;
- cherry_picked: every completion drawn four times with noise of its own, the best one kept;
- stale_liar: injected groups labelled with the version before, inside the window.
Every injected group must be rejected (the issue's bar: at least 99 %), each shard with the
reason for its kind, and the step the trainer then takes must come from the honest shard
alone.
"""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import torch
from conftest import PICKED, TEMPLATE_VERSION

from helpers.bucket_objects import FolderBucket, as_dicts, gz_lines, key
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.model.policy import encode_prompts
from volunteer_rl.model.sampling import sample
from volunteer_rl.model.scoring import token_logprobs
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.printable import printable
from volunteer_rl.task.reward import completion_reward

V = TEMPLATE_VERSION
K, T, MAX_NEW = 8, 1.0, 32
SHARDS, GROUPS = 3, 4
EXPECTED = {"injected": "replay_mismatch", "after_eos": "after_eos",
            "trailing_text": "reward_mismatch", "cherry_picked": "replay_mismatch",
            "stale_liar": "replay_mismatch"}


class Cheater:
    """Builds dishonest groups from honest ones with the template's weights."""

    def __init__(self, template):
        self.policy = template.policy
        self.problems = {p.id: p for p in template.problems}

    def reward(self, tokens: list[int], prompt_id: int) -> float:
        p = self.policy
        return completion_reward(tokens, self.problems[prompt_id]["python_expression"], p.decode_all,
                                 p.eos_id, p.special_ids)

    def true_logprobs(self, prompt_id: int, tokens: list[int]) -> list[float]:
        prompt = encode_prompts(self.policy, [self.problems[prompt_id]["natural_language"]])
        with torch.no_grad():
            logp, _ = token_logprobs(self.policy, prompt, [[tokens]], T)
        return logp[0, :len(tokens)].tolist()

    def encode(self, text: str) -> list[int]:
        return self.policy.tokenizer(text, add_special_tokens=False)["input_ids"]

    def put_tokens(self, group: dict, j: int, tokens: list[int], reward: float) -> None:
        c = group["completions"][j]
        c.update(token_ids=tokens, logprobs=self.true_logprobs(group["prompt_id"], tokens),
                 text=self.policy.tokenizer.decode(tokens, skip_special_tokens=True), reward=reward)

    def inject(self, group: dict) -> dict:
        """The right answer in place of the first sampled completion that is not it."""
        g = copy.deepcopy(group)
        right = self.encode(self.problems[g["prompt_id"]]["python_expression"]) + [self.policy.eos_id]
        j = next(j for j, c in enumerate(g["completions"]) if c["token_ids"] != right)
        self.put_tokens(g, j, right, 1.0)
        return g

    def after_eos(self, group: dict) -> dict:
        g = copy.deepcopy(group)
        c = g["completions"][0]
        tokens = (c["token_ids"] if c["token_ids"][-1] == self.policy.eos_id
                  else c["token_ids"][:-1] + [self.policy.eos_id])
        tokens = (tokens + self.encode(" visit evil example com"))[:MAX_NEW]
        self.put_tokens(g, 0, tokens, c["reward"])
        return g

    def trailing_text(self, group: dict) -> dict:
        g = copy.deepcopy(group)
        text = self.problems[g["prompt_id"]]["python_expression"] + "\nvisit evil example com"
        self.put_tokens(g, 0, (self.encode(text) + [self.policy.eos_id])[:MAX_NEW], 1.0)
        return g

    def cherry_pick(self, groups: list[dict], tries: int = 4) -> list[dict]:
        """Each completion drawn `tries` times with noise of the cheat's own (random draw keys);
        the first that scores 1 is kept (else the first draw)."""
        rng = random.Random(7)
        prompts = encode_prompts(self.policy, [self.problems[g["prompt_id"]]["natural_language"] for g in groups])
        draws = [sample(self.policy, prompts, K, T, MAX_NEW,
                        draw_keys=[[rng.randbytes(32) for _ in range(K)] for _ in groups])
                 for _ in range(tries)]
        out = []
        for i, group in enumerate(groups):
            g = copy.deepcopy(group)
            for j, c in enumerate(g["completions"]):
                picks = [d[i][j] for d in draws]
                best = next((x for x in picks if self.reward(x.token_ids, g["prompt_id"]) == 1.0), picks[0])
                c.update(token_ids=best.token_ids, logprobs=best.logprobs, text=best.text,
                         reward=self.reward(best.token_ids, g["prompt_id"]))
            out.append(g)
        return out


def cheat_groups(template, cheater: Cheater, kind: str) -> list[dict]:
    """SHARDS * GROUPS dishonest groups of volunteer `kind`, each differing from the honest
    group of the same number in at least one completion."""
    version = V - 1 if kind == "stale_liar" else V
    honest = as_dicts(template.groups(kind, version)[:SHARDS * GROUPS], kind)
    if kind == "cherry_picked":
        bad = cheater.cherry_pick(honest)
    else:
        edit = {"injected": cheater.inject, "stale_liar": cheater.inject,
                "after_eos": cheater.after_eos, "trailing_text": cheater.trailing_text}[kind]
        bad = [edit(g) for g in honest]
    assert all(b != h for b, h in zip(bad, honest))
    return bad


def test_chosen_tokens_are_caught_in_a_live_run(template, tmp_path: Path):
    bucket = FolderBucket(template.copy(tmp_path / "bucket"))
    cheater = Cheater(template)
    proc = Proc(["trainer", *bucket.args, "--max-steps", "1", "--groups-per-step", "8",
                 "--max-staleness", "1", "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
                 *PICKED, "--threads", "1", "--poll-seconds", "0.05", "--log-shards", "--deny-after", "0",
                 "--work-dir", str(tmp_path / "work"), "--signing-key", str(template.key)],
                tmp_path / "trainer.log", tmp_path)
    injected, keys = 0, {}
    try:
        for kind in EXPECTED:
            groups = cheat_groups(template, cheater, kind)
            version = V - 1 if kind == "stale_liar" else V
            for s in range(SHARDS):
                k = bucket.put(key(kind, f"s{s}", version), gz_lines(groups[s * GROUPS:(s + 1) * GROUPS]))
                keys[k] = kind
                injected += GROUPS
        for k in keys:
            shown = printable(k)
            wait_for(lambda: f"rejected {shown}:" in proc.text() or f"took {shown}:" in proc.text(),
                     120, f"the trainer to deal with {k}")
        honest = bucket.put(key("honest", "s"), gz_lines(as_dicts(template.groups("honest")[:8], "honest")))
        assert proc.wait(180) == 0, proc.text()[-3000:]
    finally:
        proc.kill()
    reasons = {k: json.loads(bucket.read(layout.quarantine_key(k)))["reason"]
               if (bucket.path / layout.quarantine_key(k)).exists() else None for k in keys}
    caught = GROUPS * sum(r is not None for r in reasons.values())
    assert injected == len(EXPECTED) * SHARDS * GROUPS and caught / injected >= 0.99, reasons
    assert all(reasons[k] == EXPECTED[kind] for k, kind in keys.items()), reasons
    step = json.loads(bucket.read(layout.metrics_key(V + 1)).decode().splitlines()[0])
    assert list(step["rollout/sources"]) == [honest], step["rollout/sources"]
    # every shard of a new volunteer that reached the audit was replayed: the structural
    # and reward checks turned the other two kinds away before it
    assert step["audit/by_volunteer"] == {"injected": SHARDS, "cherry_picked": SHARDS,
                                          "stale_liar": SHARDS, "honest": 1}, step
