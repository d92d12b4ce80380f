"""Completions crafted to break a task's reward, dropped into a live `vrl trainer`: each shard is
turned away with its reason code (`reward_timeout`, `reward_memory`) and a quarantine record,
the trainer keeps going and still trains on an honest shard after them.

The task is tests/plugins/vrl-task-trap, installed with pip into a folder of its own: the
calculator, whose reward loops forever on "spin" and allocates 2 GiB on "grab" (what a careless
task might do on text someone crafted). The trainer runs every reward in a worker process under
the task's bounds (0.5 s of CPU, 64 MiB), so neither completion reaches the trainer itself. On
"leak" the reward does what a grader that evaluates answers lets a completion do: it copies the
trainer's AWS secret and signing key into the bucket folder; the worker's walls leave it
nothing to copy and nowhere to write.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.bucket_objects import FolderBucket, gz_lines, key
from helpers.honest_groups import key_secret, nonce
from helpers.plugins import install_plugin, plugin_env
from helpers.vrlproc import Proc, run_vrl, wait_for
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import pool_prompt

TRAP_PACKAGE = Path(__file__).resolve().parents[1] / "plugins" / "vrl-task-trap"
K = 2
SECRET = "AKIAvrl-live-test-secret"


def rows_for(manifest: dict, volunteer: str, completions: list[list[int]], rewards: list[float],
             count: int = 1, secret: bytes = b"") -> list[dict]:
    """`count` groups of `volunteer` for v0, each for the prompt its number draws (granted for
    v0 by the trainer of `secret`), every group with the same `completions` (token ids) and
    claimed `rewards`."""
    run = manifest["run_id"]
    return [{"prompt_id": pool_prompt(manifest["prompt_pool"], run, 0, volunteer, seq,
                                      nonce(secret, run, volunteer, 0, seq)),
             "policy_version": 0, "volunteer_id": volunteer, "seq": seq,
             "completions": [{"token_ids": ids, "logprobs": [-1.0] * len(ids), "text": "",
                              "reward": r} for ids, r in zip(completions, rewards)]}
            for seq in range(count)]


def test_completions_that_break_the_rewards_bounds_are_rejected_with_a_reason(
        tmp_path, template):
    from transformers import AutoTokenizer

    target = install_plugin(TRAP_PACKAGE, tmp_path / "plugin")
    env = plugin_env(target)
    env["AWS_SECRET_ACCESS_KEY"] = SECRET
    listed = run_vrl(["tasks"], cwd=tmp_path)
    assert "trap" not in listed.stdout  # not installed in this environment, only in `target`
    bucket = FolderBucket(tmp_path / "bucket")
    bucket.path.mkdir()
    model = template.model(tmp_path / "model")  # the calculator's warm-started tiny model
    trainer = Proc(["trainer", "--bucket", str(bucket.path), "--task", "trap", "--model", str(model),
                    "--k", str(K), "--max-steps", "1", "--groups-per-step", "2",
                    "--audit-tolerance", "0", "--eval-every", "0",
                    "--eval-dataset", str(template.eval_csv), "--threads", "1",
                    "--poll-seconds", "0.05", "--log-shards", "--deny-after", "0",
                    "--work-dir", str(tmp_path / "work")], tmp_path / "trainer.log", tmp_path, env)
    try:
        wait_for(lambda: (bucket.path / layout.manifest_history_key(0)).exists(), 240, "v0")
        manifest = json.loads((bucket.path / layout.MANIFEST).read_text())
        secret = key_secret(tmp_path / "work" / "signing-key.pem")
        assert manifest["task"] == {"name": "trap", "package": "vrl-task-trap", "version": "0.0.1"}
        tok = AutoTokenizer.from_pretrained(model)
        eos = tok.eos_token_id

        def ids(text: str) -> list[int]:
            return tok(text, add_special_tokens=False)["input_ids"] + [eos]

        shards = {
            "reward_timeout": bucket.put(key("spinner", "s", 0), gz_lines(
                rows_for(manifest, "spinner", [ids("1 + spin"), ids("2")], [0.0, 0.0], secret=secret))),
            "reward_memory": bucket.put(key("grabber", "s", 0), gz_lines(
                rows_for(manifest, "grabber", [ids("3"), ids("grab")], [0.0, 1.0], secret=secret))),
        }
        for reason, k in shards.items():
            wait_for(lambda: f"rejected {k}: {reason}:" in trainer.text(), 120, f"{k} rejected")
        leak = bucket.put(key("leaker", "s", 0), gz_lines(
            rows_for(manifest, "leaker", [ids("leak"), ids("leak")], [0.0, 0.0], secret=secret)))
        wait_for(lambda: f"took {leak}: 0 usable" in trainer.text(), 120, f"{leak} taken")
        assert trainer.p.poll() is None, trainer.text()[-3000:]  # still running
        # An honest shard after them is still trained on: two groups with reward variance.
        pid = [pool_prompt(manifest["prompt_pool"], manifest["run_id"], 0, "honest", s,
                           nonce(secret, manifest["run_id"], "honest", 0, s)) for s in (0, 1)]
        right = [ids(template.problems[p]["python_expression"]) for p in pid]
        groups = [rows_for(manifest, "honest", [right[s], ids("none")], [1.0, 0.0], 2, secret)[s]
                  for s in (0, 1)]
        honest = bucket.put(key("honest", "s", 0), gz_lines(groups))
        assert trainer.wait(240) == 0, trainer.text()[-3000:]
    finally:
        trainer.kill()
    log = trainer.text()
    assert f"took {honest}: 2 usable" in log, log[-3000:]
    for reason, k in shards.items():
        assert json.loads((bucket.path / layout.quarantine_key(k)).read_text())["reason"] == reason
    assert "Traceback" not in log
    refused = [line for line in log.splitlines() if "the kernel refused" in line]
    if refused:  # walls this kernel lacks: the leak is open (docs/THREATS.md, class 17)
        pytest.skip(refused[0])
    assert not (bucket.path / "leaked.txt").exists()

