"""The weights the trainer holds besides the learner's master: the published versions of the
window as volunteers load them (audit.WindowWeights, for replays), and the one second model
that audits replay with, that evaluates a bf16 version as volunteers run it, and that holds
the writer rank's whole copy of sharded weights (a bare skeleton, bound to a weights file
only while it is needed, when the ranks are `lean`: learner.Learner.lean).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch

from volunteer_rl.config import TrainerConfig
from volunteer_rl.errors import VrlError
from volunteer_rl.model.chain import fetch_weights
from volunteer_rl.model.lora import adapter_tensors, load_adapter_unmerged, set_adapter_tensors
from volunteer_rl.model.policy import Policy
from volunteer_rl.model.weights import (
    WEIGHTS_DTYPES,
    bind_tensors,
    bind_weights,
    load_weights,
    skeleton,
    unbind_weights,
)
from volunteer_rl.protocol import layout
from volunteer_rl.model.vetting import WEIGHTS_FILE
from volunteer_rl.protocol.manifest import Manifest, read_manifest
from volunteer_rl.protocol.signing import Trust
from volunteer_rl.storage.base import Storage, StorageError
from volunteer_rl.trainer.audit import Unavailable, WindowWeights
from volunteer_rl.trainer.groups import ScoredGroup
from volunteer_rl.trainer.learner import Learner
from volunteer_rl.trainer.preflight import TrainerError
from volunteer_rl.trainer.publish import WeightsChain
from volunteer_rl.trainer.step import first_problem, replay_problems


class HeldWeights:
    """The window's published weights and the second model (see the module's docstring)."""

    def __init__(self, cfg: TrainerConfig, learner: Learner, chain: WeightsChain):
        self.cfg, self.learner, self.chain = cfg, learner, chain
        self.window = WindowWeights()  # published weights of the window, for audits
        self.second: Policy | None = None  # second_model's
        self.bound: int | None = None  # `lean`: the published version `second` is bound to

    @property
    def full_policy(self) -> Policy:
        """The whole current weights: the learner's own model, or once it is sharded over
        ranks the writer's copy that the last gather filled."""
        return self.second if self.learner.sharded else self.learner.policy

    def second_model(self) -> Policy:
        """The trainer's one model besides its master, made on first use: audits replay with
        it (fp32 or bf16), and with bf16 weights evals run on it (published)."""
        if self.second is None:
            p = self.learner.policy
            # A LoRA policy's frozen base is shared, not copied: only the adapters differ
            frozen = {id(t): t for t in p.model.parameters() if not t.requires_grad}
            self.second = Policy(copy.deepcopy(p.model, frozen).eval(), p.tokenizer,
                                 p.prompt_format, p.device)
        return self.second

    def make_skeleton(self) -> None:
        """`lean` writer: the second model as the architecture without the weights."""
        p = self.learner.policy
        self.second = Policy(skeleton(p.model), p.tokenizer, p.prompt_format, p.device)

    def published(self, version: int) -> Policy:
        """The weights volunteers run, of `version`, the version just published.

        fp32: the learner's own model (evals run right after a publish, before the next step).
        bf16: an fp32 model holding that version's bf16 tensors upcast, exactly as
        volunteers upcast them, so an honest volunteer's logprobs match and `eval vN` measures
        what vN is (the fp32 master differs from its weights by up to ~0.4 % per weight). That
        model is also the audit model (second_model; audits load other versions into it, this
        loads the current one back, a copy of the weights), so the trainer holds one such copy,
        not two. Under ranks with fp32 weights and no audits it is the writer's copy as the
        publish's gather left it, which are the published weights."""
        if self.cfg.weights_dtype == "fp32" and not self.learner.sharded:
            return self.learner.policy
        held = self.second_model()
        if self.learner.lean:
            self._bind_published(version)
            return held
        if self.cfg.weights_dtype == "fp32" and self.cfg.audit_tolerance <= 0:
            return held
        if not self.window.load_into(version, held.model):
            raise RuntimeError(f"v{version}'s published weights are not held")  # a bug
        return held

    @property
    def audit_policy(self) -> Policy | None:
        """The model audits replay with (second_model); None with audits off."""
        return self.second_model() if self.cfg.audit_tolerance > 0 else None

    def unbind(self) -> None:
        """`lean`: the skeleton lets go of whatever weights it held."""
        unbind_weights(self.second.model)
        self.bound = None

    def _bind_published(self, version: int) -> None:
        """`lean`: bind the skeleton to `version`, just published, the file in memory (no
        copy) or read back from where it was spilled (one copy, until the next publish)."""
        if self.bound == version:
            return
        last = self.chain.last
        if last is None or last[0] != version:
            raise RuntimeError(f"v{version}'s weights file is not held")  # a bug
        bind_weights(self.second.model, last[2] if last[2] is not None else self.chain.spill_to)
        self.bound = version

    def take_gathered(self, full: dict[str, torch.Tensor]) -> None:
        """The writer: the current weights, gathered from every rank, into the second model
        (which then holds no published version: audits and evals load theirs back)."""
        if self.learner.lean:  # the skeleton takes the gathered tensors themselves
            bind_tensors(self.second.model, full)
            self.bound = None  # the current weights, maybe not a published version's
        else:
            self.second.model.load_state_dict(full)
        self.window.loaded = None

    def keep(self, version: int) -> None:
        """Hold `version`, just published, as volunteers load it: for audits, every version
        of the window; without audits, that version only (published's), and with fp32
        weights without audits none (published is the learner's own model, or under ranks
        the writer's gathered copy: a second copy of the same weights would only cost the
        writer memory)."""
        auditing = self.cfg.audit_tolerance > 0
        if not auditing and self.cfg.weights_dtype == "fp32":
            return
        self.window.add(version, self.full_policy.model, WEIGHTS_DTYPES[self.cfg.weights_dtype])
        low = layout.window(version, self.cfg.max_staleness).start if auditing else version
        self.window.drop_below(low)

    def keep_gathered(self, version: int, full: dict[str, torch.Tensor], low: int) -> None:
        """A follower with audits: `version`'s weights as volunteers load them, from the
        writer's gather, for its share's audits; versions below `low` dropped."""
        self.second.model.load_state_dict(full)
        self.window.add(version, self.second.model, WEIGHTS_DTYPES[self.cfg.weights_dtype])
        self.window.loaded = None
        self.window.drop_below(low)

    def recover(self, published: set[int], storage: Storage, trust: Trust,
                log: Callable[[str], None], lora_base: str | None = None) -> None:
        """After a resume: the published weights of the window's older versions, read back
        from their checkpoints (each verified against its signed manifest copy), so their
        groups can be audited. A version that cannot be read is logged and its audited
        shards wait until it leaves the window. With --lora-rank (`lora_base`: the root of
        the base's weights file) a version is held as its adapters: a LoRA version's own, the
        base itself as adapters of zero; a version published whole before the base cannot
        be, and is logged as unreadable."""
        for version in sorted(published - set(self.window.versions)):
            try:
                m = read_manifest(storage, version, trust=trust)
                if m is None:
                    raise TrainerError(f"{layout.manifest_history_key(version)} is missing")
                if lora_base is not None:
                    self._recover_adapters(storage, m, lora_base)
                else:
                    load_weights(self.audit_policy, fetch_weights(storage, m).buf)
            except (VrlError, StorageError, ValueError) as exc:
                log(f"warning: v{version}'s weights for audits: {exc}")
                continue
            self.window.add(version, self.audit_policy.model, WEIGHTS_DTYPES[self.cfg.weights_dtype])
        self.window.loaded = None  # the audit model holds whatever was read last

    def _recover_adapters(self, storage: Storage, m: Manifest, base_root: str) -> None:
        """A LoRA trainer: version `m`'s adapters into the audit model (see recover)."""
        model = self.audit_policy.model
        if m.files[WEIGHTS_FILE].root != base_root:
            raise TrainerError(f"{layout.manifest_history_key(m.version)}: its weights are not "
                               "this run's LoRA base, and only adapters on the base are held")
        if m.adapter is None:  # the base itself
            set_adapter_tensors(model, {n: torch.zeros_like(t)
                                        for n, t in adapter_tensors(model).items()})
        else:
            load_adapter_unmerged(storage, m, model)

    def replay(self, version: int, groups: list[ScoredGroup], prompt_ids: dict[int, list[int]],
               run_id: str) -> tuple[str, str] | None:
        """Audit `groups` of `version` with that version's weights: the first failure or None."""
        return first_problem(self.problems(version, groups, prompt_ids, run_id))

    def problems(self, version: int, groups: list[ScoredGroup], prompt_ids: dict[int, list[int]],
                 run_id: str) -> list[tuple[str, str] | None]:
        """Replay `groups` of `version` (trainer.step.replay_problems) with that version's
        weights as volunteers load them: each group's failure or None. Unavailable if the
        weights are not held (a version unreadable after a resume)."""
        if not self.window.load_into(version, self.audit_policy.model):
            raise Unavailable(version)
        cfg = self.cfg
        return replay_problems(self.audit_policy, groups, prompt_ids, run_id,
                               cfg.temperature, cfg.replay_tolerance, cfg.audit_tolerance)
