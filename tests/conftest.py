"""Shared fixtures: a published run to start trainers from, and real rollouts of its policy."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from volunteer_rl.protocol import layout

TEMPLATE_VERSION = 2


@dataclass
class Template:
    bucket: Path
    """A folder bucket at v2 (v0 warm-started; v1 and v2 republish the same weights)."""
    groups: list
    """shards.Group objects sampled from those weights, each with reward variance."""
    eval_csv: Path
    """A 10-row held-out CSV, so a trainer's final eval takes a moment."""
    key: Path
    """The signing key that signed its manifests: trainers resuming it need --signing-key."""

    def copy(self, dest: Path) -> Path:
        shutil.copytree(self.bucket, dest)
        return dest


@pytest.fixture(scope="session")
def template(tmp_path_factory) -> Template:
    """Built in-process with the library (set-up, not the thing under test): a trainer
    publishes v0 after a short warm start, then v1 and v2 with no step in between; the
    policy then samples real groups the way a volunteer does."""
    import torch

    from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
    from volunteer_rl.model.policy import encode_prompts
    from volunteer_rl.model.sampling import sample
    from volunteer_rl.protocol.shards import Completion, Group
    from volunteer_rl.task.reward import reward
    from volunteer_rl.trainer.loop import Trainer

    root = tmp_path_factory.mktemp("template")
    eval_csv = root / "eval10.csv"
    eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:11]))
    cfg = TrainerConfig(bucket=str(root / "bucket"), warm_start_steps=500, eval_every=0,
                        eval_dataset=str(eval_csv), work_dir=str(root / "work"),
                        signing_key=str(root / "signing-key.pem"),
                        dashboard_every=0)  # no dashboard/: tests see only what their trainer writes
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.start()
    for _ in range(TEMPLATE_VERSION):
        trainer.publish_next()
    assert trainer.version == TEMPLATE_VERSION
    torch.manual_seed(1)
    problems = trainer.problems[:400]
    out = sample(trainer.policy, encode_prompts(trainer.policy, [p.prompt for p in problems]),
                 cfg.k, cfg.temperature, cfg.max_new_tokens)
    groups = []
    for p, samples in zip(problems, out):
        rewards = [reward(x.text, p.expression) for x in samples]
        if max(rewards) != min(rewards):
            groups.append(Group(p.id, TEMPLATE_VERSION, "tbd", [
                Completion(x.token_ids, x.logprobs, x.text, r) for x, r in zip(samples, rewards)]))
    assert len(groups) >= 32, f"only {len(groups)} groups with reward variance"
    shutil.rmtree(root / "work")  # trainers under test start without this one's saved state
    assert (root / "bucket" / layout.manifest_history_key(TEMPLATE_VERSION)).exists()
    return Template(root / "bucket", groups, eval_csv, root / "signing-key.pem")
