"""Withholding against a live `vrl trainer`: a volunteer that uploads only the groups it likes
(here the template's picks, the numbers whose group has reward variance, most of its numbers
kept back) gets none trained while its missing share is over --missing-bound, and `vrl
status` says why; an honest volunteer that uploads every number it sampled, those with one
reward for all K included, is trained and never held.

The picky shard is listed first and sorts first in training order (same version, same poll,
its key first), so without the price its groups would be the first trained."""
from __future__ import annotations

import json

from conftest import TEMPLATE_VERSION

from helpers.bucket_objects import FolderBucket, as_dicts, committed, gz_lines, key
from helpers.vrlproc import Proc, run_vrl
from volunteer_rl.protocol import layout

V = TEMPLATE_VERSION
STEPS = 3
GROUPS = 2


def outcomes(bucket) -> dict[str, list[str]]:
    """Shard key -> the outcomes the committed ledgers record for it."""
    out: dict[str, list[str]] = {}
    for v in committed(bucket.path):
        path = bucket.path / layout.ledger_key(v)
        for rec in map(json.loads, path.read_text().splitlines() if path.exists() else []):
            out.setdefault(rec["key"], []).append(rec["outcome"])
    return out


def test_a_volunteer_that_uploads_only_what_it_likes_gets_nothing_trained(template, tmp_path):
    picked = template.groups("picky")[:6]
    assert picked[-1].seq + 1 - len(picked) > 0.05 * (picked[-1].seq + 1)  # well over the bound
    everything = template.every_group("steady")
    varied = [i for i, g in enumerate(everything) if len({c.reward for c in g.completions}) > 1]
    honest = everything[:varied[STEPS * GROUPS - 1] + 1]  # every number up to its 6th trainable
    bucket = FolderBucket(template.copy(tmp_path / "bucket"))
    picky_key = bucket.put(key("picky", "a"), gz_lines(as_dicts(picked, "picky")))
    steady_keys = [bucket.put(key("steady", f"s{i:03d}"), gz_lines(as_dicts(honest[i:i + 8], "steady")))
                   for i in range(0, len(honest), 8)]
    proc = Proc(["trainer", *bucket.args, "--groups-per-step", str(GROUPS), "--max-steps", str(STEPS),
                 "--publish-every", "100000", "--eval-every", "0", "--dashboard-every", "0",
                 "--eval-dataset", str(template.eval_csv), "--threads", "1", "--poll-seconds", "0.05",
                 "--log-shards", "--work-dir", str(tmp_path / "work"), "--signing-key", str(template.key)],
                tmp_path / "trainer.log", tmp_path, env={"OMP_NUM_THREADS": "1"})
    try:
        assert proc.wait(600) == 0, proc.text()[-3000:]
    finally:
        proc.kill()
    log = proc.text()
    done = outcomes(bucket)
    assert "trained" not in done.get(picky_key, []), (done.get(picky_key), log[-3000:])
    assert sum(done.get(k, []).count("trained") for k in steady_keys) >= 1, log[-3000:]
    steps = [json.loads(x) for v in committed(bucket.path) if (bucket.path / layout.metrics_key(v)).exists()
             for x in (bucket.path / layout.metrics_key(v)).read_text().splitlines()]
    trained_from = {k for s in steps if s.get("kind") == "step" for k in s["rollout/sources"]}
    assert trained_from and trained_from <= set(steady_keys), trained_from
    assert sum(s.get("ingest/held_missing", 0) for s in steps) >= len(picked), steps[-1]

    r = run_vrl(["status", *bucket.args, "--json"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = {row["id"]: row for row in json.loads(r.stdout)["volunteers"]}
    picky, steady = rows["picky"], rows["steady"]
    assert picky["held_back"] and picky["missing_recent_rate"] > 0.05, picky
    assert picky["numbers_recent"] == picked[-1].seq + 1, picky  # counted from number 0
    assert not steady["held_back"] and steady["missing_recent_rate"] == 0, steady
    table = run_vrl(["status", *bucket.args], cwd=tmp_path, timeout=120)
    assert table.returncode == 0 and "held" in table.stdout, table.stdout
