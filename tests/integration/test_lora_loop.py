"""The real RL loop with LoRA adapters as the published versions (`vrl trainer --lora-rank`).

A tiny random Qwen3 saved with save_pretrained and warm-started (test_architectures_loop's
set-up), a real `vrl trainer --lora-rank 2 --weights-dtype bf16` with audits on and every
trained group verified (the defaults), and a real `vrl volunteer`, on one folder bucket, for
VERSIONS versions. What it proves:

1. v0 is the base, published whole (checkpoints/v000000/model.safetensors); every later
   version is only its adapter (adapter.safetensors, no weights file, no patch), and its
   manifest names v0's weights and the adapter (base 0, rank 2, alpha, targets);
2. an adapter is far smaller than the base's weights file;
3. the volunteer fetched the base once and every later version as its adapter ("weights
   unchanged": the base held), up to the last one, with no warning;
4. the trainer's replays of the volunteer's honest groups never rejected one: no shard
   rejected, no verified group failed, and groups were verified and audited (so the replays
   ran on the adapters, which the volunteer and the trainer both hold unmerged);
5. the adapter trained: the last version's B is not zero;
6. `vrl eval` loads the last version (base + adapter) and evaluates it.
"""
from __future__ import annotations

import json
import re

import torch
from safetensors.torch import load

from helpers.vrlproc import Proc
from test_architectures_loop import ONE_THREAD, run_loop, save_model, write_dataset
from test_hostile_bucket import tokenizer  # noqa: F401  (a fixture)
from volunteer_rl.protocol import layout, metrics
from volunteer_rl.protocol.manifest import ADAPTER_FILE, KEYFRAME_FILE, PATCH_FILE, Manifest

VERSIONS = 5
GROUPS_PER_STEP = 2
LORA = ["--lora-rank", "2", "--lora-alpha", "16"]
# --audit-full-groups 2: only the first shard is audited whole, so the step's verification
# replays the groups after it (at the default 10, a loaded machine could train all ten groups
# of the run from audited shards, and the verification would have nothing to do)
TRAINER_FLAGS = [*LORA, "--weights-dtype", "bf16", "--max-steps", str(VERSIONS),
                 "--audit-full-groups", "2",
                 "--max-staleness", "4", "--groups-per-step", str(GROUPS_PER_STEP),
                 "-k", "4", "--max-new-tokens", "12", "--eval-every", "0",
                 "--dashboard-every", "0", "--threads", "1", "--poll-seconds", "0.05"]


def test_a_lora_run_publishes_adapters_on_a_base_and_replays_accept_honest_groups(
        tokenizer, tmp_path):  # noqa: F811
    dataset, model, bucket = tmp_path / "train.csv", tmp_path / "model", tmp_path / "bucket"
    write_dataset(dataset)
    save_model("qwen3", tokenizer, False, dataset, model)
    bucket.mkdir()
    _, vol = run_loop(tmp_path, bucket, model, dataset, TRAINER_FLAGS, VERSIONS, timeout=180)
    ms = [Manifest.from_json((bucket / layout.manifest_history_key(v)).read_bytes())
          for v in range(VERSIONS + 1)]

    # 1. The base whole at v0, then adapters only, each manifest naming both.
    base = bucket / ms[0].checkpoint / KEYFRAME_FILE
    assert base.exists() and ms[0].adapter is None
    for m in ms[1:]:
        folder = bucket / m.checkpoint
        assert (folder / ADAPTER_FILE).exists(), m.version
        assert not (folder / KEYFRAME_FILE).exists() and not (folder / PATCH_FILE).exists()
        assert (m.adapter.base, m.adapter.rank, m.adapter.alpha) == (0, 2, 16.0)
        assert m.weights == ms[0].weights and m.files[KEYFRAME_FILE] == ms[0].files[KEYFRAME_FILE]
        assert m.files[ADAPTER_FILE].size == (folder / ADAPTER_FILE).stat().st_size

    # 2. An adapter is a small part of the base.
    assert ms[-1].files[ADAPTER_FILE].size * 10 < base.stat().st_size

    # 3. The volunteer took the base once, then each version's adapter on it.
    vol_log = vol.text()
    arrivals = re.findall(r"^now on v(\d+) of \S+ \((.*)\)$", vol_log, re.M)
    assert arrivals[0][1].startswith("keyframe v0, "), arrivals
    assert all(how == "weights unchanged" for _, how in arrivals[1:]), arrivals
    assert int(arrivals[-1][0]) == VERSIONS
    assert "warning" not in vol_log and "Traceback" not in vol_log

    # 4. Replays of honest LoRA groups: verified and audited, none failed, nothing rejected.
    records = [json.loads(line) for v in range(VERSIONS + 1)
               for line in (bucket / layout.metrics_key(v)).read_text().splitlines()]
    steps = [r for r in records if r[metrics.KIND] == metrics.STEP_LINE]
    assert [r[metrics.STEP] for r in steps] == list(range(1, VERSIONS + 1))
    assert sum(r["verify/groups"] for r in steps) > 0
    assert sum(r["audit/shards"] for r in steps) > 0
    assert all(r["verify/failed"] == 0 and not r["ingest/rejected"] for r in steps), steps
    assert not (bucket / layout.QUARANTINE).exists()

    # 5. The adapter trained.
    tensors = load((bucket / ms[-1].checkpoint / ADAPTER_FILE).read_bytes())
    assert any(t.abs().max() > 0 for n, t in tensors.items() if ".lora_B." in n)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())

    # 6. vrl eval loads it: the base, then the adapter.
    ev = Proc(["eval", "--bucket", str(bucket), "--dataset", str(dataset), "--samples", "1",
               "--work-dir", str(tmp_path / "ew")], tmp_path / "eval.log", tmp_path, ONE_THREAD)
    assert ev.wait(120) == 0, ev.text()[-2000:]
    assert f"v{VERSIONS}" in ev.text(), ev.text()[-2000:]
