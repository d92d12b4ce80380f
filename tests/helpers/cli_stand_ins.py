"""Stand-ins for the library behind `vrl trainer`, `vrl volunteer` and `vrl demo`, for
CliRunner tests of what the commands hand the library: the settings each builds, with neither
torch nor a run."""
from __future__ import annotations

import sys
import types

from volunteer_rl.stopping import StopSignal


def fake_module(monkeypatch, name: str, **attrs) -> None:
    """Put a stand-in for the module `name` where the command's deferred import finds it."""
    monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))


def stand_ins(monkeypatch) -> list:
    """The list that collects the settings objects the commands build: a Trainer that stops at
    v3, a Volunteer `vol-1` that uploads 7 groups, a run_demo that returns at once. The
    trainer's signal handlers and --threads stay out of the test process."""
    seen: list = []

    class Trainer:
        def __init__(self, cfg, log, stop, inputs=None):
            seen.append(cfg)
            self.manifest = types.SimpleNamespace(version=3)
            self.ranks = types.SimpleNamespace(is_writer=True)  # a single process

        def start(self):
            pass

        def run(self):
            return self.manifest

    class Volunteer:
        id = "vol-1"

        def __init__(self, cfg, log, stop):
            seen.append(cfg)

        def run(self):
            return 7

    fake_module(monkeypatch, "volunteer_rl.trainer.loop", Trainer=Trainer)
    fake_module(monkeypatch, "volunteer_rl.volunteer.loop", Volunteer=Volunteer)
    monkeypatch.setattr(StopSignal, "install", lambda self: self)
    monkeypatch.setattr("volunteer_rl.model.devices.set_process_threads", lambda n: None)
    monkeypatch.setattr("volunteer_rl_cli.demo.run_demo", seen.append)
    return seen
