"""The learner: the policy the trainer trains (its master weights), AdamW over it, the count
of optimizer steps, and the state that carries them across publishes: saved to --work-dir
before each manifest, loaded back on a resume (state.py is the format on disk).

Under torchrun the policy, its gradients and AdamW's moments are sharded over the ranks
(FSDP2, trainer.ranks): every rank's learner takes its shard of the writer's weights, and the
ranks load the resumed version's moments together.

With --lora-rank the policy is its model wrapped with LoRA adapters (model.lora): the base
frozen, rounded to the published dtype (what volunteers load), and only the adapters have
gradients, AdamW moments and an fp32 master saved in the state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.model.lora import (
    LoraSpec,
    add_adapters,
    adapter_tensors,
    round_frozen,
    set_adapter_tensors,
    trainable,
)
from volunteer_rl.model.policy import Policy
from volunteer_rl.model.recompute import enable_recompute
from volunteer_rl.model.weights import WEIGHTS_DTYPES, load_weights
from volunteer_rl.trainer.groups import ScoredGroup
from volunteer_rl.trainer.ranks import (
    Ranks,
    load_full_optimizer_state,
    scatter_full_weights,
    shard_model,
)
from volunteer_rl.trainer.state import (
    has_sharded_optimizer,
    load_sharded_optimizer,
    adapter_master,
    load_state,
    master_weights,
    named_optimizer_state,
    prune_states,
    save_sharded_optimizer,
    save_state,
)
from volunteer_rl.trainer.step import StepReplay, StepResult, train_step


class Learner:
    """The policy trained, its optimizer and step count, saved and loaded with its state."""

    def __init__(self, cfg: TrainerConfig, ranks: Ranks):
        self.cfg, self.ranks = cfg, ranks
        self.policy: Policy | None = None  # built or loaded by trainer.startup
        self.opt: torch.optim.Optimizer | None = None
        self.steps = 0  # optimizer steps of the whole run, restored on resume
        self.sharded = False  # the policy sharded over the ranks (shard_and_load)
        # Ranks share it: each writes its optimizer shards into a version's folder (state.py).
        self.state_root = Path(cfg.work_dir) / "state"
        # How the ranks get the resumed version's moments: "sharded" (saved by ranks, loaded by
        # all together), "whole" (saved by one process, broadcast from the writer), or None.
        self.moments: str | None = None
        self.adapters_restored = False  # --lora-rank: load() found the fp32 adapters saved

    @property
    def lean(self) -> bool:
        """Whether this rank holds no whole copy of the weights between publishes
        (docs/SCALE.md, memory): sharded, fp32 weights (the published file is the weights
        themselves, no master to keep) and audits off (no replay needs a version's weights
        mid-intake). The writer publishes each tensor as it gathers it, its second model is a
        skeleton bound to the weights only while it evaluates or finds a refused step's
        culprits, and the last weights file, a patch's base, waits on disk; a follower builds
        its model empty (no weights read from the checkpoint) before it takes its shards."""
        return (self.ranks.joined and self.cfg.weights_dtype == "fp32"
                and self.cfg.audit_tolerance <= 0)

    @property
    def lora(self) -> LoraSpec | None:
        """The adapters trained (--lora-rank), or None: every weight is."""
        cfg = self.cfg
        return LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) if cfg.lora_rank else None

    def take(self, policy: Policy) -> None:
        """Train `policy` from here on, with a fresh optimizer; with --lora-rank its model is
        wrapped with fresh adapters first (B zero: the policy is unchanged)."""
        if self.lora is not None:
            model = add_adapters(policy.model, self.lora)
            round_frozen(model, WEIGHTS_DTYPES[self.cfg.weights_dtype])
            policy = Policy(model, policy.tokenizer, policy.prompt_format, policy.device)
        self.hold(policy)
        self.make_optimizer()

    def hold(self, policy: Policy) -> None:
        """Train `policy` from here on (take's, or a follower rank's own, whose optimizer
        shard_and_load makes): with --gradient-checkpointing its decoder layers recompute
        their activations in the backward (model.recompute), set before any sharding. The
        warm start before v0 ran without."""
        if self.cfg.gradient_checkpointing:
            enable_recompute(policy.model)
        self.policy = policy

    def make_optimizer(self) -> None:
        self.opt = torch.optim.AdamW(trainable(self.policy.model), lr=self.cfg.lr, weight_decay=0.0)

    def step(self, batch: list[ScoredGroup], prompt_ids: dict[int, list[int]],
             version: int, check: StepReplay | None = None) -> StepResult:
        """One optimizer step on `batch` (trainer.step.train_step), collective under ranks;
        `check`: the groups its forward replays first (one process)."""
        return train_step(self.policy, self.opt, batch, prompt_ids, version, self.cfg,
                          ranks=self.ranks, check=check)

    def save(self, version: int, run_id: str, volunteers: dict, numbers: dict,
             master: torch.nn.Module | None) -> None:
        """The trainer state of `version` to disk, before its manifest: the optimizer (its
        shards were saved already by every rank when sharded), the step, every volunteer's
        counts and group numbers, and with bf16 weights the fp32 master."""
        adapter = None if self.lora is None else adapter_tensors(self.policy.model)
        save_state(self.state_root, version, self.opt,
                   {"run_id": run_id, "steps": self.steps, "volunteers": volunteers,
                    "group_numbers": numbers},
                   master=None if adapter is not None else master, sharded=self.sharded,
                   adapter=adapter)

    def save_shards(self, version: int) -> None:
        """Under ranks, every rank: its optimizer shards of `version`, before the manifest."""
        save_sharded_optimizer(self.state_root, version, self.policy.model, self.opt)

    def prune(self, version: int) -> None:
        """Drop every saved state but `version`'s (the version just published)."""
        prune_states(self.state_root, {version})

    def load(self, version: int, run_id: str, log: Callable[[str], None]) -> dict | None:
        """On a resume of `version`: the optimizer, the step and the fp32 master as saved for
        it, and the saved meta (volunteers' counts and numbers) or None when this run saved
        none there. Ranks load sharded moments together once sharded (shard_and_load); a
        single process loads either kind here."""
        sharded = self.ranks.joined and has_sharded_optimizer(self.state_root, version)
        meta = load_state(self.state_root, version, None if sharded else self.opt,
                          self.policy.model)
        if meta is None or meta.get("run_id") != run_id:
            log(f"warning: no saved trainer state for v{version} in "
                f"{self.state_root}: fresh optimizer moments")
            return None
        if self.ranks.joined:
            self.moments = "sharded" if sharded else "whole"
        self.steps = int(meta["steps"])
        master = master_weights(self.state_root, version)
        if master is not None:  # bf16 checkpoint: the fp32 master lives in the state
            load_weights(self.policy, master)
        adapter = adapter_master(self.state_root, version)
        if self.lora is not None and adapter is not None:  # the adapters' fp32 master
            set_adapter_tensors(self.policy.model, adapter)
            self.adapters_restored = True
        return meta

    def shard_and_load(self, full: dict[str, torch.Tensor], moments: str | None,
                       version: int) -> None:
        """Every rank: FSDP2 over the policy, the writer's `full` weights scattered into the
        shards, the optimizer built on them, and `version`'s moments as the writer found them
        (`moments`, see __init__): saved by ranks, resharded onto these ranks whatever number
        saved them (state.load_sharded_optimizer); saved by one process, the writer's copy
        broadcast (ranks.load_full_optimizer_state)."""
        whole = {}  # the writer's moments by name, taken before its optimizer is rebuilt
        if moments == "whole" and self.ranks.is_writer:
            whole = named_optimizer_state(self.policy.model, self.opt)
        shard_model(self.policy.model, self.ranks)
        if any(p.is_meta for p in self.policy.model.parameters()):  # a lean follower's, built empty
            self.policy.model.to_empty(device=self.ranks.device)
        scatter_full_weights(self.policy.model, full, self.ranks)
        self.sharded = True
        self.make_optimizer()
        if moments == "sharded":
            load_sharded_optimizer(self.state_root, version, self.policy.model, self.opt)
        elif moments == "whole":
            load_full_optimizer_state(self.policy.model, self.opt, whole, self.ranks)
