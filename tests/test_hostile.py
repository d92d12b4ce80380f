"""Hostile shards dropped into a live `vrl trainer`: each one is turned away with its reason,
the trainer keeps going, and its next step is bit for bit the step of a run that never saw
them.

Both runs start from the same published v2 (conftest.template). Good shards G1 and G2 hold
4 groups each (real samples of the v2 policy); a step takes 8. Run A gets G1 then G2. Run B
gets G1, then every hostile shard (waiting until the trainer has dealt with each), then G2.
"""
from __future__ import annotations

import copy
import gzip
import json
import re
from dataclasses import asdict
from pathlib import Path

from conftest import TEMPLATE_VERSION
from vrlproc import Proc, wait_for
from volunteer_rl import layout

V = TEMPLATE_VERSION
VOCAB = 640


def trainer(bucket: Path, root: Path, name: str, eval_csv: Path, key: Path) -> Proc:
    return Proc(["trainer", "--bucket", str(bucket), "--max-steps", "1", "--groups-per-step", "8",
                 "--max-staleness", "1", "--eval-every", "0", "--eval-dataset", str(eval_csv),
                 "--threads", "1", "--poll-seconds", "0.05", "--log-shards", "--deny-after", "0",
                 "--work-dir", str(root / f"{name}-work"),
                 "--signing-key", str(key)], root / f"{name}.log", root)


def as_dicts(groups, volunteer: str) -> list[dict]:
    out = []
    for g in groups:
        d = asdict(g)
        d["volunteer_id"] = volunteer
        out.append(d)
    return out


def gz_lines(rows: list) -> bytes:
    return gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode())


def put(bucket: Path, key: str, data: bytes) -> str:
    path = bucket / key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp-" + path.name)
    tmp.write_bytes(data)
    tmp.replace(path)  # the trainer must never see half a test shard either
    return key


def key(volunteer: str, name: str, version: int = V) -> str:
    return f"rollouts/{layout.version_dir(version)}/{volunteer}/{name}.jsonl.gz"


