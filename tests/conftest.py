"""Shared fixtures: a published run to start trainers from, and real rollouts of its policy."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from volunteer_rl.protocol import layout

TEMPLATE_VERSION = 2
PICKED = ("--missing-bound", "1")
"""Trainer flags for a test that uploads the template's groups: `Template.groups` are the
numbers whose group has reward variance, not every number a volunteer used, so the gaps
between them would hold its groups back as withheld (trainer.withheld) if it were priced."""
GROUPS_WANTED = 32
"""Groups with reward variance that Template.groups makes per volunteer and version: more
than any test takes (24 at most)."""
CHUNK = 100
MAX_NUMBERS = 400
"""Group numbers Template.groups samples at most per volunteer and version."""

# Hypothesis's own files go to the system's temp folder, not into the repository.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "volunteer_rl-hypothesis"))

# A command run without --work-dir keeps its state in the per-user state folder
# (config.user_state_dir, $XDG_STATE_HOME first on every platform): here one of this test
# process's own, inherited by every `vrl` it starts, so no test writes into the real home.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="volunteer_rl-state-")
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], True)


@contextmanager
def one_thread():
    """torch on one thread while the template is built and its groups are sampled. With
    torch's default of one thread per core, 50 of the template's warm-start steps took 187 s
    instead of 30 s on this 2-core machine while other processes were busy on it (the suite
    must pass beside a running demo); the thread count is restored for the tests after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class Template:
    bucket: Path
    """A folder bucket at v2 (v0 warm-started; v1 and v2 republish the same weights)."""
    policy: object
    """The published weights (v0, v1 and v2 are the same), to sample honest groups with."""
    run_id: str
    eval_csv: Path
    """A 10-row held-out CSV, so a trainer's final eval takes a moment."""
    key: Path
    """The signing key that signed its manifests: trainers resuming it need --signing-key."""
    problems: list
    """Every row of the train dataset (task.base.Row), indexed by prompt id."""
    pools: dict = field(default_factory=dict)
    """Version -> the prompt pool its manifest published."""
    made: dict = field(default_factory=dict)

    @property
    def secret(self) -> bytes:
        """The grant secret of trainers signing with the template's key (protocol.grants): the
        nonces its groups are drawn with, as if that trainer had granted their numbers."""
        from helpers.honest_groups import key_secret
        return key_secret(self.key)

    def copy(self, dest: Path) -> Path:
        shutil.copytree(self.bucket, dest)
        return dest

    def model(self, dest: Path) -> Path:
        """v0's checkpoint (the warm-started tiny model) copied to `dest` as a `--model` folder.
        A live run started from it skips the trainer's own warm start (300-800 steps in the
        live tests, at about 0.2 s a step on one thread of this 2-core machine); the tiny
        warm start itself is the template fixture's (in-process, once a test run), and
        test_trainer_signals starts one through `vrl trainer`."""
        shutil.copytree(self.bucket / layout.checkpoint_prefix(0), dest)
        return dest

    def groups(self, volunteer: str, version: int = TEMPLATE_VERSION) -> list:
        """shards.Group objects `volunteer` would make with the template's weights labelled
        `version`, each with reward variance: numbers 0, 1, 2, ..., each sampled for the prompt
        it draws from `version`'s pool with its committed draws (the numbers whose group has
        one reward for all K are left out), so they pass a replay audit as that volunteer's and
        no other's. At least 24 of them, in number order; the first GROUPS_WANTED or a few
        more, as the numbers are sampled CHUNK at a time."""
        return [g for g in self.every_group(volunteer, version) if len({c.reward for c in g.completions}) > 1]

    def every_group(self, volunteer: str, version: int = TEMPLATE_VERSION) -> list:
        """Every number `volunteer` sampled for `groups`, 0, 1, 2, ... without a gap, those
        with one reward for all K included: what an honest volunteer uploads."""
        if (volunteer, version) not in self.made:
            with one_thread():
                self.made[volunteer, version] = honest_groups(self, volunteer, version)
        return self.made[volunteer, version]


