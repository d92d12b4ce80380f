"""The ledger's bookkeeping and the trainer state folder, as pure units."""
from __future__ import annotations

import torch

from volunteer_rl.protocol import layout
from volunteer_rl.protocol.ledger import Ledger, group_digest, rebuild
from volunteer_rl.storage import open_storage
from volunteer_rl.trainer.state import STATE_FILE, load_state, prune_states, save_state, state_dir


def test_digest_ignores_what_a_replay_could_edit_and_sees_what_it_cannot():
    a = group_digest(3, 7, [[1, 2], [3]])
    assert a == group_digest(3, 7, [[1, 2], [3]])
    assert len({a, group_digest(4, 7, [[1, 2], [3]]), group_digest(3, 8, [[1, 2], [3]]),
                group_digest(3, 7, [[3], [1, 2]])}) == 4


def test_outcomes_finish_a_shard_and_prune_drops_old_versions():
    led = Ledger()
    k5, k9 = layout.shard_key(5, "a", "s"), layout.shard_key(9, "a", "s")
    assert led.claim("d1", 5, "a") and not led.claim("d1", 9, "a")
    led.record(k5, "trained", [0], 2, ["d1"], step=1)
    assert not led.finished(k5) and led.is_done(k5, 0)
    led.record(k5, "zero_variance", [1], 2, ["d2"])
    assert led.finished(k5)
    led.record(k9, "rejected", [], 0, reason="bad_json")
    assert led.finished(k9)
    led.prune(6)
    assert not led.finished(k5) and led.finished(k9) and "d1" not in led.digests


def test_rebuild_reads_only_the_versions_it_is_given():
    s = open_storage("memory://ledger-rebuild")
    key = layout.shard_key(3, "a", "s")
    led = Ledger()
    led.record(key, "trained", [0], 2, ["x"], step=1)
    led.flush(s, 4)
    led.record(key, "trained", [1], 2, ["y"], step=2)
    led.flush(s, 5)  # say v5 was never committed: a restart passes [4] only
    again = rebuild(s, [4])
    assert again.is_done(key, 0) and not again.is_done(key, 1) and "y" not in again.digests


def test_state_round_trip_restores_optimizer_and_rng(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    save_state(tmp_path, 7, opt, {"steps": 12})
    expected_rand = torch.rand(3)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = load_state(tmp_path, 7, fresh)
    assert meta["steps"] == 12
    assert torch.equal(torch.rand(3), expected_rand)
    for a, b in zip(opt.state_dict()["state"].values(), fresh.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        assert float(a["step"]) == float(b["step"])


def test_a_state_without_its_completion_mark_is_ignored(tmp_path):
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    save_state(tmp_path, 3, opt, {})
    (state_dir(tmp_path, 3) / STATE_FILE).unlink()
    assert load_state(tmp_path, 3, opt) is None
    save_state(tmp_path, 4, opt, {})
    prune_states(tmp_path, {4})
    assert not state_dir(tmp_path, 3).exists() and state_dir(tmp_path, 4).exists()
