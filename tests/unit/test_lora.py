"""LoRA adapters (volunteer_rl.model.lora): PEFT wraps tiny random models of real
architectures saved with save_pretrained; the adapter file PEFT itself loads; merged and
unmerged forms give the same logits and the same replay verdicts, fp32 and bf16; and an
adapter file that is not exactly an adapter of the base at the stated rank is refused."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load, save
from test_replay_forward import K, TOL, honest, prompts_of, saved_policy

from volunteer_rl.model import lora
from volunteer_rl.model.policy import Policy, load_policy
from volunteer_rl.model.replay import replay
from volunteer_rl.model.tiny import build_tokenizer
from volunteer_rl.task.calculator_generate import generate_problems

ARCHS = ["llama", "qwen3", "gemma3", "gpt2"]
SPEC = lora.LoraSpec(rank=4, alpha=8.0)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LoraSpec = lora.LoraSpec


@pytest.fixture(scope="module")
def tokenizer():
    problems = generate_problems(200, seed=3)
    return build_tokenizer([p.prompt for p in problems] + [p.expression for p in problems],
                           vocab_size=300)


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """A saved tiny random model folder of each architecture."""
    out = {}
    for arch in ARCHS:
        out[arch] = tmp_path_factory.mktemp(arch)
        saved_policy(arch, tokenizer, out[arch])
    return out


def trained(folder, spec: LoraSpec = SPEC, seed: int = 1) -> Policy:
    """A policy of `folder` wrapped with adapters whose B is no longer zero, as after training
    (B drawn wide enough that the adapter moves the logits by more than float noise)."""
    p = load_policy(folder)
    model = lora.add_adapters(p.model, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "lora_B" in name:
                t.copy_(torch.randn(t.shape, generator=g) * 0.2)
    return Policy(model, p.tokenizer, p.prompt_format, p.device)



def rounded(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {n: t.to(dtype).float() for n, t in tensors.items()}


def merged(folder, data: bytes, dtype: torch.dtype, spec: LoraSpec = SPEC) -> Policy:
    """What a reader runs merged: the base (rounded to `dtype` and upcast, as a volunteer loads
    a bf16 checkpoint), the adapter file checked and merged onto it."""
    p = load_policy(folder)
    with torch.no_grad():
        for t in p.model.parameters():
            t.copy_(t.to(dtype).float())
    adapter = lora.read_adapter(data, "adapter.safetensors", lora.adaptable_layers(p.model),
                                spec, dtype)
    lora.add_into(p.model, adapter)
    return p


def unmerged(folder, data: bytes, dtype: torch.dtype, spec: LoraSpec = SPEC) -> Policy:
    """What the trainer replays with: the base as above, PEFT's layers holding the adapter
    file's A and B (upcast) unmerged."""
    p = load_policy(folder)
    with torch.no_grad():
        for t in p.model.parameters():
            t.copy_(t.to(dtype).float())
    model = lora.add_adapters(p.model, spec)
    lora.set_adapter_tensors(model, {n: t.float() for n, t in load(data).items()})
    return Policy(model, p.tokenizer, p.prompt_format, p.device)


