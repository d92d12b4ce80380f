"""Retention for real: a short `vrl trainer` run with `--gc-every`, then `vrl gc`, `vrl eval`
and a volunteer whose next version is deleted under it, all on one folder bucket.

The trainer is fed by a scripted volunteer in this process (one right and one wrong answer
per group, so every group has reward variance), which keeps the run at a few seconds. It
feeds every version, and tops up whenever the trainer still waits: a lost group never stalls
the run, however busy the machine."""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from conftest import PICKED
from helpers.grants import NoGrant, Numbers
from helpers.vrlproc import Proc, run_vrl
from volunteer_rl.config import PACKAGE_DATA
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.draws import pool_prompt
from volunteer_rl.protocol.manifest import read_manifest
from volunteer_rl.protocol.signing import Trust

ANY_SIGNER = Trust()  # the test reads the run it started: any valid signature will do
from volunteer_rl.protocol.shards import Completion, Group, encode_shard, new_shard_name
from volunteer_rl.storage import open_storage
from volunteer_rl.task.dataset import load_csv
from volunteer_rl.trainer.retention import n_objects

STEPS = 8          # one version per step: v0..v8
KEEP, EVERY, STALENESS = 3, 2, 1


def head(src: Path, dst: Path, rows: int) -> Path:
    dst.write_text("".join(src.read_text().splitlines(keepends=True)[: rows + 1]))
    return dst


def versions(bucket: Path, top: str) -> set[int]:
    return {layout.split_versioned_key(k)[1] for k in open_storage(str(bucket)).list(top)}


def scripted_shard(storage, m, problems, tokenizer, seq: int, numbers, trainer: Proc) -> None:
    """Two groups of two completions, the right expression and `<n> +`, which does not parse
    (reward 1 and 0 whatever the prompt), for the prompts the next numbers draw from `m`'s
    pool (numbers drawing a long expression are skipped). The wrong answer names the group's
    own number n, so no two groups have the same content even when a prompt is drawn again:
    the trainer's duplicate rule (one content, trained once) never takes a group away."""
    eos = tokenizer.token_to_id("<eos>")
    groups = []
    while len(groups) < 2:
        ((n, nonce),) = numbers.take(1, m.version, give_up=lambda: trainer.p.poll() is not None)
        p = problems[pool_prompt(m.prompt_pool, m.run_id, m.version, "scripted", n, nonce)]
        if len(p.expression) > 24:
            continue
        answers = [tokenizer.encode(p.expression).ids + [eos], tokenizer.encode(f"{n} +").ids + [eos]]
        groups.append(Group(p.id, m.version, "scripted", n,
                            [Completion(ids, [-1.0] * len(ids), "", float(j == 0))
                             for j, ids in enumerate(answers)]))
    storage.create(layout.shard_key(m.version, "scripted", new_shard_name(seq)), encode_shard(groups))


TOP_UP_SECONDS = 1.0
"""A "waiting for" line this long after the feeder's last shard, on the same version: the
trainer polled many times since (every 0.05 s) and still lacks groups, so it gets more."""
FEED_SECONDS = 600
"""Hang guard: the trainer's 8 steps take seconds; the fixture then fails on its log."""


