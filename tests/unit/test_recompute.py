"""--gradient-checkpointing (model.recompute): each decoder layer runs its forward again in the
backward instead of keeping its activations, and that changes nothing a step computes. On
every architecture the trainer loads, full fine-tuning and LoRA, a train step gives the same
logits (the very tensors), loss and gradients with it as without, although the step's forward
runs on the KV cache that transformers' own checkpointing would drop; each layer really runs
twice as often (the learner turns it on); and the step's own replay of the version in hand's
groups (trainer.step.StepReplay) still passes honest groups and catches a forgery."""
from __future__ import annotations

import ast
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_verify import batch_of, first_forgery, put, trainer_on, trust
from volunteer_rl.config import TrainerConfig
from volunteer_rl.model.lora import LoraSpec, add_adapters
from volunteer_rl.model.policy import Policy
from volunteer_rl.model.recompute import enable_recompute, recomputes
from volunteer_rl.model.scoring import completion_logits
from volunteer_rl.trainer.groups import IngestStats, ScoredGroup
from volunteer_rl.trainer.learner import Learner
from volunteer_rl.trainer.ranks import single
from volunteer_rl.trainer.step import train_step

VOCAB, LAYERS = 64, 2


def small_model(arch: str) -> torch.nn.Module:
    """A tiny random `arch` model; Gemma 3's sliding window (4) is shorter than the rows."""
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        GPT2Config,
        LlamaConfig,
        Qwen3Config,
    )

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                 pad_token_id=0, eos_token_id=1, bos_token_id=None)
    config = {"llama": lambda: LlamaConfig(**small),
              "qwen3": lambda: Qwen3Config(**small, head_dim=8),
              "gemma3": lambda: Gemma3TextConfig(**small, head_dim=8, sliding_window=4),
              "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=None,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)}[arch]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


class Pad:
    pad_token_id = 0


def policy_of(model: torch.nn.Module) -> Policy:
    return Policy(model, Pad(), "plain", torch.device("cpu"))


def groups() -> tuple[list[ScoredGroup], dict[int, list[int]]]:
    """Three groups of K = 3 completions of uneven lengths after prompts of uneven lengths
    (padding on both sides), with reward variance; and the prompts' tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = {i: torch.randint(2, VOCAB, (3 + 2 * i,), generator=g).tolist() for i in range(3)}
    batch = []
    for i in range(3):
        ids = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (2 + i, 5, 1)]
        batch.append(ScoredGroup(prompt_id=i, policy_version=0, volunteer_id="v", token_ids=ids,
                                 behavior_logprobs=[[-4.0] * len(x) for x in ids],
                                 rewards=[1.0, 0.0, float(i % 2)], key=f"k{i}"))
    return batch, prompts


def cfg(tmp_path, **settings) -> TrainerConfig:
    return TrainerConfig(bucket=str(tmp_path / "b"), work_dir=str(tmp_path / "w"),
                         micro_batch=6, **settings)  # two micro-batches of two groups and one


def stepped(model: torch.nn.Module, settings: TrainerConfig):
    """One train step of `model` on groups(): its result and every gradient it left."""
    batch, prompts = groups()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    result = train_step(policy_of(model), opt, batch, prompts, 0, settings)
    return result, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "gpt2"])
def test_a_step_is_the_same_with_its_layers_recomputed(arch, lora, tmp_path):
    model = small_model(arch)
    if lora:
        model = add_adapters(model, LoraSpec(2, 32.0))
    plain, again = model, copy.deepcopy(model)
    enable_recompute(again)
    assert recomputes(again) and not recomputes(plain)
    # the forward gives the very same logits (what the step's replay reads)
    batch, prompts = groups()
    logits = []
    for m in (plain, again):
        m.train()
        logits.append(completion_logits(policy_of(m), [prompts[g.prompt_id] for g in batch],
                                        [g.token_ids for g in batch])[0].detach())
        m.eval()
    assert torch.equal(*logits)
    settings = cfg(tmp_path)
    (a, grads_a), (b, grads_b) = stepped(plain, settings), stepped(again, settings)
    assert a.applied and b.applied and a.loss == b.loss
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-6)
    assert sorted(grads_a) == sorted(grads_b) and len(grads_a) > 0
    for name in grads_a:
        assert torch.allclose(grads_a[name], grads_b[name], rtol=1e-5, atol=1e-7), name
    # LoRA trains only its adapters, with or without
    assert all("lora_" in n for n in grads_b) == lora


@pytest.mark.parametrize("lora", [0, 2], ids=["full", "lora"])
def test_the_learner_with_the_option_runs_each_layer_twice_in_a_step(lora, tmp_path):
    """The decoder layers' MLPs count their calls in one step of two micro-batches: each
    micro-batch runs every layer twice (the prompt pass, then the completions on its cache),
    and with --gradient-checkpointing the backward runs each of those once more. (A forward
    pre-hook counts: torch's recompute stops as soon as it has what the backward needs, inside
    the MLP, before a forward hook would run.)"""
    batch, prompts = groups()
    calls = {}
    for on in (False, True):
        learner = Learner(cfg(tmp_path, lora_rank=lora, gradient_checkpointing=on), single())
        learner.take(policy_of(small_model("qwen3")))
        assert recomputes(learner.policy.model) == on
        mlps = [m for n, m in learner.policy.model.named_modules() if n.endswith(".mlp")]
        assert len(mlps) == LAYERS
        count = [0]
        for m in mlps:
            m.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        assert learner.step(batch, prompts, 0).applied
        calls[on] = count[0]
    micro_batches = 2
    assert calls == {False: 2 * LAYERS * micro_batches, True: 4 * LAYERS * micro_batches}


def test_the_steps_own_replay_passes_honest_groups_and_catches_a_forgery(template, tmp_path):
    """A trainer with --gradient-checkpointing resumed on the template: its first step, with no
    step since the publish, replays the version in hand's groups in its own forward (as
    test_verify does without the option): honest groups pass, verified, and the step is
    applied; a forged group ends the step before its backward."""
    t = trainer_on(template, tmp_path / "honest", gradient_checkpointing=True)
    assert recomputes(t.learner.policy.model)
    trust(t, "steady")
    put(t, "steady", "s1", template.groups("steady")[:4])
    stats = IngestStats()
    _, batch = batch_of(t, stats)
    check = t.role.step_replay(unpublished=0)
    assert check is not None
    result = t.learner.step(batch, t.prompt_ids, t.version, check)
    assert result.applied and not check.problems and check.replayed == 4
    assert all(g.verified for g in batch)

    t = trainer_on(template, tmp_path / "forged", gradient_checkpointing=True)
    trust(t, "honest", "liar")
    put(t, "honest", "h1", template.groups("honest")[:3])
    liar_key = put(t, "liar", "l1", [first_forgery(template, template.groups("liar"))])
    _, batch = batch_of(t, IngestStats())
    at = next(i for i, g in enumerate(batch) if g.key == liar_key)
    check = t.role.step_replay(unpublished=0)
    result = t.learner.step(batch, t.prompt_ids, t.version, check)
    assert not result.applied and list(check.problems) == [at], check.problems
    assert check.problems[at][0] == "replay_mismatch"


SHARDED = """
import torch, torch.distributed as dist
import test_recompute as t
from volunteer_rl.trainer.learner import Learner
from volunteer_rl.trainer.ranks import Ranks

dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
calls = {}
for on in (False, True):
    ranks = Ranks(0, 1, torch.device("cpu"), joined=True)
    learner = Learner(t.cfg(t.Path(TMP), gradient_checkpointing=on), ranks)
    policy = t.policy_of(t.small_model("qwen3"))
    full = {k: v.clone() for k, v in policy.model.state_dict().items()}
    learner.hold(policy)
    learner.shard_and_load(full, None, 0)
    count = [0]
    for n, m in learner.policy.model.named_modules():
        if n.endswith(".mlp"):
            m.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    batch, prompts = t.groups()
    result = learner.step(batch, prompts, 0)
    assert result.applied and t.recomputes(learner.policy.model) == on
    calls[on] = (count[0], result.loss)
dist.destroy_process_group()
print(calls)
"""


def test_layers_sharded_by_fsdp2_still_run_twice(tmp_path):
    """Under torchrun the learner's model is sharded with FSDP2 (trainer.ranks.shard_model)
    after the option is set: a rank's step (one rank of a gloo group of one, in a process of
    its own) still runs each layer again in the backward, inside FSDP2's hooks, with the same
    loss. (2 real ranks train as one process with it: test_ranks_same_weights.)"""
    here = Path(__file__).parent
    path = os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", f"TMP = {str(tmp_path)!r}\n" + SHARDED],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    calls = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    micro_batches = 2
    assert calls[False][0] == 2 * LAYERS * micro_batches
    assert calls[True][0] == 4 * LAYERS * micro_batches
    assert calls[True][1] == pytest.approx(calls[False][1], rel=1e-6)