def logits(policy: Policy) -> torch.Tensor:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        return policy.model(input_ids=ids).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_wrapped_model_trains_only_its_adapters_and_starts_as_its_base(folders, arch):
    base = load_policy(folders[arch])
    before = logits(base)
    layers = lora.adaptable_layers(base.model)
    model = lora.add_adapters(base.model, SPEC)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(trainable.values()) == sum(SPEC.rank * (o + i) for o, i, _ in layers.values())
    assert torch.equal(logits(Policy(model, base.tokenizer, "plain", base.device)), before)
    names = set(lora.adapter_tensors(model))
    assert names == {f"{lora.ADAPTER_PREFIX}{m}.lora_{h}.weight" for m in layers for h in "AB"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_merged_and_unmerged_give_the_same_logits(folders, arch, dtype):
    """The adapter file merged onto the base, and the same file held unmerged by PEFT's layers,
    agree to float rounding; and the adapter does move the logits (so agreement means
    something)."""
    p = trained(folders[arch])
    data = lora.adapter_file(lora.adapter_tensors(p.model), DTYPES[dtype])
    a, b = logits(merged(folders[arch], data, DTYPES[dtype])), logits(unmerged(folders[arch], data, DTYPES[dtype]))
    base = load_policy(folders[arch])
    assert (a - logits(base)).abs().max() > 0.05
    assert (a - b).abs().max() < 2e-5 * max(1.0, a.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_an_honest_group_passes_replay_whichever_form_sampled_and_replays_it(
        folders, arch, dtype):
    """Committed-noise groups sampled merged replay clean unmerged and the other way round:
    the trainer's replay of an honest LoRA group never rejects, whichever form a volunteer
    runs, at fp32 and bf16 weights."""
    p = trained(folders[arch])
    data = lora.adapter_file(lora.adapter_tensors(p.model), DTYPES[dtype])
    forms = {"merged": merged(folders[arch], data, DTYPES[dtype]),
             "unmerged": unmerged(folders[arch], data, DTYPES[dtype])}
    prompts = prompts_of(forms["merged"])
    for sampler, replayer in (("merged", "unmerged"), ("unmerged", "merged")):
        comps, keys = honest(forms[sampler], prompts)
        assert sum(len(c) for g in comps for c in g) > len(prompts) * K  # tokens were drawn
        rows = replay(forms[replayer], prompts, comps, keys, 0.1)
        worst = min(m for r in rows for m in r.margins)
        assert all(r.first_failure(TOL) == -1 for r in rows), (sampler, replayer, worst)


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_the_adapter_file_is_one_peft_loads(folders, tmp_path, arch):
    """adapter_file and adapter_config make a folder peft.PeftModel.from_pretrained loads onto
    the base, giving the logits of the merged form."""
    from peft import PeftModel

    p = trained(folders[arch])
    data = lora.adapter_file(lora.adapter_tensors(p.model), torch.float32)
    (tmp_path / "adapter_model.safetensors").write_bytes(data)
    (tmp_path / "adapter_config.json").write_text(json.dumps(lora.adapter_config(SPEC)))
    base = load_policy(folders[arch])
    peft_model = PeftModel.from_pretrained(base.model, str(tmp_path))
    got = logits(Policy(peft_model, base.tokenizer, "plain", base.device))
    want = logits(merged(folders[arch], data, torch.float32))
    assert (got - want).abs().max() < 2e-5 * max(1.0, want.abs().max().item())


def _first(tensors, half="A"):
    return next(n for n in sorted(tensors) if n.endswith(f"lora_{half}.weight"))


def _mutations():
    """(what, how the tensors change, a fragment of the refusal)."""
    def reshape(t):
        n = _first(t)
        t[n] = torch.zeros(SPEC.rank + 1, t[n].shape[1])
        B = _first(t, "B")
        t[B] = torch.zeros(t[B].shape[0], SPEC.rank + 1)

    def poison(value):
        def change(t):
            n = _first(t, "B")
            t[n] = t[n].clone()
            t[n][0, 0] = value
        return change

    def extra(t):
        t["base_model.model.model.embed_tokens.weight"] = torch.zeros(4, 4)

    def head(t):
        out = t[_first(t, "B")].shape[1]
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(SPEC.rank, 32)
        t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(300, out)

    def lonely(t):
        del t[_first(t, "B")]

    def wrong_dtype(t):
        n = _first(t)
        t[n] = t[n].to(torch.float16)

    return [("shapes of another rank", reshape, "has shape"),
            ("a NaN", poison(math.nan), "NaN or an infinity"),
            ("an infinity", poison(math.inf), "NaN or an infinity"),
            ("a tensor that is no adapter's", extra, "not the A or B of an adaptable layer"),
            ("the output embedding adapted", head, "not the A or B of an adaptable layer"),
            ("an A without its B", lonely, "without its pair"),
            ("another dtype", wrong_dtype, "float16, not torch.float32"),
            ("nothing", lambda t: t.clear(), "holds no tensor")]


@pytest.mark.parametrize("what,change,why", _mutations(), ids=[m[0] for m in _mutations()])
def test_a_hostile_adapter_is_refused_in_one_line(folders, what, change, why):
    p = trained(folders["llama"])
    tensors = dict(lora.adapter_tensors(p.model))
    layers = lora.adaptable_layers(load_policy(folders["llama"]).model)
    good = lora.adapter_file(tensors, torch.float32)
    assert len(lora.read_adapter(good, "adapter.safetensors", layers, SPEC, torch.float32).layers) == len(layers)
    change(tensors)
    data = save({n: t.contiguous() for n, t in tensors.items()})
    with pytest.raises(lora.AdapterRefused) as refused:
        lora.read_adapter(data, "checkpoints/v000003/adapter.safetensors", layers, SPEC, torch.float32)
    message = str(refused.value)
    assert why in message and "\n" not in message
    assert message.startswith("checkpoints/v000003/adapter.safetensors: refused adapter: ")


def test_bytes_that_are_no_adapter_or_too_many_are_refused_before_parsing(folders, monkeypatch):
    layers = lora.adaptable_layers(load_policy(folders["llama"]).model)
    bound = lora.adapter_bytes_bound(layers, SPEC.rank, 4)
    good = lora.adapter_file(lora.adapter_tensors(trained(folders["llama"]).model), torch.float32)
    assert len(good) < bound
    parsed = []
    import safetensors.torch

    real = safetensors.torch.load
    monkeypatch.setattr(safetensors.torch, "load", lambda b: parsed.append(len(b)) or real(b))
    for data, why in ((b"\0" * (bound + 1), f"more than the {bound}"),
                      (good[:len(good) // 2], "not a safetensors file"),
                      (b"\xff" * 8 + b"{}", "not a safetensors file")):
        with pytest.raises(lora.AdapterRefused, match=why):
            lora.read_adapter(data, "a", layers, SPEC, torch.float32)
    assert len(parsed) == 2  # the oversized file was refused unparsed
    for rank, alpha in ((0, 1.0), (lora.MAX_LORA_RANK + 1, 1.0), (4, math.nan), (4, -1.0)):
        with pytest.raises(lora.AdapterRefused, match="out of bounds"):
            lora.read_adapter(good, "a", layers, LoraSpec(rank, alpha), torch.float32)
