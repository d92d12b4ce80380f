"""Balance through a real trainer and a real volunteer (issue 27): the trainer writes each
version's quota into the signed manifest (none for v0, which has measured nothing) and the
useful fraction into fleet.json and its step metrics; a volunteer stops at the quota,
flushes, says so in its heartbeat, and samples another quota when no new version comes; a
schema-6 reader refuses a schema-7 manifest in one line."""
from __future__ import annotations

import json
import threading
import time

import pytest

from helpers.honest_groups import drawn_prompt
from helpers.trainers import started_trainer
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import ManifestError, Quota, read_manifest
from volunteer_rl.protocol.shards import Completion, Group, decode_shard, encode_shard
from volunteer_rl.protocol.signing import Trust, public_key_text
from volunteer_rl.trainer.balance import WAIT_BOUNDS, participation, quota_groups

SETTINGS = {"k": 2, "max_new_tokens": 48, "audit_tolerance": 0.0, "groups_per_step": 2,
            "max_steps": 2, "quota_headroom": 1.5}


def varied_group(t, volunteer: str, seq: int) -> Group:
    """Group `seq` of `volunteer` under v0 with one right and one wrong completion: reward
    variance, so the trainer can use it. The wrong one is off by a number no other group uses,
    so two groups that drew the same prompt are still no duplicates (the ledger's digest is of
    the prompt and the tokens, not of who sent them)."""
    pid = drawn_prompt(t, 0, volunteer, seq)
    p = t.published_policy
    expression = t.problems[pid]["python_expression"]
    off_by = 1 + seq + 4 * ("vol-a", "vol-b").index(volunteer)
    right, wrong = (p.tokenizer.encode(text, add_special_tokens=False) + [p.eos_id]
                    for text in (expression, f"({expression})+{off_by}"))
    return Group(pid, 0, volunteer, seq, [Completion(right, [-1.0] * len(right), "", 1.0),
                                          Completion(wrong, [-1.0] * len(wrong), "", 0.0)])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer that took 4 groups from each of two volunteers and made 2 steps of 2."""
    t = started_trainer(tmp_path_factory.mktemp("balance-trainer"), **SETTINGS)
    for vol in ("vol-a", "vol-b"):
        groups = [varied_group(t, vol, seq) for seq in range(4)]
        t.storage.write(layout.shard_key(0, vol, "s0"), encode_shard(groups))
    t.run()
    return t


def manifest_raw(t, version: int) -> dict:
    return json.loads(t.storage.read(layout.manifest_history_key(version)))


def test_the_trainer_signs_each_versions_quota_into_its_manifest(trained):
    t = trained
    trust = Trust(public_key_text(t.key))
    # v0: nothing measured; half usable and one volunteer assumed: a version's need of 2, x 1.5 / 0.5
    assert manifest_raw(t, 0)["quota"] == {"groups": 6, "wait_seconds": WAIT_BOUNDS[0]}
    # v1, after step 1: 8 groups received from 2 volunteers, all usable, 6 still in hand
    assert manifest_raw(t, 1)["quota"] == {
        "groups": quota_groups(2, 6, 1.0, participation({"vol-a": 4, "vol-b": 4}), 1.5),
        "wait_seconds": WAIT_BOUNDS[0]}
    # v2, the final publish: nothing in hand, so a version's need of 2 shared by 2
    assert read_manifest(t.storage, 2, trust=trust).quota == Quota(2, WAIT_BOUNDS[0])
    assert read_manifest(t.storage, trust=trust).quota == Quota(2, WAIT_BOUNDS[0])


def test_fleet_json_and_the_step_metrics_carry_the_useful_fraction(trained):
    doc = json.loads(trained.storage.read(layout.FLEET))
    assert doc["schema_version"] == 6
    b = doc["balance"]
    assert (b["groups_received"], b["groups_trained"], b["useful_fraction"]) == (8, 4, 0.5)
    assert b["usable_fraction"] == 1.0 and b["volunteers"] == 2.0
    assert b["quota"] == {"groups": 2, "wait_seconds": WAIT_BOUNDS[0]}
    for vol in ("vol-a", "vol-b"):
        row = doc["volunteers"][vol]
        assert row["groups_received_recent"] == 4
        assert row["useful_fraction"] == row["groups_trained_recent"] / 4
    steps = [json.loads(line) for v in (1, 2)
             for line in trained.storage.read(layout.metrics_key(v)).decode().splitlines()]
    assert [s["fleet/useful_fraction"] for s in steps if s["kind"] == "step"] == [2 / 8, 4 / 8]


def test_a_reader_of_the_schema_before_refuses_this_schemas_manifest_in_one_line(
        trained, monkeypatch, tmp_path):
    from volunteer_rl.config import VolunteerConfig
    from volunteer_rl.volunteer.loop import Volunteer

    now = layout.SCHEMA_VERSION
    monkeypatch.setattr(layout, "SCHEMA_VERSION", now - 1)  # what a build of the schema before checks
    with pytest.raises(ManifestError) as e:
        read_manifest(trained.storage, trust=Trust(public_key_text(trained.key)))
    assert str(e.value) == (f"manifest.json: schema_version {now} is not {now - 1}, the one this "
                            "build speaks; upgrade volunteer_rl")
    lines = []
    v = Volunteer(VolunteerConfig(bucket=trained.cfg.bucket, volunteer_id="old", device="cpu",
                                  work_dir=str(tmp_path), heartbeat_seconds=0), log=lines.append)
    assert v.poll() is None and v.poll() is None  # keeps polling, samples nothing, says so once
    assert lines[-1:] == [f"warning: {e.value}; waiting for a valid one"]
    assert sum(f"schema_version {now}" in line for line in lines) == 1


# --- a volunteer at its quota -----------------------------------------------------------------


class Recorder(threading.Event):
    """The volunteer's stop event, noting what its heartbeat says while the loop waits; it
    stops a loop that would wait for good (a deadlock fails the test, never hangs it)."""

    def __init__(self, volunteer, give_up: float = 60.0):
        super().__init__()
        self.volunteer, self.waiting = volunteer, []
        self.give_up = time.time() + give_up

    def wait(self, timeout=None):
        self.waiting.append(self.volunteer._heartbeat_payload("running", time.time())["waiting"])
        if time.time() > self.give_up:
            self.set()
        return super().wait(timeout)


def volunteer_with_granter(tmp_path, m, prompts_per_batch, log):
    """A Volunteer holding manifest `m` (nothing loaded: tests stub generation), its stop a
    Recorder, trusting a fresh key; and the trainer's Granter for that key with the record of
    numbers it grants, to answer the volunteer's asks as a trainer's polls do."""
    from volunteer_rl.config import VolunteerConfig
    from volunteer_rl.protocol.signing import Ed25519PrivateKey
    from volunteer_rl.trainer.granting import Granter
    from volunteer_rl.trainer.withheld import GroupNumbers
    from volunteer_rl.volunteer.loop import Volunteer

    cfg = VolunteerConfig(bucket=str(tmp_path / "b"), volunteer_id="me",
                          prompts_per_batch=prompts_per_batch, shard_groups=100, shard_seconds=1e9,
                          poll_seconds=0.02, heartbeat_seconds=0, work_dir=str(tmp_path / "w"))
    v = Volunteer(cfg, log=log)
    v.manifest, v.stop = m, Recorder(v)
    key = Ed25519PrivateKey.generate()
    v.numbers.trust = Trust(public_key_text(key))
    received = GroupNumbers()
    return v, Granter(v.storage, m.run_id, key, received, log=lambda line: None), received


def asks_in(storage) -> list[str]:
    """The ask objects in the bucket, every version's."""
    from volunteer_rl.protocol.grants import parse_ask_key

    return [k for k in storage.list("rollouts") if parse_ask_key(k)]


