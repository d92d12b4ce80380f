"""The attack that once made every weight NaN in one step, against a live `vrl trainer`.

A group labelled one version back is inside the window. Its behavior logprobs are the
volunteer's word: here every one of them is -100 (once: NaN in all 560,768 parameters) or -30
(once: a gradient norm of 1e11 against 3.6 for the honest group). The trainer keeps the
weights of every version of the window and audits a stale group against its own version, so
the lie is rejected (`logprob_mismatch`). With the audit off (`--audit-tolerance 0`: a fleet
trusted not to lie, or a liar on a trusted volunteer's unaudited shard) the step is taken; it
must stay finite and weigh no more than the truncated importance ratio lets a stale honest
group weigh.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from conftest import PICKED, TEMPLATE_VERSION
from safetensors.numpy import load_file

from helpers.bucket_objects import FolderBucket, as_dicts, gz_lines, key
from helpers.vrlproc import Proc
from volunteer_rl.protocol import layout

V = TEMPLATE_VERSION


def step_with(template, root: Path, name: str, logprob: float | None, *args: str,
              honest: bool = False) -> tuple[dict, dict, FolderBucket]:
    """Run one step on 8 groups of v(V-1) (v1 and v2 hold the same weights; the groups are
    honest samples of v1 as "liar" makes them), their logprobs set to `logprob` (None: as
    sampled); `honest`: also 8 honest groups of v(V-1) from another volunteer, for the step to
    take if the liar's are rejected. Returns (the published weights, the step's metrics, the
    bucket)."""
    bucket = FolderBucket(template.copy(root / f"{name}-bucket"))
    rows = as_dicts(template.groups("liar", V - 1)[:8], "liar")
    for r in rows:
        if logprob is not None:
            for c in r["completions"]:
                c["logprobs"] = [logprob] * len(c["logprobs"])
    bucket.put(key("liar", "s", V - 1), gz_lines(rows))
    if honest:
        bucket.put(key("honest", "s", V - 1), gz_lines(as_dicts(template.groups("honest", V - 1)[:8], "honest")))
    proc = Proc(["trainer", *bucket.args, "--max-steps", "1", "--groups-per-step", "8",
                 "--max-staleness", "1", "--eval-every", "0", "--eval-dataset", str(template.eval_csv),
                 *PICKED, "--threads", "1", "--poll-seconds", "0.05", "--algo", "grpo",
                 "--work-dir", str(root / f"{name}-work"), "--signing-key", str(template.key), *args],
                root / f"{name}.log", root)
    try:
        assert proc.wait(180) == 0, proc.text()[-3000:]
    finally:
        proc.kill()
    weights_path = root / f"{name}.safetensors"
    weights_path.write_bytes(bucket.read(layout.checkpoint_key(V + 1, "model.safetensors")))
    metrics = json.loads(bucket.read(layout.metrics_key(V + 1)).decode().splitlines()[0])
    return load_file(str(weights_path)), metrics, bucket


def test_a_stale_group_with_lying_logprobs_is_rejected_by_an_audit_against_its_own_version(template, tmp_path):
    _, m, bucket = step_with(template, tmp_path, "caught", -30.0, honest=True)
    liar = key("liar", "s", V - 1)
    assert json.loads(bucket.read(layout.quarantine_key(liar)))["reason"] == "logprob_mismatch"
    assert sorted(m["rollout/sources"]) == [key("honest", "s", V - 1)], m
    assert m["audit/by_volunteer"] == {"liar": 1, "honest": 1}, m


def test_a_stale_group_with_lying_logprobs_cannot_blow_up_the_step(template, tmp_path):
    off = ("--audit-tolerance", "0")  # the lie is taken: what is left is the loss's own bound
    _, honest, _ = step_with(template, tmp_path, "honest", None, *off)
    assert math.isfinite(honest["train/grad_norm"]) and honest["rollout/groups"] == 8, honest
    for lie in (-100.0, -30.0):
        weights, m, _ = step_with(template, tmp_path, f"lie{int(-lie)}", lie, *off)
        assert m["rollout/groups"] == 8, m  # trained on: nothing audits it
        assert all(np.isfinite(t).all() for t in weights.values()), lie
        # the stale rows' ratio is truncated at tis_cap (2): the liar weighs at most about
        # twice what the honest group weighs, never the 1e11 it once did
        assert math.isfinite(m["train/grad_norm"]), m
        assert m["train/grad_norm"] <= 3 * honest["train/grad_norm"], (lie, m["train/grad_norm"], honest["train/grad_norm"])
