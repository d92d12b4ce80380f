"""How the trainer starts: on an empty bucket a fresh run (the initial policy, built and warm
started or loaded, published as v0 with its evaluation and metrics); else a resumed one (the
manifest's weights, the learner's saved state, the window's committed versions, ledger and
prompt pools, the volunteers' credit as of the manifest's version, and the manifest copy a
crash left missing written back).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Callable

import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import VrlError
from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.model.lora import load_adapter_unmerged
from volunteer_rl.model.policy import Policy, load_policy
from volunteer_rl.model.tiny import build_tiny_model, build_tokenizer
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.credit import Credit, CreditError, read_credit, rebuild_credit
from volunteer_rl.protocol.ledger import Ledger, rebuild
from volunteer_rl.protocol.manifest import MAX_MANIFEST_BYTES, Manifest
from volunteer_rl.stopping import StopSignal
from volunteer_rl.storage.base import AlreadyExists, Storage, StorageError
from volunteer_rl.task.base import Row, Task
from volunteer_rl.task.dataset import file_sha256
from volunteer_rl.trainer.groups import Window
from volunteer_rl.trainer.preflight import TrainerError
from volunteer_rl.trainer.publish import LoraBase, sampling_of, upload_dataset
from volunteer_rl.trainer.publisher import Publisher
from volunteer_rl.trainer.warmstart import summary, torch_threads, trainer_split, warm_start
from volunteer_rl.trainer.withheld import GroupNumbers


def initial_policy(cfg: TrainerConfig, task: Task, rows: list[Row], device: torch.device,
                   log: Callable[[str], None]) -> Policy:
    """`tiny`: build tokenizer + model offline from the task's prompts and reference answers,
    and warm-start them on those. Else: load the folder."""
    if cfg.model != "tiny":
        return load_policy(cfg.model, device)
    questions = [task.prompt(r) for r in rows]
    answers = [task.reference(r) for r in rows]
    if not all(isinstance(a, str) and a for a in answers):
        raise TrainerError(f"--model tiny: task {task.name!r} gives no reference answer for "
                           "every row, which the tiny model's tokenizer and warm start need; "
                           "give a model folder")
    tokenizer = build_tokenizer(questions + answers)
    model = build_tiny_model(tokenizer, seed=cfg.seed).to(device)
    policy = Policy(model, tokenizer, "plain", device)
    n = sum(p.numel() for p in model.parameters())
    log(f"built tiny model: {n:,} parameters, vocab {len(tokenizer)}")
    if cfg.warm_start_steps > 0:
        split = trainer_split(cfg, len(rows))  # split.rl: the rows the Trainer's picker draws
        with torch_threads(cfg.warm_start_threads):  # then back to --threads for RL
            done = warm_start(policy, [questions[i] for i in split.warm],
                              [answers[i] for i in split.warm], cfg.warm_start_steps,
                              seed=cfg.seed, log=log, instruction=task.instruction)
        log(summary(split, done))
    return policy


def start_fresh(p: Publisher, stop: StopSignal, task: Task, problems: list[Row],
                train_path: Path, device: torch.device) -> None:
    """A new run: the initial policy, the dataset uploaded, v0 published and evaluated, and
    its metrics. Once the upload begins a stop signal waits until v0 is out whole."""
    cfg = p.cfg
    torch.manual_seed(cfg.seed)
    p.learner.take(initial_policy(cfg, task, problems, device, p.log))
    p.run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    with stop.shielded():  # from here on v0 goes out whole, metrics included
        p.dataset = upload_dataset(p.storage, train_path)
        p.ledger, p.credit = Ledger(), Credit()
        p.commit(0, 0)
        p.held.keep(0)
        p.pools = {0: p.manifest.prompt_pool}
        p.log(f"published v0 of {p.run_id} to {p.storage.uri}")
        p.published = {0}
        p.records.evaluate_unless_stopping(0, full=True)
        p.records.flush(0, p.run_id)


def resume(p: Publisher, stop: StopSignal, task: Task, train_path: Path, manifest: Manifest,
           etag: str | None, device: torch.device) -> None:
    """Weights from the manifest's checkpoint; optimizer, step and counts from the state
    saved for that version; the ledger from the committed ledger objects of the window."""
    cfg = p.cfg
    if manifest.task.name != task.name:
        raise TrainerError(f"manifest.json: the run trains task {manifest.task.name!r}; "
                           f"resume it with --task {manifest.task.name}")
    if manifest.sampling != sampling_of(cfg):  # groups of the window's versions were sampled with it
        s = manifest.sampling
        raise TrainerError(f"manifest.json: the run samples with -k {s.k} --temperature "
                           f"{s.temperature:g} --max-new-tokens {s.max_new_tokens}; resume it "
                           f"with those (the groups sampled under them would be refused)")
    if manifest.dataset.sha256 != file_sha256(train_path):
        raise TrainerError(f"manifest.json: dataset {manifest.dataset.key} differs from "
                           f"{train_path}; resume with the same --dataset")
    check_lora(cfg, manifest)
    folder = fetch_checkpoint(p.storage, manifest, Path(cfg.work_dir) / "resume",
                              require_model=True)
    p.learner.take(load_policy(folder, device))  # a LoRA version: its base, wrapped afresh
    p.run_id, p.dataset, p.manifest = manifest.run_id, manifest.dataset, manifest
    p.etag = etag
    with stop.shielded():
        repair_history(p.storage, manifest)
    win = Window(manifest.version, cfg.max_staleness, set())
    p.published = committed(p.storage, win)
    p.ledger = rebuild(p.storage, sorted(p.published))
    p.ledger.prune(win.low)
    restore_credit(p, manifest.version)
    meta = p.learner.load(manifest.version, p.run_id, p.log)
    if p.learner.lora is not None:
        p.lora_base = LoraBase.of(manifest)  # a version published whole becomes the base
        if manifest.adapter is not None and not p.learner.adapters_restored:
            # no fp32 adapters saved: the published ones
            load_adapter_unmerged(p.storage, manifest, p.learner.policy.model)
    if meta is not None:
        p.fleet.load_counts(meta.get("volunteers", {}))
        try:
            p.numbers.by = GroupNumbers.from_json(meta.get("group_numbers", {})).by
        except ValueError as exc:
            p.log(f"warning: {exc}: group numbers start afresh")
    p.held.keep(manifest.version)
    recover_pools(p, manifest)
    p.log(f"resuming {p.run_id} at v{manifest.version} (step {p.learner.steps})")


def restore_credit(p: Publisher, version: int) -> None:
    """The credit as of `version`, the one resumed: its credit object (never a newer one, which
    a crash before its commit left). A run from before credit objects, or one whose object is
    not one this trainer writes: summed once from the ledgers of every committed version up
    to it, and said so."""
    try:
        credit, why = read_credit(p.storage, version), "none was written"
    except CreditError as exc:
        credit, why = None, str(exc)
    if credit is None:
        versions = sorted({v for top, v in filter(None, map(layout.split_versioned_key,
                                                             p.storage.list(layout.MANIFESTS)))
                           if top == layout.MANIFESTS and v <= version} | {version})
        p.log(f"{layout.credit_key(version)}: {why}; credit summed from the ledgers of "
              f"{len(versions)} committed versions")
        credit = rebuild_credit(p.storage, versions)
        credit.version = version
    p.credit = credit


def check_lora(cfg: TrainerConfig, manifest: Manifest) -> None:
    """A run whose versions are adapters resumes with the same --lora-rank, --lora-alpha and
    --lora-targets (other adapters would not fit its base, and without them its adapters are
    lost). A version published whole may be resumed either way: with --lora-rank it becomes
    the base of the adapters trained from there."""
    a = manifest.adapter
    if a is not None and (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) != (a.rank, a.alpha, a.targets):
        raise TrainerError(f"manifest.json: the run trains LoRA adapters on v{a.base}; resume it "
                           f"with --lora-rank {a.rank} --lora-alpha {a.alpha:g} "
                           f"--lora-targets {a.targets}")


def recover_pools(p: Publisher, manifest: Manifest) -> None:
    """After a resume: the prompt pools of the window's versions, from their manifest
    copies (written by this trainer). A version whose copy cannot be read is dropped from
    the window: its groups are refused as of an unpublished version."""
    p.pools = {manifest.version: manifest.prompt_pool}
    for version in sorted(p.published - {manifest.version}):
        try:
            m = Manifest.from_json(p.storage.read(layout.manifest_history_key(version),
                                                  max_bytes=MAX_MANIFEST_BYTES))
            p.pools[version] = m.prompt_pool
        except (VrlError, StorageError) as exc:
            p.log(f"warning: v{version}'s prompt pool: {exc}; its groups are refused")
            p.published.discard(version)


def repair_history(storage: Storage, manifest: Manifest) -> None:
    """A crash between manifest.json and its manifests/ copy leaves the copy missing:
    write it as write_manifest would have, with manifest.json's bytes, signature included
    (an unsigned copy is refused by `vrl eval --version`, `vrl gc` and the window's
    recovery). Those bytes must still hold the manifest resumed from."""
    key = layout.manifest_history_key(manifest.version)
    if storage.exists(key):
        return  # the usual case: the copy is there
    data = storage.read(layout.MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
    if Manifest.from_json(data) != manifest:
        raise TrainerError(f"{layout.MANIFEST}: changed while this trainer resumed from it; "
                           "is a second trainer running on this bucket?")
    try:
        storage.create(key, data)
    except AlreadyExists:
        pass


def committed(storage: Storage, win: Window) -> set[int]:
    """Versions of the window that were committed (have their manifest copy)."""
    return {v for v in win.versions()
            if v == win.version or storage.exists(layout.manifest_history_key(v))}