def test_a_volunteer_stops_at_the_quota_flushes_and_samples_another_after_the_wait(tmp_path, monkeypatch):
    """The loop itself (Volunteer.run) with generation stubbed and a trainer's Granter
    answering its asks: it asks for numbers of a version only within the quota, the groups
    made go out as soon as it is reached (the shard would otherwise wait for 100 groups), the
    heartbeat says `waiting`, and after `wait_seconds` without a new version another quota's
    worth is asked for and sampled, then twice that."""
    from helpers.status_fixtures import manifest as status_manifest
    from volunteer_rl.trainer.groups import Window

    quota = Quota(groups=8, wait_seconds=0.3)  # a whole block of numbers (GRANT_BLOCK)
    m = status_manifest(version=3)
    m = type(m)(**{**m.__dict__, "quota": quota})
    lines = []
    v, granter, _ = volunteer_with_granter(tmp_path, m, 4, lines.append)
    monkeypatch.setattr(v, "poll", lambda: m)  # the same version, never a new one
    calls = []  # (time, groups sampled, groups in the bucket then)

    def generate(batch):
        uploaded = sum(len(decode_shard(v.storage.read(k))) for k in v.storage.list("rollouts")
                       if k.endswith(".jsonl.gz"))
        calls.append((time.time(), batch.count, uploaded))
        if sum(c for _, c, _ in calls) >= 4 * quota.groups:
            v.stop.set()
        return [Group(0, 3, "me", batch.first + i, [Completion([1], [-0.5], "", 0.0)])
                for i in range(batch.count)]
    monkeypatch.setattr(v, "_generate", generate)

    def trainer():  # answers the asks as a trainer's polls do
        while not v.stop.is_set():
            granter.answer(asks_in(v.storage), Window(3, 2, {1, 2, 3}))
            time.sleep(0.01)
    answering = threading.Thread(target=trainer, daemon=True)
    answering.start()
    v.run()
    answering.join()
    assert [c for _, c, _ in calls] == [4, 4, 4, 4, 4, 4, 4, 4]  # never past the quota: 8, 16, 32
    starts = [i for i in range(len(calls)) if sum(c for _, c, _ in calls[:i]) in (0, 8, 16)]
    assert starts == [0, 2, 4]
    for i in starts[1:]:
        assert calls[i][0] - calls[i - 1][0] >= quota.wait_seconds  # waited before another quota
        assert calls[i][2] == sum(c for _, c, _ in calls[:i])  # everything made was uploaded
    assert "quota of v3 reached (8 groups)" in v.stop.waiting
    assert "quota of v3 reached (16 groups)" in v.stop.waiting
    assert any(line.startswith("waiting: quota of v3 reached (8 groups)") for line in lines)


