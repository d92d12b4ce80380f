"""Grants (protocol.grants): a volunteer's ask, the trainer's answer (trainer.granting) and the
volunteer's book of them (volunteer.numbering), on a real in-memory bucket. The live path,
with a volunteer process that samples one number under two versions, is
tests/integration/test_bound_numbers.py."""
import pytest

from volunteer_rl.protocol import grants as g
from volunteer_rl.protocol.draws import pool_prompt
from volunteer_rl.protocol.signing import Ed25519PrivateKey, Trust, public_key_text, sign
from volunteer_rl.storage import open_storage
from volunteer_rl.trainer.granting import Granter
from volunteer_rl.trainer.groups import Window
from volunteer_rl.trainer.withheld import GroupNumbers as Received
from volunteer_rl.volunteer.numbering import GroupNumbers

RUN = "run-g"
KEY = Ed25519PrivateKey.generate()


def setup(name, tmp_path):
    storage = open_storage(f"memory://grants-{name}")
    received = Received()
    granter = Granter(storage, RUN, KEY, received, log=lambda m: None)
    book = GroupNumbers(tmp_path / "me" / "group-numbers.json", storage, "me",
                        Trust(public_key_text(KEY)), log=lambda m: None)
    book.start_run(RUN)
    return storage, received, granter, book


def win(version, staleness=2):
    return Window(version, staleness, set(range(max(0, version - staleness), version + 1)))


def asks(storage):
    return [k for k in storage.list("rollouts/") if g.parse_ask_key(k)]


def test_an_ask_is_answered_once_with_blocks_bound_to_the_newest_version(tmp_path):
    storage, received, granter, book = setup("once", tmp_path)
    book.ask(5, 20)
    assert asks(storage) == ["rollouts/v000005/me/ask-0000000000-003"]
    granter.answer(asks(storage), win(6))
    assert book.refresh() and book.pending() == 24
    batch = book.batch(16)
    # asked with v5 in hand, granted under v6: the trainer's newest, not the volunteer's choice
    assert (batch.first, batch.count, batch.version) == (0, 16, 6)
    assert batch.nonce(9) == g.seq_nonce(g.grant_secret(KEY), RUN, "me", 6, 9)
    granter.answer(asks(storage), win(6))  # listed again: never granted twice
    book.asked = None
    book.ask(6, 8)  # the next ask goes on after the grant
    assert "rollouts/v000006/me/ask-0000000003-001" in asks(storage)
    granter.answer(asks(storage), win(6))
    book.refresh()
    assert [(x.first, x.end, x.version) for x in book.grants] == [(0, 24, 6), (24, 32, 6)]
    assert received.granted_end("me") == 32


def test_one_grant_a_poll_and_none_for_a_version_outside_the_window(tmp_path):
    storage, _, granter, book = setup("window", tmp_path)
    storage.create(g.ask_key(1, "me", 0, 1), b"")  # v1 left the window of v6
    granter.answer(asks(storage), win(6))
    assert not storage.exists(g.grants_key("me"))
    for v in (5, 6):
        storage.create(g.ask_key(v, "me", 0 if v == 5 else 1, 1), b"")
    granter.answer(asks(storage), win(6))
    book.refresh()
    assert [(x.first_block, x.version) for x in book.grants] == [(0, 6)]  # the rest waits
    granter.answer(asks(storage), win(6))
    book.refresh()
    assert [(x.first_block, x.version) for x in book.grants] == [(0, 6), (1, 6)]


def test_an_ask_ahead_is_held_until_its_version_is_published_then_granted_under_it(tmp_path):
    storage, received, granter, book = setup("ahead", tmp_path)
    book.ask(6, 16)
    granter.answer(asks(storage), win(6))
    book.refresh()
    # At its quota of v6 the volunteer asks for v7, which is not published yet.
    book.ask(7, 16)
    assert book.asked_ahead(6) and not book.awaited(version=6)
    assert "rollouts/v000007/me/ask-0000000002-002" in asks(storage)
    for _ in range(3):  # polls while v6 is the newest: held, nothing granted
        granter.answer(asks(storage), win(6))
    book.refresh()
    assert [(x.first_block, x.version) for x in book.grants] == [(0, 6)]
    assert book.asked_ahead(6)
    granter.answer(asks(storage), win(7))  # the first poll after v7 is published
    book.refresh()
    assert [(x.first_block, x.version) for x in book.grants] == [(0, 6), (2, 7)]
    assert not book.asked_ahead(6) and received.granted_end("me") == 32
    # An ask two versions ahead is no ask ahead: refused as any version not published.
    storage.create(g.ask_key(9, "me", 4, 1), b"")
    granter.answer(asks(storage), win(7))
    granter.answer(asks(storage), win(9))
    book.refresh()
    assert [(x.first_block, x.version) for x in book.grants] == [(0, 6), (2, 7)]


