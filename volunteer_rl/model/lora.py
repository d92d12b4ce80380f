"""LoRA adapters: what a LoRA policy trains, what each of its versions publishes, and how a
reader checks one and turns it into weights.

A LoRA policy is a frozen base model plus, on each adapted linear layer, two small matrices:
A (rank x in) and B (out x rank). The layer computes base(x) + scale * B(A(x)), scale =
alpha / rank, so its effective weight is W + scale * B @ A (transposed for GPT-2's Conv1D,
whose weight is stored in x out). The trainer trains A and B only (`add_adapters` wraps its
model with PEFT); a version is the base plus that version's A and B.

The adapter file is PEFT's own saved form, so `peft.PeftModel.from_pretrained` loads it onto
the base as is: a safetensors file holding, for each adapted layer `m` of the base model,
`base_model.model.{m}.lora_A.weight` and `base_model.model.{m}.lora_B.weight`, in the
weights dtype. Nothing else. `read_adapter` is what a reader runs on such bytes from a bucket
that may be hostile: every tensor name must name a linear layer of the base (never the output
embedding, which may share its weight with the input one), both halves present, the shapes
those of that layer at the rank the manifest states, the dtype the manifest's, every value
finite, and the file no larger than the adapter those shapes make (`adapter_bytes_bound`).
Anything else is refused in one line naming the object.

Merged or not: `add_into` adds scale * B @ A into weights that hold the base (computed in
fp32 from the fp32 base, so a bf16 base is upcast exactly first), for `vrl eval` and `vrl
export`; the trainer's PEFT model computes the same sum per layer unmerged, and so does a
volunteer (`hold_adapter`). The two forms differ by float rounding only, but on peaked models
that moves a token's margin by up to 7e-5 nats, more than the replay tolerance
(bench.replay_choice), so whatever is replayed is sampled unmerged.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass

import torch

from volunteer_rl.config import MAX_LORA_RANK
from volunteer_rl.model.vetting import CheckpointRefused, read_verified, weights_itemsize
from volunteer_rl.protocol import layout
from volunteer_rl.protocol.manifest import ADAPTER_FILE, Manifest
from volunteer_rl.storage.base import Storage

ADAPTER_PREFIX = "base_model.model."
"""What PEFT puts before a base module's name in an adapter file."""
_TENSOR_NAME = re.compile(r"base_model\.model\.([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)"
                          r"\.lora_([AB])\.weight")
ALL_LINEAR = "all-linear"
"""The default targets: every linear layer of the model but its output embedding (PEFT's
own shorthand, which is what the trainer passes)."""
_HEADER_SLACK = 64 << 10
"""Bytes an adapter file may hold beyond its tensors' data: its JSON header (about 150 bytes
a tensor; 64 KiB covers some 400 tensors' names, more than any model here adapts, and is
added per hundred layers below)."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapter a LoRA policy trains: its rank, alpha and target modules."""

    rank: int
    alpha: float
    targets: str = ALL_LINEAR
    """`all-linear`, or a comma-separated list of module names (PEFT's target_modules: a name
    matches a module whose dotted path ends with it, e.g. q_proj,v_proj)."""

    @property
    def scale(self) -> float:
        """What B @ A is multiplied by in the layer's output: alpha / rank."""
        return self.alpha / self.rank

    def target_modules(self) -> str | list[str]:
        if self.targets == ALL_LINEAR:
            return ALL_LINEAR
        return [t.strip() for t in self.targets.split(",") if t.strip()]


