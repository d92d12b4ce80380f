"""Held-out accuracy of a policy: greedy, and at the sampling temperature (what RL optimizes)."""

from __future__ import annotations

from pathlib import Path

from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.hashing import CheckpointError
from volunteer_rl.model.policy import Policy, encode_prompts, load_policy
from volunteer_rl.model.sampling import sample
from volunteer_rl.protocol import layout, metrics
from volunteer_rl.protocol.manifest import Manifest, ManifestError, read_manifest
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage.base import StorageError, is_missing
from volunteer_rl.task.dataset import Problem
from volunteer_rl.task.reward import completion_reward


def accuracy(policy: Policy, problems: list[Problem], temperature: float, samples: int = 1,
             max_new_tokens: int = 32) -> float:
    """Mean reward over `problems`, `samples` completions each (1 is enough for greedy), by
    the trainer's rule on the sampled tokens (`completion_reward`): a completion that runs
    out of tokens before EOS scores 0."""
    if not problems:
        raise ValueError("no problems to evaluate on")
    k = 1 if temperature <= 0 else samples
    was_training = policy.model.training
    policy.model.eval()
    try:
        groups = sample(policy, encode_prompts(policy, [p.prompt for p in problems]), k,
                        temperature, max_new_tokens)
    finally:
        policy.model.train(was_training)
    total = sum(completion_reward(s.token_ids, p.expression, policy.decode_all, policy.eos_id,
                                  policy.special_ids)
                for p, g in zip(problems, groups) for s in g)
    return total / (len(problems) * k)


def greedy_and_sampled(policy: Policy, problems: list[Problem], temperature: float,
                       samples: int = 4, max_new_tokens: int = 32) -> dict[str, float]:
    """Both accuracies under the metric names the trainer logs."""
    return {
        metrics.ACCURACY_GREEDY: accuracy(policy, problems, 0.0, 1, max_new_tokens),
        metrics.ACCURACY_SAMPLED: accuracy(policy, problems, temperature, samples, max_new_tokens),
    }


def load_version(storage, version: int | None, work_dir: Path, device="cpu", *,
                 trust: Trust) -> tuple[Manifest, Policy]:
    """Fetch a published version (the current one if None), check its manifest's signature
    with `trust`, check what its checkpoint holds before downloading it and verify its files
    against the signed sha256s (fetch_checkpoint), load it (load_policy)."""
    m = read_manifest(storage, version, trust=trust)
    if m is None:
        what = layout.MANIFEST if version is None else layout.manifest_history_key(version)
        raise ManifestError(f"{what}: not found in {storage.uri} (nothing published there?)")
    try:
        folder = fetch_checkpoint(storage, m, Path(work_dir) / layout.version_dir(m.version),
                                  require_model=True)
    except StorageError as exc:
        if version is None or not is_missing(exc):
            raise
        raise CheckpointError(
            f"{m.checkpoint}: removed by retention (`vrl gc` or `vrl trainer --gc-every`); "
            f"{layout.manifest_history_key(version)} is kept as history, the weights are not") from None
    return m, load_policy(folder, device)
