"""The loop for real: one `vrl trainer` and two `vrl volunteer` processes on a folder bucket.

One run (module fixture: 40-90 s on a busy 2-core machine, from the template's warm-started
model) and several tests that read what it left: the bucket, the metrics the trainer wrote,
and each process's log.
"""
from __future__ import annotations

import gzip
import json
import re
import shutil
from pathlib import Path

import pytest

from helpers.bucket_objects import published_versions
from helpers.grants import assert_none_missing, deal
from helpers.vrlproc import Proc, one_line_error, run_vrl, stop_on_version, wait_for
from volunteer_rl.protocol import layout

MAX_STALENESS = 2
STEPS = 40


def metrics(bucket: Path) -> list[dict]:
    rows = []
    for f in sorted((bucket / "metrics").glob("v*.jsonl")):
        rows += [json.loads(line) for line in f.read_text().splitlines()]
    return rows


def stale_shard(bucket: Path) -> str:
    """A well-formed shard of v0 that shows up when v0 is already outside the window."""
    groups = [{"prompt_id": i, "policy_version": 0, "volunteer_id": "latecomer",
               "completions": [{"token_ids": [5, 1], "logprobs": [-0.5, -0.1], "text": "x",
                                "reward": float(j % 2)} for j in range(8)]} for i in range(40)]
    key = layout.shard_key(0, "latecomer", "0000000000001-000000-00000000")
    path = bucket / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress("\n".join(json.dumps(g) for g in groups).encode()))
    return key


@pytest.fixture(scope="module")
def run(tmp_path_factory, template):
    root = tmp_path_factory.mktemp("loop")
    bucket = root / "bucket"
    bucket.mkdir()  # only the trainer makes a folder bucket; a volunteer may start first
    # v0 is the template's warm-started model (conftest): no warm start of its own to wait for.
    trainer = Proc(["trainer", "--bucket", str(bucket), "--model", str(template.model(root / "model")),
                    "--max-steps", str(STEPS), "--groups-per-step", "16", "--publish-every", "2",
                    "--max-staleness", str(MAX_STALENESS), "--eval-every", "0", "--lr", "5e-4",
                    "--threads", "1", "--work-dir", str(root / "tw")], root / "trainer.log", root)
    vols = [Proc(["volunteer", "--bucket", str(bucket), "--id", f"vol-{i}", "--threads", "1",
                  "--seed", str(i), "--shard-groups", "16", "--shard-seconds", "3",
                  "--prompts-per-batch", "16", "--log-shards", "--work-dir", str(root / "vw")],
                 root / f"vol-{i}.log", root) for i in (1, 2)]
    try:
        # Once the trainer is past v3, drop in a shard of v0: outside the window, never used.
        wait_for(lambda: (bucket / layout.manifest_history_key(4)).exists(), 420, "v4")
        late = stale_shard(bucket)
        assert trainer.wait(600) == 0, trainer.text()[-3000:]
        final = published_versions(bucket)[-1]
        codes = stop_on_version(vols, final, 60)  # each picks up the final version first
    finally:
        for p in [trainer, *vols]:
            p.kill()
    return {"root": root, "bucket": bucket, "trainer": trainer.text(), "late": late,
            "vols": {f"vol-{i}": v.text() for i, v in zip((1, 2), vols)}, "codes": codes}


def test_honest_volunteers_have_no_number_missing(run):
    """Issue 41, point 7, with one trainer process and volunteers waiting at their quotas."""
    assert_none_missing(run["bucket"], {"vol-1", "vol-2"})


def test_versions_increase(run):
    versions = published_versions(run["bucket"])
    assert versions == list(range(len(versions))) and len(versions) >= 4
    manifest = json.loads((run["bucket"] / "manifest.json").read_text())
    assert manifest["version"] == versions[-1] == STEPS // 2
    steps = [m for m in metrics(run["bucket"]) if m["kind"] == "step"]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    assert all(a["version"] <= b["version"] for a, b in zip(steps, steps[1:]))