def add_adapters(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """`model` wrapped with PEFT LoRA adapters of `spec` on its target layers: the base frozen,
    A drawn at random, B zero (so the wrapped model computes what `model` did). Only A and B
    require gradients. The returned PeftModel holds `model` (its weights are not copied)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=spec.target_modules(),
                        lora_dropout=0.0, bias="none", init_lora_weights=True)
    with warnings.catch_warnings():  # GPT-2's Conv1D: PEFT notes it sets fan_in_fan_out
        warnings.simplefilter("ignore")
        return get_peft_model(model, config)


def is_wrapped(model: torch.nn.Module) -> bool:
    """Whether `model` is a PEFT-wrapped model (add_adapters)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT-wrapped one (its adapted layers wrapped in
    place), or `model` itself."""
    return model.get_base_model() if is_wrapped(model) else model


def round_frozen(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every frozen parameter of a wrapped `model` to `dtype` and back, in place: the
    trainer then trains against the base exactly as volunteers load it (a bf16 base upcast)."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.copy_(p.to(dtype).to(p.dtype))


_WRAPPED_WEIGHT = re.compile(r"(.+)\.base_layer\.(weight|bias)")


def merged_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a wrapped `model` as the plain model's would be, each adapted layer's
    weight merged (base + lora_delta, fp32, a new tensor; the base tensor itself while B is
    zero, so v0's publish copies nothing) and the adapters themselves left out:
    what a whole weights file of its current version holds (v0 of a LoRA run, `vrl export`).
    Names and order are the plain model's."""
    base = base_model_of(model)
    modules = dict(base.named_modules())
    layers = adaptable_layers(base)
    out = {}
    for name, t in base.state_dict().items():
        if ".lora_" in name:
            continue
        m = _WRAPPED_WEIGHT.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layer, kind = m.group(1), m.group(2)
        module = modules[layer]
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        if kind == "weight" and bool(b.detach().any()):  # B zero (a fresh adapter): the base
            with torch.no_grad():  # itself, not a copy of every adapted weight (v0's publish)
                t = t.float() + lora_delta(a, b, module.scaling["default"], layers[layer][2])
        out[f"{layer}.{kind}"] = t
    return out


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer trains: all of a plain model's, a wrapped one's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter of a PEFT-wrapped model under the names its file uses, detached: every
    `base_model.model.{m}.lora_A.weight` and `...lora_B.weight` (`add_adapters`)."""
    from peft import get_peft_model_state_dict

    return {name: t.detach() for name, t in get_peft_model_state_dict(model).items()}


def adapter_file(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> bytes:
    """The bytes of an adapter file: `tensors` in `dtype`, safetensors, names sorted."""
    from safetensors.torch import save

    return save({name: tensors[name].to(dtype).contiguous() for name in sorted(tensors)},
                metadata={"format": "pt"})


def adapter_config(spec: LoraSpec, base_name: str = "") -> dict:
    """PEFT's adapter_config.json for an adapter of `spec` (`vrl export --adapter`)."""
    from peft import LoraConfig

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=spec.target_modules(),
                        lora_dropout=0.0, bias="none", base_model_name_or_path=base_name or None)
    raw = config.to_dict()
    return json.loads(json.dumps(raw, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def adaptable_layers(base: torch.nn.Module) -> dict[str, tuple[int, int, bool]]:
    """Every layer of `base` an adapter may adapt, by module name: (out, in, transposed), the
    shapes of B's rows and A's columns and whether the stored weight is in x out (GPT-2's
    Conv1D). The output embedding is not one: tied, its weight is also the input embedding's.
    In a PEFT-wrapped model a wrapped layer counts under its own name, by its base layer."""
    from transformers.pytorch_utils import Conv1D

    output = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    layers, inside = {}, set()
    for name, module in base.named_modules():
        if module is output or any(name.startswith(p) for p in inside):
            continue
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # PEFT's wrapper
            inside.add(name + ".")
            module = module.base_layer
        if isinstance(module, torch.nn.Linear):
            layers[name] = (module.out_features, module.in_features, False)
        elif isinstance(module, Conv1D):
            fan_in, fan_out = module.weight.shape
            layers[name] = (fan_out, fan_in, True)
    return layers


def adapter_bytes_bound(layers: dict[str, tuple[int, int, bool]], rank: int, itemsize: int) -> int:
    """The largest adapter file of `rank` a reader accepts for a base with `layers`: every layer
    adapted, at `itemsize` bytes a value, plus a header's worth (_HEADER_SLACK a hundred layers)."""
    values = sum(rank * (out + inp) for out, inp, _ in layers.values())
    return values * itemsize + _HEADER_SLACK * (1 + len(layers) // 100)


class AdapterRefused(CheckpointRefused):
    """An adapter file refused for what it holds (`read_adapter`)."""


@dataclass(frozen=True)
class Adapter:
    """A checked adapter: each adapted layer's (A, B) in fp32, and the scale B @ A takes."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter under its file's names (adapter_tensors' form)."""
        return {f"{ADAPTER_PREFIX}{m}.lora_{h}.weight": t for m, (a, b) in self.layers.items()
                for h, t in (("A", a), ("B", b))}


def read_adapter(data: bytes | memoryview, name: str, layers: dict[str, tuple[int, int, bool]],
                 spec: LoraSpec, dtype: torch.dtype) -> Adapter:
    """The adapter in the bytes `data` of object `name`, checked against the base's adaptable
    `layers` (adaptable_layers), the rank and alpha of `spec` and the weights `dtype`.
    AdapterRefused (one line naming `name`) for anything but an adapter of that shape."""
    def refused(why: str) -> AdapterRefused:
        return AdapterRefused(f"{name}: refused adapter: {why}")

    if not 1 <= spec.rank <= MAX_LORA_RANK or not (math.isfinite(spec.alpha) and spec.alpha > 0):
        raise refused(f"rank {spec.rank!r:.20} / alpha {spec.alpha!r:.20} out of bounds")
    bound = adapter_bytes_bound(layers, spec.rank, dtype.itemsize)
    if len(data) > bound:
        raise refused(f"{len(data)} bytes, more than the {bound} an adapter of rank {spec.rank} "
                      "of this model takes")
    from safetensors.torch import load

    try:
        tensors = load(bytes(data))
    except Exception as exc:  # safetensors raises its own error types for malformed input
        raise refused(f"not a safetensors file ({type(exc).__name__})") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, t in tensors.items():
        m = _TENSOR_NAME.fullmatch(tensor_name)
        if m is None or m.group(1) not in layers:
            raise refused(f"tensor {tensor_name!r:.120} is not the A or B of an adaptable layer")
        layer, half = m.group(1), m.group(2)
        out, inp, _ = layers[layer]
        want = (spec.rank, inp) if half == "A" else (out, spec.rank)
        if t.dtype != dtype:
            raise refused(f"tensor {tensor_name!r:.120} is {t.dtype}, not {dtype}")
        if tuple(t.shape) != want:
            raise refused(f"tensor {tensor_name!r:.120} has shape {tuple(t.shape)}, not {want}")
        halves.setdefault(layer, {})[half] = t
    for layer, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise refused(f"layer {layer!r:.120} has lora_{next(iter(pair))} without its pair")
    if not halves:
        raise refused("it holds no tensor")
    out = {}
    for layer, pair in halves.items():
        a, b = pair["A"].float(), pair["B"].float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise refused(f"layer {layer!r:.120} holds a NaN or an infinity")
        out[layer] = (a, b)
    return Adapter(out, spec.scale)


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float, transposed: bool) -> torch.Tensor:
    """[rank, in] A and [out, rank] B -> the weight delta scale * B @ A, fp32, in the layout
    the layer stores its weight in ([out, in], or [in, out] when `transposed`)."""
    delta = (b.float() @ a.float()) * scale
    return delta.T if transposed else delta


def add_into(model: torch.nn.Module, adapter: Adapter) -> None:
    """Add each adapted layer's delta (lora_delta, fp32) to `model`'s weight, which must hold
    the base: what a reader does right after loading a LoRA version's base weights."""
    modules = dict(model.named_modules())
    layers = adaptable_layers(model)
    with torch.no_grad():
        for name, (a, b) in adapter.layers.items():
            weight = modules[name].weight
            delta = lora_delta(a, b, adapter.scale, layers[name][2])
            weight.copy_((weight.float() + delta).to(weight.dtype))


def set_adapter_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load adapter `tensors` (file names, adapter_tensors) into a PEFT-wrapped `model`'s A
    and B, in their dtype: the unmerged form of that version (a replay of an older version,
    a resume). Every A and B of the model must be given."""
    from peft import set_peft_model_state_dict

    own = adapter_tensors(model)
    if set(own) != set(tensors):
        raise ValueError(f"adapter tensors do not match the model's: {sorted(set(own) ^ set(tensors))[:3]}")
    with torch.no_grad():
        result = set_peft_model_state_dict(model, tensors)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"unexpected adapter tensors {result.unexpected_keys[:3]}")  # a bug


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model: a wrapped one with its LoRA layers taken out, nothing
    merged (it holds its base again), or `model` itself."""
    return model.unload() if is_wrapped(model) else model


def hold_adapter(model: torch.nn.Module, adapter: Adapter, spec: LoraSpec) -> torch.nn.Module:
    """`model`, holding the adapter's base (plain, or wrapped by an earlier call), with
    `adapter` held unmerged in PEFT's layers on exactly the layers it names: what a volunteer
    samples with, the very computation the trainer replays (merged weights round otherwise, by
    up to 7e-5 nats of margin on peaked models, more than --replay-tolerance). Wrapped in
    place the first time; returns the wrapped model. `spec`: the manifest's rank and alpha."""
    want = adapter.tensors()
    if is_wrapped(model) and set(adapter_tensors(model)) != set(want):
        model = model.unload()  # other layers than the last adapter's
    if not is_wrapped(model):
        model = add_adapters(model, LoraSpec(spec.rank, spec.alpha, ",".join(sorted(adapter.layers))))
    set_adapter_tensors(model, want)
    return model.eval()


def spec_of(m: Manifest) -> LoraSpec:
    """The LoraSpec of a LoRA version's manifest."""
    return LoraSpec(m.adapter.rank, m.adapter.alpha, m.adapter.targets)


def fetch_adapter(storage: Storage, m: Manifest, model: torch.nn.Module) -> Adapter:
    """The adapter of LoRA version `m`, for `model` (its base): the size the manifest lists
    checked against the largest adapter of that rank for this model before anything is
    downloaded, the bytes against the sha256 it lists (read_verified), then read_adapter's
    checks. AdapterRefused or CheckpointError naming the object."""
    key = layout.checkpoint_key(m.version, ADAPTER_FILE)
    entry, spec = m.files[ADAPTER_FILE], spec_of(m)
    layers = adaptable_layers(model)
    weights_itemsize(m.weights_dtype)  # vetting's rule: float32 or bfloat16, nothing else
    dtype = getattr(torch, m.weights_dtype)
    bound = adapter_bytes_bound(layers, spec.rank, dtype.itemsize)
    if not 0 < entry.size <= bound:
        raise AdapterRefused(f"{key}: refused adapter: the manifest lists {entry.size} bytes, more "
                             f"than the {bound} an adapter of rank {spec.rank} of this model takes;"
                             " refused before downloading")
    return read_adapter(read_verified(storage, key, entry), key, layers, spec, dtype)


def load_adapter(storage: Storage, m: Manifest, model: torch.nn.Module) -> None:
    """`model` holds the weights of `m` if it holds its base's: nothing for a version
    published whole, the adapter fetched and added for a LoRA version."""
    if m.adapter is not None:
        add_into(model, fetch_adapter(storage, m, model))


def load_adapter_unmerged(storage: Storage, m: Manifest, model: torch.nn.Module) -> None:
    """A PEFT-wrapped `model`, on LoRA version `m`'s base, given that version's published
    adapter (fetch_adapter's checks) in its A and B: the trainer's form, for audits of an
    older version and for a resume without saved fp32 adapters."""
    set_adapter_tensors(model, fetch_adapter(storage, m, base_model_of(model)).tensors())
