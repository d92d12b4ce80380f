"""A volunteer its owner's host controls paused (volunteer.host): its heartbeat's `paused`
makes it `paused` in `vrl status` (table and --json) and on the dashboard, with the reason,
escaped; anything but a string there is not a pause."""
from __future__ import annotations

from rich.console import Console

from helpers.status_fixtures import NOW, beat, manifest
from volunteer_rl.observe.dashboard import index_html
from volunteer_rl.observe.status import build_status, render

BUSY = "the rest of the machine uses 93% of the CPU, over --pause-when-busy 0.5"


def test_a_paused_heartbeat_shows_as_paused_with_its_reason():
    doc = build_status("/b", manifest(), {"a": beat(), "p": beat(completions_per_minute=120.0, paused=BUSY)},
                       {}, [], [], NOW)
    a, p = doc["volunteers"]
    assert (a["state"], a["paused"]) == ("producing", None)
    assert (p["state"], p["paused"]) == ("paused", BUSY)
    assert doc["counts"]["paused"] == 1
    console = Console(record=True, width=160)
    console.print(render(doc))
    row = next(line for line in console.export_text().splitlines() if line.startswith("p "))
    assert " paused " in row
    assert f"paused: {BUSY}" in index_html(doc, NOW)


def test_a_paused_that_is_no_string_is_no_pause_and_text_is_escaped():
    doc = build_status("/b", manifest(), {"a": beat(paused=["x"]), "b": beat(paused="<b>\x1b[31m" + "w" * 500)},
                       {}, [], [], NOW)
    a, b = doc["volunteers"]
    assert a["state"] == "producing" and a["paused"] is None
    assert b["state"] == "paused" and "\x1b" not in b["paused"] and len(b["paused"]) < 200
    page = index_html(doc, NOW)
    assert "&lt;b&gt;" in page and "<b>\x1b" not in page
