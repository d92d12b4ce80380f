"""What copies of the weights a trainer holds besides its fp32 master and optimizer (issue 27:
it held the published weights twice). bf16 with audits: the audit model is also the model
evals use (published_policy), loaded back with the current version after an audit used it
for another; without audits, only the current version's published tensors are kept, and
with fp32 weights none."""
from __future__ import annotations

import torch

from helpers.trainers import started_trainer


def moved_on(t) -> None:
    """Change the master (as a step would) and publish it as the next version."""
    with torch.no_grad():
        for p in t.policy.model.parameters():
            p.add_(0.01)
    t.publish_next()


def rounded(t) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16).float() for k, v in t.policy.model.state_dict().items()}


def test_bf16_with_audits_evaluates_on_the_audit_model_loaded_back_with_the_current_version(
        template, tmp_path):
    t = started_trainer(tmp_path, weights_dtype="bf16", model=str(template.model(tmp_path / "m")))
    assert t.cfg.audit_tolerance > 0
    moved_on(t)
    assert t.version == 1 and set(t.window_weights.versions) == {0, 1}
    assert t.window_weights.load_into(0, t.audit_policy.model)  # as an audit of a v0 shard does
    published = t.published_policy
    assert published is t.audit_policy  # one upcast model, not two
    for k, v in published.model.state_dict().items():
        assert torch.equal(v, rounded(t)[k]), k


def test_without_audits_only_the_current_version_is_kept(template, tmp_path):
    model = str(template.model(tmp_path / "m"))  # the template's: no tokenizer to train
    (tmp_path / "bf16").mkdir(), (tmp_path / "fp32").mkdir()
    t = started_trainer(tmp_path / "bf16", weights_dtype="bf16", audit_tolerance=0.0, model=model)
    moved_on(t)
    moved_on(t)
    assert t.audit_policy is None and set(t.window_weights.versions) == {2}
    for k, v in t.published_policy.model.state_dict().items():
        assert torch.equal(v, rounded(t)[k]), k

    t = started_trainer(tmp_path / "fp32", audit_tolerance=0.0, model=model)
    moved_on(t)
    assert t.window_weights.versions == {} and t.published_policy is t.policy