def test_a_volunteer_stopped_at_its_quota_samples_the_grant_of_its_ask_ahead(tmp_path, monkeypatch):
    """At the quota of v3 the volunteer asks ahead, for v4; the trainer holds the ask until
    it publishes v4. A stop comes while the volunteer waits: it waits for that grant (at most
    the quota's wait) and samples it before it exits, since numbers granted after it left
    would count as missing."""
    from helpers.status_fixtures import manifest as status_manifest
    from volunteer_rl.protocol.grants import parse_ask_key
    from volunteer_rl.trainer.groups import Window

    quota = Quota(groups=8, wait_seconds=20.0)  # no second quota of v3 in this test
    m3 = status_manifest(version=3)
    m3 = type(m3)(**{**m3.__dict__, "quota": quota})
    m4 = type(m3)(**{**m3.__dict__, "version": 4})
    v, granter, received = volunteer_with_granter(tmp_path, m3, 8, lambda line: None)

    def poll():  # v3 stays the newest manifest read: v4 is published after the stop
        v.latest, v.last_manifest_ok = m3, time.time()
        return m3
    monkeypatch.setattr(v, "poll", poll)
    monkeypatch.setattr(v, "_manifest_of", lambda version: {3: m3, 4: m4}.get(version))
    monkeypatch.setattr(v, "try_switch", lambda m: setattr(v, "manifest", m) or True)
    monkeypatch.setattr(v, "switch", lambda m: setattr(v, "manifest", m))
    sampled = []  # (version, first, count)

    def generate(batch):
        sampled.append((batch.version, batch.first, batch.count))
        return [Group(0, batch.version, "me", batch.first + i, [Completion([1], [-0.5], "", 0.0)])
                for i in range(batch.count)]
    monkeypatch.setattr(v, "_generate", generate)

    def asks():
        return asks_in(v.storage)

    def trainer():
        deadline = time.time() + 30  # a volunteer that never asks ahead fails, never hangs
        while not asks() and time.time() < deadline:
            time.sleep(0.01)
        granter.answer(asks(), Window(3, 2, {1, 2, 3}))  # the quota's worth of v3
        while not any(parse_ask_key(k)[0] == 4 for k in asks()) and time.time() < deadline:
            granter.answer(asks(), Window(3, 2, {1, 2, 3}))  # held: v4 is not published
            time.sleep(0.01)
        v.stop.set()  # the stop comes while the volunteer waits at its quota
        time.sleep(0.5)
        granter.answer(asks(), Window(4, 2, {2, 3, 4}))  # v4 published: the ask ahead granted
    answering = threading.Thread(target=trainer, daemon=True)
    answering.start()
    v.run()
    answering.join()
    assert sampled == [(3, 0, 8), (4, 8, 8)]
    assert received.granted_end("me") == 16
    shards = [decode_shard(v.storage.read(k)) for k in v.storage.list("rollouts")
              if k.endswith(".jsonl.gz")]
    assert sorted(g.seq for s in shards for g in s) == list(range(16))  # uploaded, none missing
