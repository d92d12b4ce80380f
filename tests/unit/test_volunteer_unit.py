"""Volunteer logic that needs no model: shard buffering and the per-version cap."""
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.shards import Completion, Group, decode_shard
from volunteer_rl.storage import open_storage
from volunteer_rl.volunteer.loop import default_volunteer_id
from volunteer_rl.volunteer.shard_writer import ShardWriter


def groups(n, version):
    return [Group(i, version, "me", i, [Completion([1, 2], [-0.1, -0.2], "3", 1.0)]) for i in range(n)]


def test_writer_flushes_by_count_and_on_version_change():
    s = open_storage("memory://writer-test")
    w = ShardWriter(s, "me", max_groups=10, max_seconds=1e9, log=lambda m: None)
    w.add(groups(4, 1), 1)
    assert s.list("rollouts") == []                      # buffered, nothing visible yet
    w.add(groups(4, 2), 2)                               # new version: v1's 4 groups go out
    keys = s.list("rollouts")
    assert len(keys) == 1 and layout.parse_shard_key(keys[0])[:2] == (1, "me")
    w.add(groups(6, 2), 2)                               # 10 groups: flushed by count
    w.flush()                                            # nothing left: no empty shard
    keys = s.list("rollouts")
    assert len(keys) == 2
    assert [len(decode_shard(s.read(k))) for k in keys] == [4, 10]
    assert w.uploaded_groups == 14


def test_no_shard_holds_more_than_the_manifest_allows():
    s = open_storage("memory://writer-limit")
    w = ShardWriter(s, "me", max_groups=1000, max_seconds=1e9, log=lambda m: None)
    w.limit = 4                                          # the manifest's max_shard_groups
    w.add(groups(3, 1), 1)
    assert s.list("rollouts") == []                      # under both: buffered
    w.add(groups(7, 1), 1)                               # 10 >= 4: three shards, 4 + 4 + 2
    sizes = [len(decode_shard(s.read(k))) for k in s.list("rollouts")]
    assert sorted(sizes) == [2, 4, 4] and w.uploaded_groups == 10 and w.groups == []


def test_groups_per_version_are_counted():
    class M:
        version = 2
    w = ShardWriter(open_storage("memory://writer-cap"), "me", 100, 1e9, lambda m: None)
    w.add(groups(5, 1), 1)
    w.add(groups(7, 2), 2)
    assert w.version_groups(M()) == 7 and w.version_groups(None) == 0


def test_default_ids_are_safe_and_distinct():
    ids = {default_volunteer_id() for _ in range(50)}
    assert len(ids) == 50 and all(layout.is_safe_name(i) for i in ids)


def test_the_per_version_cap_pauses_but_never_deadlocks():
    """A trainer that got too few useful groups waits for more; a capped volunteer waiting
    for a new version would wait forever. The cap must give way after its patience. (The
    volunteer asks for numbers of a version only while `room` allows: volunteer.loop._ask.)"""
    from volunteer_rl.volunteer.quota import Allowance

    allowance = Allowance(cap=8, batch=4, cap_patience=5.0, log=lambda m: None)

    class M:
        run_id, version, quota = "run", 3, None
    clock = 1000.0
    assert allowance.room(M(), 8, clock) == 0            # at the cap: pause
    assert allowance.room(M(), 8, clock + 4.9) == 0      # still within its patience
    assert allowance.room(M(), 8, clock + 5.1) == 4      # patience over: one more batch
    assert allowance.room(M(), 12, clock + 5.2) == 0     # and then it pauses again


def test_a_loaded_model_sets_the_sampling_threads_and_round(tmp_path, monkeypatch):
    """Threads and prompts per round follow the model the volunteer loads: auto (0) gives a
    small CPU model one thread and 32 prompts, --threads N and --prompts-per-batch N give N;
    the thread count is logged when it changes."""
    import torch

    from volunteer_rl.config import VolunteerConfig
    from volunteer_rl.model.chain import Fetched
    from volunteer_rl.model.policy import Policy
    from volunteer_rl.protocol.manifest import TaskRef, WeightsEntry
    from volunteer_rl.volunteer import loop as vol
    from volunteer_rl.volunteer.loop import Volunteer

    small = Policy(torch.nn.Linear(10, 10), None, "plain", torch.device("cpu"))

    class M:
        run_id, version, files, dataset = "run", 0, {"model.safetensors": WeightsEntry("0" * 64, 0)}, "d"
        adapter = None  # a version published whole
        task = TaskRef("calculator", "volunteer-rl", "0.1.0")
        prompt_pool = (0,)

    monkeypatch.setattr(vol, "fetch_checkpoint", lambda *a, **k: None)
    monkeypatch.setattr(vol, "fetch_weights", lambda *a, **k: Fetched(memoryview(b""), "keyframe", 0, 1))
    monkeypatch.setattr(vol, "fetched_text", lambda f, m: "keyframe")
    monkeypatch.setattr(vol, "load_policy", lambda folder, device: small)
    monkeypatch.setattr(Volunteer, "_load_dataset", lambda self, m, task: ["one row"])
    before = torch.get_num_threads()
    try:
        for threads, expected, how in ((0, 1, "auto"), (2, 2, "--threads")):
            logs = []
            v = Volunteer(VolunteerConfig(bucket=str(tmp_path), volunteer_id="me", threads=threads,
                                          device="cpu"), log=logs.append)
            v.switch(M())
            assert torch.get_num_threads() == expected == v.threads
            assert f"sampling with {expected} torch thread" in logs[0] and f"({how})" in logs[0]
            assert v.allowance.batch == 32  # auto prompts per round: a small model
        v = Volunteer(VolunteerConfig(bucket=str(tmp_path), volunteer_id="me", device="cpu",
                                      prompts_per_batch=5), log=lambda line: None)
        v.switch(M())
        assert v.allowance.batch == 5  # --prompts-per-batch wins
    finally:
        torch.set_num_threads(before)


def test_a_pool_naming_rows_the_dataset_lacks_is_refused_before_the_model_changes(tmp_path, monkeypatch):
    import pytest
    import torch

    from volunteer_rl.config import VolunteerConfig
    from volunteer_rl.model.chain import Fetched
    from volunteer_rl.protocol.manifest import TaskRef, WeightsEntry
    from volunteer_rl.task.dataset import DatasetError
    from volunteer_rl.volunteer import loop as vol
    from volunteer_rl.volunteer.loop import Volunteer

    class M:
        run_id, version, files, dataset = "run", 0, {"model.safetensors": WeightsEntry("0" * 64, 0)}, "d"
        task = TaskRef("calculator", "volunteer-rl", "0.1.0")
        prompt_pool = (0, 5)

    M.dataset = type("D", (), {"key": "datasets/train.csv"})()

    loaded = []
    monkeypatch.setattr(vol, "fetch_checkpoint", lambda *a, **k: None)
    monkeypatch.setattr(vol, "fetch_weights", lambda *a, **k: Fetched(memoryview(b""), "keyframe", 0, 1))
    monkeypatch.setattr(vol, "load_policy", lambda folder, device: loaded.append(1) or torch.nn.Linear(1, 1))
    monkeypatch.setattr(Volunteer, "_load_dataset", lambda self, m, task: ["row 0", "row 1"])
    v = Volunteer(VolunteerConfig(bucket=str(tmp_path), volunteer_id="me", device="cpu"),
                  log=lambda m: None)
    with pytest.raises(DatasetError, match="^datasets/train.csv: 2 rows, but the prompt pool of v0 names row 5$"):
        v.switch(M())
    assert v.manifest is None and not loaded
