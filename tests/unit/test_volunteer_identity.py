"""A volunteer's id is kept in its work dir (volunteer/identity.py): a restart is the same
volunteer, two running from one work dir are two, and an explicit --id wins."""
from __future__ import annotations

from volunteer_rl.volunteer.identity import IDS_FILE, claim_id, saved_ids


def test_a_restart_takes_the_saved_id_and_two_at_once_take_two(tmp_path):
    logs: list[str] = []
    first = claim_id(tmp_path, None, logs.append)
    assert logs == [f"new volunteer id {first.id}, saved in {tmp_path / IDS_FILE} for the next start"]
    first.release()  # the process ended
    logs.clear()
    again = claim_id(tmp_path, None, logs.append)
    assert again.id == first.id and logs == []
    other = claim_id(tmp_path, None, logs.append)  # a second volunteer while the first runs
    assert other.id != first.id and saved_ids(tmp_path) == [first.id, other.id]
    again.release()
    other.release()
    a, b = claim_id(tmp_path, None, logs.append), claim_id(tmp_path, None, logs.append)
    assert (a.id, b.id) == (first.id, other.id)


def test_an_explicit_id_wins_and_leaves_the_saved_one(tmp_path):
    logs: list[str] = []
    saved = claim_id(tmp_path, None, logs.append)
    saved.release()
    logs.clear()
    assert claim_id(tmp_path, "laptop-1", logs.append).id == "laptop-1"
    assert logs == [f"--id laptop-1 given: running as it; {tmp_path / IDS_FILE} keeps "
                    f"{saved.id} for runs without --id"]
    assert saved_ids(tmp_path) == [saved.id]
    assert claim_id(tmp_path, None, logs.append).id == saved.id