def test_an_ask_ahead_does_not_hold_back_an_ask_for_the_version_in_hand(tmp_path):
    storage, _, granter, book = setup("ahead-in-hand", tmp_path)
    book.ask(7, 16, now=100.0)  # ahead of v6, the newest
    assert book.awaited(100.0) and book.awaited(100.0, version=7)
    assert not book.awaited(100.0, version=6) and book.asked_ahead(6, 100.0)
    # The quota's wait ran out with no v7: the volunteer asks for more of v6 at once.
    book.ask(6, 16, now=101.0)
    assert "rollouts/v000006/me/ask-0000000000-002" in asks(storage)
    assert book.awaited(101.0, version=6) and not book.asked_ahead(6, 101.0)
    book.ask(7, 16, now=102.0)  # and no second ask while that one is unanswered
    assert len(asks(storage)) == 2
    assert not book.awaited(101.0 + 20.0)  # ASK_AGAIN_SECONDS


def test_a_restarted_trainer_never_grants_a_block_again(tmp_path):
    storage, received, granter, book = setup("restart", tmp_path)
    book.ask(3, 16)
    granter.answer(asks(storage), win(3))
    again = Granter(storage, RUN, KEY, Received(), log=lambda m: None)  # restarted: reads back
    storage.create(g.ask_key(4, "me", 0, 2), b"")  # an ask for blocks it already has
    again.answer(asks(storage), win(4))
    book.refresh()
    assert [(x.first_block, x.version) for x in book.grants] == [(0, 3)]
    storage.create(g.ask_key(4, "me", 2, 1), b"")
    again.answer(asks(storage), win(4))
    book.refresh()
    assert [(x.first_block, x.version) for x in book.grants] == [(0, 3), (2, 4)]
    # A lost or foreign grant object: never below the numbers received from it.
    storage.write(g.grants_key("me"), g.grants_bytes(
        sign(g.encode_grants(RUN, "me", []), Ed25519PrivateKey.generate())))
    lost = Received()
    lost.add("me", "rollouts/v000004/me/s.jsonl.gz", 4, [40])
    third = Granter(storage, RUN, KEY, lost, log=lambda m: None)
    storage.create(g.ask_key(4, "me", 0, 1), b"")
    third.answer(asks(storage), win(4))
    _, grants = g.decode_grants(storage.read(g.grants_key("me")), "x")
    assert grants[-1].first_block == 6  # numbers 48.. : above number 40 received


def test_a_volunteer_goes_on_where_it_stopped_and_after_the_last_grant_if_it_lost_its_file(tmp_path):
    storage, _, granter, book = setup("resume", tmp_path)
    book.ask(2, 16)
    granter.answer(asks(storage), win(2))
    book.refresh()
    book.sampled(book.batch(8))
    again = GroupNumbers(book.path, storage, "me", Trust(public_key_text(KEY)), log=lambda m: None)
    again.start_run(RUN)
    assert again.batch(100).first == 8  # a restart samples the rest of the grant
    book.path.unlink()
    lost = GroupNumbers(book.path, storage, "me", Trust(public_key_text(KEY)), log=lambda m: None)
    lost.start_run(RUN)
    assert lost.next == 16 and lost.batch(100) is None  # its unsampled grant goes missing, once
    other = GroupNumbers(tmp_path / "b" / "n.json", storage, "me", Trust(public_key_text(KEY)),
                         log=lambda m: None)
    other.start_run("run-other")  # another run: its numbers start at 0
    assert other.next == 0


def test_grant_objects_that_are_not_the_trainers_are_refused(tmp_path):
    storage, _, _, book = setup("hostile", tmp_path)
    where = g.grants_key("me")
    forged = g.make_grant(b"guess", RUN, "me", 0, 2, 1)
    storage.write(where, g.grants_bytes(sign(g.encode_grants(RUN, "me", [forged]),
                                             Ed25519PrivateKey.generate())))
    assert not book.refresh() and book.grants == []  # signed by another key
    for junk in (b"[" * 100_000, b"{}", b'{"schema": 9, "grants": [{"first_block": -1}]}',
                 g.grants_bytes({**g.encode_grants(RUN, "me", [forged]), "grants": [
                     {"first_block": 0, "blocks": 2, "version": 1, "nonces": ["x"]}]})):
        storage.write(where, junk)
        assert not book.refresh() and book.grants == []
    with pytest.raises(g.GrantError):  # overlapping grants
        g.decode_grants(g.grants_bytes(g.encode_grants(RUN, "me", [forged, forged])), where)
    for key in ("rollouts/v000001/me/ask-1-1", "rollouts/v000001/me/ask-0000000000-000",
                "rollouts/v000001/me/ask-0000000000-001.json", "rollouts/v000001/ask-0000000000-001",
                "rollouts/v000001/../ask-0000000000-001"):
        assert g.parse_ask_key(key) is None


def test_a_number_draws_another_prompt_under_another_version_or_nonce():
    """What binds a number to its grant's version: its prompt (and noise) is keyed by the
    nonce of that version, which only the trainer can compute."""
    secret, pool = g.grant_secret(KEY), list(range(256))
    drawn = {v: [pool_prompt(pool, RUN, v, "me", n, g.seq_nonce(secret, RUN, "me", v, n))
                 for n in range(64)] for v in (5, 6)}
    assert sum(a == b for a, b in zip(drawn[5], drawn[6])) < 5
    guessed = [pool_prompt(pool, RUN, 5, "me", n, "0" * 32) for n in range(64)]
    assert sum(a == b for a, b in zip(drawn[5], guessed)) < 5