def feed(storage, trainer: Proc, problems) -> set[int]:
    """Keep the trainer supplied until it stops; return the versions fed. A shard of two
    fresh groups goes out for each version it publishes, and another for the same version
    whenever the trainer says it is still waiting for groups after the last one (a group can
    still go stale, or come too late), so the run never stalls on a lost group. Topping up
    only when asked keeps spare groups rare: a spare lets the trainer step without a shard
    of the next version, and the tests read which versions were fed instead of assuming."""
    from tokenizers import Tokenizer

    tokenizer, fed, numbers = None, set(), None
    shards, last, since, mark = 0, None, 0.0, 0  # last shard's version, time and log offset
    deadline = time.time() + FEED_SECONDS
    while trainer.p.poll() is None and time.time() < deadline:
        m = read_manifest(storage, trust=ANY_SIGNER)
        if m is not None and (m.version != last or (
                time.time() - since > TOP_UP_SECONDS and "waiting for" in trainer.text()[mark:])):
            if tokenizer is None:
                tokenizer = Tokenizer.from_file(str(Path(storage.uri) / m.checkpoint / "tokenizer.json"))
                numbers = Numbers(storage, "scripted", m.run_id)
            mark = len(trainer.text())
            try:
                scripted_shard(storage, m, problems, tokenizer, shards, numbers, trainer)
            except NoGrant:  # the trainer stopped (at its last version) before it granted
                fed.add(m.version)  # the ask went into that version's rollouts/ all the same
                break
            shards, last, since = shards + 1, m.version, time.time()
            fed.add(m.version)
        time.sleep(0.05)
    return fed


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("retention")
    bucket = root / "bucket"
    train = head(PACKAGE_DATA / "train.csv", root / "train.csv", 200)
    held_out = head(PACKAGE_DATA / "eval.csv", root / "eval.csv", 10)
    problems = load_csv(train)
    trainer = Proc(["trainer", "--bucket", str(bucket), "--dataset", str(train),
                    "--eval-dataset", str(held_out), "--warm-start-steps", "0", "-k", "2",
                    "--groups-per-step", "2", "--max-steps", str(STEPS), "--eval-every", "0",
                    "--max-staleness", str(STALENESS), "--keep-versions", str(KEEP),
                    "--gc-every", str(EVERY), "--poll-seconds", "0.05", "--threads", "1",
                    "--audit-tolerance", "0",  # the scripted logprobs are made up
                    *PICKED,  # numbers drawing long expressions, and the rest of a grant, are left out
                    "--work-dir", str(root / "tw")], root / "trainer.log", root)
    try:
        fed = feed(open_storage(str(bucket)), trainer, problems)
        assert trainer.wait(60) == 0, trainer.text()[-3000:]
    finally:
        trainer.kill()
    return {"root": root, "bucket": bucket, "eval": held_out, "trainer": trainer.text(), "fed": fed}


def test_trainer_gc_every_keeps_the_newest_versions(run):
    bucket = run["bucket"]
    assert read_manifest(open_storage(str(bucket)), trust=ANY_SIGNER).version == STEPS
    # Passes after v2, v4, v6 and v8 (every 2nd publish); the last keeps v6-v8, the 3 newest.
    assert versions(bucket, layout.CHECKPOINTS) == {6, 7, 8}
    # Rollouts of every kept version the feeder wrote to, and of no other (it writes to each
    # version it sees; one the trainer stepped past on spare groups may have none).
    assert versions(bucket, layout.ROLLOUTS) == {v for v in run["fed"] if v >= 6}, run["fed"]
    assert versions(bucket, layout.MANIFESTS) == set(range(STEPS + 1))  # history stays
    assert versions(bucket, layout.METRICS) == set(range(STEPS + 1))
    # The pass after v2 finds nothing old enough; each later one removes two versions.
    # Passes run off the publish path, one at a time: one that falls due while another runs
    # is folded into the next, but the last publish always gets its pass.
    kept = re.findall(r"^retention: removed \d+ objects; kept (v\d+-v\d+)$", run["trainer"], re.M)
    assert kept[-1] == "v6-v8" and set(kept) <= {"v2-v4", "v4-v6", "v6-v8"}, run["trainer"]
    assert kept == sorted(kept) and "warning" not in run["trainer"]


@pytest.fixture(scope="module")
def collected(run):
    """A copy of the run's bucket with other parts' prefixes added, then `vrl gc` on it."""
    bucket = run["root"] / "gc-bucket"
    shutil.copytree(run["bucket"], bucket)
    s = open_storage(str(bucket))
    s.write("ledger/v000001.jsonl", b"{}\n")
    s.write("quarantine/v000006/scripted/x.json", b"{}")
    before = sorted(p for p in bucket.rglob("*") if p.is_file())
    # v6's rollout objects, which `vrl gc` removes: the feeder's asks for numbers and its
    # shards (one, more if the trainer asked for a top-up, none if it stepped past v6)
    shards = sum(p.is_file() for p in (bucket / layout.rollout_version_prefix(6)).rglob("*"))
    dry = run_vrl(["gc", "--bucket", str(bucket), "--keep-versions", "2", "--dry-run"], run["root"])
    assert sorted(p for p in bucket.rglob("*") if p.is_file()) == before
    real = run_vrl(["gc", "--bucket", str(bucket), "--keep-versions", "2"], run["root"])
    return {"bucket": bucket, "dry": dry, "real": real, "root": run["root"], "eval": run["eval"],
            "v6 shards": shards}


