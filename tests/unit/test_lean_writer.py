"""The pieces of a `lean` writer rank (trainer.learner.Learner.lean: sharded, fp32, audits off),
each on its own: a skeleton model bound to a published weights file's bytes computes what
the model computes without copying them, and a WeightsChain that keeps its last file on disk
between publishes makes the patches and keyframes an in-memory chain makes. The ranks
themselves run in tests/integration/test_ranks_same_weights.py."""
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from volunteer_rl.model.hashing import piece_hashes
from volunteer_rl.model.weights import bind_weights, skeleton, unbind_weights, weights_bytes
from volunteer_rl.protocol.manifest import WeightsEntry, pieces_root
from volunteer_rl.trainer.publish import WeightsChain

MIB = 1 << 20


def models():
    torch.manual_seed(0)
    yield Qwen3ForCausalLM(Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8,
                                       tie_word_embeddings=True))
    yield LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, tie_word_embeddings=False))


@pytest.mark.parametrize("model", list(models()), ids=["qwen3-tied", "llama-untied"])
def test_a_skeleton_bound_to_the_file_is_the_model_without_a_copy(model):
    model.eval()
    sk = skeleton(model)
    assert all(p.device.type == "meta" for p in sk.parameters())  # it holds no weights
    buf = weights_bytes(model, torch.float32)
    bind_weights(sk, buf)
    x = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, sk(x).logits)
    lo = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    for name, p in sk.named_parameters():  # every weight lives in the file's bytes
        assert lo <= p.data_ptr() < lo + len(buf), name
    assert (sk.lm_head.weight is sk.get_input_embeddings().weight) == model.config.tie_word_embeddings
    unbind_weights(sk)
    assert all(p.device.type == "meta" for p in sk.parameters())


def publish(chain: WeightsChain, version: int, buf: memoryview):
    pieces = piece_hashes(buf, MIB)
    root = pieces_root(MIB, len(buf), pieces)
    patch, keyframe = chain.plan(version, buf, root, word=4)
    weights = chain.weights(version, WeightsEntry(root, len(buf)), pieces, None, keyframe)
    chain.commit(version, weights, root, buf)
    return patch, keyframe


def test_a_spilled_chain_plans_what_an_in_memory_one_does(tmp_path):
    rng = np.random.default_rng(0)
    files = [rng.integers(0, 256, 2 * MIB + 64, dtype=np.uint8)]
    for share in (0.01, 0.9, 0.02):  # the second change cannot pay: a keyframe
        nxt = files[-1].copy()
        words = nxt.view(np.uint32)
        where = rng.choice(len(words), size=int(len(words) * share), replace=False)
        words[where] = (words[where] + 1 if share < 0.5  # small steps, or random rewrites
                        else rng.integers(0, 1 << 32, size=len(where), dtype=np.uint32))
        files.append(nxt)
    spill = tmp_path / "last.bin"
    held = WeightsChain(keyframe_every=8, patch_max_fraction=0.5, piece_bytes=MIB)
    spilled = WeightsChain(keyframe_every=8, patch_max_fraction=0.5, piece_bytes=MIB, spill_to=spill)
    plans = []
    for v, f in enumerate(files):
        a = publish(held, v, memoryview(f.copy()))
        b = publish(spilled, v, memoryview(f.copy()))
        assert a == b, v  # the same patch bytes, the same keyframe decision
        plans.append((b[0] is not None, b[1]))
        spilled.spill()
        assert spilled.last[2] is None and spilled.spare is None  # nothing held in memory
        assert spill.read_bytes() == f.tobytes()
    assert plans == [(False, True), (True, False), (False, True), (True, False)]


def test_a_lost_spilled_file_costs_a_keyframe_not_the_publish(tmp_path):
    spill = tmp_path / "last.bin"
    chain = WeightsChain(keyframe_every=8, patch_max_fraction=0.5, piece_bytes=MIB, spill_to=spill)
    f = np.zeros(MIB, dtype=np.uint8)
    publish(chain, 0, memoryview(f.copy()))
    chain.spill()
    spill.write_bytes(b"short")  # cut short (a full disk, someone's cleanup)
    assert publish(chain, 1, memoryview(f.copy())) == (None, True)
    chain.spill()
    spill.unlink()
    assert publish(chain, 2, memoryview(f.copy())) == (None, True)


def test_moments_saved_in_many_files_come_back_whole(tmp_path, monkeypatch):
    """A rank's moments go into files of at most state.FILE_BYTES each (the storage writer
    holds two copies of a file in memory while it writes it), and load back from them."""
    from volunteer_rl.trainer import state

    torch.manual_seed(0)
    model = next(models())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    monkeypatch.setattr(state, "FILE_BYTES", 16 << 10)
    moments = state.named_optimizer_state(model, opt)["state"]
    mapping = state.file_indices(moments)
    sizes: dict[int, int] = {}
    for name, slots in moments.items():
        for key, t in slots.items():
            i = mapping[f"state.{name}.{key}"]
            sizes[i] = sizes.get(i, 0) + t.numel() * t.element_size()
    largest = max(t.numel() * t.element_size() for slots in moments.values() for t in slots.values())
    assert max(sizes.values()) <= max(state.FILE_BYTES, largest)
    state.prepare_sharded(tmp_path, 1)
    state.save_sharded_optimizer(tmp_path, 1, model, opt)
    files = list((state.state_dir(tmp_path, 1) / state.SHARDED_DIR).glob("*.safetensors"))
    assert len(files) == max(mapping.values()) > 10
    model.zero_grad(set_to_none=True)  # as a resumed trainer's model is
    again = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state.load_sharded_optimizer(tmp_path, 1, model, again)
    assert len(again.state) == len(opt.state) > 10
    for p, slots in opt.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(slots[key], again.state[p][key])
