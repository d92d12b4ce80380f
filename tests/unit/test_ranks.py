"""trainer.ranks without torchrun: a plain process joins no group and nothing is sharded;
decoder_layers finds the blocks of every architecture the project loads; rank_share splits a
batch into disjoint, complete shares. (Two real ranks: tests/integration/test_ranks_same_weights.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from volunteer_rl.trainer.ranks import (
    TORCHRUN_ENV,
    RankJoinError,
    Ranks,
    decoder_layers,
    full_state_dict,
    join,
    rank_share,
    shard_model,
)


@pytest.fixture
def no_torchrun(monkeypatch):
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)


def tiny_llama(layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=layers, num_attention_heads=2,
                                        num_key_value_heads=2, tie_word_embeddings=True))


def test_without_torchrun_join_is_a_single_process_with_no_group(no_torchrun):
    ranks = join("cpu", timeout_seconds=1)
    assert ranks == Ranks(rank=0, world_size=1, device=torch.device("cpu"), joined=False)
    assert ranks.is_writer and not ranks.is_follower
    assert not dist.is_initialized()


def test_without_torchrun_shard_model_leaves_the_model_alone(no_torchrun):
    from torch.distributed.tensor import DTensor

    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {n: type(m) for n, m in model.named_modules()}
    ranks = join("cpu", timeout_seconds=1)
    assert shard_model(model, ranks) is model
    assert {n: type(m) for n, m in model.named_modules()} == types  # no FSDP classes swapped in
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    full = full_state_dict(model, ranks)
    assert sorted(full) == sorted(before)
    assert all(torch.equal(full[k], before[k]) for k in before)


def test_a_partial_torchrun_environment_is_one_clear_error(no_torchrun, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RankJoinError, match="RANK set but WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                                            "MASTER_PORT not"):
        join("cpu", timeout_seconds=1)
    assert not dist.is_initialized()


def architectures():
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GPT2Config,
        GPT2LMHeadModel,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    return [
        (tiny_llama(3), "LlamaDecoderLayer"),
        (Qwen3ForCausalLM(Qwen3Config(**small)), "Qwen3DecoderLayer"),
        (Gemma3ForCausalLM(Gemma3TextConfig(**small)), "Gemma3DecoderLayer"),
        (GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=3, n_head=2)), "GPT2Block"),
    ]


def test_decoder_layers_are_every_architectures_blocks():
    for model, name in architectures():
        layers = decoder_layers(model)
        assert [type(m).__name__ for m in layers] == [name] * 3
        blocks = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
        assert {id(m) for m in layers} == {id(m) for m in blocks}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rank_shares_are_disjoint_and_cover_the_batch(world):
    cpu = torch.device("cpu")
    shares = [list(range(8))[rank_share(8, Ranks(r, world, cpu, joined=world > 1))]
              for r in range(world)]
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert len({len(s) for s in shares}) == 1


def test_a_batch_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="6 groups does not split evenly over 4 ranks"):
        rank_share(6, Ranks(1, 4, torch.device("cpu"), joined=True))
