"""The policy's weights on disk and on the wire: safetensors written straight from the tensors
(`write_weights`) or made in one buffer for a published checkpoint (`fill_weights`), a model
folder saved (`save_policy`), and new weights swapped into a live model in place
(`load_weights`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from volunteer_rl import config
from volunteer_rl.model.hashing import byte_buffer
from volunteer_rl.model.lora import base_model_of, is_wrapped, merged_tensors
from volunteer_rl.model.policy import Policy, quiet_transformers
from volunteer_rl.model.safetensors_file import (
    PIECE,
    ST_DTYPES,
    fitted,
    header_length,
    parse_header,
    view,
)
from volunteer_rl.model.vetting import VRL_CONFIG, WEIGHTS_FILE

WEIGHTS_DTYPES = dict(zip(config.WEIGHTS_DTYPES, (torch.float32, torch.bfloat16), strict=True))
"""The torch dtype of each `--weights-dtype` name (config.WEIGHTS_DTYPES lists the names)."""


def save_policy(policy: Policy, folder: Path, weights_dtype: torch.dtype = torch.float32,
                weights: bool = True) -> Path:
    """Write an HF model folder: config (with `dtype` set to the weights' dtype), generation
    config, tokenizer, vrl.json and, unless `weights` is False (the trainer streams them
    straight to the bucket instead, see trainer.publish), model.safetensors in
    `weights_dtype` with tied tensors saved once."""
    import copy

    quiet_transformers()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = policy.model
    config = copy.deepcopy(model.config)  # the live model's config stays as it is
    config.dtype = str(weights_dtype).removeprefix("torch.")
    config.architectures = [type(base_model_of(model)).__name__]
    config.save_pretrained(folder)
    if model.can_generate():
        model.generation_config.save_pretrained(folder)
    policy.tokenizer.save_pretrained(folder)
    (folder / VRL_CONFIG).write_text(json.dumps({"prompt_format": policy.prompt_format}))
    if weights:
        with open(folder / WEIGHTS_FILE, "wb") as f:
            write_weights(model, f, weights_dtype)
    return folder


# safetensors, by hand: the format is 8 bytes of header length, a JSON header naming each
# tensor's dtype, shape and byte range, then the raw bytes. Writing it ourselves lets the
# bytes go from the tensors straight into the sink (a bucket object, being hashed on the
# way) with no second copy in memory; `save_pretrained` took 12 s for Qwen3-0.6B here,
# this takes the time of the write.


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for a DTensor (a parameter sharded by FSDP2) this rank's shard."""
    return getattr(t, "_local_tensor", t)


def published_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as a checkpoint stores it: a tensor shared under several names (a tied
    lm_head) is kept under its first name only, as transformers saves it. A model sharded
    over ranks gives its DTensors, in the same order on every rank (fill_weights gathers
    them). A LoRA-wrapped model gives the plain model's, its adapters merged
    (lora.merged_tensors)."""
    out, seen = {}, set()
    state = merged_tensors(model) if is_wrapped(model) else model.state_dict()
    for name, t in state.items():
        local = local_tensor(t)
        ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape))
        if ident not in seen:
            seen.add(ident)
            out[name] = t
    return out


def _serialized(model: torch.nn.Module, dtype: torch.dtype):
    """(the 8-byte length and JSON header, [(tensor, its bytes' cast)], total bytes) of the
    model's safetensors file with floating tensors in `dtype`."""
    tensors = published_tensors(model)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        dt = dtype if t.is_floating_point() else t.dtype
        size = t.numel() * dt.itemsize
        header[name] = {"dtype": ST_DTYPES[dt], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # the data starts 8-byte aligned, as safetensors does
    head = len(head).to_bytes(8, "little") + head
    return head, list(tensors.values()), len(head) + offset


def _tensor_bytes(t: torch.Tensor, dtype: torch.dtype):
    """A tensor's bytes as published: floating tensors rounded to `dtype` (round-to-nearest-
    even for bf16, the same rounding `Tensor.to` gives everywhere), the others as they are."""
    cast = t.detach().to(dtype) if t.is_floating_point() else t.detach()
    return cast.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def write_weights(model: torch.nn.Module, out, dtype: torch.dtype = torch.float32) -> int:
    """Write the model's weights to `out` as safetensors, floating tensors cast to `dtype`,
    one tensor at a time. Returns the bytes written."""
    head, tensors, total = _serialized(model, dtype)
    out.write(head)
    with torch.no_grad():
        for t in tensors:
            data = _tensor_bytes(t, dtype)
            for start in range(0, len(data), PIECE):
                out.write(memoryview(data[start:start + PIECE]))
    return total


def weights_size(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The size of the file `write_weights` writes."""
    return _serialized(model, dtype)[2]


def fill_weights(model: torch.nn.Module, dtype: torch.dtype, buf: memoryview,
                 made: Callable[[int], None] = lambda end: None) -> None:
    """Make in `buf` (weights_size bytes) the file `write_weights` writes, calling
    `made(end)` each time buf[:end] is done (hashing.Filling: threads that hash and upload
    it follow along, so a big tensor is made PIECE bytes at a time).

    Each tensor is cast straight into its place in `buf` (the same rounding as `Tensor.to`):
    no temporary copy, which made this three times slower on a 0.6 B model."""
    import numpy as np

    head, tensors, total = _serialized(model, dtype)
    if len(buf) != total:
        raise ValueError(f"fill_weights: a buffer of {len(buf)} bytes for a {total}-byte file")
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    out = torch.from_numpy(arr)
    at = len(head)
    with torch.no_grad():
        for t in tensors:
            t = _whole(t)
            dt = dtype if t.is_floating_point() else t.dtype
            n = t.numel() * dt.itemsize
            if at % dt.itemsize:  # only after a tensor of odd bytes; never in a model of ours
                arr[at:at + n] = _tensor_bytes(t, dtype)
            else:
                dst, src = out[at:at + n].view(dt), t.detach().reshape(-1)
                step = max(1, PIECE // dt.itemsize)
                for i in range(0, src.numel(), step):
                    dst[i:i + step].copy_(src[i:i + step])
                    made(at + min((i + step) * dt.itemsize, n))
            at += n
            made(at)
    made(total)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor as it is; a DTensor gathered whole from every rank's shard (a
    collective: every rank must gather the same tensors in the same order, gather_along)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def gather_along(model: torch.nn.Module) -> None:
    """A rank other than the writer, while the writer runs fill_weights on the same sharded
    model: take part in each tensor's gather, in the same order, and drop the result."""
    with torch.no_grad():
        for t in published_tensors(model).values():
            _whole(t)


def weights_bytes(model: torch.nn.Module, dtype: torch.dtype, reuse=None) -> memoryview:
    """The bytes `write_weights` writes, in one buffer (`reuse` if it is of the right size)."""
    buf = byte_buffer(weights_size(model, dtype), reuse)
    fill_weights(model, dtype, buf)
    return buf


def _fitted(model: torch.nn.Module, source) -> tuple[memoryview, int, dict, dict]:
    """(the bytes, where their data starts, each tensor's (dtype, shape, byte range), the
    model's tensors to fill) of a safetensors file's path or bytes, every tensor's shape and
    byte range checked against `model` (safetensors_file.fitted; WeightsError naming the file)."""
    import numpy as np

    if isinstance(source, (str, Path)):
        name = Path(source).name
        source = memoryview(np.fromfile(source, dtype=np.uint8))
    else:
        name = WEIGHTS_FILE
    buf = memoryview(source).cast("B")
    n = header_length(bytes(buf[:8]), len(buf), name)
    header = parse_header(bytes(buf[8:8 + n]), name)
    return buf, 8 + n, header, fitted(model, header, 8 + n, len(buf), name)


def load_weights(policy: Policy, source) -> None:
    """Swap new weights into the live model in place (no rebuild, no re-allocation).

    `source` is a safetensors file's path or its bytes already in memory (a verified buffer
    from chain.fetch_weights): each tensor is copied straight from those bytes into the
    model's own tensor, cast to its dtype (bf16 weights into an fp32 model are upcast
    exactly), with no intermediate state dict. A tied lm_head is saved once under the
    embedding's name, so it may be missing here. Every tensor's shape and byte range is
    checked before the first one is copied: weights that do not fit (WeightsError) leave the
    model as it was."""
    buf, base, header, targets = _fitted(policy.model, source)
    with torch.no_grad():
        for key, (dtype, shape, (begin, _)) in header.items():
            targets[key].copy_(view(buf, base, dtype, shape, begin))


def skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` (architecture, config, buffers) whose parameters hold no memory (on
    the meta device; ties kept): `bind_weights` gives it its weights. Taken before the model
    is sharded, it costs the trainer's writer rank no second copy of the weights."""
    import copy

    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
            for p in model.parameters()}
    return copy.deepcopy(model, memo).eval()


def bind_weights(model: torch.nn.Module, source) -> None:
    """Make `model`'s parameters (a `skeleton`'s, or any model's) views of the weights file
    `source` (its path, or its bytes, which must then stay unchanged while the model is
    used): no copy where the file's dtype is the model's (fp32 weights), a cast copy where it
    is not. WeightsError as load_weights."""
    buf, base, header, targets = _fitted(model, source)
    views = {}
    for key, (dtype, shape, (begin, _)) in header.items():
        v = view(buf, base, dtype, shape, begin)
        views[key] = v if dtype == targets[key].dtype else v.to(targets[key].dtype)
    bind_tensors(model, views)


def bind_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make `model`'s parameters these very tensors (by state-dict name, no copy; a tied
    lm_head follows the embedding whether or not it is among them)."""
    model.load_state_dict(tensors, strict=False, assign=True)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def unbind_weights(model: torch.nn.Module) -> None:
    """Let go of the weights `bind_weights` gave `model` (its parameters back on the meta
    device), so the file they viewed can be freed."""
    bind_tensors(model, {k: torch.empty_like(p, device="meta") for k, p in model.named_parameters()})