def hostile_shards(g1: list[dict], spare: list[dict]) -> dict[str, tuple[str, bytes]]:
    """name -> (key, bytes), every one of which the trainer must turn away. `spare` groups
    are real but never sent honestly, so only the hostile edit can be the reason."""
    def edited(vol: str, fn) -> bytes:
        rows = copy.deepcopy(spare[:2])
        for r in rows:
            r["volunteer_id"] = vol
        fn(rows)
        return gz_lines(rows)

    def set_(path, value):
        def fn(rows):
            target = rows[0]
            for p in path[:-1]:
                target = target[p]
            target[path[-1]] = value
        return fn

    def text_bomb(rows):
        rows[0]["completions"][0]["text"] = "x" * (1 << 20)

    def shift_logprobs(rows):  # every group: the audit looks at one of them
        for r in rows:
            for c in r["completions"]:
                c["logprobs"] = [lp - 0.3 for lp in c["logprobs"]]

    def ramble(rows):
        rows[0]["completions"][0].update(token_ids=[5] * 40, logprobs=[-0.1] * 40)

    def forge_reward(rows):
        c = next(c for c in rows[0]["completions"] if c["reward"] == 0.0)
        c["reward"] = 1.0

    def raw_edit(vol: str, old: str, new: str) -> bytes:
        """A JSON text no json.dumps writes: numbers and nesting the parser must bound."""
        rows = copy.deepcopy(spare[:2])
        for r in rows:
            r["volunteer_id"] = vol
        text = "".join(json.dumps(r) + "\n" for r in rows)
        assert old in text
        return gzip.compress(text.replace(old, new, 1).encode())

    first_logprob = json.dumps(spare[0]["completions"][0]["logprobs"][0])
    good = gz_lines(g1)
    bomb = gzip.compress(b"\n" * (100 << 20), compresslevel=9)
    dup_one = copy.deepcopy(g1[1])
    dup_one["volunteer_id"] = "copycat"
    shards = {
        "gzip_bomb": (key("bomber", "s"), bomb),
        "forged_reward": (key("forger", "s"), edited("forger", forge_reward)),
        "unknown_prompt": (key("asker", "s"), edited("asker", set_(["prompt_id"], 10 ** 7))),
        "out_of_range_token": (key("tokens", "s"), edited(
            "tokens", set_(["completions", 0, "token_ids", 0], VOCAB + 5))),
        "nan_logprob": (key("nan", "s"), edited("nan", set_(["completions", 0, "logprobs", 0], float("nan")))),
        "oversized_line": (key("big", "s"), edited("big", text_bomb)),
        "unpublished_version": (key("future", "s"), edited("future", set_(["policy_version"], V + 1))),
        "stale_version": (key("oldie", "s"), edited("oldie", set_(["policy_version"], V - 2))),
        "version_mismatch": (key("liar", "s", V - 1), edited("liar", lambda rows: None)),
        "path_traversal_id": (f"rollouts/{layout.version_dir(V)}/up..up/s.jsonl.gz",
                              edited("up..up", lambda rows: None)),
        "mismatched_volunteer_id": (key("mallory", "s"), edited("alice", lambda rows: None)),
        "wrong_behavior_logprobs": (key("drifter", "s"), edited("drifter", shift_logprobs)),
        "truncated_gzip": (key("cutoff", "s"), good[: len(good) // 2]),
        "not_json": (key("prose", "s"), gzip.compress(b"hello, trainer\n")),
        "wrong_group_size": (key("short", "s"), edited(
            "short", lambda rows: rows[0].update(completions=rows[0]["completions"][:3]))),
        "missing_field": (key("sloppy", "s"), edited("sloppy", lambda rows: rows[0].pop("prompt_id"))),
        "too_many_tokens": (key("chatty", "s"), edited("chatty", ramble)),
        "not_a_shard_name": (f"rollouts/{layout.version_dir(V)}/x/notes.txt", b"hi"),
        # float(10**400) raises OverflowError, and 5,000 brackets (well inside the line budget) RecursionError: both once
        # escaped intake and stopped the trainer for good
        "bignum_logprob": (key("bignum", "s"), raw_edit("bignum", first_logprob, "-" + "9" * 400)),
        "infinite_logprob": (key("inf", "s"), raw_edit("inf", first_logprob, "-1e999")),
        "deep_nesting": (key("deep", "s"), raw_edit(
            "deep", '"prompt_id": ', '"prompt_id": ' + "[" * 5_000 + "]" * 5_000 + ", \"x\": ")),
        # after G1 was taken: the same bytes again, and one of its groups under another id
        "replayed_shard": (key("good-a", "again"), good),
        "duplicated_group": (key("copycat", "s"), gz_lines([dup_one])),
    }
    return shards


EXPECTED = {
    "gzip_bomb": "too_large", "forged_reward": "reward_mismatch",
    "unknown_prompt": "unknown_prompt", "out_of_range_token": "bad_token",
    "nan_logprob": "bad_number", "oversized_line": "line_too_long",
    "unpublished_version": "unpublished_version", "stale_version": "stale_version",
    "version_mismatch": "version_mismatch", "path_traversal_id": "bad_key",
    "mismatched_volunteer_id": "volunteer_mismatch", "wrong_behavior_logprobs": "logprob_mismatch",
    "truncated_gzip": "bad_gzip", "not_json": "bad_json", "wrong_group_size": "bad_group_size",
    "missing_field": "bad_schema", "too_many_tokens": "too_many_tokens",
    "not_a_shard_name": "bad_key", "bignum_logprob": "bad_number", "infinite_logprob": "bad_number",
    "deep_nesting": "too_deep",
}
DUPLICATES = {"replayed_shard": 4, "duplicated_group": 1}


def run(template, root: Path, name: str, hostile: bool) -> tuple[bytes, str, Path]:
    bucket = template.copy(root / f"{name}-bucket")
    groups = template.groups
    g1, g2 = as_dicts(groups[:4], "good-a"), as_dicts(groups[4:8], "good-b")
    proc = trainer(bucket, root, name, template.eval_csv, template.key)
    try:
        g1_key = put(bucket, key("good-a", "g1"), gz_lines(g1))
        wait_for(lambda: f"took {g1_key}: 4 usable" in proc.text(), 120, "G1 taken")
        if hostile:
            for what, (k, data) in hostile_shards(g1, as_dicts(groups[8:10], "x")).items():
                put(bucket, k, data)
                wait_for(lambda: re.search(rf"(rejected|took) {re.escape(k)}:", proc.text()),
                         60, f"the trainer to deal with {what}")
        put(bucket, key("good-b", "g2"), gz_lines(g2))
        assert proc.wait(120) == 0, proc.text()[-3000:]
    finally:
        proc.kill()
    weights = (bucket / layout.checkpoint_key(V + 1, "model.safetensors")).read_bytes()
    return weights, proc.text(), bucket


def test_hostile_shards_are_rejected_and_change_nothing(template, tmp_path):
    clean, _, _ = run(template, tmp_path, "clean", hostile=False)
    dirty, log, bucket = run(template, tmp_path, "hostile", hostile=True)
    shards = hostile_shards(as_dicts(template.groups[:4], "good-a"), as_dicts(template.groups[8:10], "x"))
    assert len(shards) >= 15
    for what, reason in EXPECTED.items():
        k = shards[what][0]
        assert re.search(rf"rejected {re.escape(k)}: {reason}:", log), (what, reason)
        if layout.parse_shard_key(k):  # a key that is no shard has no quarantine name either
            record = json.loads((bucket / layout.quarantine_key(k)).read_text())
            assert record["reason"] == reason
    for what, n in DUPLICATES.items():
        assert f"took {shards[what][0]}: 0 usable, 0 zero-variance, {n} duplicate" in log, what
    assert "Traceback" not in log
    step = [json.loads(x) for x in (bucket / layout.metrics_key(V + 1)).read_text().splitlines()]
    sources = step[0]["rollout/sources"]
    assert sorted(sources) == [key("good-a", "g1"), key("good-b", "g2")]
    assert dirty == clean, "the step after the hostile shards differs from the clean run's"