def test_each_volunteer_follows_every_new_version(run):
    final = published_versions(run["bucket"])[-1]
    for vid, log in run["vols"].items():
        switched = [int(v) for v in re.findall(r"now on v(\d+) ", log)]
        assert switched[0] == 0 and switched[-1] == final, vid
        assert switched == sorted(set(switched)), f"{vid} went back or repeated: {switched}"
        # groups of one version live under that version's prefix; a volunteer produced many
        uploaded = {layout.parse_shard_key(k)[0] for k in re.findall(r"uploaded (\S+):", log)}
        assert len(uploaded) >= 3, vid
        assert "stopped after uploading" in log
    assert run["codes"] == [0, 0]


def test_no_group_outside_the_window_is_trained_on(run):
    steps = [m for m in metrics(run["bucket"]) if m["kind"] == "step"]
    used = 0
    for m in steps:
        assert all(int(lag) <= MAX_STALENESS for lag in m["rollout/staleness_hist"])
        for key, n in m["rollout/sources"].items():
            version, vid, _ = layout.parse_shard_key(key)
            assert 0 <= m["version"] - version <= MAX_STALENESS, (key, m["version"])
            assert vid in ("vol-1", "vol-2")
            used += n
    assert used == 16 * STEPS
    assert not any(run["late"] in m["rollout/sources"] for m in steps)
    assert run["late"] not in run["trainer"]  # not even read: its prefix is no longer listed


def test_held_out_reward_improves(run):
    evals = {m["version"]: m for m in metrics(run["bucket"]) if m["kind"] == "eval"}
    first, last = evals[0], evals[max(evals)]
    assert max(evals) == STEPS // 2
    assert first["eval/prompts"] == last["eval/prompts"] == 500
    assert last["eval/accuracy_sampled"] > first["eval/accuracy_sampled"] + 0.03, (first, last)


def test_eval_command_reads_any_published_version(run):
    r = run_vrl(["eval", "--bucket", str(run["bucket"]), "--version", "1",
                 "--work-dir", str(run["root"] / "ew")], cwd=run["root"])
    assert r.returncode == 0, r.stderr
    assert re.search(r"v1: greedy \d+\.\d%, sampled \(T=1.0\) \d+\.\d% on 500 prompts", r.stdout)


# --- bad input: one line naming the object, exit 1, nothing trained on ---------------------

def without_quota(bucket: Path, key_file: Path) -> None:
    """Replace the bucket's manifest.json by the same manifest with `quota` null, signed."""
    import dataclasses

    from volunteer_rl.protocol.manifest import Manifest
    from volunteer_rl.protocol.signing import load_or_create_key

    key, _ = load_or_create_key(key_file)
    m = Manifest.from_json((bucket / layout.MANIFEST).read_bytes())
    (bucket / layout.MANIFEST).write_bytes(dataclasses.replace(m, quota=None).to_signed_json(key))


def copy_bucket(run, name: str) -> Path:
    dst = run["root"] / name
    shutil.copytree(run["bucket"], dst)
    return dst


def test_missing_manifest_is_one_line(run, tmp_path):
    (tmp_path / "empty").mkdir()  # a folder that does not exist is another error (test_cli_front_door)
    err = one_line_error(run_vrl(["eval", "--bucket", str(tmp_path / "empty")], cwd=tmp_path))
    assert "manifest.json" in err and "not found" in err


def test_malformed_manifest_is_one_line(run):
    bucket = copy_bucket(run, "malformed")
    (bucket / "manifest.json").write_text('{"schema_version": 1, "version": "x"')
    err = one_line_error(run_vrl(["eval", "--bucket", str(bucket)], cwd=run["root"]))
    assert "manifest.json" in err and "malformed" in err
    err = one_line_error(run_vrl(["trainer", "--bucket", str(bucket)], cwd=run["root"]))
    assert "manifest.json" in err
    # A volunteer does not crash or spam: it says so once and keeps waiting for a valid one.
    r = run_vrl(["volunteer", "--bucket", str(bucket), "--max-seconds", "4", "--id", "v"],
                cwd=run["root"])
    assert r.returncode == 0 and r.stdout.count("manifest.json: malformed") == 1, r.stdout


