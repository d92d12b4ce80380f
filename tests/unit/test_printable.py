"""Volunteer-written strings on the operator's screen: escaped, cut, never markup."""
from __future__ import annotations

import pytest
from rich.console import Console

from helpers.status_fixtures import NOW, beat, manifest
from volunteer_rl.observe.status import build_status, render
from volunteer_rl.protocol.printable import markup_safe, printable

NASTY = [
    "\x1b]52;c;ZWNobyBvd25lZA==\x07",          # OSC 52: write the operator's clipboard
    "\x1b]8;;https://evil.example\x1b\\click\x1b]8;;\x1b\\",  # OSC 8 hyperlink
    "\x1b[2J\x1b[H", "\x9b31m",                  # clear screen; C1 CSI
    "[/]", "[bold red]x[/bold red]", "[link=file:///etc/passwd]x[/link]",
    "a\u202eb", "zero\u200bwidth", "\ud800", "\r\rover", "x" * 5000,
]


@pytest.mark.parametrize("text", NASTY)
def test_printable_leaves_no_control_character(text):
    out = printable(text)
    assert len(out) <= 200 + len("…(+99999)")
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 or c in "\u202e\u200b" for c in out)


def test_markup_safe_is_shown_literally():
    console = Console(record=True, width=200, force_terminal=True)
    from rich.text import Text

    console.print(Text.from_markup(f"id {markup_safe('[/][bold]x[/bold]')}"))
    assert "[/][bold]x[/bold]" in console.export_text()


@pytest.mark.parametrize("text", NASTY)
def test_status_table_renders_hostile_heartbeat_fields_literally(text):
    """`[/]` in a heartbeat's device field once crashed `vrl status`; escape sequences reached
    the terminal. Every volunteer-chosen string is shown escaped."""
    hb = beat(host={"device": text, "os": text}, state=text, run_id=text)
    doc = build_status("/b", manifest(), {"vol": hb}, {}, [], [], NOW)
    console = Console(record=True, width=200, force_terminal=True, color_system="truecolor")
    console.print(render(doc))
    shown = console.export_text(styles=False)
    assert "\x1b]" not in shown and "\x9b" not in shown and "\u202e" not in shown
    assert "vol" in shown


@pytest.mark.parametrize("text", NASTY)
def test_dashboard_rows_escape_hostile_fields(text):
    from volunteer_rl.observe.dashboard import fleet_rows_html

    hb = beat(host={"device": text})
    page = fleet_rows_html(build_status("/b", manifest(), {"vol": hb}, {}, [], [], NOW))
    assert "<td>vol</td>" in page
    assert not any(ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0 for c in page.replace("\n", ""))
    assert "<script" not in page