def honest_groups(t: Template, volunteer: str, version: int) -> list:
    from volunteer_rl.model.policy import encode_prompts
    from volunteer_rl.model.sampling import sample
    from helpers.honest_groups import nonce
    from volunteer_rl.protocol.draws import group_keys, pool_prompt
    from volunteer_rl.protocol.shards import Completion, Group
    from volunteer_rl.task.base import completion_reward
    from volunteer_rl.task.calculator_task import CalculatorTask

    k, temperature, max_new = 8, 1.0, 32  # the trainer's defaults, which the template publishes
    policy, task, secret = t.policy, CalculatorTask(), t.secret
    groups = []
    # The numbers in chunks, until GROUPS_WANTED groups have reward variance: about one in six
    # gives one, so this samples some 200 numbers, at some 10 s per 400 on a busy 2-core
    # machine, for each volunteer name the tests ask for.
    for start in range(0, MAX_NUMBERS, CHUNK):
        nonces = [nonce(secret, t.run_id, volunteer, version, n) for n in range(start, start + CHUNK)]
        chunk = [t.problems[pool_prompt(t.pools[version], t.run_id, version, volunteer, n, x)]
                 for n, x in zip(range(start, start + CHUNK), nonces)]
        keys = [group_keys(t.run_id, version, volunteer, start + j, p.id, k, nonces[j])
                for j, p in enumerate(chunk)]
        out = sample(policy, encode_prompts(policy, [task.prompt(p) for p in chunk]), k, temperature,
                     max_new, draw_keys=keys)
        for j, (p, samples) in enumerate(zip(chunk, out)):
            rewards = [completion_reward(task, p, x.token_ids, policy.decode_all,
                                         policy.eos_id, policy.special_ids) for x in samples]
            groups.append(Group(p.id, version, volunteer, start + j, [
                Completion(x.token_ids, x.logprobs, x.text, r) for x, r in zip(samples, rewards)]))
        varied = sum(1 for g in groups if len({c.reward for c in g.completions}) > 1)
        if varied >= GROUPS_WANTED:
            break
    assert varied >= 24, f"only {varied} groups with reward variance"
    return groups


def build_template(root: Path) -> list:
    """A trainer publishes v0 after a short warm start, then v1 and v2 with no step in
    between, into `root`/bucket, signed with `root`/signing-key.pem (in-process with the
    library: set-up, not the thing under test). Returns the trainer's rows, to check what
    `read_template` reads back against."""
    from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
    from volunteer_rl.trainer.loop import Trainer

    root.mkdir(parents=True)
    eval_csv = root / "eval10.csv"
    eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:11]))
    cfg = TrainerConfig(bucket=str(root / "bucket"), warm_start_steps=500, eval_every=0,
                        eval_dataset=str(eval_csv), work_dir=str(root / "work"),
                        signing_key=str(root / "signing-key.pem"),
                        dashboard_every=0)  # no dashboard/: tests see only what their trainer writes
    trainer = Trainer(cfg, log=lambda m: None)
    with one_thread():
        trainer.start()
        for _ in range(TEMPLATE_VERSION):
            trainer.publish_next()
    assert trainer.version == TEMPLATE_VERSION
    shutil.rmtree(root / "work")  # trainers under test start without this one's saved state
    assert (root / "bucket" / layout.manifest_history_key(TEMPLATE_VERSION)).exists()
    return trainer.problems


def read_template(root: Path) -> Template:
    """The template `build_template` left in `root`, as a volunteer would take it: the policy
    loaded from v0's checkpoint (v1 and v2 republish its weights), the rows from the
    dataset the manifests name, each version's prompt pool from its manifest."""
    import json

    from volunteer_rl.model.policy import load_policy
    from volunteer_rl.task.calculator_task import CalculatorTask
    from volunteer_rl.task.dataset import load_rows

    bucket = root / "bucket"
    manifests = {v: json.loads((bucket / layout.manifest_history_key(v)).read_text())
                 for v in range(TEMPLATE_VERSION + 1)}
    last = manifests[TEMPLATE_VERSION]
    return Template(bucket, load_policy(bucket / layout.checkpoint_prefix(0)), last["run_id"],
                    root / "eval10.csv", root / "signing-key.pem",
                    load_rows(bucket / last["dataset"]["key"], CalculatorTask()),
                    {v: tuple(m["prompt_pool"]) for v, m in manifests.items()})


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> Template:
    """The template run (`build_template`), built once per test run: under pytest-xdist the
    first worker to ask builds it (80 s of warm start on one thread) in the folder the
    workers share, and the others wait for it and read it."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # pytest-N/, above each worker's popen-gwK/
    root = shared / "template"
    built = None
    with FileLock(str(shared / "template.lock")):
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)  # a build that died half way
            built = build_template(root)
            (root / "built").write_text("")
    t = read_template(root)
    assert built is None or t.problems == built  # what every worker reads back
    assert len(t.groups("tbd")) >= GROUPS_WANTED
    return t


BUILDS_THE_TEMPLATE = "tests/integration/test_loop_local.py"
"""The file run first: it needs the template (so its worker builds it at once) and is the
suite's longest, so the other worker has the template-free files meanwhile."""


def pytest_collection_modifyitems(config, items):
    """Order the files for pytest-xdist (with --no-loadscope-reorder, pyproject's addopts):
    BUILDS_THE_TEMPLATE first, then the integration files that need no template, then those
    that do, then the rest (unit, bench) in their own order, whose many short files even out
    the two workers' ends. The template is built once a run (`template`): ordered so, the
    worker not building it has other work meanwhile instead of waiting on the lock. Every
    worker collects the same order (xdist requires it)."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(path: str) -> int:
        if path == BUILDS_THE_TEMPLATE:
            return 0
        if path.startswith("tests/integration/"):
            return 2 if any("template" in i.fixturenames for i in files[path]) else 1
        return 3

    items[:] = [i for path in sorted(files, key=rank) for i in files[path]]  # a stable sort
