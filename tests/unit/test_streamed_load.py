"""Loading a model folder (model.policy.load_policy) reads model.safetensors a piece at a time
into a model built from the config (model.safetensors_file.stream_into), and gives exactly the
model transformers' from_pretrained gives: every parameter and buffer, the tie, eval mode, the
logits, on a tiny random model of each architecture family saved in fp32 and in bf16. A file
whose names are not the model's own falls back to from_pretrained."""
import json

import pytest
import torch

from tests.unit.test_replay_forward import ARCHS, small_config
from volunteer_rl.model import policy as policy_module
from volunteer_rl.model import safetensors_file
from volunteer_rl.model.policy import load_policy
from volunteer_rl.model.safetensors_file import WeightsError, stream_into
from volunteer_rl.model.tiny import build_tokenizer
from volunteer_rl.task.calculator_generate import generate_problems


@pytest.fixture(scope="module")
def tokenizer():
    problems = generate_problems(100, seed=5)
    return build_tokenizer([p.prompt for p in problems], vocab_size=200)


def save(arch: str, tokenizer, folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    config = small_config(arch, len(tokenizer))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def transformers_load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                use_safetensors=True, local_files_only=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_streamed_load_is_the_model_from_pretrained_gives(arch, dtype, tokenizer, tmp_path,
                                                              monkeypatch):
    folder = save(arch, tokenizer, tmp_path / arch, dtype)
    streamed = []
    real = policy_module._streamed
    monkeypatch.setattr(policy_module, "_streamed",
                        lambda *a: streamed.append(m := real(*a)) or m)
    ours = load_policy(folder).model
    theirs = transformers_load(folder)
    assert streamed and streamed[0] is ours, "the folder was not streamed"
    assert not ours.training and not theirs.training
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == ref.keys()
    for name, t in ref.items():
        assert mine[name].dtype == t.dtype == (torch.float32 if t.is_floating_point() else t.dtype), name
        assert torch.equal(mine[name], t), name
    buffers = dict(theirs.named_buffers())
    assert dict(ours.named_buffers()).keys() == buffers.keys()
    for name, b in ours.named_buffers():
        assert torch.equal(b, buffers[name]), name
    if ours.config.tie_word_embeddings:
        assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    ids = torch.tensor([[5, 9, 11, 3, 7, 2]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_the_file_is_read_a_piece_at_a_time(tokenizer, tmp_path, monkeypatch):
    """No read takes more than PIECE bytes, so the file never sits in memory beside the model
    (from_pretrained maps it whole)."""
    folder = save("qwen3", tokenizer, tmp_path / "m")
    monkeypatch.setattr(safetensors_file, "PIECE", 4096)
    sizes = []
    real_open = open

    class Spy:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            sizes.append(n)
            return self.f.read(n)

        def readinto(self, b):
            sizes.append(len(b))
            return self.f.readinto(b)

    monkeypatch.setattr(safetensors_file, "open", lambda p, mode: Spy(real_open(p, mode)),
                        raising=False)
    load_policy(folder)
    reads = sizes[2:]  # after the header's length and the header
    assert reads and max(reads) <= 4096
    data = (folder / "model.safetensors").read_bytes()
    assert sum(reads) == len(data) - 8 - int.from_bytes(data[:8], "little")  # every tensor once


def test_names_transformers_would_map_fall_back_to_from_pretrained(tokenizer, tmp_path):
    """A file whose tensor names are not the model's own: stream_into refuses it before copying
    anything (the model untouched), and load_policy loads it with from_pretrained, which maps
    names (here a legacy GPT-2 checkpoint without the `transformer.` prefix)."""
    from safetensors.torch import load_file, save_file

    folder = save("gpt2", tokenizer, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()}, path,
              metadata={"format": "pt"})
    before = {k: v.clone() for k, v in transformers_load(tmp_path / "m").state_dict().items()}
    from transformers import AutoModelForCausalLM

    blank = AutoModelForCausalLM.from_config(load_policy(folder).model.config)
    kept = {k: v.clone() for k, v in blank.state_dict().items()}
    with pytest.raises(WeightsError, match="do not fit"):
        stream_into(blank, path)
    assert all(torch.equal(v, blank.state_dict()[k]) for k, v in kept.items())
    loaded = load_policy(folder).model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in before.items())


def test_a_header_longer_than_its_file_is_refused_in_one_line(tokenizer, tmp_path):
    folder = save("llama", tokenizer, tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    with pytest.raises(WeightsError, match=r"model.safetensors: not a safetensors file \(a header"):
        stream_into(model, path)
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert header  # the file was a real one before the header's length was changed


def test_a_truncated_file_is_refused_before_anything_is_copied(tokenizer, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = save("qwen3", tokenizer, tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError, match=r"model.safetensors: .* has shape"):
        stream_into(model, path)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in kept.items())
