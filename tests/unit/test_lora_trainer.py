"""`vrl trainer --lora-rank`: the learner trains only the adapters, v0 is the base published
whole, each later version is its adapter, and a resume restores the adapters and their AdamW
moments exactly (from the fp32 copy in the trainer's state; without it, the bucket's)."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import one_thread
from helpers.vrlproc import one_line_error, run_vrl
from safetensors.torch import load

from volunteer_rl.config import PACKAGE_DATA, TrainerConfig
from volunteer_rl.model.lora import adapter_tensors, trainable
from volunteer_rl.model.policy import load_policy
from volunteer_rl.model.checkpoint import fetch_checkpoint
from volunteer_rl.protocol.manifest import ADAPTER_FILE, KEYFRAME_FILE
from volunteer_rl.protocol.signing import public_key_text
from volunteer_rl.trainer.loop import Trainer
from volunteer_rl.trainer.preflight import TrainerError

RANK = 2


def lora_config(root, **changes) -> TrainerConfig:
    eval_csv = root / "eval10.csv"
    if not eval_csv.exists():
        eval_csv.write_text("".join((PACKAGE_DATA / "eval.csv").read_text().splitlines(True)[:11]))
    settings = dict(bucket=str(root / "bucket"), model=str(root / "model"), eval_every=0,
                    eval_dataset=str(eval_csv), work_dir=str(root / "work"), weights_dtype="bf16",
                    signing_key=str(root / "key.pem"), lora_rank=RANK)
    return TrainerConfig(**{**settings, **changes})


def trained_a_step(t: Trainer, seed: int) -> None:
    """What a step leaves: adapters moved by AdamW (random gradients), moments set."""
    g = torch.Generator().manual_seed(seed)
    for p in trainable(t.policy.model):
        p.grad = torch.randn(p.shape, generator=g)
    t.opt.step()
    t.opt.zero_grad()


@pytest.fixture(scope="module")
def lora_run(template, tmp_path_factory):
    """A LoRA trainer (rank 2, bf16) started on the template's warm-started model, with v0
    published, and v1 published after one step."""
    root = tmp_path_factory.mktemp("lora")
    template.model(root / "model")
    t = Trainer(lora_config(root), log=lambda m: None)
    with one_thread():
        t.start()
        v0 = t.manifest
        trained_a_step(t, seed=1)
        t.publish_next()
    return t, root, v0


def test_only_the_adapters_train_and_the_base_goes_out_whole_once(lora_run, tmp_path):
    t, root, v0 = lora_run
    params = [p for group in t.opt.param_groups for p in group["params"]]
    adapters = adapter_tensors(t.policy.model)
    assert len(params) == len(adapters) and sum(p.numel() for p in params) == sum(
        a.numel() for a in adapters.values())
    assert t.cfg.lr == pytest.approx(3e-3)  # ten times full fine-tuning's default
    assert v0.adapter is None and KEYFRAME_FILE in v0.files
    base = load_policy(fetch_checkpoint(t.storage, v0, tmp_path / "v0"))
    plain = load_policy(root / "model")
    for name, w in base.model.state_dict().items():  # the model it started from, as bf16
        assert torch.equal(w, plain.model.state_dict()[name].to(torch.bfloat16).float()), name
    m = t.manifest
    assert m.version == 1 and m.adapter.base == 0 and m.adapter.rank == RANK
    assert m.weights == v0.weights and ADAPTER_FILE in m.files
    assert not t.storage.exists(f"{m.checkpoint}/{KEYFRAME_FILE}")
    published = load(t.storage.read(f"{m.checkpoint}/{ADAPTER_FILE}"))
    assert set(published) == set(adapters)
    for name, a in adapters.items():  # the adapters, rounded to bf16
        assert torch.equal(published[name], a.to(torch.bfloat16)), name
    assert any(a.abs().max() > 0 for n, a in published.items() if ".lora_B." in n)


def test_a_resume_restores_the_adapters_and_their_moments_exactly(lora_run):
    t, root, _ = lora_run
    again = Trainer(t.cfg, log=lambda m: None)
    with one_thread():
        again.start()
    assert again.version == 1
    want, got = adapter_tensors(t.policy.model), adapter_tensors(again.policy.model)
    for name in want:
        assert torch.equal(got[name], want[name]), name  # fp32, not the bucket's bf16
    a, b = t.opt.state_dict(), again.opt.state_dict()
    assert a["state"].keys() == b["state"].keys() and a["state"]
    for i, slots in a["state"].items():
        for slot, value in slots.items():
            assert torch.equal(torch.as_tensor(b["state"][i][slot]), torch.as_tensor(value)), (i, slot)


def test_without_its_state_a_resume_takes_the_published_adapters(lora_run, tmp_path):
    t, root, _ = lora_run
    shutil.copytree(root / "bucket", tmp_path / "bucket")
    cfg = lora_config(root, bucket=str(tmp_path / "bucket"), work_dir=str(tmp_path / "work"))
    again = Trainer(cfg, log=lambda m: None)
    with one_thread():
        again.start()
    got = adapter_tensors(again.policy.model)
    for name, a in adapter_tensors(t.policy.model).items():
        assert torch.equal(got[name], a.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("changes, flags", [
    ({"lora_rank": 0}, "--lora-rank 2 --lora-alpha 32 --lora-targets all-linear"),
    ({"lora_rank": 4}, "--lora-rank 2"),
    ({"lora_alpha": 8.0}, "--lora-alpha 32"),
])
def test_a_lora_run_resumed_with_other_adapters_is_refused_in_one_line(lora_run, changes, flags):
    t, root, _ = lora_run
    again = Trainer(lora_config(root, **changes), log=lambda m: None)
    with pytest.raises(TrainerError) as refused:
        again.start()
    message = str(refused.value)
    assert message.startswith("manifest.json: the run trains LoRA adapters on v0")
    assert flags in message and "\n" not in message


def logits_of(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def test_vrl_export_writes_folders_transformers_and_peft_load_with_the_trainers_logits(
        lora_run, tmp_path):
    """`vrl export` of v1, whole and --adapter: loaded by transformers and by PEFT with no
    vrl code, each gives the logits of the trainer's own v1 (its published adapters, held
    unmerged for audits) to float rounding; v0, published whole, has no adapter to export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t, root, _ = lora_run
    key = public_key_text(t.key)
    common = ["--bucket", str(root / "bucket"), "--trust-key", key,
              "--work-dir", str(tmp_path / "ew")]
    for args in (["export", *common, str(tmp_path / "whole")],
                 ["export", *common, "--adapter", str(tmp_path / "adapter")]):
        r = run_vrl(args, tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    tokens = t.prompt_ids[0] + t.prompt_ids[1][:3]
    want = logits_of(t.held.published(1).model, tokens)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
    # the base as published (bf16 here), computed in fp32 as volunteers run it
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter" / "base", dtype=torch.float32)
    unmerged = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    assert whole.dtype == torch.float32
    for got in (logits_of(whole, tokens), logits_of(unmerged, tokens)):
        assert (got - want).abs().max() < 2e-5 * max(1.0, want.abs().max().item())
    assert (want - logits_of(load_policy(root / "model").model, tokens)).abs().max() > 1e-4
    r = run_vrl(["export", *common, "--version", "0", "--adapter", str(tmp_path / "v0")], tmp_path)
    assert one_line_error(r) == ("error: manifests/v000000.json: v0 is published whole, with no "
                                 "adapter; export it without --adapter")
