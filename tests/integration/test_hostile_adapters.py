"""A LoRA version's adapter, from a bucket whose trainer key is stolen: every manifest here is
signed, so only the volunteer's own checks stand between the bytes and its model.

A real Volunteer on a folder bucket loads v0 (a tiny Llama, the base) and then meets v1, a
LoRA version whose adapter is hostile: NaN or infinite values, shapes of another rank, an
extra tensor, the output embedding adapted, another dtype, or a listed size beyond any
adapter of that rank for this model (refused before it is downloaded: the object is not even
in the bucket). Each is refused in one line naming the object; the volunteer keeps v0's
weights and says so once. An honest adapter is held unmerged, computing exactly what the
trainer's replay computes (the check of the test itself: what is refused would otherwise have
loaded)."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save

from test_hostile_bucket import (  # noqa: F401  (fixtures)
    KEY,
    PUB,
    dataset_csv,
    folder_files,
    llama,
    make_manifest,
    put_files,
    tokenizer,
)
from volunteer_rl.config import VolunteerConfig
from volunteer_rl.model import lora
from volunteer_rl.model.hashing import sha256_bytes
from volunteer_rl.model.lora import ADAPTER_PREFIX
from volunteer_rl.model.policy import load_policy
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import ADAPTER_FILE, AdapterRef, FileEntry, write_manifest
from volunteer_rl.storage import open_storage

RANK, ALPHA = 2, 4.0


def honest_adapter(llama) -> dict[str, torch.Tensor]:
    """An adapter of every adaptable layer of the tiny Llama, B not zero."""
    g = torch.Generator().manual_seed(5)
    layers = lora.adaptable_layers(load_policy(llama).model)
    out = {}
    for name, (o, i, _) in layers.items():
        out[f"{ADAPTER_PREFIX}{name}.lora_A.weight"] = torch.randn(RANK, i, generator=g) * 0.1
        out[f"{ADAPTER_PREFIX}{name}.lora_B.weight"] = torch.randn(o, RANK, generator=g) * 0.1
    return out


def _b(tensors):
    return next(n for n in sorted(tensors) if n.endswith("lora_B.weight"))


def poisoned(value):
    def change(t):
        t[_b(t)] = t[_b(t)].clone()
        t[_b(t)][1, 1] = value
    return change


def other_rank(t):
    for n in list(t):
        t[n] = torch.zeros(RANK + 1, t[n].shape[1]) if ".lora_A." in n else torch.zeros(t[n].shape[0], RANK + 1)


HOSTILE = {
    "NaN": (poisoned(math.nan), "holds a NaN or an infinity"),
    "infinity": (poisoned(-math.inf), "holds a NaN or an infinity"),
    "another rank": (other_rank, "has shape"),
    "an extra tensor": (lambda t: t.update({"base_model.model.model.norm.weight": torch.ones(32)}),
                        "is not the A or B of an adaptable layer"),
    "the output embedding": (lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": torch.zeros(RANK, 32),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(300, RANK)}),
        "is not the A or B of an adaptable layer"),
    "another dtype": (lambda t: t.update({n: v.half() for n, v in t.items()}), "float16, not torch.float32"),
}


def publish_lora_v1(storage, llama, dataset_csv, etag, base_manifest, data: bytes,
                    listed: int | None = None, upload: bool = True):
    """v1: v0's config and tokenizer, v0's weights as its base, and `data` as its adapter
    (listed with `listed` bytes if given; not uploaded at all if not `upload`)."""
    small = {n: b for n, b in folder_files(llama).items() if n != "model.safetensors"}
    files = put_files(storage, 1, small)
    if upload:
        storage.create(layout.checkpoint_key(1, ADAPTER_FILE), data)
    files[ADAPTER_FILE] = FileEntry(sha256_bytes(data), listed or len(data))
    files["model.safetensors"] = base_manifest.files["model.safetensors"]
    m = make_manifest(storage, 1, files, dataset_csv, weights=base_manifest.weights,
                      adapter=AdapterRef(0, RANK, ALPHA, "all-linear"))
    write_manifest(storage, m, etag, KEY)
    return m


@pytest.fixture
def volunteer_on_v0(llama, dataset_csv, tmp_path):  # noqa: F811
    from volunteer_rl.volunteer.loop import Volunteer

    storage = open_storage(str(tmp_path / "bucket"))
    files = put_files(storage, 0, folder_files(llama))
    v0 = make_manifest(storage, 0, files, dataset_csv)
    etag = write_manifest(storage, v0, None, KEY)
    logs: list[str] = []
    v = Volunteer(VolunteerConfig(bucket=str(tmp_path / "bucket"), volunteer_id="v", device="cpu",
                                  trust_key=PUB, heartbeat_seconds=0,
                                  work_dir=str(tmp_path / "vw")), log=logs.append)
    assert v.try_switch(v.poll()) and v.manifest.version == 0
    return v, storage, v0, etag, logs


@pytest.mark.parametrize("what", HOSTILE)
def test_a_hostile_adapter_is_refused_and_the_volunteer_keeps_its_weights(
        what, volunteer_on_v0, llama, dataset_csv):  # noqa: F811
    v, storage, v0, etag, logs = volunteer_on_v0
    before = {n: t.clone() for n, t in v.policy.model.state_dict().items()}
    tensors = honest_adapter(llama)
    change, why = HOSTILE[what]
    change(tensors)
    publish_lora_v1(storage, llama, dataset_csv, etag, v0,
                    save({n: t.contiguous() for n, t in tensors.items()}))
    m = v.poll()
    assert m.version == 1 and not v.try_switch(m)
    assert v.manifest.version == 0
    for n, t in v.policy.model.state_dict().items():
        assert torch.equal(t, before[n]), n
    line = logs[-1]
    assert line.startswith("warning: cannot load v1: checkpoints/v000001/adapter.safetensors: "
                           "refused adapter: ") and why in line and "\n" not in line, line


def test_an_adapter_listed_larger_than_any_of_its_rank_is_refused_before_download(
        volunteer_on_v0, llama, dataset_csv):  # noqa: F811
    v, storage, v0, etag, logs = volunteer_on_v0
    layers = lora.adaptable_layers(v.policy.model)
    bound = lora.adapter_bytes_bound(layers, RANK, 4)
    publish_lora_v1(storage, llama, dataset_csv, etag, v0, b"", listed=bound + 1, upload=False)
    assert not v.try_switch(v.poll())
    assert logs[-1] == (f"warning: cannot load v1: checkpoints/v000001/adapter.safetensors: refused "
                        f"adapter: the manifest lists {bound + 1} bytes, more than the {bound} an "
                        f"adapter of rank {RANK} of this model takes; refused before downloading; "
                        "will retry")


def test_an_honest_adapter_is_held_unmerged_as_the_trainer_replays_it(
        volunteer_on_v0, llama, dataset_csv):  # noqa: F811
    """The volunteer holds the adapter unmerged on the base it kept (no weights fetched or
    copied again), and computes bit for bit what the trainer's replay of v1 computes: the
    base under PEFT's layers holding the published A and B (lora.load_adapter_unmerged).
    Merged weights round otherwise (red with lora.load_adapter in its place)."""
    v, storage, v0, etag, logs = volunteer_on_v0
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        before = v.policy.model(input_ids=ids).logits
    tensors = honest_adapter(llama)
    publish_lora_v1(storage, llama, dataset_csv, etag, v0, save(tensors))
    assert v.try_switch(v.poll()) and v.manifest.version == 1, logs[-3:]
    assert logs[-1] == "now on v1 of run-h (weights unchanged)"
    replayer = lora.add_adapters(load_policy(llama).model, lora.LoraSpec(RANK, ALPHA)).eval()
    lora.load_adapter_unmerged(storage, v.manifest, replayer)
    with torch.no_grad():
        got, want = v.policy.model(input_ids=ids).logits, replayer(input_ids=ids).logits
    assert (got - before).abs().max() > 1e-3  # the adapter moved them
    assert torch.equal(got, want)
