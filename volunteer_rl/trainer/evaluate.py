"""Held-out accuracy of a policy: greedy, and at the sampling temperature (what RL optimizes)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.hashing import CheckpointError
from volunteer_rl.model.lora import load_adapter
from volunteer_rl.model.policy import Policy, encode_prompts, load_policy
from volunteer_rl.model.sampling import sample
from volunteer_rl.progress import progress
from volunteer_rl.protocol import layout, metrics
from volunteer_rl.protocol.manifest import Manifest, ManifestError, read_manifest
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage.base import StorageError, is_missing
from volunteer_rl.task.base import Row, Task, completion_text
from volunteer_rl.task.dataset import load_rows
from volunteer_rl.task.registry import TaskError, for_manifest


EVAL_BATCH = 256
"""Completions sampled in one batched call (sampling.sample's batch_size): the evaluation
goes chunk by chunk, each one call, so its progress can be shown between calls."""


def is_correct(task: Task, row: Row, token_ids: list[int], policy: Policy) -> bool:
    """Whether a sampled completion solves `row`: vrl's rule on the tokens (it ends at its
    first EOS, no other special token: task.base.completion_text), then the task's `correct`
    on the text (a task that raises counts it wrong)."""
    text = completion_text(token_ids, policy.decode_all, policy.eos_id, policy.special_ids)
    try:
        return text is not None and bool(task.correct(text, row))
    except Exception:
        return False


def accuracy(policy: Policy, task: Task, problems: list[Row], temperature: float,
             samples: int = 1, max_new_tokens: int = 32,
             advance: Callable[[int], None] = lambda n: None) -> float:
    """Share of completions over `problems`, `samples` each (1 is enough for greedy), that
    solve their row (is_correct): a completion that runs out of tokens before EOS is wrong.
    The completions are the trainer's own, so the task runs here, without the intake's
    bounds. `advance(n)` is told of each n completions made.

    The prompts go in length order, EVAL_BATCH // K of them a call: the batches sample()
    would make of them all in one call, so the figures are the same."""
    if not problems:
        raise ValueError("no problems to evaluate on")
    k = 1 if temperature <= 0 else samples
    prompts = encode_prompts(policy, [task.prompt(p) for p in problems], task.instruction)
    order = sorted(range(len(problems)), key=lambda i: len(prompts[i]))
    per_call = max(1, EVAL_BATCH // k)
    was_training = policy.model.training
    policy.model.eval()
    total = 0.0
    try:
        for start in range(0, len(order), per_call):
            chunk = order[start:start + per_call]
            groups = sample(policy, [prompts[i] for i in chunk], k, temperature, max_new_tokens,
                            batch_size=EVAL_BATCH)
            total += sum(is_correct(task, problems[i], s.token_ids, policy)
                         for i, g in zip(chunk, groups) for s in g)
            advance(len(chunk) * k)
    finally:
        policy.model.train(was_training)
    return total / (len(problems) * k)


def greedy_and_sampled(policy: Policy, task: Task, problems: list[Row], temperature: float,
                       samples: int = 4, max_new_tokens: int = 32, *,
                       log: Callable[[str], None] | None = None,
                       label: str = "eval") -> dict[str, float]:
    """Both accuracies under the metric names the trainer logs. Its progress (progress.py):
    a bar on a terminal, else a line per STATUS_SECONDS through `log` (none without it)."""
    with progress(label, len(problems) * (1 + samples), log=log, unit="completions") as advance:
        return {
            metrics.ACCURACY_GREEDY: accuracy(policy, task, problems, 0.0, 1, max_new_tokens,
                                              advance),
            metrics.ACCURACY_SAMPLED: accuracy(policy, task, problems, temperature, samples,
                                               max_new_tokens, advance),
        }


def held_out(manifest: Manifest, dataset: str | Path | None) -> tuple[Task, list[Row]]:
    """The task `manifest` names (installed here: task.registry.for_manifest) and the rows of
    `dataset`, else of the task's own held-out file."""
    task, _ = for_manifest(manifest.task)
    if dataset is None:
        own = task.data()
        if own is None:
            raise TaskError(f"task {task.name!r} ships no held-out data: give --dataset")
        dataset = own[1]
    return task, load_rows(dataset, task)


def read_version(storage, version: int | None, *, trust: Trust) -> Manifest:
    """The signed manifest of a published version (the current one if None), checked with
    `trust`; ManifestError naming it if there is none."""
    m = read_manifest(storage, version, trust=trust)
    if m is None:
        what = layout.MANIFEST if version is None else layout.manifest_history_key(version)
        raise ManifestError(f"{what}: not found in {storage.uri} (nothing published there?)")
    return m


def load_version(storage, version: int | None, work_dir: Path, device="cpu", *,
                 trust: Trust) -> tuple[Manifest, Policy]:
    """Fetch a published version (the current one if None), check its manifest's signature
    with `trust`, check what its checkpoint holds before downloading it and verify its files
    against the signed sha256s (fetch_checkpoint), load it (load_policy), and add a LoRA
    version's adapter (lora.load_adapter)."""
    m = read_version(storage, version, trust=trust)
    try:
        folder = fetch_checkpoint(storage, m, Path(work_dir) / layout.version_dir(m.version),
                                  require_model=True)
    except StorageError as exc:
        if version is None or not is_missing(exc):
            raise
        raise CheckpointError(
            f"{m.checkpoint}: removed by retention (`vrl gc` or `vrl trainer --gc-every`); "
            f"{layout.manifest_history_key(version)} is kept as history, the weights are not") from None
    policy = load_policy(folder, device)
    load_adapter(storage, m, policy.model)  # a LoRA version: its base's weights + its adapter
    return m, policy