def test_gc_removes_beyond_the_window_and_reports_each_prefix(collected):
    dry, real = collected["dry"], collected["real"]
    for r in (dry, real):
        assert r.returncode == 0 and not r.stderr, r.stderr
        assert r.stdout.splitlines()[0].startswith("kept: v7-v8 and anything newer (manifest v8")
    files = len(list((collected["bucket"] / layout.checkpoint_prefix(7)).iterdir()))
    assert re.search(rf"^checkpoints/: would remove {files} objects, [\d.]+ [kM]B "
                     r"\(\d+ below the kept range: v6\)$", dry.stdout, re.M), dry.stdout
    shards = collected["v6 shards"]
    below = rf" \({shards} below the kept range: v6\)" if shards else ""
    assert re.search(rf"^rollouts/: would remove {n_objects(shards)}, [\d.]+ k?B{below}$",
                     dry.stdout, re.M), dry.stdout
    assert dry.stdout.replace("would remove", "removed") == real.stdout
    bucket = collected["bucket"]
    assert versions(bucket, layout.CHECKPOINTS) == {7, 8}
    assert not (bucket / layout.checkpoint_prefix(6)).exists()  # no empty folders left
    s = open_storage(str(bucket))
    assert s.exists("ledger/v000001.jsonl") and s.exists("quarantine/v000006/scripted/x.json")
    assert s.exists(layout.manifest_history_key(0)) and s.exists(layout.MANIFEST)


def test_eval_of_the_current_version_works_and_a_removed_one_says_so(collected):
    from volunteer_rl.model.hashing import CheckpointError
    from volunteer_rl.trainer.evaluate import load_version

    r = run_vrl(["eval", "--bucket", str(collected["bucket"]), "--dataset", str(collected["eval"]),
                 "--samples", "1", "--work-dir", str(collected["root"] / "ew")], collected["root"])
    assert r.returncode == 0, r.stderr
    assert re.search(r"^v8: greedy \d+\.\d%, sampled \(T=1.0\) \d+\.\d% on 10 prompts$", r.stdout, re.M)
    # `vrl eval --version 6` prints this one line (CheckpointError) and exits 1.
    with pytest.raises(CheckpointError) as e:
        load_version(open_storage(str(collected["bucket"])), 6, collected["root"] / "ew",
                     trust=ANY_SIGNER)
    assert str(e.value) == (
        "checkpoints/v000006: removed by retention (`vrl gc` or `vrl trainer --gc-every`); "
        "manifests/v000006.json is kept as history, the weights are not")


def test_volunteer_moves_on_when_the_version_it_is_about_to_fetch_is_gone(collected, tmp_path):
    """The volunteer reads the manifest naming v8; before it fetches v8's weights the trainer
    publishes v9 and retention deletes v8. It must re-read the manifest and load v9."""
    from volunteer_rl.config import TrainerConfig, VolunteerConfig
    from volunteer_rl.protocol.signing import load_or_create_key
    from volunteer_rl.trainer.publish import WeightsChain, publish
    from volunteer_rl.volunteer.loop import Volunteer

    bucket = tmp_path / "bucket"
    shutil.copytree(collected["bucket"], bucket)
    s = open_storage(str(bucket))
    m7, m8 = read_manifest(s, 7, trust=ANY_SIGNER), read_manifest(s, 8, trust=ANY_SIGNER)
    logs: list[str] = []
    v = Volunteer(VolunteerConfig(bucket=str(bucket), volunteer_id="v", work_dir=str(tmp_path / "vw")),
                  log=logs.append)
    s.write(layout.MANIFEST, s.read(layout.manifest_history_key(7)))  # v7 is current (signed bytes)
    assert v.try_switch(v.poll()) and v.manifest.version == 7
    s.write(layout.MANIFEST, s.read(layout.manifest_history_key(8)))  # v8 is published and seen...
    seen = v.poll()
    assert seen.version == 8 and v.manifest.version == 7
    etag = s.read_if_changed(layout.MANIFEST, None)[1]
    cfg = TrainerConfig(bucket=str(bucket), k=2, max_staleness=STALENESS, work_dir=str(tmp_path / "tw"),
                        max_new_tokens=32)
    key, _ = load_or_create_key(collected["root"] / "tw" / "signing-key.pem")
    publish(s, v.policy, 9, cfg, m8.run_id, m8.dataset, etag, key,  # ...then v9 comes
            WeightsChain(cfg.keyframe_every, cfg.patch_max_fraction), task=m8.task)
    for key in s.list(layout.checkpoint_prefix(8)):             # and v8 goes
        s.delete(key)
    assert v.try_switch(seen)
    assert v.manifest.version == 9
    assert logs.count("v8 was removed from the bucket; the manifest now names v9") == 1
    assert logs[-1].startswith("now on v9 ") and not any("warning" in line for line in logs)
    # The manifest's own version missing is a broken bucket, not retention: said once, no move.
    for key in s.list(layout.checkpoint_prefix(9)):
        s.delete(key)
    v.manifest = m7
    assert not v.try_switch(v.latest) and not v.try_switch(v.latest)
    assert sum("cannot load v9" in line for line in logs) == 1 and v.manifest is m7, logs[-3:]


