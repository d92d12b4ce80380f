"""Numbers bound to versions against a live `vrl trainer` (issue 41, point 3): a volunteer asks
for numbers as every volunteer does (an ask in the bucket, the trainer's grant object), and
the trainer binds them to the version asked for. Sampling a granted number under another
version of the window, to keep whichever draw it likes, gets that shard rejected; a number
never granted is refused the same way; the granted draws are taken.

Before grants a volunteer numbered its groups itself, and the same number under each version
of the window drew another prompt and noise, each of which the trainer took."""
from __future__ import annotations

import json

from conftest import PICKED, TEMPLATE_VERSION

from helpers.bucket_objects import FolderBucket, gz_lines, key
from helpers.grants import Numbers
from helpers.vrlproc import Proc, wait_for
from volunteer_rl.model.policy import encode_prompts
from volunteer_rl.model.sampling import sample
from volunteer_rl.protocol import grants, layout
from volunteer_rl.protocol.draws import group_keys, pool_prompt
from volunteer_rl.protocol.shards import Completion, Group, encode_shard
from volunteer_rl.storage import open_storage
from volunteer_rl.task.base import completion_reward
from volunteer_rl.task.calculator_task import CalculatorTask

V = TEMPLATE_VERSION
K, MAX_NEW = 8, 32  # the template's sampling settings


def groups_for(template, version: int, numbers: list[tuple[int, str]]) -> list[Group]:
    """What `chooser` samples for `numbers` ((number, nonce)) under `version`: the prompt each
    draws from that version's pool with the nonce given, sampled with that version's weights
    (the template's versions share theirs) under the committed noise of that key."""
    policy, task = template.policy, CalculatorTask()
    rows = [template.problems[pool_prompt(template.pools[version], template.run_id, version,
                                          "chooser", n, x)] for n, x in numbers]
    keys = [group_keys(template.run_id, version, "chooser", n, r.id, K, x)
            for (n, x), r in zip(numbers, rows)]
    out = sample(policy, encode_prompts(policy, [task.prompt(r) for r in rows]), K, 1.0, MAX_NEW,
                 draw_keys=keys)
    return [Group(r.id, version, "chooser", n, [
        Completion(s.token_ids, s.logprobs, s.text,
                   completion_reward(task, r, s.token_ids, policy.decode_all, policy.eos_id,
                                     policy.special_ids)) for s in samples])
        for (n, _), r, samples in zip(numbers, rows, out)]


def test_a_number_counts_only_under_the_version_it_was_granted_for(template, tmp_path):
    bucket = FolderBucket(template.copy(tmp_path / "bucket"))
    storage = open_storage(str(bucket.path))
    proc = Proc(["trainer", *bucket.args, "--groups-per-step", "1000", "--max-steps", "1",
                 "--eval-every", "0", "--dashboard-every", "0", "--eval-dataset", str(template.eval_csv),
                 "--threads", "1", "--poll-seconds", "0.05", "--log-shards", *PICKED,
                 "--work-dir", str(tmp_path / "work"), "--signing-key", str(template.key)],
                tmp_path / "trainer.log", tmp_path, env={"OMP_NUM_THREADS": "1"})
    try:
        granted = Numbers(storage, "chooser", template.run_id).take(8, V)
        assert [n for n, _ in granted] == list(range(8))  # its first numbers, bound to v2
        obj = json.loads(bucket.read(grants.grants_key("chooser")))
        assert [(x["first_block"], x["version"]) for x in obj["grants"]] == [(0, V)]

        # The same numbers drawn under v1 (with the only nonce it has) ...
        other = bucket.put(key("chooser", "a-other", V - 1),
                           encode_shard(groups_for(template, V - 1, granted)))
        # ... a number never granted, with a nonce it made up ...
        made_up = bucket.put(key("chooser", "b-made-up"),
                             encode_shard(groups_for(template, V, [(4000, "0" * 32)])))
        for k in (other, made_up):
            wait_for(lambda: f"rejected {k}: prompt_mismatch" in proc.text(), 300, f"{k} rejected")
        # ... and the draws it was granted, under v2: taken.
        mine = bucket.put(key("chooser", "c-granted"), encode_shard(groups_for(template, V, granted)))
        wait_for(lambda: f"took {mine}:" in proc.text(), 300, f"{mine} taken")
    finally:
        proc.kill()
    log = proc.text()
    assert f"rejected {mine}" not in log and "Traceback" not in log, log[-3000:]
    record = json.loads(bucket.read(layout.quarantine_key(other)))
    assert record["reason"] == "prompt_mismatch", record