def test_checkpoint_with_wrong_sha_is_refused(run):
    bucket = copy_bucket(run, "tampered")
    manifest = json.loads((bucket / "manifest.json").read_text())
    weights = bucket / manifest["checkpoint"] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    err = one_line_error(run_vrl(["eval", "--bucket", str(bucket), "--work-dir",
                                  str(run["root"] / "ew2")], cwd=run["root"]))
    assert f"{manifest['checkpoint']}/model.safetensors: sha256 of piece 0" in err
    r = run_vrl(["volunteer", "--bucket", str(bucket), "--max-seconds", "4", "--id", "v",
                 "--work-dir", str(run["root"] / "vw2")], cwd=run["root"])
    assert r.returncode == 0 and r.stdout.count("sha256") == 1, r.stdout
    assert "uploaded" not in r.stdout  # never generated with weights it could not verify


def test_unreadable_shard_is_reported_and_never_trained_on(run):
    bucket = copy_bucket(run, "garbage")
    manifest = json.loads((bucket / "manifest.json").read_text())
    key = layout.shard_key(manifest["version"], "vol-x", "0000000000001-000000-00000000")
    (bucket / key).parent.mkdir(parents=True)
    (bucket / key).write_bytes(b"\x1f\x8b\x08 this is not a gzip stream")
    # Stopped once it has dealt with the shard, not after a fixed time: on a busy machine the
    # first poll (which also reads the run's untrained shards) can take longer than 3 s.
    rejected = f"rejected {key}: bad_gzip"
    trainer = Proc(["trainer", "--bucket", str(bucket), "--work-dir", str(run["root"] / "tw3"),
                    "--signing-key", str(run["root"] / "tw/signing-key.pem"), "--threads", "1"],
                   run["root"] / "garbage.log", run["root"])
    try:
        wait_for(lambda: rejected in trainer.text(), 120, "the trainer to reject the shard")
        assert trainer.terminate() == 0, trainer.text()[-3000:]
    finally:
        trainer.kill()
    assert trainer.text().count(rejected) == 1


def test_ctrl_c_uploads_the_partial_shard_and_exits_0(run):
    import signal

    from volunteer_rl.protocol.shards import decode_shard

    bucket = copy_bucket(run, "ctrl-c")
    # Nothing may go up before the signal: no count or age reached, and fewer groups than the
    # manifest's max_shard_groups (256) buffered, which the per-version cap (160, then one
    # batch of 16 per 2 s of patience) keeps it under; and no quota, which the run's last
    # manifest has (a volunteer uploads what it holds when it reaches one): the same manifest,
    # signed again by the run's key without it.
    without_quota(bucket, run["root"] / "tw" / "signing-key.pem")
    final = json.loads((bucket / layout.MANIFEST).read_text())
    deal(bucket, run["root"] / "tw" / "signing-key.pem", final["run_id"], "ctrlc", final["version"],
         run["root"] / "vw3", blocks=4)  # the trainer has exited: dealt, two batches' worth
    v = Proc(["volunteer", "--bucket", str(bucket), "--id", "ctrlc", "--threads", "1",
              "--shard-groups", "100000", "--shard-seconds", "100000", "--max-groups-per-version", "160",
              "--log-shards", "--heartbeat-seconds", "0.5",
              "--work-dir", str(run["root"] / "vw3")], run["root"] / "ctrlc.log", run["root"])
    heartbeat = bucket / layout.heartbeat_key("ctrlc")

    def groups_made() -> int:
        return json.loads(heartbeat.read_text())["groups_total"] if heartbeat.exists() else 0
    try:
        wait_for(lambda: "now on v" in v.text(), 120, "the volunteer to load the checkpoint")
        before = len(list((bucket / "rollouts").rglob("*.jsonl.gz")))
        # A batch made, as its heartbeat counts (a sleep would ask the machine for a pace):
        # nothing uploaded yet, all of it buffered.
        wait_for(lambda: groups_made() >= 16, 300, "a batch of groups made", 0.1)
        assert "uploaded" not in v.text()
        v.p.send_signal(signal.SIGINT)
        assert v.wait(60) == 0, v.text()
    finally:
        v.kill()
    keys = re.findall(r"uploaded (\S+): (\d+) groups", v.text())
    assert len(keys) == 1 and int(keys[0][1]) >= 16
    groups = decode_shard((bucket / keys[0][0]).read_bytes())
    assert len(groups) == int(keys[0][1]) and all(g.volunteer_id == "ctrlc" for g in groups)
    assert len(list((bucket / "rollouts").rglob("*.jsonl.gz"))) == before + 1