# --- off the publish path ---------------------------------------------------------------------

class HeldListings:
    """The trainer's real storage, whose listings from any thread but the main one wait until
    `release` is set: a retention pass on its own thread stops at its first listing."""

    def __init__(self, inner):
        import threading

        self.inner, self.uri = inner, inner.uri
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        import threading

        fn = getattr(self.inner, name)
        if name not in ("list", "list_level"):
            return fn

        def held(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()
                self.release.wait()
            return fn(*args, **kwargs)
        return held


def held_trainer(tmp_path, monkeypatch):
    """A trainer on a fresh folder bucket (no warm start, v0 then v1 and v2 published) with a
    pass after every publish keeping one version; the bucket's retention listings are held
    from now on, and a volunteer left junk in v2, which the next publish puts out of range."""
    import volunteer_rl.trainer.loop as loop
    from volunteer_rl.config import TrainerConfig

    bucket = tmp_path / "bucket"
    held = HeldListings(open_storage(str(bucket)))
    held.release.set()  # v0-v2 go out with their passes unheld
    monkeypatch.setattr(loop, "open_storage", lambda uri, endpoint=None: held)
    cfg = TrainerConfig(bucket=str(bucket), gc_every=1, keep_versions=1, max_staleness=0,
                        warm_start_steps=0, eval_every=0, dashboard_every=0, threads=1,
                        eval_dataset=str(head(PACKAGE_DATA / "eval.csv", tmp_path / "eval.csv", 2)),
                        work_dir=str(tmp_path / "tw"))
    logs: list[str] = []
    trainer = loop.Trainer(cfg, log=logs.append)
    trainer.start()
    trainer.publish_next()
    trainer.publish_next()
    trainer.retention.wait()
    junk = [f"{layout.rollout_volunteer_prefix(2, 'vol-9')}/junk-{i}" for i in range(5)]
    for key in junk:
        held.write(key, b"j")
    held.release.clear()
    held.entered.clear()
    return trainer, held, junk, logs


def test_publish_does_not_wait_for_retention(tmp_path, monkeypatch):
    """Trainer.publish_next returns while its retention pass is held in a listing (on the
    publish path it would have deleted the junk before returning); released, the pass
    removes what fell out of the kept range."""
    trainer, held, junk, logs = held_trainer(tmp_path, monkeypatch)
    trainer.publish_next()
    assert trainer.version == 3
    assert all(held.exists(key) for key in junk), "retention ran inside the publish"
    assert held.entered.wait(120) and not held.release.is_set()
    held.release.set()
    trainer.retention.close()
    assert not any(held.exists(key) for key in junk)
    assert held.list(layout.rollout_version_prefix(2)) == []
    assert held.exists(layout.MANIFEST) and held.exists(layout.manifest_history_key(0))
    assert any(line.startswith("retention: removed") for line in logs), logs


def test_a_stopping_trainer_does_not_wait_for_a_hung_pass(tmp_path, monkeypatch):
    """A stop signal while a pass hangs in a request: the trainer's run ends (after at most
    RETENTION_STOP_WAIT) with no traceback, leaving the pass's thread behind; once the
    request returns, the pass stops at once, having deleted nothing."""
    trainer, held, junk, logs = held_trainer(tmp_path, monkeypatch)
    trainer.publish_next()
    assert held.entered.wait(120)
    trainer.stop.set()  # what SIGINT or SIGTERM does
    trainer.run()  # stops at once: no step, the views' last write, retention abandoned
    thread = trainer.retention._thread
    assert thread.is_alive()
    held.release.set()
    thread.join(60)
    assert not thread.is_alive() and all(held.exists(key) for key in junk)
    assert not any("Traceback" in line or "warning" in line for line in logs), logs
